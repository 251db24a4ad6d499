"""BART encoder-decoders: every point against a reference written from the Hugging Face modules, every edit and its
gradient against the same edit made in that reference, edits against plain PyTorch hooks, generation with hooks and
the named refusals. TransformerLens 2.18 has no BART (no ``HookedEncoderDecoder`` conversion for it): nothing to
compare with there. The forward without hooks (bitwise Hugging Face's), the firing order, ``unwrap`` and patching
are the contract's (``test_bart_contract.py``).

The models are tiny (width 16, 2 layers of each stack, 2 heads), their weights unit-scale
(``lensadapters.testing.reinit``), and none is built at import.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import lensadapters_bart
import pytest
import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, BartForConditionalGeneration, BartModel

from lensadapters import HookedModel
from lensadapters.errors import UnsupportedModelError
from lensadapters.plugin_api import first_output, replace_first_output
from lensadapters.testing import assert_close
from lensadapters.testing import encoder_decoder as kit
from lensadapters.testing.models import reinit

IMPLEMENTATIONS = ("eager", "sdpa")
#: the families beside BART (lensadapters_bart.FAMILIES) served as encoder-decoders
OTHERS = [t for t in lensadapters_bart.FAMILIES if t != "bart"]
#: the families whose encoder attention is BigBird's (full or block-sparse)
BLOCK_SPARSE = [t for t, f in lensadapters_bart.FAMILIES.items() if f.block_sparse_encoder]


def make_model(
    implementation: str = "eager", seed: int = 0, scaled: bool = False, act: str = "gelu", model_type: str = "bart"
) -> nn.Module:
    config = lensadapters_bart.bart_config(
        layers=2, heads=2, d_model=16, ffn=24, vocab=40, scale_embedding=scaled, act=act, model_type=model_type
    )
    torch.manual_seed(seed)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation=implementation)
    reinit(model, seed)
    with torch.no_grad():  # a bias on the logits (zero at initialization)
        model.final_logits_bias.normal_(generator=torch.Generator().manual_seed(seed))
    return model.eval()


def make_causal(model_type: str, seed: int = 0, scaled: bool = True) -> nn.Module:
    config = lensadapters_bart.bart_config(
        layers=2, heads=2, d_model=16, ffn=24, vocab=40, scale_embedding=scaled, model_type=model_type
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    reinit(model, seed)
    return model.eval()


def inputs(seed: int = 0) -> dict[str, Tensor]:
    """Two encoder rows of 7 tokens, the second right-padded by 3 (pad id 1), and decoder rows of 5 tokens (the
    start token 2 first)."""
    return kit.tiny_batch(seed, pad=1, start=2, low=3)


def reference(model: Any, batch: dict[str, Tensor], edits: Optional[dict[str, Callable]] = None) -> dict:
    """Every point, computed step by step from the model's modules; ``edits`` (point -> fn) change a point's value
    where it is computed. Embeddings (the table's rows, times ``sqrt(d_model)`` where ``scale_embedding``;
    positions at rows ``position + offset`` of the position table: 2 for BART's learned ones), the embeddings' norm
    where the family has one, LayerNorms, attention (``q kᵀ * d_head**-0.5`` plus the additive mask: ``finfo.min``
    at padding keys and, in the decoder's self-attention, at later positions), the MLPs, post-LN or pre-LN blocks
    and the stacks' final norms (as ``lensadapters_bart.FAMILIES`` declares them) are written out. A causal LM
    (the decoder alone) gets TransformerLens' decoder-only names (``blocks.{i}``, ``ln_final``)."""
    out = kit.ReferencePoints(edits)
    at = out.at
    c = model.config
    fam = lensadapters_bart.FAMILIES[c.model_type]
    causal = lensadapters_bart.causal(model)
    h = c.decoder_attention_heads
    d = c.d_model // h
    lowest = torch.finfo(torch.float32).min
    factor = math.sqrt(c.d_model) if c.scale_embedding else 1.0

    def norm(prefix: str, ln: Any, x: Tensor) -> Tensor:
        centred = x - x.mean(-1, keepdim=True)
        scale = at(f"{prefix}.hook_scale", (centred.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt())
        return at(f"{prefix}.hook_normalized", centred / scale * ln.weight + ln.bias)

    def attention(prefix: str, attn: Any, x: Tensor, kv: Tensor, mask: Tensor) -> Tensor:
        b, p = x.shape[:2]
        sources = zip("qkv", (x, kv, kv))
        # an encoder's self-attention: the family's projections (BigBird's query/key/value/output linears)
        paths = fam.encoder_attention if prefix.startswith("encoder") else ("q_proj", "k_proj", "v_proj", "out_proj")
        *proj, out_proj = (attn.get_submodule(path) for path in paths)
        q, k, v = (at(f"{prefix}.hook_{n}", m(y).view(b, -1, h, d)) for (n, y), m in zip(sources, proj))
        scores = at(f"{prefix}.hook_attn_scores", torch.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5 + mask)
        pattern = at(f"{prefix}.hook_pattern", scores.softmax(-1))
        z = at(f"{prefix}.hook_z", torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return out_proj(z.reshape(b, p, h * d))

    def post_ln(pre: str, block: Any, x: Tensor, mask: Tensor, memory: Any, cross_mask: Any) -> Tensor:
        attn_out = at(f"{pre}.hook_attn_out", attention(f"{pre}.attn", block.self_attn, x, x, mask))
        x = norm(f"{pre}.ln1", block.self_attn_layer_norm, at(f"{pre}.hook_resid_mid", x + attn_out))
        last = "ln2"
        if memory is not None:
            cross = attention(f"{pre}.cross_attn", block.encoder_attn, x, memory, cross_mask)
            cross = at(f"{pre}.hook_cross_attn_out", cross)
            x = norm(f"{pre}.ln2", block.encoder_attn_layer_norm, at(f"{pre}.hook_resid_mid_cross", x + cross))
            last = "ln3"
        hidden = block.activation_fn(at(f"{pre}.mlp.hook_pre", block.fc1(x)))
        mlp_out = at(f"{pre}.hook_mlp_out", block.fc2(at(f"{pre}.mlp.hook_post", hidden)))
        x = norm(f"{pre}.{last}", block.final_layer_norm, at(f"{pre}.hook_resid_post", x + mlp_out))
        return at(f"{pre}.hook_normalized_resid_post", x)

    def pre_ln(pre: str, block: Any, x: Tensor, mask: Tensor, memory: Any, cross_mask: Any) -> Tensor:
        normed = norm(f"{pre}.ln1", block.self_attn_layer_norm, x)
        attn_out = at(f"{pre}.hook_attn_out", attention(f"{pre}.attn", block.self_attn, normed, normed, mask))
        x = at(f"{pre}.hook_resid_mid", x + attn_out)
        last = "ln2"
        if memory is not None:
            normed = norm(f"{pre}.ln2", block.encoder_attn_layer_norm, x)
            cross = attention(f"{pre}.cross_attn", block.encoder_attn, normed, memory, cross_mask)
            x = at(f"{pre}.hook_resid_mid_cross", x + at(f"{pre}.hook_cross_attn_out", cross))
            last = "ln3"
        normed = norm(f"{pre}.{last}", block.final_layer_norm, x)
        hidden = block.activation_fn(at(f"{pre}.mlp.hook_pre", block.fc1(normed)))
        mlp_out = at(f"{pre}.hook_mlp_out", block.fc2(at(f"{pre}.mlp.hook_post", hidden)))
        return at(f"{pre}.hook_resid_post", x + mlp_out)

    def stack(name: str, ids: Tensor, mask: Tensor, memory: Optional[Tensor], cross_mask: Optional[Tensor]) -> Tensor:
        module = getattr(model.model, name)
        lead = "" if name == "encoder" or causal else "decoder."
        b, p = ids.shape
        offset = lensadapters_bart.position_offset(module)
        scaled = name == "encoder" or fam.decoder_scaled  # BlenderbotSmall's decoder: never scaled
        embed = at(f"{lead}hook_embed", module.embed_tokens.weight[ids] * (factor if scaled else 1.0))
        pos = at(f"{lead}hook_pos_embed", module.embed_positions.weight[offset : p + offset].expand(b, p, -1))
        if name == "decoder" and fam.decoder_norm_first:  # the token embeddings normalized, then the positions
            x = norm(f"{lead}embed.ln", module.layernorm_embedding, embed) + pos
        elif fam.embed_ln:
            x = norm(f"{lead}embed.ln", module.layernorm_embedding, embed + pos)
        else:
            x = embed + pos
        for i, block in enumerate(module.layers):
            pre = f"blocks.{i}" if causal else f"{name}.{i}"
            x = at(f"{pre}.hook_resid_pre", x)
            x = (pre_ln if fam.pre_ln else post_ln)(pre, block, x, mask, memory, cross_mask)
        if fam.final_norms:
            x = norm("ln_final" if causal else f"{name}_final_ln", getattr(module, fam.final_norm), x)
        return x

    ids, keep = batch["input_ids"], batch["attention_mask"].bool()
    padding = torch.zeros(keep.shape).masked_fill(~keep, lowest)[:, None, None, :]
    decoder_ids = ids if causal else batch["decoder_input_ids"]
    q = decoder_ids.shape[1]
    causal_mask = torch.zeros(q, q).masked_fill(torch.ones(q, q, dtype=torch.bool).triu(1), lowest)
    if causal:  # the causal LM's padding (its attention mask) is masked in its self-attention
        out["logits"] = model.lm_head(stack("decoder", ids, (causal_mask + padding).clamp_min(lowest), None, None))
        return out
    memory = stack("encoder", ids, padding, None, None)
    x = stack("decoder", decoder_ids, causal_mask, memory, padding)
    out["logits"] = model.lm_head(x) + model.final_logits_bias
    return out


# --- reading ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_point_matches_the_reference(implementation):
    model = make_model(implementation, scaled=implementation == "sdpa")
    batch = inputs()
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        assert torch.equal(hm(**batch).logits, model(**batch).logits), "no hooks: Hugging Face's forward, bitwise"
    cache, worst = kit.check_points_against_reference(hm, batch, reference, eager=implementation == "eager")
    print(f"largest difference from the reference ({implementation}): {worst:.3g} over {len(hm.hook_names)} points")
    kit.check_reference_patterns(cache)
    hm.unwrap()


@pytest.mark.parametrize("model_type", OTHERS)
def test_family_points_and_edits_match_the_reference(model_type):
    """Each family beside BART (``FAMILIES``: pre-LN or post-LN, learned or sinusoidal positions, with or without
    the embeddings' norm and final norms, the embedding scale in the module or in the stack): every point against
    the reference (eager, bitwise logits when cached), every edit and its gradient against the same edits there."""
    model = make_model("eager", seed=2, scaled=True, model_type=model_type)
    batch = inputs(2)
    hm = HookedModel.wrap(model)
    fam = lensadapters_bart.FAMILIES[model_type]
    assert ("encoder_final_ln.hook_scale" in hm.hook_names) == fam.final_norms
    assert ("embed.ln.hook_scale" in hm.hook_names) == fam.embed_ln
    _, worst = kit.check_points_against_reference(hm, batch, reference, eager=True)
    edit, grad = kit.check_edits_against_reference(hm, batch, reference)
    print(f"{model_type}: {len(hm.hook_names)} points, largest difference {worst:.3g}, edits {edit:.3g}, {grad:.3g}")
    hm.unwrap()


@pytest.mark.parametrize("model_type", list(lensadapters_bart.FAMILIES))
def test_causal_lm_points_match_the_reference(model_type):
    """``*ForCausalLM`` (the decoder alone) with TransformerLens' decoder-only names: without hooks Hugging Face's
    forward bitwise, and every point the reference writes out (all but the core's own ``hook_attn_in``,
    ``attn.hook_result``, ``hook_mlp_in``...) matches it; an edit at ``hook_embed`` is the same edit in the
    reference."""
    model = make_causal(model_type)
    batch = {k: v for k, v in inputs(4).items() if k != "decoder_input_ids"}
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        expected = model(**batch).logits
        assert torch.equal(hm(**batch).logits, expected), "no hooks: Hugging Face's forward, bitwise"
        logits, cache = hm.run_with_cache(**batch, names_filter=hm.hook_names)
        ref = reference(model, batch)
        assert_close(kit.logits_of(logits), expected, "a cached forward")
        assert_close(ref.pop("logits"), expected, "the reference's logits are HF's")
        assert set(ref) <= set(hm.hook_names) and len(ref) == len(hm.hook_names) - 6 * hm.cfg.n_layers
        # masked scores: finfo.min in the reference, at most that in the core's (which may add masks)
        lowest = torch.finfo(torch.float32).min
        worst = max((cache[n] - v).where(v > lowest / 2, 0).abs().max().item() for n, v in ref.items())
        assert worst < 1e-4
        assert all(torch.all(cache[n][v <= lowest / 2] <= lowest) for n, v in ref.items())
        edit = {"hook_embed": kit.nudge, "hook_pos_embed": kit.nudge}
        edited = hm.run_with_hooks(**batch, fwd_hooks=[(n, lambda t, hook, f=f: f(t)) for n, f in edit.items()])
        assert_close(kit.logits_of(edited), reference(model, batch, edit)["logits"], "edited embeddings")
    print(f"{model_type} causal LM: {len(ref)} of {len(hm.hook_names)} points, largest difference {worst:.3g}")
    hm.unwrap()


# --- editing ---------------------------------------------------------------------------------------------------


def test_every_edit_and_its_gradient_match_the_reference():
    """Edits at every point at once (``nudge(t) + delta_j * t``) change the logits as the same edits in the reference
    do, and the gradient of the logits with respect to each point's ``delta_j`` is the reference's."""
    model = make_model("sdpa", seed=1, scaled=True)
    batch = inputs(1)
    hm = HookedModel.wrap(model)
    worst, worst_grad = kit.check_edits_against_reference(hm, batch, reference)
    print(f"largest edit difference: logits {worst:.3g}, gradients (relative) {worst_grad:.3g}")
    hm.unwrap()


def test_edits_match_plain_pytorch_hooks():
    """An edit through a point is the same edit made by a plain PyTorch hook on the module, bit for bit."""
    model = make_model()
    batch = inputs()
    hm = HookedModel.wrap(model)
    enc, dec = model.model.encoder, model.model.decoder
    cases = [
        ("hook_embed", enc.embed_tokens, "output"),
        ("decoder.hook_pos_embed", dec.embed_positions, "output"),
        ("encoder.0.hook_resid_mid", enc.layers[0].self_attn_layer_norm, "input"),
        ("encoder.1.attn.hook_v", enc.layers[1].self_attn.v_proj, "output"),
        ("decoder.1.hook_cross_attn_out", dec.layers[1].encoder_attn.out_proj, "output"),
        ("decoder.0.mlp.hook_post", dec.layers[0].fc2, "input"),
        ("decoder.1.hook_mlp_out", dec.layers[1].fc2, "output"),
        ("decoder.0.ln3.hook_normalized", dec.layers[0].final_layer_norm, "output"),
        ("encoder.1.hook_normalized_resid_post", enc.layers[1], "output"),
    ]

    def post(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (kit.nudge(output[0]), *output[1:])
        return kit.nudge(output.expand(args[0].shape[0], *output.shape[1:]))

    kit.check_edits_match_plain_hooks(hm, batch, cases, post)
    hm.unwrap()


@pytest.mark.parametrize("model_type", [t for t, f in lensadapters_bart.FAMILIES.items() if f.decoder_norm_first])
def test_a_decoder_that_normalizes_its_token_embeddings_first_edits_as_plain_hooks_do(model_type):
    """BlenderbotSmall's decoder reads ``layernorm_embedding(embed_tokens(ids)) + positions``: an edit of
    ``decoder.hook_pos_embed`` (the positions' output), of the norm's output and of the decoder's token embeddings
    is the same edit made by a plain hook there, bit for bit (the encoder normalizes the sum, as BART's)."""
    model = make_model(model_type=model_type, scaled=True)
    batch = inputs()
    hm = HookedModel.wrap(model)
    dec = model.model.decoder
    cases = [
        ("decoder.hook_pos_embed", dec.embed_positions, "output"),
        ("decoder.embed.ln.hook_normalized", dec.layernorm_embedding, "output"),
        ("decoder.hook_embed", dec.layernorm_embedding, "input"),
    ]

    def post(module: Any, args: Any, output: Any) -> Any:
        rows = batch["decoder_input_ids"].shape[0]  # the positions' output: [pos, d_model]
        return kit.nudge(output.expand(rows, *output.shape) if output.dim() == 2 else output)

    kit.check_edits_match_plain_hooks(hm, batch, cases, post)
    hm.unwrap()


# --- weights, generation, the analysis layer ---------------------------------------------------------------------


def test_weights_embedding_scale_positions_and_logits_bias():
    """``W_E`` includes the embedding scale (TransformerLens' convention), ``W_pos`` starts at BART's offset 2,
    ``b_U`` is ``final_logits_bias``; the logits are the last block's output through ``W_U`` plus ``b_U``."""
    for scaled in (False, True):
        model = make_model(scaled=scaled)
        batch = inputs()
        hm = HookedModel.wrap(model)
        factor = 4.0 if scaled else 1.0  # sqrt(d_model = 16)
        assert hm.cfg.extra["embed_scale"] == factor
        assert_close(hm.W_E, model.model.shared.weight * factor, "W_E")
        assert torch.equal(hm.W_pos, model.model.encoder.embed_positions.weight[2:])
        assert torch.equal(hm.b_U, model.final_logits_bias[0])
        with torch.no_grad():
            names = ["hook_embed", "decoder.1.hook_normalized_resid_post"]
            logits, cache = hm.run_with_cache(**batch, names_filter=names)
        assert_close(cache["hook_embed"], hm.W_E[batch["input_ids"]], "hook_embed is W_E's rows")
        final = cache["decoder.1.hook_normalized_resid_post"]
        assert_close(final @ hm.W_U + hm.b_U, kit.logits_of(logits), "logits from W_U and b_U")
        hm.unwrap()


def test_generate_with_hooks_and_cached_patterns():
    """Hugging Face's ``generate`` runs with the hooks attached (with its key/value cache): an ablation at a decoder
    point changes what is generated exactly as a plain PyTorch hook does, and patterns can be read at every step."""
    model = make_model("sdpa", seed=3)
    hm = HookedModel.wrap(model)
    ours, plain = kit.check_generation_with_hooks(hm, inputs(3), model.model.decoder.layers[1].fc2)
    assert not torch.equal(ours, plain), "the ablation changes what is generated"
    hm.unwrap()


def test_generate_with_hooks_pre_ln_family():
    """Generation with hooks on a pre-LN family (mBART, with its final norms): as for BART."""
    model = make_model("sdpa", seed=5, model_type="mbart")
    hm = HookedModel.wrap(model)
    ours, plain = kit.check_generation_with_hooks(hm, inputs(5), model.model.decoder.layers[1].fc2)
    assert not torch.equal(ours, plain), "the ablation changes what is generated"
    hm.unwrap()


def test_analysis_layer_and_named_refusals():
    """Patching works with the encoder-decoder's inputs; TransformerLens' one-stack methods, the stacked per-block
    weights, the causal LM's loss and TransformerLens' decoder-only generate are refused by name; so are models
    without the stacks or the head, and unequal stacks."""
    model = make_model()
    batch = inputs()
    hm = HookedModel.wrap(model)
    corrupted = {**batch, "input_ids": batch["input_ids"].flip(1)}
    kit.check_one_stack_refusals(hm, batch, corrupted, "encoder.1.hook_normalized_resid_post")
    hm.unwrap()
    with pytest.raises(UnsupportedModelError, match="serves encoder-decoders"):
        HookedModel.wrap(BartModel(model.config))
    config = lensadapters_bart.bart_config(layers=2, heads=2, d_model=16, ffn=24, vocab=40)
    config.decoder_layers = 1
    with pytest.raises(UnsupportedModelError, match="equal stacks"):
        HookedModel.wrap(BartForConditionalGeneration(config))


def test_tiny_configs_wrap():
    for seed in range(4):
        config = lensadapters_bart.lensadapters_tiny_config(arch=lensadapters_bart.ARCH, seed=seed)
        hm = HookedModel.wrap(BartForConditionalGeneration(config).eval())
        assert hm.cfg.n_layers == config.encoder_layers and hm.cfg.normalization_type == "LN"
        assert "encoder_final_ln.hook_scale" not in hm.hook_names
        hm.unwrap()


def test_causal_lm_refuses_cross_attention_inputs():
    """A ``*ForCausalLM`` is served as the decoder alone: ``encoder_hidden_states=`` (its cross-attention, which has
    no points) is refused by name, and the failed call leaves no hook behind."""
    model = make_causal("mbart")
    batch = {k: v for k, v in inputs().items() if k != "decoder_input_ids"}
    hm = HookedModel.wrap(model)
    memory = torch.zeros(2, 3, 16)
    with pytest.raises(UnsupportedModelError, match="encoder_hidden_states"):
        hm.run_with_hooks(**batch, encoder_hidden_states=memory, fwd_hooks=[("hook_embed", lambda t, hook: t)])
    assert not hm.has_hooks
    hm.unwrap()


# --- BigBird-Pegasus: its encoder attention full or block-sparse, per forward -------------------------------------


def make_block_sparse(model_type: str, seed: int = 6) -> nn.Module:
    """A tiny BigBird-Pegasus whose encoder attention is block-sparse for inputs of more than 14 tokens (``block_size``
    2, one random block: ``(5 + 2 * 1) * 2``), as transformers builds it (``attention_type="block_sparse"``)."""
    config = lensadapters_bart.bart_config(
        layers=2, heads=2, d_model=16, ffn=24, vocab=40, scale_embedding=True, model_type=model_type
    )
    config.block_size, config.num_random_blocks = 2, 1
    torch.manual_seed(seed)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager")
    reinit(model, seed)
    return model.eval()


def long_inputs(length: int, seed: int = 6) -> dict[str, Tensor]:
    """Two encoder rows of ``length`` tokens, the second right-padded by 5, and the decoder rows of ``inputs``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    ids[1, -5:], mask[1, -5:] = 1, 0
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": inputs(seed)["decoder_input_ids"]}


@pytest.mark.parametrize("model_type", BLOCK_SPARSE)
def test_block_sparse_encoder_serves_its_points_and_refuses_its_scores_by_name(model_type):
    """A genuinely block-sparse forward (16 tokens > 14): without hooks Hugging Face's forward bitwise; every point but
    the encoder's scores and patterns read as plain PyTorch hooks see them (q/k/v: the shared linears' outputs per
    head, ``hook_z``/``hook_attn_out``: the attention's output linear's input/output, the MLP's and the pre-LN
    residual ``resid_post = resid_mid + mlp_out`` exactly) and edit as plain hooks do, bit for bit; the scores and
    patterns are refused by name (the model stays block-sparse); a block-sparse input the encoder pads (15 tokens)
    is served on its own positions."""
    model = make_block_sparse(model_type)
    batch = long_inputs(16)
    hm = HookedModel.wrap(model)
    enc = model.model.encoder
    attn = enc.layers[1].self_attn
    with torch.no_grad():
        assert torch.equal(hm(**batch).logits, model(**batch).logits), "no hooks: Hugging Face's forward, bitwise"
        assert enc.attention_type == "block_sparse" and type(attn.self).__name__.endswith("BlockSparseAttention")
        seen: dict[str, Tensor] = {}
        handles = [
            attn.self.value.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o)),
            attn.output.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0])),
            enc.layers[0].fc2.register_forward_hook(lambda m, a, o: seen.__setitem__("mlp", o)),
            # (each returns None: a plain hook that reads; a layer's output is a tensor on 5.x, a tuple on 4.57)
            enc.layers[0].register_forward_hook(lambda m, a, o: seen.__setitem__("post", first_output(o))),
        ]
        names = [n for n in hm.hook_names if not n.endswith(("hook_attn_scores", "hook_pattern"))]
        logits, cache = hm.run_with_cache(**batch, names_filter=names)
        for h in handles:
            h.remove()
        assert torch.equal(kit.logits_of(logits), model(**batch).logits), "a cached forward"
        assert torch.equal(cache["encoder.1.attn.hook_v"], seen["v"].view(2, 16, 2, 8))
        assert torch.equal(cache["encoder.1.attn.hook_z"], seen["z"].view(2, 16, 2, 8))
        assert torch.equal(cache["encoder.0.hook_mlp_out"], seen["mlp"])
        assert torch.equal(cache["encoder.0.hook_resid_post"], seen["post"])
        assert torch.equal(cache["encoder.0.hook_resid_mid"] + seen["mlp"], seen["post"])
    cases = [
        ("encoder.1.attn.hook_q", attn.self.query, "output"),
        ("encoder.1.attn.hook_z", attn.output, "input"),
        ("encoder.0.hook_attn_out", enc.layers[0].self_attn.output, "output"),
        ("encoder.0.mlp.hook_post", enc.layers[0].fc2, "input"),
        ("encoder.1.hook_resid_post", enc.layers[1], "output"),
        ("encoder_final_ln.hook_normalized", enc.layernorm_embedding, "output"),
    ]
    kit.check_edits_match_plain_hooks(
        hm, batch, cases, lambda m, a, o: replace_first_output(o, kit.nudge(first_output(o)))
    )
    for name in ("encoder.0.attn.hook_attn_scores", "encoder.1.attn.hook_pattern"):
        with pytest.raises(UnsupportedModelError, match="block-sparse.*no\\s+\\[query, key\\] matrix"):
            hm.run_with_hooks(**batch, fwd_hooks=[(name, lambda t, hook: t)])
        assert not hm.has_hooks
    assert enc.attention_type == "block_sparse", "refusing leaves the model block-sparse"
    with torch.no_grad():  # (the padded input's points: test_bigbird_padding.py)
        _, padded = hm.run_with_cache(**long_inputs(15), names_filter=["encoder.0.hook_mlp_out"])
    assert padded["encoder.0.hook_mlp_out"].shape == (2, 15, 16), "the input's positions"
    assert not hm.has_hooks
    hm.unwrap()


@pytest.mark.parametrize("model_type", BLOCK_SPARSE)
def test_block_sparse_encoder_falls_back_to_full_attention_and_serves_every_point(model_type):
    """A block-sparse model given a short input (7 tokens <= 14): transformers switches it to full attention (for
    good); that forward, hooked from the start, serves every point, the encoder's scores (with the padding mask as
    transformers adds it: ``finfo.min`` at padding keys) and patterns included, against the reference; its edits
    match plain hooks and the reference; the longer input after it is then full attention too, and served."""
    model = make_block_sparse(model_type)
    hm = HookedModel.wrap(model)
    enc = model.model.encoder
    batch = inputs(6)
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=["encoder.1.attn.hook_pattern"])
    assert enc.attention_type == "original_full", "transformers switched to full attention in that forward"
    assert cache["encoder.1.attn.hook_pattern"].shape == (2, 2, 7, 7)
    _, worst = kit.check_points_against_reference(hm, batch, reference, eager=True)
    edit, grad = kit.check_edits_against_reference(hm, batch, reference)
    attn = enc.layers[0].self_attn
    plain = [
        ("encoder.0.attn.hook_k", attn.self.key, "output"),
        ("encoder.0.attn.hook_z", attn.output, "input"),
    ]
    kit.check_edits_match_plain_hooks(hm, batch, plain)
    long = long_inputs(16)
    with torch.no_grad():
        _, long_cache = hm.run_with_cache(**long, names_filter=["encoder.0.attn.hook_attn_scores"])
    masked = long_cache["encoder.0.attn.hook_attn_scores"][1, :, :, -5:]
    assert torch.all(masked < torch.finfo(torch.float32).min / 2), "padding keys masked as transformers adds it"
    _, worst_long = kit.check_points_against_reference(hm, long, reference, eager=True)
    at_16 = f"{worst_long:.3g} at 16 tokens"
    print(f"{model_type} full: largest difference {worst:.3g} ({at_16}), edits {edit:.3g}, gradients {grad:.3g}")
    hm.unwrap()


@pytest.mark.parametrize("model_type", BLOCK_SPARSE)
def test_generate_with_hooks_block_sparse_family(model_type):
    """Generation with hooks on BigBird-Pegasus (its encoder switched to full attention by the short input), at a
    decoder point (as for BART) and at an encoder point, each as a plain PyTorch hook generates."""
    model = make_model("eager", seed=2, model_type=model_type)
    hm = HookedModel.wrap(model)
    ours, plain = kit.check_generation_with_hooks(hm, inputs(2), model.model.decoder.layers[1].fc2)
    assert not torch.equal(ours, plain), "the ablation changes what is generated"
    # an encoder point during generation: the edit made once, as a plain hook on the encoder's attention output
    kwargs = dict(input_ids=inputs(2)["input_ids"], attention_mask=inputs(2)["attention_mask"], max_new_tokens=4)
    hm.add_hook("encoder.1.hook_attn_out", lambda t, hook: t * 0)
    ours = hm.generate(**kwargs, do_sample=False)
    hm.reset_hooks()
    handle = model.model.encoder.layers[1].self_attn.output.register_forward_hook(lambda m, a, o: o * 0)
    try:
        theirs = model.generate(**kwargs, do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(ours, theirs)
    hm.unwrap()


@pytest.mark.parametrize("model_type", BLOCK_SPARSE)
def test_block_sparse_encoder_refuses_a_linear_replaced_after_wrapping(model_type):
    """The q/k/v points hold the attention wrapper (transformers replaces its inner module when it switches to full
    attention, keeping the linears): a query linear replaced by hand after wrapping is refused by name when hooked,
    where a switch of the inner module (the short input's fallback) is followed."""
    model = make_block_sparse(model_type)
    hm = HookedModel.wrap(model)
    attn = model.model.encoder.layers[0].self_attn
    with torch.no_grad():
        _, cache = hm.run_with_cache(**inputs(6), names_filter=["encoder.0.attn.hook_q"])  # the switch to full
        assert cache["encoder.0.attn.hook_q"].shape == (2, 7, 2, 8)
        attn.self.query = nn.Linear(16, 16, bias=False)
        with pytest.raises(UnsupportedModelError, match="self.query was replaced after HookedModel.wrap"):
            hm.run_with_hooks(**inputs(6), fwd_hooks=[("encoder.0.attn.hook_q", lambda t, hook: t)])
    assert not hm.has_hooks
    hm.unwrap()
