"""What the Falcon-H1 tests share (tests/test_generic_falcon_h1_multipliers.py,
tests/test_generic_falcon_h1_attention_in.py, tests/test_generic_parallel_mixers.py): the real checkpoints'
multipliers, block 0's values and edits by plain PyTorch hooks on the HF modules with the multipliers applied as the
model applies them, and the checks of the served points against them."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import (
    add_to_input,
    add_to_output,
    block_points,
    edit_error,
    first_tensor,
    forward_with,
    gradients_through_edit,
    logits_with,
    record,
    relative_error,
    seeded_delta,
    sum_edits,
    tiny_model,
    wrap_generic,
)

Tensor = torch.Tensor
#: a plain-hook edit: ``install = make(d)`` (:func:`tests.branch_helpers.add_to_output` and the like)
Make = Callable[[Tensor], Callable[[], list]]

#: tiiuae/Falcon-H1-0.5B's multipliers (rounded): every one other than 1
REAL = {
    "attention_out_multiplier": 0.9375,
    "ssm_out_multiplier": 0.2357,
    "key_multiplier": 0.39,
    "mlp_multipliers": [0.88, 0.59],
    "embedding_multiplier": 5.656,
    "lm_head_multiplier": 0.039,
    "ssm_multipliers": [0.35, 0.25, 0.5, 0.5, 0.35],
}
#: the points of block 0 that :func:`reference_values` gives bit for bit
EXACT = ("hook_resid_pre", "hook_mixer_out", "hook_attn_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out")
EXACT += ("hook_resid_post", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "mlp.hook_pre")
EXACT += ("mlp.hook_pre_linear", "mlp.hook_post")


def multipliers(kw: dict) -> dict[str, float]:
    """The multipliers of a config's keywords ``kw`` the layer applies (1.0 where ``kw`` has none)."""
    gate, down = kw.get("mlp_multipliers", [1.0, 1.0])
    return {
        "attn": kw.get("attention_out_multiplier", 1.0),
        "ssm": kw.get("ssm_out_multiplier", 1.0),
        "key": kw.get("key_multiplier", 1.0),
        "gate": gate,
        "down": down,
    }


def unit_multiplier_points() -> list[set[str]]:
    """The points each block of the tiny Falcon-H1 with unit multipliers gets."""
    hm = wrap_generic(tiny_model("falcon_h1"))
    points = [block_points(hm, i) for i in range(hm.cfg.n_layers)]
    hm.unwrap()
    return points


def assert_the_points_of_unit_multipliers(hm: Any, unit: list[set[str]]) -> None:
    """Every block of ``hm`` serves the 31 points (with the scan's five: hook_gate, hook_conv, hook_dt,
    hook_ssm_state, hook_ssm_out) of the same block with unit multipliers (``unit``)."""
    for i in range(hm.cfg.n_layers):
        got = block_points(hm, i)
        assert len(got) == 31, (i, sorted(got))
        assert got == unit[i], (i, sorted(got ^ unit[i]))


def branch_record(
    model: torch.nn.Module, layer: torch.nn.Module, more: dict[str, tuple[torch.nn.Module, str]] | None = None
) -> dict[str, Tensor]:
    """:func:`tests.branch_helpers.record` of a Falcon-H1 layer's branch points as its modules give them (the
    attention's and the Mamba mixer's outputs as they are, before any multiplier), and of the ``more`` modules."""
    return record(
        model,
        {
            "hook_resid_pre": (layer, "in"),
            "hook_attn_out": (layer.self_attn, "out"),
            "hook_mixer_out": (layer.mamba, "out"),
            "hook_resid_mid": (layer.pre_ff_layernorm, "in"),
            "hook_mlp_out": (layer.feed_forward, "out"),
            **(more or {}),
        },
    )


def reference_values(model: torch.nn.Module, m: dict[str, float]) -> dict[str, Tensor]:
    """Block 0's points by plain hooks on the HF modules, the multipliers applied as the model applies them."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import apply_rotary_pos_emb

    layer = model.model.layers[0]
    attn, ff = layer.self_attn, layer.feed_forward
    heads, kv, d = model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim
    seen: dict[str, Any] = {}

    def out(key: str, c: float = 1.0) -> Callable:
        return lambda mod, a, o: seen.__setitem__(key, first_tensor(o).clone() * c if c != 1.0 else first_tensor(o))

    def inp(key: str) -> Callable:
        return lambda mod, a: seen.__setitem__(key, a[0].clone())

    def kwargs(mod: Any, a: Any, k: dict) -> None:
        seen["cos_sin"] = k["position_embeddings"]

    handles = [
        layer.register_forward_pre_hook(inp("hook_resid_pre")),
        layer.register_forward_hook(out("hook_resid_post")),
        layer.mamba.register_forward_hook(out("hook_mixer_out", m["ssm"])),
        attn.register_forward_hook(out("hook_attn_out", m["attn"])),
        attn.register_forward_pre_hook(kwargs, with_kwargs=True),
        layer.pre_ff_layernorm.register_forward_pre_hook(inp("hook_resid_mid")),
        ff.register_forward_hook(out("hook_mlp_out")),
        attn.q_proj.register_forward_hook(out("q")),
        attn.k_proj.register_forward_hook(out("k")),
        attn.v_proj.register_forward_hook(out("v")),
        attn.q_proj.register_forward_pre_hook(inp("q_in")),
        attn.o_proj.register_forward_pre_hook(inp("z")),
        ff.gate_proj.register_forward_hook(out("mlp.hook_pre", m["gate"])),
        ff.up_proj.register_forward_hook(out("mlp.hook_pre_linear")),
        ff.down_proj.register_forward_pre_hook(inp("mlp.hook_post")),
    ]
    forward_with(model, handles)
    b, p = seen["q"].shape[:2]
    q, v = seen.pop("q").view(b, p, heads, d), seen.pop("v").view(b, p, kv, d)
    k = seen.pop("k").view(b, p, kv, d) * m["key"]  # what the attention module computes
    rot_q, rot_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *seen.pop("cos_sin"))
    z = seen.pop("z").view(b, p, heads, d)
    W_O = attn.o_proj.weight.T.unflatten(0, (heads, d))  # [h, d, d_model]
    seen.update({"attn.hook_q": q, "attn.hook_k": k, "attn.hook_v": v, "attn.hook_z": z})
    seen["attn.hook_rot_q"], seen["attn.hook_rot_k"] = rot_q.transpose(1, 2), rot_k.transpose(1, 2)
    seen["attn.hook_result"] = torch.einsum("bphd,hdm->bphm", z, W_O) * m["attn"]
    seen["hook_mlp_in"] = seen["hook_resid_mid"]
    seen["hook_q_input_read"] = seen.pop("q_in")
    return seen


def plain_edits(layer: torch.nn.Module, m: dict[str, float]) -> dict[str, tuple[Make, bool]]:
    """Each point's edit by plain hooks on the HF modules at the same place (``d`` added there), and whether the
    point's edit is bit for bit that one (an edit of a value the model multiplies by a constant after a module
    reaches that module's output divided by it, exact up to one rounding)."""
    attn, ff = layer.self_attn, layer.feed_forward
    before = {"hook_mixer_out": (layer.mamba, m["ssm"]), "hook_attn_out": (attn, m["attn"])}
    summed = sum_edits(layer, layer.pre_ff_layernorm, before, [ff], 1.0)
    return {
        **{name: (make, True) for name, make in summed.items()},
        "hook_mlp_in": (lambda d: add_to_input(layer.pre_ff_layernorm, d), True),
        "hook_resid_post": (lambda d: add_to_output(layer, d), True),
        "attn.hook_q": (lambda d: add_to_output(attn.q_proj, d.flatten(-2)), True),
        "attn.hook_k": (lambda d: add_to_output(attn.k_proj, d.flatten(-2) / m["key"]), m["key"] == 1.0),
        "attn.hook_v": (lambda d: add_to_output(attn.v_proj, d.flatten(-2)), True),
        "attn.hook_z": (lambda d: add_to_input(attn.o_proj, d.flatten(-2)), True),
        "attn.hook_result": (lambda d: summed["hook_attn_out"](d.sum(-2)), False),
        "mlp.hook_pre": (lambda d: add_to_output(ff.gate_proj, d / m["gate"]), m["gate"] == 1.0),
        "mlp.hook_pre_linear": (lambda d: add_to_output(ff.up_proj, d), True),
        "mlp.hook_post": (lambda d: add_to_input(ff.down_proj, d), True),
    }


def assert_edits_are_the_plain_hooks(hm: Any, reference: torch.nn.Module, edits: dict[str, tuple[Make, bool]]) -> None:
    """An edit of each of block 0's points (a seeded delta of a tenth, by point) changes the logits as its plain
    hooks on ``reference`` do (``edits``, :func:`plain_edits`): bit for bit where they say so, else within 1e-5 of
    the largest logit."""
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith("blocks.0."))
    scale = float(logits_with(reference, lambda: []).abs().max())
    errors = {}
    for k, (name, (make, exact)) in enumerate(edits.items()):
        d = seeded_delta(cache[f"blocks.0.{name}"], 20 + k) * 0.1
        error = edit_error(hm, reference, f"blocks.0.{name}", d, make(d))
        errors[name] = error / scale
        if exact:
            assert error == 0.0, (name, error)
    assert all(e < 1e-5 for e in errors.values()), errors


def edit_gradient_error(
    model: torch.nn.Module, edits: Callable[[torch.nn.Module], dict[str, tuple[Make, bool]]], point: str
) -> float:
    """In float64: the relative difference of the gradients of a loss of the logits with respect to an edit of block
    0's ``point`` made through the wrapped ``model`` and by the plain hooks ``edits(layer)[point]`` on a copy."""
    model = model.double()
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    make = edits(reference.model.layers[0])[point][0]
    _, cache = hm.run_with_cache(input_ids(), names_filter=f"blocks.0.{point}")
    d0 = seeded_delta(cache[f"blocks.0.{point}"], 11).double() * 0.1
    grad, want, _ = gradients_through_edit(hm, reference, f"blocks.0.{point}", make, d0)
    hm.unwrap()
    return relative_error(grad, want)
