"""The selective-scan points of Falcon-H1's Mamba-2 mixer (``blocks.<i>.mamba.hook_dt``, ``hook_ssm_state``,
``hook_ssm_out``: :mod:`lensadapters.adapters.generic.scan_heads`), a token mixer the layer runs beside its attention
(:mod:`lensadapters.adapters.generic.parallel`) that multiplies in_proj's output by a per-channel buffer before the
scan and, without ``mamba_rms_norm``, gates the scan's output itself before ``out_proj``. Each variant (the gated norm
or not, unit and non-unit ``ssm_multipliers``, ``mamba_d_ssm``, branch multipliers other than 1): every point's value
against transformers' own equations written out in float64 from the HF modules' outputs, each edit's logits against
the same edit made by that computation and put in by a plain PyTorch hook, gradients through an edit against finite
differences, cached generation with an edited state against one full pass."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
import transformers

from lensadapters.adapters.generic import findings
from lensadapters.testing.scan_checks import (
    check_cached_edit,
    check_gradient_through_an_edit,
    read_points,
    recorded,
    set_state,
    ssd_recurrence,
)
from tests.branch_helpers import tiny_model, wrap_generic

Tensor = torch.Tensor
POINTS = ("mamba.hook_dt", "mamba.hook_ssm_state", "mamba.hook_ssm_out")
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11], [4, 4, 8, 30, 2, 6, 1]])
MULTIPLIERS = [1.5, 0.5, 2.0, 0.8, 1.2]  # the gate, x, B, C and dt parts of in_proj's output
VARIANTS: dict[str, dict[str, Any]] = {
    "as_is": {},
    "rms_norm": {"mamba_rms_norm": True},
    "ssm_multipliers": {"ssm_multipliers": MULTIPLIERS},
    "rms_norm_multipliers": {"mamba_rms_norm": True, "ssm_multipliers": MULTIPLIERS, "mamba_norm_before_gate": True},
    "d_ssm": {"mamba_d_ssm": 48, "mamba_n_heads": 6, "mamba_n_groups": 2, "ssm_multipliers": MULTIPLIERS},
    "branch_multipliers": {
        "attention_out_multiplier": 0.75,
        "ssm_out_multiplier": 1.25,
        "ssm_in_multiplier": 0.7,
        "ssm_multipliers": MULTIPLIERS,
        "mamba_rms_norm": True,
    },
}
#: the largest difference from the float64 equations of each variant's points and edits (the report's numbers)
ERRORS: dict[str, float] = {}


def _model(variant: str, dtype: torch.dtype = torch.float32) -> Any:
    model: Any = tiny_model("falcon_h1", **VARIANTS[variant])
    torch.manual_seed(1)
    with torch.no_grad():  # each term of the equations away from its initial value
        for layer in model.model.layers:
            layer.mamba.D.uniform_(-1.0, 1.0)
            layer.mamba.A_log.add_(torch.randn_like(layer.mamba.A_log) * 0.5)
            layer.mamba.dt_bias.add_(torch.randn_like(layer.mamba.dt_bias))
    return model.to(dtype)


def _mixer(model: Any, i: int = 0) -> Any:
    return model.model.layers[i].mamba


def _inject(mixer: Any) -> Any:
    """The module the scan's value goes into: the gated norm, or (no ``mamba_rms_norm``) ``out_proj``."""
    return mixer.norm if mixer.mamba_rms_norm else mixer.out_proj


@torch.no_grad()
def _reference(
    mixer: Any,
    proj: Tensor,
    mask: Optional[Tensor] = None,
    dt_edit: Any = None,
    state_at: Any = None,
    out_edit: Any = None,
) -> dict[str, Tensor]:
    """transformers' FalconH1Mixer.torch_forward in float64, one position at a time (the SSD recurrence), from
    in_proj's output: ``projected_states * mup_vector``, the causal depthwise convolution of xBC and its activation,
    ``dt = clamp(softplus(dt + dt_bias), time_step_limit)``, ``h_t = exp(dt A) h_{t-1} + dt x (x) B``, ``y = h . C``,
    then ``y + D x`` (the gated norm's input) and, without the norm, ``(y + D x) * silu(gate)`` (out_proj's input).
    With an optional edit: ``dt_edit(dt)``, ``state_at = (t, state)``, ``out_edit(y)``."""
    heads, head_dim, groups, n = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    inner = mixer.intermediate_size
    proj = proj.double() * mixer.mup_vector.double()
    gate, xbc, dt = proj.split([inner, inner + 2 * groups * n, heads], -1)
    conv, k = mixer.conv1d, mixer.conv1d.kernel_size[0]
    bias = conv.bias.double() if conv.bias is not None else None
    xbc = F.conv1d(F.pad(xbc.transpose(1, 2), (k - 1, 0)), conv.weight.double(), bias, groups=conv.groups)
    xbc = F.silu(xbc.transpose(1, 2))
    if mask is not None:
        xbc = xbc * mask[:, :, None].double()
    x, b, c = xbc.split([inner, groups * n, groups * n], -1)
    x = x.reshape(*x.shape[:2], heads, head_dim)
    of_head = [h // (heads // groups) for h in range(heads)]
    b = b.reshape(*b.shape[:2], groups, n)[:, :, of_head]
    c = c.reshape(*c.shape[:2], groups, n)[:, :, of_head]
    low, high = mixer.time_step_limit
    dt = torch.clamp(F.softplus(dt + mixer.dt_bias.double()), low, high)
    if dt_edit is not None:
        dt = dt_edit(dt)
    a = -torch.exp(mixer.A_log.double())
    states, y = ssd_recurrence(dt, a, x, b, c, state_at, out_edit)
    norm_in = (y + x * mixer.D.double()[:, None]).flatten(2)
    inject = norm_in if mixer.mamba_rms_norm else norm_in * F.silu(gate)
    return {"dt": dt, "state": states, "y": y, "inject": inject}


def _plain(model: Any, ids: Tensor, **kwargs: Any) -> dict[str, Tensor]:
    """Layer 0's in_proj output and the input of the module the scan goes into, by plain PyTorch hooks."""
    mixer = _mixer(model)

    def run() -> None:
        with torch.no_grad():
            model(ids, use_cache=False, **kwargs)

    return recorded(run, outputs={"proj": mixer.in_proj}, inputs={"inject": _inject(mixer)})


def _logits_with_input(model: Any, module: Any, value: Callable[[Tensor], Tensor]) -> Tensor:
    """The model's logits on :data:`IDS` with ``module``'s first input replaced by ``value(input)`` (a plain hook)."""
    handle = module.register_forward_pre_hook(lambda m, a: (value(a[0]).to(a[0].dtype), *a[1:]))
    try:
        with torch.no_grad():
            return model(IDS, use_cache=False).logits
    finally:
        handle.remove()


def _largest(name: str, error: float) -> None:
    ERRORS[name] = max(ERRORS.get(name, 0.0), error)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mamba_layer_gets_the_points_and_their_values_are_transformers_equations(variant: str) -> None:
    model = _model(variant)
    hm = wrap_generic(model)
    layers = len(model.model.layers)
    assert {f"blocks.{i}.{p}" for i in range(layers) for p in POINTS} <= set(hm.hook_names)
    names = hm.hook_names  # listed where they fire: inside the mixer, before its output's point
    assert names.index("blocks.0.mamba.hook_ssm_out") < names.index("blocks.0.hook_mixer_out")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # unhooked: nothing installed
    plain = _plain(model, IDS)
    mixer = _mixer(model)
    ref = _reference(mixer, plain["proj"])
    # the reference is the model's own computation (its chunked scan in float32)
    torch.testing.assert_close(plain["inject"].double(), ref["inject"], atol=1e-5, rtol=1e-4)
    got, seen = read_points(hm, IDS, "blocks.0.", POINTS, [], inputs={"inject": _inject(mixer)})
    heads, head_dim = mixer.num_heads, mixer.head_dim
    assert got["mamba.hook_dt"].shape == (2, 7, heads)
    assert got["mamba.hook_ssm_state"].shape == (2, 7, heads, head_dim, mixer.ssm_state_size)
    assert got["mamba.hook_ssm_out"].shape == (2, 7, heads, head_dim)
    for point, key in zip(POINTS, ("dt", "state", "y")):
        error = float((got[point].double() - ref[key]).abs().max())
        _largest(f"value {point}", error)
        torch.testing.assert_close(got[point].double(), ref[key], atol=1e-5, rtol=1e-4)
    assert torch.equal(seen["inject"], plain["inject"])  # reading edits nothing: the model's own value goes on
    with torch.no_grad(), hm.hooks([(f"blocks.{i}.{p}", lambda t, hook: None) for i in range(layers) for p in POINTS]):
        assert torch.equal(hm(IDS, use_cache=False).logits, model(IDS, use_cache=False).logits)
    hm.unwrap()


def _edit(which: str, new_state: Tensor) -> tuple[str, Any, dict[str, Any]]:
    table: dict[str, tuple[str, Any, dict[str, Any]]] = {
        "dt": ("mamba.hook_dt", lambda t, hook: t * 3.0, {"dt_edit": lambda d: d * 3.0}),
        "state": ("mamba.hook_ssm_state", set_state(3, new_state), {"state_at": (3, new_state)}),
        "out": ("mamba.hook_ssm_out", lambda t, hook: t - 0.5, {"out_edit": lambda y: y - 0.5}),
    }
    return table[which]


@pytest.mark.parametrize("which", ["dt", "state", "out"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_edit_changes_the_logits_as_the_equations_with_that_edit_do(variant: str, which: str) -> None:
    """The logits with the point edited, against the model's logits with the input of the module the scan goes into
    replaced, by a plain hook, by transformers' equations computed with the same edit (float64, independently)."""
    model = _model(variant)
    hm = wrap_generic(model)
    mixer = _mixer(model)
    proj = _plain(model, IDS)["proj"]
    ref = _reference(mixer, proj)
    new_state = ref["state"][:, 3] * -2.0 + 0.25
    point, hook, kwargs = _edit(which, new_state)
    expected_in = _reference(mixer, proj, **kwargs)["inject"]
    with torch.no_grad(), hm.hooks([(f"blocks.0.{point}", hook)]):
        edited = hm(IDS, use_cache=False).logits
    by_hand = _logits_with_input(model, _inject(mixer), lambda x: expected_in)
    with torch.no_grad():
        unedited = model(IDS, use_cache=False).logits
    error = float((edited - by_hand).abs().max())
    _largest(f"edit {point}", error)
    torch.testing.assert_close(edited, by_hand, atol=1e-5, rtol=1e-4)
    assert (by_hand - unedited).abs().max() > 1e-2  # the edit matters: a thousand times the tolerance
    hm.unwrap()


@pytest.mark.parametrize("variant", ["as_is", "rms_norm", "branch_multipliers"])
def test_an_edit_of_the_scan_output_is_a_plain_edit_of_the_input_it_goes_into(variant: str) -> None:
    """``y -> y + 0.5`` is the gated norm's input plus 0.5, or (no norm: the mixer gates it) out_proj's input plus
    ``0.5 * silu(gate)``, the gate from in_proj's output times the mixer's buffer, as the model computes it."""
    model = _model(variant)
    hm = wrap_generic(model)
    mixer = _mixer(model, 1)
    with torch.no_grad(), hm.hooks([("blocks.1.mamba.hook_ssm_out", lambda t, hook: t + 0.5)]):
        edited = hm(IDS, use_cache=False).logits
    seen = recorded(lambda: model(IDS, use_cache=False), outputs={"proj": mixer.in_proj})
    gate = (seen["proj"] * mixer.mup_vector)[..., : mixer.intermediate_size]
    delta = 0.5 if mixer.mamba_rms_norm else 0.5 * F.silu(gate)
    by_hand = _logits_with_input(model, _inject(mixer), lambda x: x + delta)
    torch.testing.assert_close(edited, by_hand, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        assert (by_hand - model(IDS, use_cache=False).logits).abs().max() > 1e-2
    hm.unwrap()


def test_a_padded_batch_reads_the_masked_scan() -> None:
    model = _model("ssm_multipliers")
    hm = wrap_generic(model)
    mask = torch.ones_like(IDS)
    mask[1, :3] = 0  # left padding: x, B and C are zero there
    plain = _plain(model, IDS, attention_mask=mask)
    mixer = _mixer(model)
    # the mixer masks its input before in_proj (the recorded output is that of the masked input)
    ref = _reference(mixer, plain["proj"], mask=mask)
    torch.testing.assert_close(plain["inject"].double(), ref["inject"], atol=1e-5, rtol=1e-4)
    got, seen = read_points(hm, IDS, "blocks.0.", POINTS, [], inputs={"inject": _inject(mixer)}, attention_mask=mask)
    torch.testing.assert_close(got["mamba.hook_ssm_state"].double(), ref["state"], atol=1e-5, rtol=1e-4)
    assert torch.equal(seen["inject"], plain["inject"])
    hm.unwrap()


@pytest.mark.parametrize("point", POINTS + ("mamba.hook_conv",))
@pytest.mark.parametrize("variant", ["as_is", "rms_norm_multipliers", "branch_multipliers"])
def test_gradients_through_an_edit_match_finite_differences(variant: str, point: str) -> None:
    """In float64, of the input of the module the scan goes into (the gated norm computes in float32 itself)."""
    model = _model(variant, torch.float64)
    hm = wrap_generic(model)
    check_gradient_through_an_edit(hm, IDS[:1, :6], f"blocks.0.{point}", _inject(_mixer(model)), at_input=True)
    hm.unwrap()


@pytest.mark.parametrize("point", POINTS + ("mamba.hook_conv", "mamba.hook_gate"))
@pytest.mark.parametrize("variant", ["as_is", "rms_norm_multipliers", "branch_multipliers"])
def test_cached_generation_with_an_edit_equals_one_full_pass(variant: str, point: str) -> None:
    """Greedy generation through the model's cache (the mixer's convolution and recurrent states, the attention's
    keys and values) with an edited scan point gives at each step the logits of one full pass with the same edit.
    One sequence where transformers 4.x's gated norm is on: its cached step broadcasts the norm's output of a batch
    against the gate (``[b, d] * [b, 1, d]``), so the unhooked model's own cached decoding of a batch is not one pass
    there."""
    model = _model(variant)
    hm = wrap_generic(model)
    rows = 1 if transformers.__version__.startswith("4.") and model.config.mamba_rms_norm else 2
    check_cached_edit(hm, IDS[:rows, :5], f"blocks.1.{point}", lambda t, hook: t * 1.5 + 0.25, effect=1e-3)
    hm.unwrap()


@pytest.mark.parametrize("variant", ["as_is", "rms_norm_multipliers"])
def test_a_bfloat16_model_gets_the_points_checked_at_its_own_rounding(variant: str) -> None:
    """The model computes in_proj's output times its buffer, the convolution and the step sizes in bfloat16 and
    scans in float32: the check allows bfloat16's rounding, reading edits nothing, the values are the equations' to
    bfloat16's rounding, and generation with an edited state passes the cache's check."""
    model = _model(variant, torch.bfloat16)
    hm = wrap_generic(model)
    assert all(f"blocks.{i}.{p}" in hm.hook_names for i in range(len(model.model.layers)) for p in POINTS)
    plain = _plain(model, IDS)
    mixer = _mixer(model)
    got, seen = read_points(hm, IDS, "blocks.0.", POINTS, [], inputs={"inject": _inject(mixer)})
    assert torch.equal(seen["inject"], plain["inject"])
    ref = _reference(mixer, plain["proj"])
    scale = float(ref["y"].abs().max())
    torch.testing.assert_close(got["mamba.hook_ssm_out"].double() / scale, ref["y"] / scale, atol=3e-2, rtol=0)
    with torch.no_grad(), hm.hooks([("blocks.1.mamba.hook_ssm_state", lambda t, hook: t * 1.5)]):
        out = hm.generate(IDS[:, :4], attention_mask=torch.ones_like(IDS[:, :4]), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)
    hm.unwrap()


def test_a_mixer_with_two_tensors_of_in_projs_width_gets_no_scan_points_and_the_findings_say_why() -> None:
    """Which of two per-channel tensors scales in_proj's output is unknown: no layer gets the points."""
    model = _model("ssm_multipliers")
    for layer in model.model.layers:
        layer.mamba.register_buffer("other_scale", torch.full_like(layer.mamba.mup_vector, 3.0), persistent=False)
    hm = wrap_generic(model)
    assert not any(n.endswith(p.split(".")[1]) for n in hm.hook_names for p in POINTS)
    why = findings(model).missing["selective-scan points (hook_gate, hook_conv, hook_dt, hook_ssm_state, hook_ssm_out)"]
    assert "several tensors of its own have one element per output of in_proj" in why
    assert "(layers 0, 1, 2, 3)" in why
    hm.unwrap()


@pytest.fixture(scope="module", autouse=True)
def _report() -> Any:
    yield
    if ERRORS:
        print("\nlargest difference from the float64 equations:", {k: f"{v:.1e}" for k, v in sorted(ERRORS.items())})
