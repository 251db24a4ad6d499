"""The generic adapter as a whole: when it is chosen, what it refuses, how it explains what a model lacks, and that
it agrees with the architecture plugins on the points both serve."""

from __future__ import annotations

import copy
import json
import types
import warnings

import pytest
import torch
import transformers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    FalconConfig,
    Gemma2Config,
    PhiConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutput

from lensadapters import Architecture, HookedModel, Registry, UnsupportedModelError, get_registry, hookimpl
from lensadapters.cli import main as cli_main
from lensadapters.demo import tiny_model
from lensadapters.generic import GenericAdapterWarning
from lensadapters.hf import tiny_config_of
from lensadapters.testing import assert_close, reinit
from lensadapters.testing.census import CANONICAL
from lensadapters.testing.models import EmbedAndHead

PLUGIN_FAMILIES = ("llama", "gpt2", "gpt_neox")
#: families the automatic description serves every canonical point of (the others: what it verifies)
DESCRIBED = ("llama",)


def _tiny(config_class, seed=0, auto=AutoModelForCausalLM, **kwargs):
    torch.manual_seed(seed)
    model = auto.from_config(tiny_config_of(config_class, **{"vocab": 96, "positions": None, **kwargs}))
    reinit(model, seed)
    return model.eval()


def _phi(**kwargs):
    return _tiny(PhiConfig, **kwargs)


def _ids(batch=2, length=5, seed=0):
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _plugin(name, model_type, refuse=False):
    plugin = types.ModuleType(name)

    @hookimpl
    def lensadapters_architectures():
        return [Architecture(name, (model_type,))]

    @hookimpl
    def lensadapters_validate(arch, model):
        if refuse:
            raise UnsupportedModelError(f"{name} cannot represent this configuration")

    plugin.lensadapters_architectures = lensadapters_architectures
    plugin.lensadapters_validate = lensadapters_validate
    return plugin


def test_a_model_type_a_plugin_claims_is_never_handled_generically():
    registry = Registry()
    registry.register(_plugin("strict_phi", "phi", refuse=True), "strict_phi")
    assert registry.select("phi")[0].name == "strict_phi"
    assert registry.select("falcon")[0] is registry.generic
    assert registry.select("phi", adapter="generic")[0] is registry.generic
    with pytest.raises(UnsupportedModelError, match="strict_phi cannot represent"):  # refused, not handled generically
        HookedModel.wrap(_phi(), registry=registry)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenericAdapterWarning)  # asked for explicitly: no warning
        hm = HookedModel.wrap(_phi(), adapter="generic", registry=registry)
    assert hm.arch.name == "generic" and "generic" not in registry.infos  # not listed among the plugins
    hm.unwrap()


@pytest.mark.parametrize("family", PLUGIN_FAMILIES)
def test_generic_points_agree_with_the_plugin_on_the_same_model(family):
    """Forced on a model a plugin describes, every point the generic adapter serves reads what the plugin's point of
    the same name reads, and patching it from other tokens gives the same logits."""
    registry = get_registry()
    claims = registry.claims(family)
    if not claims:
        pytest.skip(f"no plugin for {family} installed")
    model = tiny_model(registry, *claims[0])
    ids, other = _ids(), _ids(seed=1)
    plugin_hm = HookedModel.wrap(model, registry=registry)
    generic_hm = HookedModel.wrap(copy.deepcopy(model), adapter="generic", registry=registry)
    shared = [n for n in generic_hm.hook_names if n in plugin_hm.hook_names]
    # the automatic description: every point the plugin serves of the canonical ones, verified, and no other name
    canonical = [n for n in CANONICAL if n in plugin_hm.hook_names]
    assert set(generic_hm.hook_names) <= set(plugin_hm.hook_names), set(generic_hm.hook_names) - set(
        plugin_hm.hook_names
    )
    if family in DESCRIBED:
        assert set(canonical) <= set(shared), set(canonical) - set(shared)
        for weight in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "W_in", "W_out", "W_E", "W_U"):
            assert_close(
                getattr(generic_hm, weight), getattr(plugin_hm, weight), f"{family} {weight}: generic vs plugin"
            )
    with torch.no_grad():
        _, by_plugin = plugin_hm.run_with_cache(ids, names_filter=shared)
        _, generic = generic_hm.run_with_cache(ids, names_filter=shared)
        for name in shared:
            assert_close(generic[name], by_plugin[name], f"{family} {name}: generic vs plugin")
        _, theirs = plugin_hm.run_with_cache(other, names_filter=shared)
        for name in ("blocks.0.attn.hook_z", "blocks.0.hook_attn_out", "blocks.1.hook_resid_pre"):

            def patch(t, hook, value=theirs[name]):
                return value

            assert_close(
                generic_hm.run_with_hooks(ids, fwd_hooks=[(name, patch)]),
                plugin_hm.run_with_hooks(ids, fwd_hooks=[(name, patch)]),
                f"{family}: patching {name}",
            )
    plugin_hm.unwrap()
    generic_hm.unwrap()


def _softcapped_gemma2(implementation: str) -> torch.nn.Module:
    model = _tiny(
        Gemma2Config,
        head_dim=8,
        sliding_window=3,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=None,
    )
    model.config._attn_implementation = implementation
    return model


def test_a_gemma2_without_its_plugin_is_described_with_softcapped_patterns():
    """Gemma 2 (wrapped without its plugin): its sandwich-norm blocks are described, the (1 + weight) RMSNorm is
    recognised as such, and the softcapped eager attention gets patterns (verified against the model's eager
    attention, which applies the softcap): the scores are ``5 * tanh(q·kᵀ·scaling / 5)`` where not masked."""
    model = _softcapped_gemma2("eager")
    with pytest.warns(GenericAdapterWarning) as warned:
        hm = HookedModel.wrap(model, registry=Registry())
    message = str(warned[0].message)
    names = hm.hook_names
    assert "writing-a-plugin" in message
    assert all(f"blocks.{i}.attn.{p}" in names for i in (0, 1) for p in ("hook_attn_scores", "hook_pattern"))
    with torch.no_grad():
        _, cache = hm.run_with_cache(_ids(), names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    q, k = cache["blocks.0.attn.hook_rot_q"], cache["blocks.0.attn.hook_rot_k"].repeat_interleave(2, dim=2)
    raw = torch.einsum("bqhd,bkhd->bhqk", q, k) * model.model.layers[0].self_attn.scaling
    capped, kept = cache["blocks.0.attn.hook_attn_scores"], torch.isfinite(cache["blocks.0.attn.hook_attn_scores"])
    assert_close(capped[kept], (5.0 * torch.tanh(raw / 5.0))[kept], "softcapped scores")
    for point in ("attn.hook_z", "attn.hook_q", "hook_attn_out", "hook_mlp_out", "ln1_post.hook_scale"):
        assert f"blocks.1.{point}" in names, point
    assert "ln_final.hook_normalized" in names
    spec = hm.norm_spec(hm.norm_module("ln_final"))
    assert spec.kind == "RMS" and spec.weight_offset == 1.0
    seen = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        _, cache = hm.run_with_cache(_ids(), names_filter="ln_final.hook_normalized")
    handle.remove()
    assert_close(cache["ln_final.hook_normalized"] * (1 + spec.weight), seen[0], "RMSNorm with (1 + weight)")
    hm.unwrap()


@pytest.mark.skipif(not transformers.__version__.startswith("4."), reason="transformers 5 runs Gemma 2 only eagerly")
def test_softcapped_patterns_are_not_served_under_sdpa_which_ignores_the_softcap():
    """Under transformers 4.x's sdpa, which ignores the softcap the model passes, the softcapped patterns are not the
    model's (the verification, run with eager attention, must not serve them: every use would raise); the warning
    says why, and the other attention points are served."""
    model = _softcapped_gemma2("sdpa")
    with pytest.warns(GenericAdapterWarning) as warned:
        hm = HookedModel.wrap(model, registry=Registry())
    message = " ".join(str(w.message) for w in warned)
    assert not any(n.endswith(("hook_pattern", "hook_attn_scores")) for n in hm.hook_names)
    assert "blocks.0.attn.hook_rot_q" in hm.hook_names and "blocks.0.attn.hook_z" in hm.hook_names
    assert "sdpa" in message and "softcap" in message, message
    hm.unwrap()


class _LoopConfig(PretrainedConfig):
    model_type = "test_looped_decoder"

    def __init__(self, loops=1, num_hidden_layers=2, hidden_size=8, vocab_size=16, **kwargs):
        self.loops, self.num_hidden_layers, self.hidden_size, self.vocab_size = (
            loops,
            num_hidden_layers,
            hidden_size,
            vocab_size,
        )
        super().__init__(**kwargs)


class _LoopedDecoder(EmbedAndHead, PreTrainedModel):
    """A model of someone's own: an embedding, a list of residual layers that it may run more than once, a norm."""

    config_class = _LoopConfig

    def __init__(self, config):
        super().__init__(config)
        width = config.hidden_size
        self.embed = torch.nn.Embedding(config.vocab_size, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(config.num_hidden_layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, config.vocab_size)

    def forward(self, input_ids, **kwargs):
        x = self.embed(input_ids)
        for _ in range(self.config.loops):
            for layer in self.layers:
                x = x + layer(x)
        return CausalLMOutput(logits=self.head(self.norm(x)))


@pytest.mark.parametrize("loops", [1, 2])
def test_a_model_of_its_own_gets_what_can_be_identified_and_an_account_of_the_rest(loops):
    model = _LoopedDecoder(_LoopConfig(loops=loops)).eval()
    with pytest.warns(GenericAdapterWarning) as warned:
        hm = HookedModel.wrap(model, registry=Registry())
    message = str(warned[0].message)
    # its layers return their change, which the model adds (x + layer(x)): their input and output are not the
    # residual stream an edit would change, so they get no residual points
    assert hm.hook_names == ["hook_embed", "ln_final.hook_normalized"]
    assert "'test_looped_decoder'" in message and "writing-a-plugin" in message
    if loops == 1:
        assert "attention interface" in message and "return their change" in message
    else:
        assert "did not run once each" in message
    ids = torch.randint(0, 16, (2, 4))
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids)
        assert torch.equal(logits, model(ids).logits) and len(cache) == len(hm.hook_names)
    hm.unwrap()


def test_a_model_the_probe_cannot_run_gets_no_unverified_point():
    """Principle 7: a point is served only if the probe proved its value and its edit; a model whose probe forward
    fails (here: weights on the meta device) gets no point and no weight, and the warning says why."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
        )
    with pytest.warns(GenericAdapterWarning, match="probe forward pass failed") as record:
        hm = HookedModel.wrap(model, registry=Registry())
    assert hm.hook_names == []
    assert any("so no value or edit could be checked" in str(w.message) for w in record)
    # the model's own forward cannot run on the meta device either: the warning says so
    assert any("own forward fails the same way" in str(w.message) for w in record)
    for weight in ("W_E", "W_U"):
        with pytest.raises(Exception, match="probe forward pass failed"):
            getattr(hm, weight)
    hm.unwrap()


def test_a_model_that_cannot_run_as_it_is_gets_a_warning_that_says_so():
    """A model whose own forward fails here (transformers' grouped-matmul experts in float64, a kernel for another
    device: here a layer that raises) gets no point, and the warning says the failure is the model's own, not the
    probe's, and what to change."""
    model = _tiny(FalconConfig)

    def refuse(module: torch.nn.Module, args: tuple) -> None:
        raise RuntimeError("this layer cannot run in this dtype")

    handle = model.transformer.h[1].register_forward_pre_hook(refuse)
    try:
        with pytest.warns(GenericAdapterWarning, match="probe forward pass failed") as record:
            hm = HookedModel.wrap(model, registry=Registry())
    finally:
        handle.remove()
    assert hm.hook_names == []
    message = " ".join(str(w.message) for w in record)
    assert "this layer cannot run in this dtype" in message
    assert "the model's own forward fails the same way without any hook" in message
    assert "set_experts_implementation('eager')" in message
    hm.unwrap()


def test_a_value_the_model_writes_into_later_stays_what_hooks_saw():
    """Falcon's parallel block adds the attention output into the MLP's output tensor in place: the probe sees it,
    and the model then continues with a copy, so a cached hook_mlp_out is the MLP's output."""
    model = _tiny(FalconConfig, parallel_attn=True)
    with pytest.warns(GenericAdapterWarning):
        hm = HookedModel.wrap(model, registry=Registry())
    mlp_outputs = []
    handle = model.transformer.h[0].mlp.register_forward_hook(lambda m, args, out: mlp_outputs.append(out.clone()))
    with torch.no_grad():
        logits, cache = hm.run_with_cache(_ids(), names_filter="blocks.0.hook_mlp_out")
        assert torch.equal(logits, model(_ids()).logits)
    handle.remove()
    assert torch.equal(cache["mlp_out", 0], mlp_outputs[0])
    hm.unwrap()


def test_attention_function_points_need_eager_or_sdpa():
    model = _phi()
    with pytest.warns(GenericAdapterWarning):
        hm = HookedModel.wrap(model, registry=Registry())
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="set_attn_implementation"):
        hm.add_hook("blocks.0.attn.hook_pattern", lambda t, hook: None)
    if hm.block_layouts[0] is None:  # an opaque block's hook_z runs through the attention function
        with pytest.raises(UnsupportedModelError, match="hook_z.*'flash_attention_2'.*set_attn_implementation"):
            hm.run_with_hooks(_ids(), fwd_hooks=[("blocks.0.attn.hook_z", lambda t, hook: None)])
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        hm.run_with_hooks(_ids(), fwd_hooks=[("blocks.0.attn.hook_z", lambda t, hook: None)])
    hm.unwrap()


def test_a_model_without_a_language_model_head():
    model = _phi(auto=AutoModel)
    with pytest.warns(GenericAdapterWarning):
        hm = HookedModel.wrap(model, registry=Registry())
    assert "ln_final.hook_normalized" in hm.hook_names and hm.W_E.shape == (96, 32)
    with torch.no_grad():
        out = model(_ids())
        _, cache = hm.run_with_cache(_ids(), names_filter="ln_final.hook_normalized")
    assert torch.equal(cache["ln_final.hook_normalized"], out.last_hidden_state)
    with pytest.raises(AttributeError, match="no unembedding"):
        _ = hm.W_U
    hm.unwrap()


def test_gradients_reach_generic_points():
    model = _phi()
    with pytest.warns(GenericAdapterWarning):
        hm = HookedModel.wrap(model, registry=Registry())
    ids = _ids()
    _, cache = hm.run_with_cache(
        ids, labels=ids, incl_bwd=True, names_filter=["blocks.0.hook_resid_pre", "blocks.1.attn.hook_z"]
    )
    for name in ("blocks.0.hook_resid_pre", "blocks.1.attn.hook_z"):
        assert cache[name + "_grad"].shape == cache[name].shape and cache[name + "_grad"].abs().sum() > 0
    hm.unwrap()


def test_lora_fine_tune_of_a_model_without_plugin():
    peft = pytest.importorskip("peft")
    if "peft" not in get_registry().infos:
        pytest.skip("no plugin for PEFT models is installed")
    model = peft.get_peft_model(
        _phi(), peft.LoraConfig(r=4, target_modules=["q_proj", "dense", "fc1"], init_lora_weights=False)
    ).eval()
    with pytest.warns(GenericAdapterWarning):
        hm = HookedModel.wrap(model)
    ids = _ids()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        logits, cache = hm.run_with_cache(input_ids=ids, names_filter=lambda n: n.endswith("hook_resid_pre"))
        assert torch.equal(hm(input_ids=ids).logits, out.logits)
    for i in range(2):
        assert_close(cache["resid_pre", i], out.hidden_states[i], f"adapted resid_pre {i}")
    hm.unwrap()


def test_cli_hooks_on_a_checkpoint_directory_says_the_adapter_is_generic(tmp_path, capsys):
    _tiny(FalconConfig).save_pretrained(tmp_path)
    assert cli_main(["hooks", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    # Falcon computes attention in its own code: described automatically, patterns included
    assert text.startswith("generic adapter: 33 hook points") and "blocks.1.attn.hook_pattern" in text
    assert "model_type 'falcon'" in text and "described automatically" in text and "writing-a-plugin" in text
    assert cli_main(["hooks", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["adapter"] == "generic" and "blocks.0.hook_resid_pre" in report["hook_points"]
    assert "falcon" in report["generic"]
