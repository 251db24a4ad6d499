"""GraniteMoeHybrid's attention layer, whose MLP is two modules it adds as one sum (routed experts, and a shared MLP
of one fused gate-up projection), each branch times ``residual_multiplier``, with ibm-granite's multipliers: the
automatic description gives it every attention point (queries, keys, values, ``hook_result``, ``hook_z``, scores,
patterns), the routing points and the shared MLP's as a shared expert's (``mlp.shared_expert.*``),
``hook_mlp_out`` the sum it adds; values and edits as plain PyTorch hooks on the HF modules compute them, gradients
through an edit too, and cached generation with an edit equals one full pass. Its Mamba layer keeps the mixer form,
with its shared MLP's points too.
GraniteMoeShared (the same MLP of two modules, every layer attention) is described all the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters.adapters.generic import findings
from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import (
    add_to_input,
    add_to_output,
    assert_cached_edit_is_a_full_pass,
    attention_weights,
    block_points,
    edit_error,
    logits_with,
    plain_edit_error,
    plain_gradient_error,
    record,
    record_heads,
    relative_error,
    seeded_delta,
    sum_edit,
    sum_edits,
    tiny_model,
    wrap_generic,
    wrapped,
)

#: ibm-granite's checkpoints' multipliers (granite-4.0-h-tiny: residual 0.22, attention 1/128, ...)
GRANITE = {"residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0}
GRANITE["logits_scaling"] = 8.0
C = GRANITE["residual_multiplier"]
ATTENTION = 1  # layer_types: a Mamba layer, then the attention layer
SHARED = ["mlp.shared_expert.hook_gate", "mlp.shared_expert.hook_pre", "mlp.shared_expert.hook_post"]
SHARED.append("mlp.shared_expert.hook_result")
ATTENTION_POINTS = ["attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "attn.hook_result"]
ATTENTION_POINTS += ["attn.hook_attn_scores", "attn.hook_pattern"]


def _plain(name: str) -> bool:
    return not name.endswith(("hook_attn_scores", "hook_pattern"))


def _hybrid() -> Any:
    return tiny_model(
        "granitemoehybrid", layer_types=["linear_attention", "full_attention"], num_hidden_layers=2, **GRANITE
    )


@pytest.fixture(scope="module")
def hybrid() -> Any:
    yield from wrapped(_hybrid())


def test_the_attention_layer_is_described_and_the_mamba_layer_keeps_the_mixer_form(hybrid: Any) -> None:
    model, hm = hybrid
    got = block_points(hm, ATTENTION)
    want = {*ATTENTION_POINTS, *SHARED, "hook_attn_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out"}
    want |= {"ln1.hook_scale", "ln2.hook_scale", "hook_resid_pre", "hook_resid_post"}
    want |= {"mlp.hook_router_logits", "mlp.hook_routing_weights"}  # (4.x: grouped experts, 5.x: fused experts)
    assert want <= got, sorted(want - got)
    mamba = block_points(hm, 0)
    assert {"mamba.hook_in_proj", "mamba.hook_ssm_state", "hook_attn_out", "hook_mlp_out", *SHARED} <= mamba, mamba
    assert not any(n.startswith("attn.") for n in mamba)
    d = findings(model).description
    assert d is not None and d.layers[ATTENTION] is not None and d.layers[0] is None
    assert d.layers[ATTENTION].block.mlp == "block_sparse_moe"
    assert (d.layers[ATTENTION].block.attn_scale, d.layers[ATTENTION].block.mlp_scale) == (C, C)


def test_each_point_reads_what_the_hf_modules_compute(hybrid: Any) -> None:
    model, hm = hybrid
    layer = model.model.layers[ATTENTION]
    attn, shared = layer.self_attn, layer.shared_mlp
    seen = record_heads(
        model,
        attn,
        {
            "attn": (attn, "out"),
            "mid": (layer.post_attention_layernorm, "in"),
            "gate_up": (shared.input_linear, "out"),
            "post": (shared.output_linear, "in"),
            "shared": (shared, "out"),
            "moe": (layer.block_sparse_moe, "out"),
        },
    )
    p = f"blocks.{ATTENTION}."
    # (not the scores and patterns: hooking them computes the attention explicitly, not bit for bit)
    logits, cache = hm.run_with_cache(input_ids(), names_filter=lambda name: name.startswith(p) and _plain(name))
    with torch.no_grad():
        assert torch.equal(logits, model(input_ids()).logits)  # reading them changes nothing
    gate, up = seen["gate_up"].chunk(2, dim=-1)
    exact = {
        **{name: seen[name] for name in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z")},  # per head
        "hook_attn_out": seen["attn"] * C,  # what the layer adds
        "hook_resid_mid": seen["mid"],
        "hook_mlp_in": seen["mid"],
        "mlp.shared_expert.hook_gate": gate,
        "mlp.shared_expert.hook_pre": up,
        "mlp.shared_expert.hook_post": seen["post"],
        "mlp.shared_expert.hook_result": seen["shared"],
        "hook_mlp_out": (seen["moe"] + seen["shared"]) * C,  # the two modules' sum, as the layer adds it
    }
    for name, want in exact.items():
        assert torch.equal(cache[p + name], want), (name, relative_error(cache[p + name], want))
    # per head, the output projection's contributions times the constant: their sum is what the layer adds
    assert relative_error(cache[p + "attn.hook_result"].sum(-2), seen["attn"] * C) < 1e-5


def test_the_weights_of_the_described_layer_include_the_constant(hybrid: Any) -> None:
    model, hm = hybrid
    W_O = attention_weights(hm, model, ATTENTION, model.model.layers[ATTENTION].self_attn, o_scale=C)
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith(f"blocks.{ATTENTION}."))
    z, out = cache[f"blocks.{ATTENTION}.attn.hook_z"], cache[f"blocks.{ATTENTION}.hook_attn_out"]
    assert relative_error(torch.einsum("bphd,hdm->bpm", z, W_O), out) < 1e-5


def _part(module: torch.nn.Module, d: torch.Tensor, index: int) -> Any:
    """``d`` added to part ``index`` of a fused gate-up projection's output (``[gate | up]``)."""
    zeros = torch.zeros_like(d)
    return add_to_output(module, torch.cat([d, zeros] if index == 0 else [zeros, d], dim=-1))


def _plain_edits(layer: Any) -> dict[str, tuple[torch.nn.Module, str, Any]]:
    """Each point's plain-hook edit: ``(module whose value d is shaped like, side, install(d))``."""
    attn, shared, reader = layer.self_attn, layer.shared_mlp, layer.post_attention_layernorm
    summed = sum_edits(layer, reader, {"hook_attn_out": (attn, C)}, [layer.block_sparse_moe, shared], C)
    return {
        "attn.hook_q": (attn.q_proj, "out", lambda d: add_to_output(attn.q_proj, d)),
        "attn.hook_k": (attn.k_proj, "out", lambda d: add_to_output(attn.k_proj, d)),
        "attn.hook_v": (attn.v_proj, "out", lambda d: add_to_output(attn.v_proj, d)),
        "attn.hook_z": (attn.o_proj, "in", lambda d: add_to_input(attn.o_proj, d)),
        "hook_attn_out": (attn, "out", summed["hook_attn_out"]),
        "hook_resid_mid": (reader, "in", summed["hook_resid_mid"]),
        "mlp.shared_expert.hook_gate": (shared.output_linear, "in", lambda d: _part(shared.input_linear, d, 0)),
        "mlp.shared_expert.hook_pre": (shared.output_linear, "in", lambda d: _part(shared.input_linear, d, 1)),
        "mlp.shared_expert.hook_post": (shared.output_linear, "in", lambda d: add_to_input(shared.output_linear, d)),
        "mlp.shared_expert.hook_result": (shared, "out", lambda d: add_to_output(shared, d)),
        "hook_mlp_out": (shared, "out", summed["hook_mlp_out"]),
    }


@pytest.mark.parametrize("point", list(_plain_edits(_hybrid().model.layers[ATTENTION])))
def test_an_edit_changes_the_logits_as_the_same_plain_hook_does(point: str) -> None:
    model = _hybrid()
    hm = wrap_generic(model)
    try:
        module, side, install = _plain_edits(model.model.layers[ATTENTION])[point]
        err = plain_edit_error(hm, model, f"blocks.{ATTENTION}.{point}", (module, side), 3, install)
        assert err == 0.0, err  # the same computation, bit for bit
    finally:
        hm.unwrap()


def test_a_per_head_result_edit_enters_what_the_layer_adds(hybrid: Any) -> None:
    """An edit of ``attn.hook_result`` changes the attention's contribution by its sum over heads, as a plain hook
    adding that sum where the layer adds the contribution does (up to the rounding of the sum)."""
    model, hm = hybrid
    layer = model.model.layers[ATTENTION]
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n == f"blocks.{ATTENTION}.attn.hook_result")
    like = cache[f"blocks.{ATTENTION}.attn.hook_result"]
    d = seeded_delta(like, 4) * float(like.abs().max())
    mlps = [layer.block_sparse_moe, layer.shared_mlp]
    install = sum_edit(layer, layer.post_attention_layernorm, [(layer.self_attn, C)], mlps, C, "before0", d.sum(-2))
    expected = logits_with(model, install)
    edited = hm.run_with_hooks(input_ids(), fwd_hooks=[(f"blocks.{ATTENTION}.attn.hook_result", lambda t, hook: t + d)])
    assert relative_error(edited, expected) < 1e-5


@pytest.mark.parametrize("point", ["mlp.shared_expert.hook_post", "hook_mlp_out"])
def test_gradients_through_an_edit_are_the_plain_hooks(hybrid: Any, point: str) -> None:
    model, hm = hybrid
    module, side, install = _plain_edits(model.model.layers[ATTENTION])[point]
    error = plain_gradient_error(hm, model, f"blocks.{ATTENTION}.{point}", (module, side), install)
    assert error < 1e-6, error


@pytest.mark.parametrize("point", ["attn.hook_v", "mlp.shared_expert.hook_post", "hook_mlp_out"])
def test_cached_generation_with_an_edit_is_a_full_pass(hybrid: Any, point: str) -> None:
    _, hm = hybrid
    assert_cached_edit_is_a_full_pass(hm, f"blocks.{ATTENTION}.{point}")


def test_granite_moe_shared_is_described_with_its_shared_mlp() -> None:
    """GraniteMoeShared's layers (attention, then experts plus a shared MLP, times the multiplier): every layer
    described, with the attention points and the shared MLP's, which read what its modules compute and whose edit
    is a plain hook's."""
    model = tiny_model("granitemoeshared", shared_intermediate_size=96, **GRANITE)
    hm = wrap_generic(model)
    try:
        d = findings(model).description
        assert d is not None and all(layer is not None for layer in d.layers)
        for i in range(model.config.num_hidden_layers):
            assert {*ATTENTION_POINTS, *SHARED, "hook_mlp_out"} <= block_points(hm, i), sorted(block_points(hm, i))
        layer = model.model.layers[0]
        shared = layer.shared_mlp
        seen = record(
            model, {"post": (shared.output_linear, "in"), "s": (shared, "out"), "m": (layer.block_sparse_moe, "out")}
        )
        _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith("blocks.0.") and _plain(n))
        assert torch.equal(cache["blocks.0.mlp.shared_expert.hook_post"], seen["post"])
        assert torch.equal(cache["blocks.0.hook_mlp_out"], (seen["m"] + seen["s"]) * C)
        d_post = seeded_delta(seen["post"], 5) * float(seen["post"].abs().max())
        err = edit_error(
            hm, model, "blocks.0.mlp.shared_expert.hook_post", d_post, add_to_input(shared.output_linear, d_post)
        )
        assert err == 0.0, err
    finally:
        hm.unwrap()


def test_the_mamba_layer_gets_its_shared_mlps_points_read_and_edited_as_plain_hooks(hybrid: Any) -> None:
    """The Mamba layer (the mixer form) has the same MLP of two modules: its shared MLP's points read what its
    modules compute and an edit of each gives the logits of the same plain hook, bit for bit."""
    model, hm = hybrid
    assert set(SHARED) <= block_points(hm, 0), sorted(block_points(hm, 0))
    shared = model.model.layers[0].shared_mlp
    seen = record(model, {"gate_up": (shared.input_linear, "out"), "post": (shared.output_linear, "in")})
    seen["s"] = record(model, {"s": (shared, "out")})["s"]
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith("blocks.0.mlp."))
    gate, up = seen["gate_up"].chunk(2, dim=-1)
    for name, want in zip(SHARED, (gate, up, seen["post"], seen["s"])):
        assert torch.equal(cache[f"blocks.0.{name}"], want), name
    edits = {
        "mlp.shared_expert.hook_gate": lambda d: _part(shared.input_linear, d, 0),
        "mlp.shared_expert.hook_pre": lambda d: _part(shared.input_linear, d, 1),
        "mlp.shared_expert.hook_post": lambda d: add_to_input(shared.output_linear, d),
        "mlp.shared_expert.hook_result": lambda d: add_to_output(shared, d),
    }
    for k, (name, install) in enumerate(edits.items()):
        like = cache[f"blocks.0.{name}"]
        d = seeded_delta(like, 10 + k) * float(like.abs().max())
        assert edit_error(hm, model, f"blocks.0.{name}", d, install(d)) == 0.0, name
