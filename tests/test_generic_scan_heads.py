"""The selective scan's points of Mamba-2's per-head mixer (lensadapters.adapters.generic.scan_heads):
``mixer.hook_dt``, ``hook_ssm_state`` and ``hook_ssm_out``, their values against the published equations computed
from the model's own modules, their edits against a hand-written recomputation and a plain hook on the gated norm's
input, gradients through an edit against finite differences, cached generation, and the refusals."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from transformers import Mamba2Config, Mamba2ForCausalLM

from lensadapters import HookedModel, Registry
from lensadapters.adapters.generic.scan import ScanMismatch
from lensadapters.testing.every_model_type import NotBuildable, build
from lensadapters.testing.scan_checks import (
    check_cached_edit,
    check_gradient_through_an_edit,
    edits,
    keep,
    read_points,
    recorded,
    ssd_recurrence,
)
from tests.mamba2_helpers import GROUPS, HEAD_DIM, HEADS, IDS, STATE, tiny_mamba2

POINTS = ("mixer.hook_dt", "mixer.hook_ssm_state", "mixer.hook_ssm_out")


def _mixer(model: Any, i: int) -> Any:
    return model.backbone.layers[i].mixer


def _seen(model: Any, run: Callable[[], Any]) -> dict[str, torch.Tensor]:
    """Layer 0's in_proj output and its gated norm's input (plain PyTorch hooks) during ``run()``."""
    mixer = _mixer(model, 0)
    return recorded(run, outputs={"proj": mixer.in_proj}, inputs={"norm_in": mixer.norm})


def _reference(
    mixer: Any,
    proj: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    dt_edit: Any = None,
    state_at: Any = None,
    out_edit: Any = None,
) -> dict[str, torch.Tensor]:
    """Mamba-2's scan (Dao and Gu 2024, the SSD recurrence) one position at a time in float64, from in_proj's output
    through the model's conv1d (its own padding), with an optional edit: ``dt_edit(dt)``, ``state_at = (t, state)``,
    ``out_edit(y)``."""
    inner = HEADS * HEAD_DIM
    proj = proj.double()
    gate, xbc, dt = proj.split([inner, inner + 2 * GROUPS * STATE, HEADS], -1)
    conv = mixer.conv1d
    xbc = F.conv1d(xbc.transpose(1, 2), conv.weight.double(), conv.bias.double(), padding=3, groups=conv.groups)
    xbc = F.silu(xbc[..., : proj.shape[1]].transpose(1, 2))
    if mask is not None:
        xbc = xbc * mask[:, :, None].double()
    x, b, c = xbc.split([inner, GROUPS * STATE, GROUPS * STATE], -1)
    x = x.reshape(*x.shape[:2], HEADS, HEAD_DIM)
    per_group = HEADS // GROUPS
    b = b.reshape(*b.shape[:2], GROUPS, STATE)[:, :, [h // per_group for h in range(HEADS)]]
    c = c.reshape(*c.shape[:2], GROUPS, STATE)[:, :, [h // per_group for h in range(HEADS)]]
    dt = F.softplus(dt + mixer.dt_bias.double())
    if dt_edit is not None:
        dt = dt_edit(dt)
    a = -torch.exp(mixer.A_log.double())
    states, y = ssd_recurrence(dt, a, x, b, c, state_at, out_edit)
    return {"dt": dt, "state": states, "y": y, "norm_in": (y + x * mixer.D.double()[:, None]).flatten(2)}


def _with_input_edit(model: Any, ids: torch.Tensor, module: Any, edit: Callable[[torch.Tensor], Any]) -> Any:
    """The model's logits with ``module``'s first input edited by a plain PyTorch pre-hook."""
    handle = module.register_forward_pre_hook(lambda m, a: (edit(a[0]), *a[1:]))
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    finally:
        handle.remove()


def _hooked(hm: HookedModel, ids: torch.Tensor, hooks: list, **kwargs: Any) -> tuple[dict, dict]:
    """The three points' values (read) and what the plain hooks saw, with ``hooks`` added."""
    mixer = _mixer(hm.hf_model, 0)
    outputs, inputs = {"proj": mixer.in_proj}, {"norm_in": mixer.norm}
    return read_points(hm, ids, "blocks.0.", POINTS, hooks, outputs, inputs, **kwargs)


def test_the_points_are_the_published_equations_and_cost_nothing_unhooked() -> None:
    model, hm = tiny_mamba2()
    for i in range(2):
        for p in POINTS:
            assert f"blocks.{i}.{p}" in hm.hook_names
    # no hook: nothing is installed on any module, the forward is HF's own
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        plain = _seen(model, lambda: model(IDS, use_cache=False))
    mixer = _mixer(model, 0)
    ref = _reference(mixer, plain["proj"])
    torch.testing.assert_close(plain["norm_in"].double(), ref["norm_in"], atol=1e-5, rtol=1e-4)  # the reference
    got, seen = _hooked(hm, IDS, [])
    assert got["mixer.hook_dt"].shape == (2, 7, HEADS)
    assert got["mixer.hook_ssm_state"].shape == (2, 7, HEADS, HEAD_DIM, STATE)
    assert got["mixer.hook_ssm_out"].shape == (2, 7, HEADS, HEAD_DIM)
    for name, key in (("hook_dt", "dt"), ("hook_ssm_state", "state"), ("hook_ssm_out", "y")):
        torch.testing.assert_close(got[f"mixer.{name}"].double(), ref[key], atol=1e-5, rtol=1e-4)
    assert torch.equal(seen["norm_in"], plain["norm_in"])  # reading edits nothing: the model's own value goes on
    with torch.no_grad():
        assert torch.equal(hm(IDS).logits, model(IDS).logits)
    hm.unwrap()


def test_a_padded_batch_reads_the_masked_scan() -> None:
    model, hm = tiny_mamba2()
    mask = torch.ones_like(IDS)
    mask[1, :3] = 0  # left padding: x, B and C are zero there
    with torch.no_grad():
        plain = _seen(model, lambda: model(IDS, attention_mask=mask, use_cache=False))
    ref = _reference(_mixer(model, 0), plain["proj"], mask=mask)
    torch.testing.assert_close(plain["norm_in"].double(), ref["norm_in"], atol=1e-5, rtol=1e-4)
    got, seen = _hooked(hm, IDS, [], attention_mask=mask)
    torch.testing.assert_close(got["mixer.hook_ssm_state"].double(), ref["state"], atol=1e-5, rtol=1e-4)
    assert torch.equal(seen["norm_in"], plain["norm_in"])
    _hooked(hm, IDS[1:], [], attention_mask=mask[1:])  # one padded sequence (transformers 4.x masks none): checked
    hm.unwrap()


@pytest.mark.parametrize("which", ["dt", "state", "out"])
def test_an_edit_changes_the_rest_of_the_scan_as_the_equations_do(which: str) -> None:
    model, hm = tiny_mamba2()
    mixer = _mixer(model, 0)
    with torch.no_grad():
        proj = _seen(model, lambda: model(IDS, use_cache=False))["proj"]
    ref = _reference(mixer, proj)
    new_state = ref["state"][:, 3] * -2.0 + 0.25
    point, hook, kwargs = edits(which, new_state)
    expected = _reference(mixer, proj, **kwargs)
    _, seen = _hooked(hm, IDS, [(f"blocks.0.{point}", hook)])
    torch.testing.assert_close(seen["norm_in"].double(), expected["norm_in"], atol=1e-5, rtol=1e-4)
    assert (seen["norm_in"].double() - ref["norm_in"]).abs().max() > 1e-3  # the edit matters: 100 times the tolerance
    hm.unwrap()


def test_an_edit_of_the_scan_output_is_a_plain_edit_of_the_gated_norms_input() -> None:
    model, hm = tiny_mamba2()
    with torch.no_grad(), hm.hooks([("blocks.1.mixer.hook_ssm_out", lambda t, hook: t * 0.5 - 0.25)]):
        edited = hm(IDS, use_cache=False).logits
    # y -> y / 2 - 1/4 is, at the norm's input y + D x, that input minus y / 2 + 1/4: y from the unedited read
    got: dict[str, torch.Tensor] = {}
    with torch.no_grad(), hm.hooks([("blocks.1.mixer.hook_ssm_out", lambda t, hook: keep(got, "y", t))]):
        hm(IDS, use_cache=False)
    y = got["y"].flatten(2)
    plain = _with_input_edit(model, IDS, _mixer(model, 1).norm, lambda x: x - (y * 0.5 + 0.25).to(x.dtype))
    torch.testing.assert_close(edited, plain, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        assert (plain - model(IDS, use_cache=False).logits).abs().max() > 1e-3
    hm.unwrap()


@pytest.mark.parametrize("point", POINTS)
def test_gradients_through_an_edit_match_finite_differences(point: str) -> None:
    """In float64, of the gated norm's input (the norm itself computes in float32)."""
    model, hm = tiny_mamba2(torch.float64)
    check_gradient_through_an_edit(hm, IDS[:1, :6], f"blocks.0.{point}", _mixer(model, 0).norm, at_input=True)
    hm.unwrap()


@pytest.mark.parametrize("point", POINTS + ("mixer.hook_conv", "mixer.hook_gate"))
def test_cached_generation_with_an_edit_equals_one_full_pass(point: str) -> None:
    _, hm = tiny_mamba2()
    check_cached_edit(hm, IDS[:, :5], f"blocks.1.{point}", effect=1e-4)  # 20 times the tolerance
    hm.unwrap()


def test_a_hooked_call_the_scan_does_not_reproduce_raises_naming_the_points() -> None:
    model, hm = tiny_mamba2()
    norm = _mixer(model, 0).norm
    # once the points are installed, the norm is given another input than the scan's (a hook that runs first): the
    # check fails and the hooked call raises rather than serving the scan's values; unhooked, the model runs as it is
    with pytest.raises(ScanMismatch, match="blocks.0.mixer.hook_dt"):
        with hm.hooks([("blocks.0.mixer.hook_ssm_out", lambda t, hook: None)]):
            handle = norm.register_forward_pre_hook(lambda m, a: (a[0] * 2.0, *a[1:]), prepend=True)
            try:
                hm(IDS, use_cache=False)
            finally:
                handle.remove()
    with torch.no_grad():
        assert torch.equal(hm(IDS).logits, model(IDS).logits)
    hm.unwrap()


def _one_layer() -> Mamba2ForCausalLM:
    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=64, hidden_size=16, state_size=STATE, num_heads=HEADS, head_dim=HEAD_DIM, n_groups=GROUPS
    )
    config.num_hidden_layers = 1
    return Mamba2ForCausalLM(config).eval()


def _wrap_warnings(model: Any) -> tuple[HookedModel, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model, registry=Registry())
    return hm, " ".join(str(w.message) for w in caught)


@pytest.mark.transformers5_only
def test_a_mixer_that_does_not_compute_the_scan_has_no_points_and_the_warning_says_why() -> None:
    model = _one_layer()
    # transformers 5 activates the convolution by the mixer's activation name, the scan by its act: they differ now
    _mixer(model, 0).act = torch.nn.Tanh()
    hm, said = _wrap_warnings(model)
    assert not any(f"blocks.0.{p}" in hm.hook_names for p in POINTS)
    assert "does not reproduce the model's input of norm (layers 0)" in said
    hm.unwrap()


def test_a_per_channel_tensor_the_mixer_does_not_scale_by_fails_the_probe_and_leaves_no_points() -> None:
    """A tensor of the mixer's own with one element per output of in_proj is read as the factor it multiplies that
    output by before the scan (Falcon-H1's form: tests/test_generic_scan_falcon_h1.py); a mixer that does not (this
    one ignores it) fails the probe's check, and the warning says so."""
    model = _one_layer()
    mixer = _mixer(model, 0)
    mixer.register_buffer("scale", torch.linspace(0.5, 2.0, mixer.in_proj.out_features))
    hm, said = _wrap_warnings(model)
    assert not any(f"blocks.0.{p}" in hm.hook_names for p in POINTS)
    assert "does not reproduce the model's input of norm (layers 0)" in said
    hm.unwrap()


@pytest.mark.parametrize("model_type", ["zamba2", "nemotron_h", "bamba"])
def test_the_hybrids_written_as_mamba2_get_the_points_with_their_edits(model_type: str) -> None:
    """The census's tiny model of each type that has a Mamba2Mixer written anew: every Mamba layer of the mixer form
    gets the points, reading them edits nothing, an edit of hook_ssm_out is a plain edit of the norm's input, and
    (where transformers generates with the tiny model) cached generation with an edited state is one full pass."""
    try:
        model: Any = build(model_type)
    except NotBuildable as e:
        pytest.skip(f"{model_type}: {str(e)[:120]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model, registry=Registry())
    served = sorted(n[: -len(".hook_ssm_out")] for n in hm.hook_names if n.endswith(".hook_ssm_out"))
    assert served
    ids = torch.tensor([[1, 5, 9, 3, 7], [4, 4, 8, 30, 2]])
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with hm.hooks([(f"{s}.{p.split('.')[-1]}", lambda t, hook: None) for s in served for p in POINTS]):
            assert torch.equal(hm(ids, use_cache=False).logits, plain)
    last = served[-1]  # blocks.<i>.<mixer>
    i, child = int(last.split(".")[1]), last.split(".", 2)[2]
    norm = hm.block_modules[i].get_submodule(child).norm
    with torch.no_grad(), hm.hooks([(f"{last}.hook_ssm_out", lambda t, hook: t + 0.5)]):
        edited = hm(ids, use_cache=False).logits
    by_hand = _with_input_edit(model, ids, norm, lambda x: x + 0.5)
    torch.testing.assert_close(edited, by_hand, atol=1e-5, rtol=1e-4)
    assert (edited - plain).abs().max() > 1e-3
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
    except Exception:  # the tiny model does not generate in this transformers (bamba in 4.x: no attention layer)
        hm.unwrap()
        return
    check_cached_edit(hm, ids, f"{last}.hook_ssm_state", lambda t, hook: t * 1.5 + 0.5, effect=1e-3)
    hm.unwrap()


def test_a_bfloat16_model_gets_the_points_checked_at_its_own_rounding() -> None:
    """The model computes the convolution and the step sizes in bfloat16 and scans in float32: the check allows
    bfloat16's rounding, reading edits nothing, and generation with an edited state passes the cache's check."""
    model, hm = tiny_mamba2(torch.bfloat16)
    assert all(f"blocks.{i}.{p}" in hm.hook_names for i in range(2) for p in POINTS)
    with torch.no_grad():
        plain = _seen(model, lambda: model(IDS, use_cache=False))
    got, seen = _hooked(hm, IDS, [])
    assert torch.equal(seen["norm_in"], plain["norm_in"])
    ref = _reference(_mixer(model, 0), plain["proj"])
    torch.testing.assert_close(got["mixer.hook_ssm_out"].double(), ref["y"], atol=2e-2, rtol=2e-2)
    with torch.no_grad(), hm.hooks([("blocks.1.mixer.hook_ssm_state", lambda t, hook: t * 1.5)]):
        out = hm.generate(IDS[:, :4], attention_mask=torch.ones_like(IDS[:, :4]), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)
    hm.unwrap()


def test_an_edit_upstream_of_the_scan_is_what_the_scan_points_read() -> None:
    """An edit of in_proj's output (its point) and one of hook_ssm_out in one call: the scan reads the edited
    projections, as the model does, so the call is the upstream edit plus a plain edit of the norm's input."""
    model, hm = tiny_mamba2()
    up = ("blocks.0.mixer.hook_in_proj", lambda t, hook: t * 1.1)
    with torch.no_grad(), hm.hooks([up, ("blocks.0.mixer.hook_ssm_out", lambda t, hook: t + 0.1)]):
        both = hm(IDS, use_cache=False).logits
    norm = _mixer(model, 0).norm
    handle = norm.register_forward_pre_hook(lambda m, a: (a[0] + 0.1, *a[1:]))
    try:
        with torch.no_grad(), hm.hooks([up]):
            by_hand = hm(IDS, use_cache=False).logits
    finally:
        handle.remove()
    torch.testing.assert_close(both, by_hand, atol=1e-5, rtol=1e-4)
    # no hook left on any module once the call is over (the readers are registered for each hooked call)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    hm.unwrap()
