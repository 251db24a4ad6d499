"""The selective scan's points on Mamba mixers whose step input, B and C are normalized between ``x_proj`` and the
scan (lensadapters.adapters.generic.scan): Jamba's norm children and Falcon-Mamba's weightless RMS (its children on
transformers 5, ``rms_eps`` on 4). Values against a float64 recurrence written here from the HF modules' weights,
edits against it, no hooks bitwise, gradients against finite differences, cached generation against one pass."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from transformers import FalconMambaConfig, FalconMambaForCausalLM, JambaConfig, JambaForCausalLM

from lensadapters import HookedModel, Registry
from lensadapters.testing.scan_checks import (
    check_cached_edit,
    check_gradient_through_an_edit,
    edits,
    mamba_mixer_io,
    mamba_reference,
    read_points,
)

POINTS = ("hook_dt", "hook_ssm_state", "hook_ssm_out")
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11], [4, 4, 8, 30, 2, 6, 1]])
KINDS = ("jamba", "falcon_mamba")


def _build(kind: str, dtype: torch.dtype = torch.float32) -> tuple[Any, HookedModel, list[nn.Module], str]:
    """A tiny model of ``kind`` with Mamba layers 0 and 2 (Jamba's layer 1 attention: its cache needs one): the
    model, its wrap, its mixers and their child's name."""
    torch.manual_seed(0)
    if kind == "jamba":
        config: Any = JambaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=4,
            expert_layer_offset=3, num_experts=1, mamba_d_state=4, mamba_dt_rank=4, use_mamba_kernels=False,
            initializer_range=0.2,
        )  # fmt: skip
        model: Any = JambaForCausalLM(config)
        mixers, name = [layer.mamba for layer in model.model.layers if hasattr(layer, "mamba")], "mamba"
    else:
        config = FalconMambaConfig(
            vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=3, time_step_rank=4,
            residual_in_fp32=False, mixer_rms_eps=1e-3,
        )  # fmt: skip
        model = FalconMambaForCausalLM(config)
        mixers, name = [layer.mixer for layer in model.backbone.layers], "mixer"
    model = model.eval().to(dtype)
    with torch.no_grad():  # D, the steps and the norms' weights away from their initial values: each term matters
        for mixer in mixers:
            mixer.D.uniform_(-1.0, 1.0)
            mixer.A_log.add_(torch.randn_like(mixer.A_log) * 0.3)
            for norm in _norms(mixer):
                if isinstance(getattr(norm, "weight", None), nn.Parameter):
                    norm.weight.uniform_(0.5, 1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, HookedModel.wrap(model, registry=Registry()), mixers, name


def _norms(mixer: nn.Module) -> list[nn.Module]:
    return [m for m in (getattr(mixer, f"{p}_layernorm", None) for p in ("dt", "b", "c")) if isinstance(m, nn.Module)]


def _normalized(mixer: Any, part: torch.Tensor, i: int) -> torch.Tensor:
    """Part ``i`` of x_proj's output normalized in float64 as the HF mixer says: its norm child's eps and weight (a
    parameter), or the weightless RMS with the mixer's ``rms_eps``."""
    norms = _norms(mixer)
    norm = norms[i] if norms else None
    eps = mixer.rms_eps if norm is None else getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    out = part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + float(eps))
    weight = getattr(norm, "weight", None)
    return out * weight.double() if isinstance(weight, nn.Parameter) else out


def _reference(mixer: Any, seen: dict, **edit: Any) -> dict:
    """The selective scan in float64 from the normalized parts, one position at a time, with an optional edit."""
    return mamba_reference(mixer, seen, lambda parts: [_normalized(mixer, p, i) for i, p in enumerate(parts)], **edit)


def _served(hm: HookedModel, mixer: nn.Module, name: str, hooks: list) -> tuple[dict, torch.Tensor]:
    """The three points' values (read) and out_proj's input, with ``hooks`` added."""
    got, seen = read_points(hm, IDS, f"blocks.0.{name}.", POINTS, hooks, inputs={"out_in": mixer.out_proj})
    return got, seen["out_in"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_points_are_the_normalized_scan_and_cost_nothing_unhooked(kind: str) -> None:
    model, hm, mixers, name = _build(kind)
    assert all(f"blocks.{i}.{name}.{p}" in hm.hook_names for i in (0, 2) for p in POINTS)
    seen = mamba_mixer_io(model, mixers[0], IDS)
    ref = _reference(mixers[0], seen)
    got, out_in = _served(hm, mixers[0], name, [])
    torch.testing.assert_close(got["hook_dt"].double(), ref["dt"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["hook_ssm_state"].double(), ref["state"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["hook_ssm_out"].double(), ref["y"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out_in.double(), ref["out_in"], atol=1e-6, rtol=1e-5)
    assert torch.equal(out_in, seen["out_in"])  # reading edits nothing: the model's own value goes on
    with torch.no_grad():
        assert torch.equal(hm(IDS).logits, model(IDS).logits)
    hm.unwrap()


@pytest.mark.parametrize("which", ["dt", "state", "out"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_edit_changes_the_rest_of_the_normalized_scan(kind: str, which: str) -> None:
    model, hm, mixers, name = _build(kind)
    seen = mamba_mixer_io(model, mixers[0], IDS)
    ref = _reference(mixers[0], seen)
    point, hook, kwargs = edits(which, ref["state"][:, 3] * -2.0 + 0.25)
    expected = _reference(mixers[0], seen, **kwargs)
    _, out_in = _served(hm, mixers[0], name, [(f"blocks.0.{name}.{point.split('.')[-1]}", hook)])
    torch.testing.assert_close(out_in.double(), expected["out_in"], atol=1e-5, rtol=1e-5)
    assert (out_in.double() - ref["out_in"]).abs().max() > 3e-4  # the edit matters: 30 times the tolerance
    hm.unwrap()


# hook_conv's edit goes through x_proj and the parts' norms, which compute in float32 even in a float64 model: finite
# differences are float32's there (tests/test_generic_scan_conv_gate.py checks its gradient on the unnormalized form)
@pytest.mark.parametrize("point", POINTS + ("hook_gate",))
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_an_edit_of_the_normalized_scan(kind: str, point: str) -> None:
    _, hm, mixers, name = _build(kind, torch.float64)
    check_gradient_through_an_edit(hm, IDS[:1, :5], f"blocks.0.{name}.{point}", mixers[0], at_input=False)
    hm.unwrap()


@pytest.mark.parametrize("point", POINTS + ("hook_conv", "hook_gate"))
@pytest.mark.parametrize("kind", KINDS)
def test_cached_generation_with_an_edit_of_the_normalized_scan(kind: str, point: str) -> None:
    _, hm, _, name = _build(kind)
    check_cached_edit(hm, IDS[:, :4], f"blocks.2.{name}.{point}")
    hm.unwrap()


@pytest.mark.parametrize("kind", KINDS)
def test_a_bfloat16_model_gets_the_normalized_scan_checked_at_its_own_rounding(kind: str) -> None:
    """In bfloat16 the mixer normalizes, projects and scans at bfloat16's rounding: the points are served and pass
    their own check on every hooked call, reading edits nothing, the values are the float64 scan of the model's own
    projections to bfloat16's precision, an edit of the state moves the output, and cached generation with it runs."""
    model, hm, mixers, name = _build(kind, torch.bfloat16)
    assert all(f"blocks.{i}.{name}.{p}" in hm.hook_names for i in (0, 2) for p in POINTS)
    seen = mamba_mixer_io(model, mixers[0], IDS)
    ref = _reference(mixers[0], {k: v.double() for k, v in seen.items()})
    got, out_in = _served(hm, mixers[0], name, [])
    assert torch.equal(out_in, seen["out_in"])
    torch.testing.assert_close(got["hook_ssm_out"].double(), ref["y"], atol=5e-2, rtol=5e-2)
    with torch.no_grad():
        assert torch.equal(hm(IDS).logits, model(IDS).logits)
    _, edited = _served(hm, mixers[0], name, [(f"blocks.0.{name}.hook_ssm_state", lambda t, hook: t * 2.0 + 0.5)])
    assert (edited.double() - out_in.double()).abs().max() > 1e-2
    ids = IDS[:, :4]
    with torch.no_grad(), hm.hooks([(f"blocks.2.{name}.hook_ssm_state", lambda t, hook: t * 1.5)]):
        out = hm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)
    hm.unwrap()
