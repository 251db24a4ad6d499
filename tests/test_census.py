"""The census (:mod:`lensadapters.testing.census`) on a sample of model types, and the wrap-time verification of the
generic adapter's automatic description: a served point whose value or edit is not what its name says is caught.

Every causal-LM model type of the installed transformers is checked (about 40 seconds on one core); the sample must
also be served in full: a decoder and a post-LN encoder with TransformerLens' ``BertBlock`` points served by
plugins, and decoders no plugin claims that the automatic description serves in full under transformers 4.57 and 5.x
(parallel blocks with interleaved rotary, interleaved rotary with a gated MLP, per-layer rotary with norms after the
branches, branch multipliers, nested pre-LN parts, an attention-score softcap, LayerNorms with a literal eps, an
activation called in code, a mixture of experts after a dense layer, a complex rotary table with a norm after rotary
and layers without rotary), and a post-LN encoder that copies BERT's modelling code (described automatically under
transformers 5.x). ``LENSADAPTERS_EVERY_MODEL_TYPE=0`` checks the sample only.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters import HookedModel
from lensadapters.adapters.generic import GenericAdapterWarning, findings
from lensadapters.adapters.generic.verify import check_points
from lensadapters.analysis.threads import single_thread
from lensadapters.testing.census import CANONICAL, census_entry, main
from lensadapters.testing.every_model_type import build, input_ids
from lensadapters.testing.generic_support import wrap_generic

SAMPLE = (
    "llama",
    "ministral",  # its default config leaves the head size None
    "bert",
    "cohere",
    "helium",
    "olmo3",
    "granite",
    "biogpt",
    "olmo",
    "lfm2",
    "glm4_moe",
    "persimmon",
    # rotary as complex multiplication on interleaved pairs, a norm after rotary, NoPE layers, a mixture of experts
    # returning merged tokens
    "llama4_text",
    # attention computed in the model's own code (the softmax capture): a softmax of [b, heads, q, k] scores, of
    # [b * heads, q, k] scores with an ALiBi bias, of queries scaled before the product, sdpa called in the code
    # (served) or a softmax (verified), a post-LN encoder copy
    "gpt_neo",
    "bloom",
    "gpt_neox_japanese",
    "xglm",
    "mpt",
    "falcon",
    "rembert",
    "big_bird",
    # transformers 4.x: sdpa called in the model's own code (verified against PyTorch's math attention), keys
    # repeated per query head in the code (StableLM), a router's softmax beside the attention (Qwen2-MoE)
    "stablelm",
    "moshi",
    "qwen2_moe",
    # issue #28's sample, FULL on both versions (Cohere, Cohere 2, Granite, StableLM, SmolLM3, OLMo 3, GLM-4 above or
    # in the contract suites)
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",  # transformers 4.x's default: one expert (a mixture all the same, its MLP opaque)
    "seed_oss",
    "apertus",
    "arcee",
    "ernie4_5",
    "exaone4",
    # a composite config whose causal LM is built from its text config, as from_pretrained builds it (transformers
    # 4.x's from_config builds it from the composite config)
    "llama4",
    "emu3",
    # BART-family decoders served by a plugin: BigBird-Pegasus' (its final norm named layernorm_embedding) and
    # Blenderbot-Small's (its token embeddings normalized before the positions, unscaled)
    "bigbird_pegasus",
    "blenderbot-small",
    # embeddings scaled in place, then positions added to them, before the first layer
    "ctrl",
    # a final norm the model also runs on the embeddings (served on its call after the last layer)
    "nanochat",
    # the attention output changed before the output projection (BitNet's norm, Laguna's and AFMoE's output gates:
    # hook_z the attention function's output, hook_result and W_O refused), a norm before the MLP's down projection
    "bitnet",
    "laguna",
    "afmoe",
) + (
    # softcapped attention: transformers 4.x runs it with sdpa, which ignores the softcap (no patterns served there)
    # a projection fused in groups of heads, a rotary module returning (sin, cos) (4.x: CodeGen's attention and
    # rotary in its own code)
    ("vaultgemma", "codegen") if not transformers.__version__.startswith("4.") else ()
)
#: post-LN encoders no plugin claims (copies of BERT's modelling code): described in full, through transformers'
#: attention interface (5.x) or in their own code (4.x: sdpa called there, verified against PyTorch's math attention)
POST_LN = ("electra",)
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
#: multi-head latent attention no plugin claims (copies of DeepSeek-V3's, transformers 5.x), described automatically:
#: every canonical point (hook_k per head too, edited on the keys the attention function gets); with sparse attention
#: (an indexer's ``indices``), no patterns, and hook_k unchecked (the reference attention does not take the indices)
LATENT = {
    "glm4_moe_lite": [],
    "deepseek_v32": ["blocks.0.attn.hook_k", "blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern"],
}
EVERY = os.environ.get("LENSADAPTERS_EVERY_MODEL_TYPE", "1") not in ("", "0")  # =0: the sample only
MODEL_TYPES = (
    sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if EVERY
    else [t for t in SAMPLE + POST_LN + tuple(LATENT) if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_census_finds_no_wrong_value_or_ignored_edit(model_type: str) -> None:
    entry = census_entry(model_type)
    assert not entry.wrong, entry.wrong
    if model_type in SAMPLE + POST_LN:  # served in full, by a plugin or described
        assert entry.status == "FULL", (entry.missing, entry.why)
    if model_type in LATENT:
        assert entry.adapter == "generic" and entry.missing == LATENT[model_type], (entry.missing, entry.why)


def test_census_cli_prints_the_table_and_the_summary(capsys: pytest.CaptureFixture) -> None:
    assert main(["--markdown", "llama"]) == 0
    out = capsys.readouterr().out
    assert "| llama | llama | 17/17 | FULL |" in out and "FULL 1/1 = 100.0%" in out


def test_census_cli_gives_the_callers_thread_count_back() -> None:
    """The census runs its tiny models on one thread, then restores the caller's count: it left one thread to
    everything after it in the test session (CI's whole suite ran the plugins' tests on one of its two cores, where
    float32 rounding differs, and Gemma 4's exactness test failed only there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["--markdown", "llama"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_single_thread_gives_the_count_back_when_the_block_raises() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(KeyError), single_thread():
            assert torch.get_num_threads() == 1
            raise KeyError("stop")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def _described(model_type: str = "helium") -> tuple[torch.nn.Module, HookedModel]:
    model = build(model_type)
    return model, wrap_generic(model)


def test_the_verification_catches_swapped_queries_and_keys_and_a_wrong_mlp() -> None:
    """Regression guard of the verifier itself: a description that reads the key projection as the queries, or the
    up projection as the gate, fails on exactly those points (and the points it does not touch still pass)."""
    model, hm = _described()
    wiring = hm.wiring
    qkv, mlp = wiring.qkv_layouts[0], wiring.mlp_layouts[0]
    names = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_rot_q", "blocks.0.mlp.hook_pre", "blocks.0.hook_resid_pre"]
    assert all(why is None for why in check_points(wiring, input_ids(), names).values())
    wiring.qkv_layouts[0] = dataclasses.replace(qkv, q=qkv.k, k=qkv.q)
    wiring.mlp_layouts[0] = dataclasses.replace(mlp, pre=mlp.pre_linear, pre_linear=mlp.pre)
    try:
        problems = check_points(wiring, input_ids(), ["blocks.0.attn.hook_q", "blocks.0.mlp.hook_pre"])
    finally:
        wiring.qkv_layouts[0], wiring.mlp_layouts[0] = qkv, mlp
    assert problems["blocks.0.attn.hook_q"] is not None and problems["blocks.0.mlp.hook_pre"] is not None, problems
    hm.unwrap()


def test_batched_verification_gives_every_point_the_verdict_it_gets_alone(monkeypatch) -> None:
    """Points are checked many at a time, each edited in its own batch row: on a description that reads the keys as
    the queries and the up projection as the gate, every point of the layer gets the verdict a check of it alone
    gives (the wrong ones fail, the others pass), and a batched pass that raises is redone point by point."""
    from lensadapters.adapters.generic import verify

    model, hm = _described("olmo3")
    wiring = hm.wiring
    names = [n for n in hm.hook_names if not n.startswith("blocks.") or n.startswith(("blocks.0.", "blocks.1."))]
    qkv, mlp = wiring.qkv_layouts[0], wiring.mlp_layouts[0]
    wiring.qkv_layouts[0] = dataclasses.replace(qkv, q=qkv.k, k=qkv.q)
    wiring.mlp_layouts[0] = dataclasses.replace(mlp, pre=mlp.pre_linear, pre_linear=mlp.pre)
    passes: list[int] = []
    original = verify._check_batch

    def counted(hooked: object, ids: torch.Tensor, owner: object, points: list, *rest: object) -> dict:
        verdicts = original(hooked, ids, owner, points, *rest)
        passes.append(len(points))
        return verdicts

    try:
        alone = check_points(wiring, input_ids(), names, points_per_pass=1)
        monkeypatch.setattr(verify, "_check_batch", counted)
        batched = check_points(wiring, input_ids(), names)
        assert passes and max(passes) > 1 and len(passes) < len(names) // 2, passes  # batched, without a fallback

        def broken(*args: object) -> None:
            raise RuntimeError("a pass that fails")

        monkeypatch.setattr(verify, "_check_batch", broken)
        redone = check_points(wiring, input_ids(), names)
    finally:
        wiring.qkv_layouts[0], wiring.mlp_layouts[0] = qkv, mlp
    assert batched == alone == redone
    assert alone["blocks.0.attn.hook_q"] is not None and alone["blocks.0.mlp.hook_pre"] is not None
    assert alone["blocks.1.attn.hook_q"] is None and alone["blocks.0.hook_resid_mid"] is None
    assert sum(why is None for why in alone.values()) > len(names) // 2
    hm.unwrap()


def test_a_point_that_fails_verification_is_not_served_and_the_warning_says_why(monkeypatch) -> None:
    """Regression: with the verification reporting hook_v of every layer wrong, the wrap serves no hook_v, keeps the
    rest, and the warning names the points and the reason."""
    from lensadapters.adapters.generic import verify

    original = verify.check_points

    def failing(hooked, ids, names, *args):
        results = original(hooked, ids, names, *args)
        return {name: "a deliberate failure" if name.endswith("attn.hook_v") else why for name, why in results.items()}

    monkeypatch.setattr(verify, "check_points", failing)
    model = build("helium")
    with pytest.warns(GenericAdapterWarning) as warned:
        hm = HookedModel.wrap(model)
    message = " ".join(str(w.message) for w in warned)
    assert not any(n.endswith("attn.hook_v") for n in hm.hook_names)
    assert "blocks.0.attn.hook_q" in hm.hook_names and "blocks.0.mlp.hook_post" in hm.hook_names
    assert "hook_v" in message and "a deliberate failure" in message, message
    assert findings(model).unverified["blocks.0.attn.hook_v"] == "a deliberate failure"
    with torch.no_grad():  # the remaining points work and cost nothing unhooked
        plain = model(input_ids()).logits
        assert torch.equal(hm(input_ids()).logits, plain)
        _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n in CANONICAL)
    assert set(cache.keys()) == {n for n in CANONICAL if n in hm.hook_names}
    hm.unwrap()


@pytest.mark.skipif(
    not TRANSFORMERS_5,
    reason="transformers 4.x's BERT computes attention in its own code, whose direction (cfg.attention_dir) the "
    "generic adapter does not read yet: it says causal",
)
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_the_automatic_post_ln_description_serves_what_the_plugin_serves(model_type: str) -> None:
    """BERT and RoBERTa with the generic adapter forced on: the automatic post-LN description serves every block
    point the model's plugin serves (TransformerLens' HookedEncoder names), with the same values, bidirectionally
    (a padded row: padding keys are masked, nothing else), and the same effect of an edit at each of them."""
    model = build(model_type)
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        plugged = HookedModel.wrap(model)
    if plugged.plugin.name == "generic":
        plugged.unwrap()
        pytest.skip(f"no plugin claims {model_type} here")
    names = [n for n in plugged.hook_names if n.startswith("blocks.") or n == "hook_embed"]
    logits, cache = plugged.run_with_cache(input_ids=ids, attention_mask=mask, names_filter=names)
    direction = plugged.cfg.attention_dir
    edited = {n: _edited_logits(plugged, ids, mask, n, cache[n]) for n in names[1::5]}
    plugged.unwrap()
    hm = wrap_generic(model)
    assert hm.plugin.name == "generic" and all(bl is not None and bl.post_norm for bl in hm.block_layouts)
    assert hm.cfg.attention_dir == direction == "bidirectional"
    assert not set(names) - set(hm.hook_names), set(names) - set(hm.hook_names)
    generic_logits, generic_cache = hm.run_with_cache(input_ids=ids, attention_mask=mask, names_filter=names)
    assert torch.equal(generic_logits, logits)
    for name in names:
        assert torch.allclose(generic_cache[name], cache[name], atol=1e-6, rtol=1e-5), name
    assert bool((generic_cache["blocks.0.attn.hook_pattern"][1, :, :, 5:] == 0).all())  # padding keys only
    assert bool((generic_cache["blocks.0.attn.hook_pattern"][0] > 0).all())  # later positions too: bidirectional
    for name, expected in edited.items():
        assert torch.allclose(_edited_logits(hm, ids, mask, name, cache[name]), expected, atol=1e-5), name
    hm.unwrap()


def _edited_logits(
    hm: HookedModel, ids: torch.Tensor, mask: torch.Tensor, name: str, value: torch.Tensor
) -> torch.Tensor:
    delta = torch.randn(value.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    if name.endswith("hook_pattern"):
        delta = delta * (value > 0)
    hooks = [(name, lambda t, hook: t + delta.to(t.dtype))]
    return hm.run_with_hooks(input_ids=ids, attention_mask=mask, fwd_hooks=hooks).detach()


@pytest.mark.skipif("granite_swa" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, reason="transformers 5.x model")
@pytest.mark.parametrize("model_type", ["granite_swa", "granitemoe_swa"])
def test_sink_patterns_are_verified_against_the_weights_that_mix_the_values(model_type: str) -> None:
    """Regression (Granite-SWA's ``hook_pattern`` was refused as 'not the reference's'): its eager attention returns
    the softmax before it applies the sinks (a rescaling of its output by ``sigmoid(logsumexp - sink)``), but the
    pattern that mixes the values is the softmax with the sink as one more column, which the explicit attention
    serves, as gpt-oss's eager function returns it; the reference now takes the weights that reproduce the attention
    function's output, so the pattern is served, verified, and nothing served is wrong."""
    entry = census_entry(model_type)
    assert not entry.wrong, entry.wrong
    assert {"blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern"} <= set(entry.served) - set(entry.refused)
    assert entry.status == "FULL", (entry.missing, entry.why)


def test_the_sink_pattern_reference_is_the_weights_that_give_the_output_and_nothing_else() -> None:
    """The reference pattern of attention with sinks is the returned weights where they mix the values into the
    output (gpt-oss), the softmax with the sinks where the function returns the weights before the sinks rescale its
    output (Granite-SWA), and neither (no reference, not a guess) where neither gives the output."""
    from lensadapters.adapters.generic.eager_reference import _mixing_weights, _softmax_with_sinks
    from lensadapters.adapters.generic.references import Unchecked

    g = torch.Generator().manual_seed(0)
    scores, value = torch.randn(1, 2, 3, 3, generator=g), torch.randn(1, 2, 3, 4, generator=g)
    sinks = torch.randn(2, generator=g)
    plain, sinked = torch.softmax(scores, -1), _softmax_with_sinks(scores, sinks)
    scale = (torch.logsumexp(scores, -1) - sinks.view(1, -1, 1)).sigmoid().unsqueeze(-1)
    rescaled = ((plain @ value) * scale).transpose(1, 2)  # Granite-SWA's eager attention
    assert _mixing_weights(plain, sinked, value, rescaled) is sinked
    returned = sinked.clone()  # gpt-oss: the sink's column dropped after the softmax
    assert _mixing_weights(returned, plain, value, (sinked @ value).transpose(1, 2)) is returned
    with pytest.raises(Unchecked):
        _mixing_weights(plain, sinked, value, (plain @ value).transpose(1, 2) + 1.0)


def test_a_latent_attention_config_shrinks_to_a_model_that_runs_and_is_served_whole() -> None:
    """Shrinking keeps the relations a config computes when it is made (multi-head latent attention: key/value heads
    equal to the query heads, the query/key head size the sum of its parts), so DeepSeek-V3 is in the census, not
    'not buildable'; its plugin serves every canonical point, ``hook_k`` with its per-head rope columns (one key every
    head shares in the model) too: FULL."""
    from transformers import AutoConfig

    from lensadapters.testing.every_model_type import shrink_config

    config = shrink_config(AutoConfig.for_model("deepseek_v3"))
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    entry = census_entry("deepseek_v3")
    assert entry.adapter == "deepseek_v3" and not entry.wrong, (entry.adapter, entry.why, entry.wrong)
    assert not entry.refused and entry.status == "FULL", (entry.refused, entry.missing)


def test_a_state_space_config_keeps_heads_times_head_size_equal_to_its_inner_width_and_runs() -> None:
    """Shrinking keeps a state-space layer's heads times head size equal to its inner width (``expand`` times the
    hidden size, or an inner-width field of its own), so Mamba-2 and Falcon-H1 build instead of failing on a reshape."""
    from transformers import AutoConfig

    from lensadapters.testing.every_model_type import shrink_config

    config = shrink_config(AutoConfig.for_model("mamba2"))
    assert config.num_heads * config.head_dim == config.expand * config.hidden_size
    hybrid = shrink_config(AutoConfig.for_model("falcon_h1"))
    assert hybrid.mamba_n_heads * hybrid.mamba_d_head == hybrid.mamba_d_ssm
    model = build("mamba2")
    assert model(input_ids()).logits.shape == (1, 6, config.vocab_size)


def test_a_shrunk_mixture_of_experts_config_routes_to_no_more_experts_than_it_has() -> None:
    """Every name a config gives its number of experts per token (``moe_k``, ``num_experts_per_token``, ...) is
    shrunk with the number of experts, so ERNIE-4.5-MoE's router does not ask for 6 of 4 experts."""
    from transformers import AutoConfig

    from lensadapters.testing.every_model_type import shrink_config

    config = shrink_config(AutoConfig.for_model("ernie4_5_moe"))
    assert config.moe_k <= config.moe_num_experts


@pytest.mark.parametrize(
    "model_type, filled",
    [
        ("ministral", "head_dim"),  # hidden_size / num_attention_heads
        ("hunyuan_v1_dense", "head_dim"),
        ("nemotron", "num_key_value_heads"),  # as many as the query heads
        ("deepseek_v2", "num_experts_per_tok"),  # and the expert groups
        ("dots1", "n_routed_experts"),  # and the experts per token and the shared experts
    ],
)
def test_a_count_the_default_config_leaves_none_is_filled_as_a_released_checkpoint_has_it(
    model_type: str, filled: str
) -> None:
    """A field transformers' own default config leaves ``None`` that the model reads (a head size, key/value heads,
    experts per token) is filled the way released checkpoints have it, so the type builds and runs instead of being
    'not buildable' (Ministral and Hunyuan failed on ``None ** -0.5``)."""
    from transformers import AutoConfig

    from lensadapters.testing.every_model_type import shrink_config

    config = shrink_config(AutoConfig.for_model(model_type))
    assert isinstance(getattr(config, filled), int)
    assert getattr(config, "head_dim", None) in (None, config.hidden_size // config.num_attention_heads)
    assert config.num_key_value_heads <= config.num_attention_heads
    assert getattr(config, "num_experts_per_tok", None) in (None, *range(1, getattr(config, "n_routed_experts", 0) + 1))
    model = build(model_type)
    assert model(input_ids()).logits.shape == (1, 6, config.vocab_size)


def test_an_option_the_default_config_turns_off_is_set_only_where_the_model_fails_without_it() -> None:
    """A ``None`` that turns an option off (query/key/value clipping) stays ``None`` where the model runs without it
    (OLMo), and is set as released checkpoints set it only where the model fails without it (DBRX under 5.x clamps
    with ``None`` bounds); a model that reads a tensor's value when it is made (Apertus' xIELU under 4.x) cannot be
    sized on the meta device and is sized once built."""
    from transformers import AutoConfig

    from lensadapters.testing.every_model_type import shrink_config

    assert shrink_config(AutoConfig.for_model("olmo")).clip_qkv is None
    assert build("olmo").config.clip_qkv is None
    for model_type in ("dbrx", "apertus"):
        model = build(model_type)
        assert model(input_ids()).logits.shape[:2] == (1, 6)
    # a switch asking for fused GPU kernels (Jamba's, which transformers 4.x refuses to run without) is turned off
    # with the options only: the default config's value otherwise
    assert shrink_config(AutoConfig.for_model("jamba")).use_mamba_kernels is True
    assert shrink_config(AutoConfig.for_model("jamba"), options=True).use_mamba_kernels is False
    assert build("jamba")(input_ids()).logits.shape[:2] == (1, 6)


def test_a_model_whose_unembedding_reads_the_last_layer_as_it_is_has_no_final_norm_point() -> None:
    """Regression (TrOCR was PARTIAL for ``ln_final.hook_scale``: its decoder has a norm child, but it normalizes the
    embeddings): a forward that shows the unembedding reading the last layer's output exactly as it is proves the
    architecture has no final norm, so the census does not count the point as missing and the adapter says why."""
    from lensadapters.adapters.generic.identify import NO_FINAL_NORM
    from lensadapters.testing.census import has_final_norm, unembeds_the_last_layer_as_it_is

    entry = census_entry("trocr")
    assert "ln_final.hook_scale" not in entry.applicable and entry.status == "FULL", (entry.missing, entry.why)
    model = build("trocr")
    assert not has_final_norm(model, "model.decoder.layers")  # its one norm child is the embeddings' (by name)
    assert unembeds_the_last_layer_as_it_is(model, "model.decoder.layers")  # and the forward proves it, whatever names
    bart = build("bart")  # BART's decoder likewise (its layernorm_embedding): both rules agree
    assert not has_final_norm(bart, "model.decoder.layers") and unembeds_the_last_layer_as_it_is(
        bart, "model.decoder.layers"
    )
    assert findings(model).missing["ln_final.hook_normalized"] == NO_FINAL_NORM


def test_a_final_norm_the_adapter_does_not_find_is_still_counted_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule above needs the proof: with the automatic description made blind to final norms, Nemotron's (a
    LayerNorm of ``1 + weight``) is not found, and its row keeps ``ln_final.hook_scale`` as missing (PARTIAL), the
    adapter's reason not being that the model has none."""
    import importlib

    from lensadapters.adapters.generic.identify import NO_FINAL_NORM

    identify = importlib.import_module("lensadapters.adapters.generic.identify")  # the module, not the function
    monkeypatch.setattr(identify, "_final_norm", lambda *args: (None, None))
    monkeypatch.setattr(identify, "_head_norm", lambda *args: (None, None))
    entry = census_entry("nemotron")
    assert "ln_final.hook_scale" in entry.missing and entry.status == "PARTIAL"
    assert "ln_final.hook_normalized: " in entry.why and NO_FINAL_NORM not in entry.why, entry.why


def test_an_embedding_norm_is_not_a_final_norm() -> None:
    """BART's decoder has a norm of its embeddings (``layernorm_embedding``) and no final norm: the census expects
    no ``ln_final`` there; mBART's has both (``layer_norm`` after the last layer)."""
    from transformers import BartConfig, BartForCausalLM, MBartConfig, MBartForCausalLM

    from lensadapters.testing.census import has_final_norm

    sizes = dict(d_model=16, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=16, vocab_size=32)
    assert not has_final_norm(BartForCausalLM(BartConfig(**sizes)), "model.decoder.layers")
    assert has_final_norm(MBartForCausalLM(MBartConfig(**sizes)), "model.decoder.layers")
    # BigBird-Pegasus' decoder: its final norm (after the last layer) is named layernorm_embedding
    assert has_final_norm(build("bigbird_pegasus"), "model.decoder.layers")
    assert "ln_final.hook_scale" in census_entry("bigbird_pegasus").applicable


def test_a_composite_config_builds_its_causal_lm_from_its_text_config_as_from_pretrained_does() -> None:
    """Llama 4's and Emu3's causal LMs take their text config (``Llama4TextConfig``); built from the composite config
    (transformers 4.x's ``from_config``) they lack the text model's fields. A plain config is built as it is."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from lensadapters.testing.every_model_type import causal_lm_class

    for model_type, name in (("llama4", "Llama4ForCausalLM"), ("emu3", "Emu3ForCausalLM")):
        composite = AutoConfig.for_model(model_type)
        auto, config = causal_lm_class(composite)
        assert config is composite.get_text_config() and config is not composite
        assert type(build(model_type)).__name__ == name
    plain = LlamaConfig()
    assert causal_lm_class(plain) == (AutoModelForCausalLM, plain)


def test_a_child_wrapping_the_attention_and_its_norms_counts_as_the_parts_it_holds() -> None:
    """DBRX's layer holds its two norms and its attention in one child (``norm_attn_norm``): the census expects the
    attention points, both norms and ``hook_resid_mid`` there, as for a layer holding them itself, and the table's
    count and the progress line's agree (the points served whole over those the architecture has)."""
    entry = census_entry("dbrx", check=False)
    expected = {"blocks.0.attn.hook_pattern", "blocks.0.attn.hook_q", "blocks.0.hook_resid_mid"}
    assert expected <= set(entry.applicable), entry.applicable
    whole = (set(entry.served) - set(entry.refused)) & set(entry.applicable)
    assert entry.points == f"{len(whole)}/{len(entry.applicable)}"
