"""ActivationCache analysis methods against the model's own hook points, on every installed architecture:
decompositions add up to the residual stream, norms applied to stacks add up to the model's norm output,
attributions add up to the logits; undefined decompositions (post-LN, parallel blocks' resid_mid) are refused."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import OPTConfig

from lensadapters import ActivationCache, DecompositionUndefinedError, HookedModel, LensAdaptersError
from lensadapters.hf import tiny_config_of
from lensadapters.testing import assert_close
from lensadapters.testing.tiny_models import ARCH_NAMES, first_causal, from_config, needs, tiny
from lensadapters.wiring import non_attention_blocks

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def norm_output_without_bias(hm: HookedModel, cache: ActivationCache, prefix: str) -> torch.Tensor:
    """What the norm ``prefix`` computes, less its bias, read from its own hook points."""
    spec = hm.norm_spec(hm.norm_module(prefix))
    normalized = cache[prefix + ".hook_normalized"]
    if spec.kind == "LN":  # hook_normalized is the norm's output
        return normalized - (spec.bias if spec.bias is not None else 0)
    return normalized * (spec.weight + spec.weight_offset)  # RMS: hook_normalized is before the weight


def pre_ln(hm: HookedModel) -> bool:
    """Pre-LN blocks adding their attention and MLP outputs as computed (no post-LN, no post norms, no experts)."""
    return (
        not any(bl.post_norm or bl.ln1_post is not None or bl.ln2_post is not None for bl in hm.block_layouts)
        and not hm.cfg.num_experts
    )


def heads_undefined(hm: HookedModel, layer: int, mlp_input: bool = False) -> bool:
    """Whether the heads stacked up to block ``layer``'s input (its attention too, for ``mlp_input`` of a sequential
    block) include a block without softmax attention (a hybrid's linear-attention layer): no heads there, so
    ``stack_head_results`` and ``get_full_resid_decomposition`` refuse it."""
    own = mlp_input and layer < hm.cfg.n_layers and not hm.block_layouts[layer].parallel
    return any(i < layer + own for i in non_attention_blocks(hm))


def refused_for_heads(call) -> None:
    with pytest.raises(DecompositionUndefinedError, match="something other than softmax attention"):
        call()


@pytest.mark.parametrize("arch", ARCH_NAMES)
@SETTINGS
@given(data=st.data())
def test_decompositions_add_up_to_the_residual_stream(arch: str, data: st.DataObject) -> None:
    hm = HookedModel.wrap(tiny(arch, data.draw(st.integers(0, 60), label="seed")))
    n = hm.cfg.n_layers
    ids = torch.randint(0, hm.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(n))
    if not pre_ln(hm):
        hm.unwrap()
        return  # post-LN: see test_post_ln_decompositions_are_refused
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids)
    layer = data.draw(st.integers(0, n), label="layer")
    stream = cache["resid_pre", layer] if layer < n else cache["resid_post", n - 1]
    assert_close(cache.decompose_resid(layer).sum(0), stream, "decompose_resid adds up")
    for expand in (True, False):
        if heads_undefined(hm, layer):
            refused_for_heads(partial(cache.get_full_resid_decomposition, layer, expand_neurons=expand))
            continue
        assert_close(
            cache.get_full_resid_decomposition(layer, expand_neurons=expand).sum(0),
            stream,
            f"full decomposition (expand_neurons={expand}) adds up",
        )
    if layer > 0 and heads_undefined(hm, layer):
        refused_for_heads(lambda: cache.stack_head_results(layer, incl_remainder=True))
    elif layer > 0:
        assert_close(
            cache.stack_head_results(layer, incl_remainder=True).sum(0),
            cache["resid_post", layer - 1],
            "heads + remainder",
        )
        assert_close(
            cache.stack_neuron_results(layer, incl_remainder=True).sum(0),
            cache["resid_post", layer - 1],
            "neurons + remainder",
        )
    if layer < n:  # the MLP's input: resid_mid of sequential blocks, the block input of parallel ones
        mlp_in = cache["mlp_in", layer] if f"blocks.{layer}.hook_mlp_in" in cache else stream
        assert_close(cache.decompose_resid(layer, mlp_input=True).sum(0), mlp_in, "decompose_resid(mlp_input)")
        if heads_undefined(hm, layer, mlp_input=True):
            refused_for_heads(lambda: cache.get_full_resid_decomposition(layer, mlp_input=True))
            hm.unwrap()
            return
        assert_close(
            cache.get_full_resid_decomposition(layer, mlp_input=True).sum(0),
            mlp_in,
            "get_full_resid_decomposition(mlp_input)",
        )
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
@SETTINGS
@given(data=st.data())
def test_norms_applied_to_stacks_add_up_to_the_model_norm(arch: str, data: st.DataObject) -> None:
    """``apply_ln_to_stack`` is the norm's linear part (centre, cached scale, weight): over a decomposition it
    adds up to the model's own norm output less its bias, at every block input and at the unembedding."""
    hm = HookedModel.wrap(tiny(arch, data.draw(st.integers(0, 60), label="seed")))
    if not pre_ln(hm):
        hm.unwrap()
        return
    n = hm.cfg.n_layers
    ids = torch.randint(0, hm.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids)
    layer = data.draw(st.integers(0, n), label="layer")
    mlp_input = layer < n and data.draw(st.booleans(), label="mlp_input")
    pos = data.draw(st.sampled_from([None, -1, (1, 3)]), label="pos_slice")
    if heads_undefined(hm, layer, mlp_input):  # no heads to stack: the blocks' outputs, which add up as well
        refused_for_heads(lambda: cache.get_full_resid_decomposition(layer, mlp_input=mlp_input, pos_slice=pos))
        stack = cache.decompose_resid(layer, mlp_input=mlp_input, pos_slice=pos)
    else:
        stack = cache.get_full_resid_decomposition(layer, mlp_input=mlp_input, pos_slice=pos)
    normalized = cache.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos)
    if layer == n:
        prefix = "ln_final" if "ln_final.hook_scale" in hm.hook_names else None
    else:
        ln2 = mlp_input and f"blocks.{layer}.ln2.hook_scale" in hm.hook_names
        prefix = f"blocks.{layer}.ln{2 if ln2 else 1}"
        if not ln2 and hm.block_layouts[layer].ln1 is None:  # no norm before the block's attention (ModernBERT's)
            prefix = None
    if prefix is None:
        assert torch.equal(normalized, stack)
    else:
        from lensadapters.utils import Slice

        expected = Slice(pos).apply(norm_output_without_bias(hm, cache, prefix), dim=-2)
        assert_close(normalized.sum(0), expected, f"apply_ln_to_stack at {prefix}")
    # the logit lens: the final norm recomputed on each whole stream (the model's own output at the end)
    lens = cache.accumulated_resid(apply_ln=True)
    if "ln_final.hook_scale" in hm.hook_names:
        assert_close(
            lens[-1],
            cache["ln_final.hook_normalized"]
            if hm.norm_spec(hm.norm_module("ln_final")).kind == "LN"
            else norm_output_without_bias(hm, cache, "ln_final"),
            "accumulated_resid(apply_ln)[-1]",
        )
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_logit_attributions_add_up_to_the_logit(arch: str) -> None:
    hm = HookedModel.wrap(tiny(arch, 3))
    if not pre_ln(hm):
        hm.unwrap()
        return
    ids = torch.randint(0, hm.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, return_type="logits")
        answer, wrong = ids[:, -1], (ids[:, -1] + 1) % hm.cfg.d_vocab
        if heads_undefined(hm, hm.cfg.n_layers):  # a hybrid's linear-attention block: no heads to decompose into
            refused_for_heads(lambda: cache.get_full_resid_decomposition(pos_slice=-1))
            hm.unwrap()
            return
        stack = cache.get_full_resid_decomposition(pos_slice=-1)
        names = hm.hook_names
        if "ln_final.hook_normalized" in names and names[-1] != "ln_final.hook_normalized":  # a head after it
            with pytest.raises(DecompositionUndefinedError, match="prediction head runs between"):
                cache.logit_attrs(stack, answer, wrong, pos_slice=-1)
            hm.unwrap()
            return
        attrs = cache.logit_attrs(stack, answer, wrong, pos_slice=-1)
        diff = logits[:, -1].gather(-1, answer[:, None])[:, 0] - logits[:, -1].gather(-1, wrong[:, None])[:, 0]
        bias = hm.b_U[answer] - hm.b_U[wrong]
        if "ln_final.hook_scale" in hm.hook_names:
            spec = hm.norm_spec(hm.norm_module("ln_final"))
            if spec.bias is not None:
                bias = bias + spec.bias @ (hm.W_U[:, answer] - hm.W_U[:, wrong])
        assert_close(attrs.sum(0), diff - bias, "logit difference attributions add up")
        assert attrs.shape == (stack.shape[0], 2)
        with pytest.raises(ValueError, match="same shape"):
            cache.logit_attrs(stack, answer, wrong[:1], pos_slice=-1)
    hm.unwrap()


@needs("opt")
def test_post_ln_decompositions_are_refused() -> None:
    sizes = dict(hidden=16, heads=2, positions=32, ffn_dim=32, word_embed_proj_dim=16)
    config = tiny_config_of(OPTConfig, **sizes, do_layer_norm_before=False, dropout_free=True)
    hm = HookedModel.wrap(from_config(config))
    with torch.no_grad():
        _, cache = hm.run_with_cache(torch.randint(0, 64, (1, 4)))
    for call in (
        lambda: cache.decompose_resid(),
        lambda: cache.get_full_resid_decomposition(),
        lambda: cache.stack_head_results(incl_remainder=True),
        lambda: cache.apply_ln_to_stack(cache.accumulated_resid(1), 1),
        lambda: cache.accumulated_resid(1, apply_ln=True),
    ):
        with pytest.raises(DecompositionUndefinedError, match="post-LN"):
            call()
    assert cache.accumulated_resid().shape[0] == 3  # the streams themselves are fine
    assert cache.stack_head_results().shape[0] == 2 * 2  # and so are the heads' outputs
    stack = cache.accumulated_resid()
    assert torch.equal(cache.apply_ln_to_stack(stack), stack)  # no final norm: the unembedding reads the stream
    hm.unwrap()


def test_parallel_blocks_have_no_resid_mid_and_their_mlp_reads_the_block_input() -> None:
    for seed in range(30):
        model = tiny("gpt_neox", seed)
        if model.config.use_parallel_residual:
            break
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        _, cache = hm.run_with_cache(torch.randint(0, hm.cfg.d_vocab, (1, 4)))
    with pytest.raises(DecompositionUndefinedError, match="resid_mid"):
        cache.accumulated_resid(incl_mid=True)
    _, labels = cache.decompose_resid(0, mlp_input=True, return_labels=True)
    assert "0_attn_out" not in labels
    with pytest.raises(ValueError, match="mlp_input needs a block"):
        cache.decompose_resid(hm.cfg.n_layers, mlp_input=True)
    hm.unwrap()


def test_cache_moves_slices_and_keys_as_transformer_lens() -> None:
    hm = HookedModel.wrap(tiny(first_causal()))
    with torch.no_grad():
        _, cache = hm.run_with_cache(torch.randint(0, hm.cfg.d_vocab, (2, 4)))
    assert cache.to("cpu") is cache and cache.cpu() is cache
    assert torch.equal(cache["k0"], cache["blocks.0.attn.hook_k"])  # TransformerLens' shorthand
    assert torch.equal(cache["scale", 0, "ln2"], cache["blocks.0.ln2.hook_scale"])
    assert torch.equal(cache["resid_pre", -1], cache[f"blocks.{hm.cfg.n_layers - 1}.hook_resid_pre"])
    assert cache.cache_dict is cache._data and cache.has_embed
    sliced = cache.apply_slice_to_batch_dim(1)
    assert not sliced.has_batch_dim and torch.equal(sliced["resid_pre", 0], cache["resid_pre", 0][1])
    assert sliced.model is hm
    one = cache.apply_slice_to_batch_dim((0, 1))
    assert one.remove_batch_dim() is one and not one.has_batch_dim and one["embed"].dim() == 2
    cache.compute_head_results()
    z, W_O = cache["z", 0], hm.W_O[0]
    assert_close(cache["result", 0], torch.einsum("bphd,hdm->bphm", z, W_O), "compute_head_results")
    with torch.no_grad():
        _, hooked = hm.run_with_cache(torch.zeros(1, 2, dtype=torch.long), names_filter="blocks.0.attn.hook_result")
    assert hooked["result", 0].shape[-2:] == (hm.cfg.n_heads, hm.cfg.d_model)
    with pytest.raises(LensAdaptersError, match="has no model"):
        ActivationCache(dict(cache), hm.cfg.n_layers).decompose_resid()
    hm.unwrap()
