"""Falcon-H1 with an attention input multiplier (``attention_in_multiplier``, the layer calls its attention with
``hidden_states * attention_in_multiplier``, its Mamba mixer with the norm's output as it is) gets the points it gets
with unit multipliers (31 a layer with the scan's points; 17 before the generic adapter described the constant), each
what the model computes. Nothing is named: the constant is the one of the config's numbers the norm's output times
which is, bit for bit, what the attention module reads on the probe (``BlockLayout.attn_in_scale``).

TransformerLens' reading: ``ln1.hook_normalized`` is the RMSNorm's ``x / scale`` (before its weight ``w``, as for every
RMSNorm), the norm's output ``hook_normalized * w`` what both branches start from: an edit of it gives the norm's
output recomputed from it, which the layer multiplies by the constant for the attention and not for the Mamba mixer,
exactly as if the norm had computed it. ``W_Q``/``W_K``/``W_V`` include the constant (their biases do not), so
``hook_q = (ln1.hook_normalized * w) @ W_Q + b_Q`` (the key multiplier in ``W_K`` too), and the head inputs' edits
reach the projections through those weights.

Checked with the real checkpoints' other multipliers and alone: values against plain hooks on the HF modules, edits
against plain hooks making them at the same place, gradients through edits, the weights' identities, cached
generation with edits."""

from __future__ import annotations

import copy

import pytest
import torch

from lensadapters.testing.every_model_type import input_ids
from lensadapters.testing.scan_checks import check_cached_edit
from tests.branch_helpers import (
    add_to_output,
    assert_verified_but_scan,
    block_points,
    edit_error,
    logits_with,
    relative_error,
    seeded_delta,
    tiny_model,
    wrap_generic,
)
from tests.falcon_h1_helpers import (
    EXACT,
    REAL,
    assert_edits_are_the_plain_hooks,
    assert_the_points_of_unit_multipliers,
    edit_gradient_error,
    multipliers,
    plain_edits,
    reference_values,
    unit_multiplier_points,
)

Tensor = torch.Tensor

C = 0.7
VARIANTS = {"real": dict(REAL, attention_in_multiplier=C), "alone": {"attention_in_multiplier": C}}


def _model(variant: str) -> torch.nn.Module:
    """The tiny model, its pre-attention norms' weights not ones (the weights' identities then need them)."""
    model = tiny_model("falcon_h1", **VARIANTS[variant])
    g = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        w = layer.input_layernorm.weight
        w.data.copy_(1.0 + 0.2 * torch.randn(w.shape, generator=g))
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_layer_gets_the_31_points_of_unit_multipliers_each_verified(variant: str) -> None:
    unit = unit_multiplier_points()
    hm = wrap_generic(_model(variant))
    assert_the_points_of_unit_multipliers(hm, unit)
    assert [hm.block_layouts[i].attn_in_scale for i in range(hm.cfg.n_layers)] == [C] * hm.cfg.n_layers
    assert_verified_but_scan(hm, 0)
    hm.unwrap()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_points_value_is_what_the_model_computes_and_the_weights_map_ln1s_output(variant: str) -> None:
    model = _model(variant)
    reference = copy.deepcopy(model)
    want = reference_values(reference, multipliers(VARIANTS[variant]))
    layer = reference.model.layers[0]
    normalized: dict[str, Tensor] = {}
    handle = layer.input_layernorm.register_forward_hook(lambda m, a, o: normalized.__setitem__("x", o.clone()))
    with torch.no_grad():
        plain = reference(input_ids()).logits
    handle.remove()
    assert torch.equal(want["hook_q_input_read"], normalized["x"] * C)  # what the model's attention reads
    hm = wrap_generic(model)
    skipped = ("hook_pattern", "hook_attn_scores")
    logits, cache = hm.run_with_cache(
        input_ids(), names_filter=lambda n: n.startswith("blocks.0.") and not n.endswith(skipped)
    )
    assert torch.equal(logits, plain)  # reading changes nothing
    w = layer.input_layernorm.weight
    x = cache["blocks.0.ln1.hook_normalized"] * w  # the norm's output (x / scale times its weight), not times C
    assert relative_error(x, normalized["x"]) < 1e-6
    for name in EXACT:
        assert torch.equal(cache[f"blocks.0.{name}"], want[name]), name
    errors = {}
    for which, W, b in (("q", hm.W_Q[0], hm.b_Q[0]), ("k", hm._W_K[0], hm._b_K[0]), ("v", hm._W_V[0], hm._b_V[0])):
        at_w = torch.einsum("bpm,hmd->bphd", x, W) + b
        errors[which] = relative_error(at_w, cache[f"blocks.0.attn.hook_{which}"])
    assert all(e < 1e-5 for e in errors.values()), errors
    for i in range(hm.cfg.n_layers):  # the constant in the weights, not in the biases
        W_Q = reference.model.layers[i].self_attn.q_proj.weight.T.unflatten(-1, (hm.cfg.n_heads, -1)).permute(1, 0, 2)
        assert torch.equal(hm.W_Q[i], W_Q * C)
        bias = reference.model.layers[i].self_attn.q_proj.bias
        assert bias is None or torch.equal(hm.b_Q[i].flatten(), bias)
    hm.unwrap()


def _edits(layer: torch.nn.Module, m: dict) -> dict:
    plain = plain_edits(layer, m)
    # x / scale + d: the norm's output plus d * w (the norm's own output recomputed there: up to rounding)
    plain["ln1.hook_normalized"] = (
        lambda d: add_to_output(layer.input_layernorm, d * layer.input_layernorm.weight),
        False,
    )
    return plain


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_edit_changes_the_logits_as_a_plain_hook_making_it_at_the_same_place(variant: str) -> None:
    model = _model(variant)
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    assert_edits_are_the_plain_hooks(hm, reference, _edits(reference.model.layers[0], multipliers(VARIANTS[variant])))
    hm.unwrap()


def _head_input_edit(layer: torch.nn.Module, d: Tensor, heads: int) -> object:
    """``hook_q_input + d`` by plain hooks: each head's query from its own edited copy of the layer's input, through
    the norm, the constant and ``q_proj`` (the model's own modules)."""
    attn = layer.self_attn

    def hook(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
        x = layer.input_layernorm(state["x"].unsqueeze(-2) + d) * C  # [b, p, h, d_model]
        per_head = torch.nn.functional.linear(x, module.weight, module.bias).unflatten(
            -1, (heads, -1)
        )  # [b, p, h(copy), h, d]
        return per_head.diagonal(dim1=-3, dim2=-2).movedim(-1, -2).flatten(-2)

    state: dict[str, Tensor] = {}
    return lambda: [
        layer.register_forward_pre_hook(lambda m, a: state.__setitem__("x", a[0])),
        attn.q_proj.register_forward_hook(hook),
    ]


def test_a_head_input_edit_changes_the_logits_as_the_model_reading_the_edited_copy() -> None:
    model = _model("real")
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    _, cache = hm.run_with_cache(input_ids(), names_filter="blocks.0.hook_q_input")
    d = seeded_delta(cache["blocks.0.hook_q_input"], 5) * 0.1
    d[..., 1:, :] = 0.0  # head 0's copy only
    error = edit_error(
        hm, reference, "blocks.0.hook_q_input", d, _head_input_edit(reference.model.layers[0], d, hm.cfg.n_heads)
    )
    assert error / float(logits_with(reference, lambda: []).abs().max()) < 1e-5, error
    hm.unwrap()


@pytest.mark.parametrize("point", ["ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z"])
def test_gradients_through_an_edit_equal_a_plain_hooks(point: str) -> None:
    """In float64: the gradient of a loss of the logits with respect to an edit equals the gradient through the same
    edit made by plain hooks on a copy. ``ln1.hook_normalized``'s to 1e-6: the model's RMSNorm computes in float32 even
    in a float64 model, so its output and the edit recomputing it from ``x / scale + d`` differ by float32's rounding
    (so they do with unit multipliers, and in Llama)."""
    error = edit_gradient_error(_model("real"), lambda layer: _edits(layer, multipliers(VARIANTS["real"])), point)
    assert error < (1e-6 if point == "ln1.hook_normalized" else 1e-10), error


@pytest.mark.parametrize("point", ["ln1.hook_normalized", "attn.hook_q", "attn.hook_v", "hook_q_input"])
def test_cached_generation_with_an_edit_gives_a_full_passs_logits(point: str) -> None:
    hm = wrap_generic(_model("real"))
    check_cached_edit(hm, input_ids()[:, :5], f"blocks.1.{point}", lambda t, hook: t * 1.5 + 0.25, effect=1e-3)
    hm.unwrap()


def test_a_bfloat16_model_finds_the_constant_and_gets_its_points_each_verified() -> None:
    """In bfloat16 the norm's output times the Python float is still, bit for bit, what the attention reads."""
    hm = wrap_generic(tiny_model("falcon_h1", attention_in_multiplier=C).to(torch.bfloat16))
    for i in range(hm.cfg.n_layers):
        assert len(block_points(hm, i)) == 31
        assert hm.block_layouts[i].attn_in_scale == C
    assert_verified_but_scan(hm, 0)
    hm.unwrap()
