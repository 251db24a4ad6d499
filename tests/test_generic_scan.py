"""The selective scan's points of a Mamba token mixer (lensadapters.adapters.generic.scan): ``mixer.hook_dt``,
``hook_ssm_state`` and ``hook_ssm_out``, their values against the published equations, their edits against a
hand-written recomputation, gradients through an edit against finite differences, and cached generation."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from lensadapters import HookedModel, Registry
from lensadapters.adapters.generic.scan import ScanMismatch
from lensadapters.hf import tiny_config_of
from lensadapters.testing.scan_checks import (
    check_cached_edit,
    check_gradient_through_an_edit,
    edits,
    mamba_mixer_io,
    mamba_reference,
    read_points,
)

POINTS = ("mixer.hook_dt", "mixer.hook_ssm_state", "mixer.hook_ssm_out")
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11], [4, 4, 8, 30, 2, 6, 1]])


def _mamba(dtype: torch.dtype = torch.float32) -> tuple[MambaForCausalLM, HookedModel]:
    torch.manual_seed(0)
    # float64 throughout (finite differences): no float32 residual
    config = tiny_config_of(MambaConfig, hidden=16, state_size=4, time_step_rank=4, residual_in_fp32=False)
    model = MambaForCausalLM(config).eval().to(dtype)
    with torch.no_grad():  # D and the steps away from their initial values: each term of the equations matters
        for layer in model.backbone.layers:
            layer.mixer.D.uniform_(-1.0, 1.0)
            layer.mixer.A_log.add_(torch.randn_like(layer.mixer.A_log) * 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, HookedModel.wrap(model, registry=Registry())


def _served(hm: HookedModel, ids: torch.Tensor, hooks: list) -> tuple[dict, torch.Tensor]:
    """The three points' values (read) and out_proj's input, with ``hooks`` added."""
    mixer = hm.hf_model.backbone.layers[0].mixer
    got, seen = read_points(hm, ids, "blocks.0.", POINTS, hooks, inputs={"out_in": mixer.out_proj})
    return got, seen["out_in"]


def test_the_points_are_the_published_equations_and_cost_nothing_unhooked() -> None:
    model, hm = _mamba()
    for i in range(2):
        for p in POINTS:
            assert f"blocks.{i}.{p}" in hm.hook_names
    seen = mamba_mixer_io(model, model.backbone.layers[0].mixer, IDS)
    ref = mamba_reference(model.backbone.layers[0].mixer, seen)
    got, out_in = _served(hm, IDS, [])
    assert got["mixer.hook_dt"].shape == (2, 7, 32) and got["mixer.hook_ssm_state"].shape == (2, 7, 32, 4)
    torch.testing.assert_close(got["mixer.hook_dt"].double(), ref["dt"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["mixer.hook_ssm_state"].double(), ref["state"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["mixer.hook_ssm_out"].double(), ref["y"], atol=1e-6, rtol=1e-5)
    assert torch.equal(out_in, seen["out_in"])  # reading edits nothing: the model's own value goes on
    with torch.no_grad():
        assert torch.equal(hm(IDS).logits, model(IDS).logits)
    hm.unwrap()


@pytest.mark.parametrize("which", ["dt", "state", "out"])
def test_an_edit_changes_the_rest_of_the_scan_as_the_equations_do(which: str) -> None:
    model, hm = _mamba()
    mixer = model.backbone.layers[0].mixer
    seen = mamba_mixer_io(model, model.backbone.layers[0].mixer, IDS)
    ref = mamba_reference(mixer, seen)
    new_state = ref["state"][:, 3] * -2.0 + 0.25
    point, hook, kwargs = edits(which, new_state)
    expected = mamba_reference(mixer, seen, **kwargs)
    got, out_in = _served(hm, IDS, [(f"blocks.0.{point}", hook)])
    torch.testing.assert_close(out_in.double(), expected["out_in"], atol=1e-5, rtol=1e-5)
    assert (out_in.double() - ref["out_in"]).abs().max() > 3e-4  # the edit matters: 30 times the tolerance
    hm.unwrap()


@pytest.mark.parametrize("point", POINTS)
def test_gradients_through_an_edit_match_finite_differences(point: str) -> None:
    """In float64, of the layer's mixer output (the model's norms compute in float32 after it)."""
    model, hm = _mamba(torch.float64)
    mixer = model.backbone.get_submodule("layers.0.mixer")
    check_gradient_through_an_edit(hm, IDS[:1, :5], f"blocks.0.{point}", mixer, at_input=False)
    hm.unwrap()


@pytest.mark.parametrize("point", POINTS + ("mixer.hook_conv", "mixer.hook_gate"))
def test_cached_generation_with_an_edit_equals_one_full_pass(point: str) -> None:
    _, hm = _mamba()
    check_cached_edit(hm, IDS[:, :4], f"blocks.1.{point}")
    hm.unwrap()


def _break(mixer: Any) -> None:
    """Make the mixer's forward compute other step sizes or another gate than the scan (which reads dt_proj's
    weights and gates with ``act``): transformers 4.x calls dt_proj (its output is doubled) and gates with act, 5.x
    uses dt_proj's weights and gates with silu (act becomes tanh)."""
    mixer.act = torch.nn.Tanh()
    mixer.dt_proj.register_forward_hook(lambda m, a, o: o * 2.0)


def test_a_hooked_call_the_scan_does_not_reproduce_raises_naming_the_points() -> None:
    model, hm = _mamba()
    mixer = model.backbone.layers[0].mixer
    # the mixer changed after wrapping so that its forward no longer computes what the scan does: the check fails
    # and the hooked call raises rather than serving the scan's values; unhooked, the model runs as it is
    _break(mixer)
    with pytest.raises(ScanMismatch, match="blocks.0.mixer.hook_dt"):
        with hm.hooks([("blocks.0.mixer.hook_ssm_out", lambda t, hook: None)]):
            hm(IDS, use_cache=False)
    with torch.no_grad():
        assert torch.equal(hm(IDS).logits, model(IDS).logits)
    hm.unwrap()


def test_an_unrecognised_mixer_has_no_scan_points_and_the_warning_says_why() -> None:
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2)
    model = MambaForCausalLM(config).eval()
    mixer = model.backbone.layers[0].mixer
    _break(mixer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model, registry=Registry())
    assert not any(f"blocks.0.{p}" in hm.hook_names for p in POINTS)
    assert any("selective-scan points" in str(w.message) for w in caught)
    hm.unwrap()


@pytest.mark.parametrize("upstream", ["mixer.hook_in_proj", "mixer.hook_x_proj"])
def test_an_edit_upstream_of_the_scan_is_what_the_scan_points_read(upstream: str) -> None:
    """An edit of a projection's output (its point) and one of hook_ssm_out in one call: the scan reads the edited
    projection, as the model does; reading the scan's points leaves the upstream edit's logits as they are."""
    model, hm = _mamba()
    up = (f"blocks.0.{upstream}", lambda t, hook: t * 1.1)
    with torch.no_grad(), hm.hooks([up]):
        alone = hm(IDS, use_cache=False).logits
    with torch.no_grad(), hm.hooks([up] + [(f"blocks.0.{p}", lambda t, hook: None) for p in POINTS]):
        read = hm(IDS, use_cache=False).logits
    assert torch.equal(read, alone)
    with torch.no_grad(), hm.hooks([up, ("blocks.0.mixer.hook_ssm_out", lambda t, hook: t + 0.1)]):
        assert (hm(IDS, use_cache=False).logits - alone).abs().max() > 1e-3
    hm.unwrap()
