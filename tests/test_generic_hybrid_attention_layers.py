"""The attention layers of a hybrid (token mixers of other kinds in the other layers) are described automatically
(:mod:`lensadapters.adapters.generic.describe`) while the other layers keep the mixer form
(:mod:`lensadapters.adapters.generic.mixer`): OLMo-Hybrid's full-attention layer (OLMo-2-style norms after the
attention and after the MLP, no pre-norms, q/k norms) gets the points the generic adapter gives an OLMo-2 layer, each
read and edited exactly as plain PyTorch hooks on the HF modules compute them; its gated-DeltaNet layers keep theirs.
OLMo-Hybrid exists on transformers 5 only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters.adapters.generic import findings
from lensadapters.errors import WeightUnavailableError
from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import (
    assert_cached_edit_is_a_full_pass,
    attention_weights,
    block_points,
    plain_edit_error,
    plain_gradient_error,
    record_heads,
    relative_error,
    resid_mid_edit,
    tiny_model,
    wrap_generic,
    wrapped,
)

pytestmark = pytest.mark.transformers5_only

ATTENTION = 3  # the tiny model's layer_types: linear_attention x3, then full_attention


@pytest.fixture(scope="module")
def hybrid() -> Any:
    model = tiny_model("olmo_hybrid")
    assert model.config.layer_types[ATTENTION] == "full_attention"
    assert all(t == "linear_attention" for t in model.config.layer_types[:ATTENTION])
    yield from wrapped(model)


def test_the_attention_layer_gets_an_olmo2_layers_points_and_the_deltanet_layers_keep_theirs(hybrid: Any) -> None:
    model, hm = hybrid
    olmo2 = wrap_generic(tiny_model("olmo2"))
    try:
        want = block_points(olmo2, 0)  # the generic adapter's points of an OLMo-2 layer (same block form)
    finally:
        olmo2.unwrap()
    got = block_points(hm, ATTENTION)
    assert sorted(got) == sorted(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))
    assert {"attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_result", "hook_resid_mid", "mlp.hook_post"} <= set(
        got
    )
    for i in range(ATTENTION):  # the mixer form's points of the gated-DeltaNet layers, no attention points
        names = block_points(hm, i)
        assert len(names) == 19, names
        assert {"linear_attn.hook_q_proj", "linear_attn.hook_o_proj_input", "mlp.hook_post"} <= set(names), names
        assert not any(n.startswith("attn.") for n in names), names
    d = findings(model).description
    assert d is not None and d.layers[ATTENTION] is not None and d.layers[0] is None


def test_each_new_point_reads_what_the_hf_modules_compute(hybrid: Any) -> None:
    model, hm = hybrid
    layer = model.model.layers[ATTENTION]
    attn, mlp = layer.self_attn, layer.mlp
    seen = record_heads(
        model,
        attn,
        {
            "o": (attn.o_proj, "out"),
            "attn_out": (layer.post_attention_layernorm, "out"),
            "mid": (mlp, "in"),
            "post": (mlp.down_proj, "in"),
            "mlp_out": (layer.post_feedforward_layernorm, "out"),
        },
    )
    p = f"blocks.{ATTENTION}."
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda name: name.startswith(p))
    pairs = {
        **{name: seen[name] for name in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z")},  # per head
        "hook_attn_out": seen["attn_out"],
        "hook_resid_mid": seen["mid"],
        "mlp.hook_post": seen["post"],
        "hook_mlp_out": seen["mlp_out"],
    }
    errors = {name: relative_error(cache[p + name], want) for name, want in pairs.items()}
    assert max(errors.values()) < 1e-5, errors
    # per head, the output projection's contributions: their sum is the projection's output
    assert relative_error(cache[p + "attn.hook_result"].sum(-2), seen["o"]) < 1e-5


@pytest.mark.parametrize(
    "point, module, side",
    [
        ("attn.hook_v", "self_attn.v_proj", "out"),
        ("attn.hook_z", "self_attn.o_proj", "in"),
        ("hook_attn_out", "post_attention_layernorm", "out"),
        ("mlp.hook_post", "mlp.down_proj", "in"),
        ("hook_mlp_out", "post_feedforward_layernorm", "out"),
    ],
)
def test_an_edit_changes_the_logits_as_the_same_plain_hook_does(
    hybrid: Any, point: str, module: str, side: str
) -> None:
    model, hm = hybrid
    target = model.model.layers[ATTENTION].get_submodule(module)
    err = plain_edit_error(hm, model, f"blocks.{ATTENTION}.{point}", (target, side), 1)
    assert err < 1e-4, err


def test_a_query_edit_is_the_projections_output_edited_before_the_q_norm(hybrid: Any) -> None:
    model, hm = hybrid
    q_proj = model.model.layers[ATTENTION].self_attn.q_proj
    err = plain_edit_error(hm, model, f"blocks.{ATTENTION}.attn.hook_q", (q_proj, "out"), 2, scaled=False)
    assert err < 1e-4, err


def test_a_resid_mid_edit_reaches_the_mlp_and_the_residual(hybrid: Any) -> None:
    model, hm = hybrid
    layer = model.model.layers[ATTENTION]

    def install(d: torch.Tensor) -> Any:
        return resid_mid_edit(layer, layer.mlp, [layer.post_feedforward_layernorm], d)

    err = plain_edit_error(hm, model, f"blocks.{ATTENTION}.hook_resid_mid", (layer.mlp, "in"), 3, install, scaled=False)
    assert err < 1e-4, err


def test_gradients_through_an_edit_are_the_plain_hooks(hybrid: Any) -> None:
    model, hm = hybrid
    v_proj = model.model.layers[ATTENTION].self_attn.v_proj
    error = plain_gradient_error(hm, model, f"blocks.{ATTENTION}.attn.hook_v", (v_proj, "out"))
    assert error < 1e-5, error


def test_cached_generation_with_an_edited_attention_point_is_a_full_pass(hybrid: Any) -> None:
    _, hm = hybrid
    for point in (f"blocks.{ATTENTION}.attn.hook_v", f"blocks.{ATTENTION}.hook_resid_mid"):
        assert_cached_edit_is_a_full_pass(hm, point)


def test_weights_of_the_described_layer_are_read_and_the_stack_names_the_undescribed_layers(hybrid: Any) -> None:
    model, hm = hybrid
    attention_weights(hm, model, ATTENTION, model.model.layers[ATTENTION].self_attn)
    with pytest.raises(WeightUnavailableError, match="layer 0 is not described"):
        _ = hm.W_O
