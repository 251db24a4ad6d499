"""An attention-only block (one branch: ``out = x + attn(norm x)``, no MLP) is described automatically
(``BlockLayout.no_mlp``, :mod:`lensadapters.adapters.generic.describe`): Nemotron-H's attention block gets the attention
points a Llama layer's attention gets (q/k/v, z, result, scores, pattern, attn_out, ln1), each read and edited exactly
as plain PyTorch hooks on the HF modules compute them, and its weights, while its Mamba-2, MoE and MLP blocks keep
the mixer form's points. Nemotron-H exists on transformers 5 only (4.57 has no ``nemotron_h``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters.adapters.generic import findings
from lensadapters.adapters.generic.verify import check_points
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
    tiny_model,
    wrap_generic,
    wrapped,
)

pytestmark = pytest.mark.transformers5_only

TYPES = ["linear_attention", "moe", "full_attention", "mlp"]
ATTENTION = 2
#: a Llama layer's points that belong to its MLP branch (an attention-only block has none of them)
MLP_BRANCH = ("hook_resid_mid", "hook_mlp_in", "hook_mlp_out", "ln2.", "mlp.")


@pytest.fixture(scope="module")
def hybrid() -> Any:
    model = tiny_model("nemotron_h", layers_block_type=TYPES, num_hidden_layers=4)
    assert list(model.config.layers_block_type) == TYPES
    yield from wrapped(model)


def test_the_attention_block_gets_a_llama_layers_attention_points(hybrid: Any) -> None:
    model, hm = hybrid
    llama = wrap_generic(tiny_model("llama"))
    try:
        want = [n for n in block_points(llama, 0) if not n.startswith(MLP_BRANCH)]
    finally:
        llama.unwrap()
    d = findings(model).description
    assert d is not None and d.layers[ATTENTION] is not None
    if d.layers[ATTENTION].qkv.rotary is None:  # Nemotron-H's attention has no rotary: no hook_rot_q/k
        want = [n for n in want if not n.startswith("attn.hook_rot_")]
    if model.config.num_key_value_heads != model.config.num_attention_heads:  # grouped queries: no hook_attn_in
        want = [n for n in want if n != "hook_attn_in"]
    got = block_points(hm, ATTENTION)
    assert sorted(got) == sorted(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))
    assert {"attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_result", "ln1.hook_scale"} <= set(got)
    assert not any(n.startswith(MLP_BRANCH) for n in got), got
    for i in (0, 1, 3):  # the other blocks keep the mixer form's points: no attention point
        assert not any(n.startswith("attn.") for n in block_points(hm, i)), (i, block_points(hm, i))
    assert "mixer.hook_ssm_out" in block_points(hm, 0)
    assert d.layers[ATTENTION].block.no_mlp
    assert all(d.layers[i] is None for i in (0, 1, 3))


def test_every_point_of_the_attention_block_passes_the_independent_check(hybrid: Any) -> None:
    _, hm = hybrid
    served = [n for n in hm.hook_names if n.startswith(f"blocks.{ATTENTION}.")]
    assert check_points(hm.wiring, input_ids(), served) == dict.fromkeys(served)  # value and edit, each


def test_each_point_reads_what_the_hf_modules_compute(hybrid: Any) -> None:
    model, hm = hybrid
    layer = model.model.layers[ATTENTION]
    attn = layer.mixer
    seen = record_heads(
        model,
        attn,
        {
            "hook_resid_pre": (layer, "in"),
            "ln1.hook_normalized": (layer.norm, "out"),
            "hook_attn_out": (attn.o_proj, "out"),
            "hook_resid_post": (layer, "out"),
        },
    )
    p = f"blocks.{ATTENTION}."
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda name: name.startswith(p))
    errors = {name: relative_error(cache[p + name], want) for name, want in seen.items()}
    assert max(errors.values()) < 1e-5, errors
    # per head, the output projection's contributions: their sum is the projection's output
    assert relative_error(cache[p + "attn.hook_result"].sum(-2), seen["hook_attn_out"]) < 1e-5
    # the pattern's rows are distributions over the earlier positions
    pattern = cache[p + "attn.hook_pattern"]
    assert torch.allclose(pattern.sum(-1), torch.ones_like(pattern.sum(-1)), atol=1e-5)
    assert float(pattern.triu(1).abs().max()) == 0.0


@pytest.mark.parametrize(
    "point, module, side",
    [
        ("attn.hook_q", "mixer.q_proj", "out"),
        ("attn.hook_k", "mixer.k_proj", "out"),
        ("attn.hook_v", "mixer.v_proj", "out"),
        ("attn.hook_z", "mixer.o_proj", "in"),
        ("hook_attn_out", "mixer.o_proj", "out"),
        ("ln1.hook_normalized", "norm", "out"),
    ],
)
def test_an_edit_changes_the_logits_as_the_same_plain_hook_does(
    hybrid: Any, point: str, module: str, side: str
) -> None:
    model, hm = hybrid
    target = model.model.layers[ATTENTION].get_submodule(module)
    err = plain_edit_error(hm, model, f"blocks.{ATTENTION}.{point}", (target, side), 1)
    assert err < 1e-4, err


def test_gradients_through_an_edit_are_the_plain_hooks(hybrid: Any) -> None:
    model, hm = hybrid
    v_proj = model.model.layers[ATTENTION].mixer.v_proj
    error = plain_gradient_error(hm, model, f"blocks.{ATTENTION}.attn.hook_v", (v_proj, "out"))
    assert error < 1e-5, error


def test_cached_generation_with_an_edited_attention_point_is_a_full_pass(hybrid: Any) -> None:
    _, hm = hybrid
    for point in (f"blocks.{ATTENTION}.attn.hook_v", f"blocks.{ATTENTION}.attn.hook_k"):
        assert_cached_edit_is_a_full_pass(hm, point)


def test_weights_of_the_attention_block_are_the_parameters_and_the_stack_names_the_undescribed_layers(
    hybrid: Any,
) -> None:
    model, hm = hybrid
    W_O = attention_weights(hm, model, ATTENTION, model.model.layers[ATTENTION].mixer)
    # z @ W_O per head is hook_result
    p = f"blocks.{ATTENTION}."
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda name: name.startswith(p))
    result = torch.einsum("bphd,hdm->bphm", cache[p + "attn.hook_z"], W_O)
    assert relative_error(result, cache[p + "attn.hook_result"]) < 1e-5
    for name in ("W_Q", "W_O"):
        with pytest.raises(WeightUnavailableError, match="layer 0 is not described"):
            _ = getattr(hm, name)
