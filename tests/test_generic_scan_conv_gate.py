"""The scan's inputs as points (lensadapters.adapters.generic.scan and scan_heads): ``<mixer>.hook_conv``, the
causal convolution's activated output as the scan reads it, and ``<mixer>.hook_gate``, the gate. Their values
against plain-PyTorch computations from the HF modules' own outputs and weights; their edits against a float64
recomputation of the scan from the edited value (Mamba's edited convolution also goes into x_proj, as the model
computes dt, B and C from it) and against plain hooks on the modules the model runs (the gated norm's gate input);
gradients through the edits; cached generation with an edit against one full pass; every model type whose mixer has
the scan's form gets both points on every layer that has the scan's."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

from lensadapters import HookedModel, Registry
from lensadapters.hf import tiny_config_of
from lensadapters.testing.every_model_type import input_ids
from lensadapters.testing.scan_checks import (
    check_cached_edit,
    check_gradient_through_an_edit,
    keep,
    mamba_reference,
    read_points,
    recorded,
    recurrence,
)
from tests.branch_helpers import tiny_model
from tests.mamba2_helpers import GROUPS, HEAD_DIM, HEADS, IDS, STATE, tiny_mamba2

INPUTS = ("mixer.hook_conv", "mixer.hook_gate")
INNER = HEADS * HEAD_DIM


def _wrap(model: Any) -> HookedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HookedModel.wrap(model, registry=Registry())


def _mamba(dtype: torch.dtype = torch.float32) -> tuple[MambaForCausalLM, HookedModel]:
    torch.manual_seed(0)
    config = tiny_config_of(MambaConfig, hidden=16, state_size=4, time_step_rank=4, residual_in_fp32=False)
    model = MambaForCausalLM(config).eval().to(dtype)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.D.uniform_(-1.0, 1.0)
            layer.mixer.A_log.add_(torch.randn_like(layer.mixer.A_log) * 0.3)
    return model, _wrap(model)


def _causal_conv(conv: Any, seq: torch.Tensor) -> torch.Tensor:
    """silu of the depthwise causal convolution of ``seq`` ``[b, p, channels]`` with the module's own weights, in
    float64 (a plain PyTorch computation: nothing of the adapter's)."""
    k = conv.kernel_size[0]
    out = F.conv1d(
        seq.double().transpose(1, 2), conv.weight.double(), conv.bias.double(), padding=k - 1, groups=conv.groups
    )
    return F.silu(out[..., : seq.shape[1]]).transpose(1, 2)


# Mamba (one scan per channel): hook_conv is x_proj's input, the scan's input too


def _mamba_io(model: Any, mixer: Any, hm: Optional[HookedModel] = None, hooks: tuple = ()) -> dict[str, Any]:
    """in_proj's output, x_proj's input and output and out_proj's input, in one pass (``hm`` with ``hooks``, or the
    plain model), by plain PyTorch hooks."""

    def run() -> None:
        with torch.no_grad():
            if hm is None:
                model(IDS, use_cache=False)
            else:
                with hm.hooks(list(hooks)):
                    hm(IDS, use_cache=False)

    seen: dict[str, Any] = {}
    # x_proj's input as its forward hook sees it: after every pre-hook (the point's edit is one, made on each call)
    handle = mixer.x_proj.register_forward_hook(lambda m, a, o: keep(seen, "x", a[0]))
    try:
        seen.update(recorded(run, {"in": mixer.in_proj, "xp": mixer.x_proj}, {"out_in": mixer.out_proj}))
    finally:
        handle.remove()
    return seen


def _mamba_scan(mixer: Any, x: torch.Tensor, gate: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float64 selective scan (the published equations) from the scan's input ``x`` and the gate, dt, B and C
    computed from ``x`` by x_proj's own weights, as the model computes them."""
    xp = F.linear(x, mixer.x_proj.weight.double())
    seen = {"x": x, "xp": xp, "in": torch.cat([torch.zeros_like(gate), gate], -1)}
    return mamba_reference(mixer, seen)


def test_mamba_reads_the_activated_convolution_and_the_gate() -> None:
    model, hm = _mamba()
    mixer = model.backbone.layers[0].mixer
    plain = _mamba_io(model, mixer)
    d = mixer.intermediate_size
    conv = _causal_conv(mixer.conv1d, plain["in"][..., :d])  # from in_proj's output and conv1d's weights
    got, seen = read_points(hm, IDS, "blocks.0.", INPUTS, [], inputs={"out_in": mixer.out_proj})
    assert got["mixer.hook_conv"].shape == (2, 7, d) and got["mixer.hook_gate"].shape == (2, 7, d)
    torch.testing.assert_close(got["mixer.hook_conv"].double(), conv, atol=1e-6, rtol=1e-5)
    assert torch.equal(got["mixer.hook_conv"], plain["x"])  # exactly what x_proj and the scan read
    assert torch.equal(got["mixer.hook_gate"], plain["in"][..., d:])
    assert torch.equal(seen["out_in"], plain["out_in"])  # reading edits nothing
    hm.unwrap()


@pytest.mark.parametrize("point", INPUTS)
def test_a_mamba_edit_is_the_scan_recomputed_from_the_edited_value(point: str) -> None:
    """An edited convolution output is x_proj's input (the model computes dt, B and C from it) and the scan's input
    (its D skip too); an edited gate gates the scan's output: out_proj's input is the float64 scan from them."""
    model, hm = _mamba()
    mixer = model.backbone.layers[0].mixer
    plain = _mamba_io(model, mixer)
    d = mixer.intermediate_size
    x, gate = plain["x"].double(), plain["in"][..., d:].double()
    torch.testing.assert_close(_mamba_scan(mixer, x, gate)["out_in"], plain["out_in"].double(), atol=1e-5, rtol=1e-5)
    edit: Callable[[torch.Tensor], torch.Tensor] = lambda t: t * 1.5 - 0.2  # noqa: E731
    x_e, gate_e = (edit(x), gate) if point == "mixer.hook_conv" else (x, edit(gate))
    expected = _mamba_scan(mixer, x_e, gate_e)["out_in"]
    got = _mamba_io(model, mixer, hm, ((f"blocks.0.{point}", lambda t, hook: edit(t)),))
    torch.testing.assert_close(got["out_in"].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["x"].double(), x_e, atol=1e-6, rtol=1e-6)  # x_proj was given the edited value
    assert (got["out_in"].double() - plain["out_in"].double()).abs().max() > 1e-2  # the edit matters
    hm.unwrap()


@pytest.mark.parametrize("point", INPUTS)
def test_mamba_gradients_through_an_edit_match_finite_differences(point: str) -> None:
    model, hm = _mamba(torch.float64)
    mixer = model.backbone.get_submodule("layers.0.mixer")
    check_gradient_through_an_edit(hm, IDS[:1, :5], f"blocks.0.{point}", mixer, at_input=False)
    hm.unwrap()


@pytest.mark.parametrize("point", INPUTS)
def test_mamba_cached_generation_with_an_edit_equals_one_full_pass(point: str) -> None:
    _, hm = _mamba()
    check_cached_edit(hm, IDS[:, :4], f"blocks.1.{point}")
    hm.unwrap()


# Mamba-2 (per head): hook_conv is x, B and C as the scan reads them; the gate is the gated norm's second input


def _norm_io(model: Any, mixer: Any, run: Callable[[], Any]) -> dict[str, Any]:
    """in_proj's output and the gated norm's inputs (first and gate) during ``run()``, by plain PyTorch hooks."""
    seen: dict[str, Any] = {}

    def norm(m: Any, args: tuple, kwargs: dict) -> None:
        seen.setdefault("norm_in", args[0])
        seen.setdefault("gate", args[1] if len(args) > 1 else kwargs["gate"])

    handles = [
        mixer.in_proj.register_forward_hook(lambda m, a, o: keep(seen, "proj", o)),
        mixer.norm.register_forward_pre_hook(norm, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _xbc(mixer: Any, proj: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    xbc = _causal_conv(mixer.conv1d, proj[..., INNER : 2 * INNER + 2 * GROUPS * STATE])
    return xbc if mask is None else xbc * mask[:, :, None].double()


def _heads_scan(mixer: Any, proj: torch.Tensor, xbc: torch.Tensor) -> torch.Tensor:
    """The gated norm's first input ``y + D x`` from x, B and C (``xbc``) and in_proj's dt, the SSD recurrence one
    position at a time in float64."""
    x, b, c = xbc.split([INNER, GROUPS * STATE, GROUPS * STATE], -1)
    x = x.reshape(*x.shape[:2], HEADS, HEAD_DIM)
    group = [h // (HEADS // GROUPS) for h in range(HEADS)]
    b = b.reshape(*b.shape[:2], GROUPS, STATE)[:, :, group]
    c = c.reshape(*c.shape[:2], GROUPS, STATE)[:, :, group]
    dt = F.softplus(proj[..., -HEADS:].double() + mixer.dt_bias.double())
    a = -torch.exp(mixer.A_log.double())
    _, y = recurrence(
        torch.zeros(x.shape[0], HEADS, HEAD_DIM, STATE, dtype=torch.float64),
        lambda h, t: (
            torch.exp(dt[:, t] * a)[:, :, None, None] * h + torch.einsum("bh,bhd,bhn->bhdn", dt[:, t], x[:, t], b[:, t])
        ),
        lambda h, t: torch.einsum("bhdn,bhn->bhd", h, c[:, t]),
        x.shape[1],
    )
    return (y + x * mixer.D.double()[:, None]).flatten(2)


def test_mamba2_reads_the_masked_convolution_and_the_gate_the_norm_is_given() -> None:
    model, hm = tiny_mamba2()
    mixer = model.backbone.layers[0].mixer
    mask = torch.ones_like(IDS)
    mask[1, :3] = 0  # left padding: the model's x, B and C are zero there
    plain = _norm_io(model, mixer, lambda: model(IDS, attention_mask=mask, use_cache=False))
    xbc = _xbc(mixer, plain["proj"], mask)
    torch.testing.assert_close(_heads_scan(mixer, plain["proj"], xbc), plain["norm_in"].double(), atol=1e-5, rtol=1e-4)
    got, seen = read_points(hm, IDS, "blocks.0.", INPUTS, [], inputs={"norm_in": mixer.norm}, attention_mask=mask)
    assert got["mixer.hook_conv"].shape == (2, 7, INNER + 2 * GROUPS * STATE)
    torch.testing.assert_close(got["mixer.hook_conv"].double(), xbc, atol=1e-6, rtol=1e-5)
    assert torch.equal(got["mixer.hook_conv"][1, :3], torch.zeros_like(got["mixer.hook_conv"][1, :3]))
    assert torch.equal(got["mixer.hook_gate"], plain["gate"])  # what the gated norm reads
    assert torch.equal(got["mixer.hook_gate"], plain["proj"][..., :INNER])  # in_proj's gate part
    assert torch.equal(seen["norm_in"], plain["norm_in"])
    hm.unwrap()


def test_a_mamba2_convolution_edit_is_the_scan_from_the_edited_x_b_c() -> None:
    model, hm = tiny_mamba2()
    mixer = model.backbone.layers[0].mixer
    plain = _norm_io(model, mixer, lambda: model(IDS, use_cache=False))

    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[:, 2] = t[:, 2] * -1.5 + 0.3  # x, B and C at one position: the states after it carry it
        return t

    expected = _heads_scan(mixer, plain["proj"], edit(_xbc(mixer, plain["proj"])))

    def run() -> None:
        with hm.hooks([("blocks.0.mixer.hook_conv", lambda t, hook: edit(t))]):
            hm(IDS, use_cache=False)

    got = _norm_io(model, mixer, run)
    torch.testing.assert_close(got["norm_in"].double(), expected, atol=1e-5, rtol=1e-4)
    assert (got["norm_in"] - plain["norm_in"]).abs().max() > 1e-2
    assert torch.equal(got["gate"], plain["gate"])
    hm.unwrap()


def _gate_by_hand(model: Any, norm: Any, edit: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The gated norm given ``edit(gate)`` as its gate by a plain PyTorch pre-hook: the reference for hook_gate."""

    def pre(m: Any, args: tuple, kwargs: dict) -> Any:
        if len(args) > 1:
            return (args[0], edit(args[1]), *args[2:]), kwargs
        return args, {**kwargs, "gate": edit(kwargs["gate"])}

    return norm.register_forward_pre_hook(pre, with_kwargs=True)


def test_a_mamba2_gate_edit_is_a_plain_edit_of_the_gated_norms_gate() -> None:
    model, hm = tiny_mamba2()
    edit: Callable[[torch.Tensor], torch.Tensor] = lambda t: t * 0.5 + 0.7  # noqa: E731
    with torch.no_grad(), hm.hooks([("blocks.1.mixer.hook_gate", lambda t, hook: edit(t))]):
        edited = hm(IDS, use_cache=False).logits
    handle = _gate_by_hand(model, model.backbone.layers[1].mixer.norm, edit)
    try:
        with torch.no_grad():
            by_hand = model(IDS, use_cache=False).logits
    finally:
        handle.remove()
    assert torch.equal(edited, by_hand)  # the model's own scan value goes on, with the edited gate
    with torch.no_grad():
        assert (by_hand - model(IDS, use_cache=False).logits).abs().max() > 1e-3
    hm.unwrap()


def test_mamba2_gradients_through_an_edit_are_exact() -> None:
    """In float64. The convolution's edit: the norm's first input against finite differences. The gate's: the
    gradient through the served edit equals the gradient through the same edit made by a plain hook on the norm."""
    model, hm = tiny_mamba2(torch.float64)
    mixer = model.backbone.layers[0].mixer
    check_gradient_through_an_edit(hm, IDS[:1, :6], "blocks.0.mixer.hook_conv", mixer.norm, at_input=True)
    direction = torch.randn(2, 7, INNER, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def grad(served: bool) -> torch.Tensor:
        scale = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        edit = lambda t: t + scale * direction  # noqa: E731
        if served:
            with hm.hooks([("blocks.0.mixer.hook_gate", lambda t, hook: edit(t))]):
                out = hm(IDS, use_cache=False).logits
        else:
            handle = _gate_by_hand(model, mixer.norm, edit)
            try:
                out = model(IDS, use_cache=False).logits
            finally:
                handle.remove()
        (g,) = torch.autograd.grad(out.pow(2).sum(), scale)
        return g

    served, plain = grad(True), grad(False)
    assert plain.abs() > 1e-6
    torch.testing.assert_close(served, plain, atol=0.0, rtol=1e-12)
    hm.unwrap()


@pytest.mark.parametrize("point", INPUTS)
def test_mamba2_cached_generation_with_an_edit_equals_one_full_pass(point: str) -> None:
    _, hm = tiny_mamba2()
    check_cached_edit(hm, IDS[:, :5], f"blocks.1.{point}", effect=1e-4)
    hm.unwrap()


# Falcon-H1's mixer without a gated norm gates the scan itself: the gate's edit is applied there


def test_falcon_h1s_gate_edit_gates_the_scan_as_the_mixer_does() -> None:
    model: Any = tiny_model("falcon_h1")
    assert not model.config.mamba_rms_norm
    hm = _wrap(model)
    mixer = model.model.layers[0].mamba
    out_proj = mixer.out_proj
    names = ("mamba.hook_ssm_out", "mamba.hook_conv", "mamba.hook_gate")
    got, seen = read_points(hm, IDS, "blocks.0.", names, [], inputs={"out_in": out_proj})
    inner = mixer.out_proj.in_features
    heads = mixer.A_log.shape[0]
    x = got["mamba.hook_conv"][..., :inner].double().reshape(*IDS.shape, heads, inner // heads)
    before_gate = (got["mamba.hook_ssm_out"].double() + x * mixer.D.double()[:, None]).flatten(2)
    gate = got["mamba.hook_gate"].double()
    # the readings are the model's: before the gate times silu(gate) is out_proj's input, the model's own value
    torch.testing.assert_close(before_gate * F.silu(gate), seen["out_in"].double(), atol=1e-5, rtol=1e-4)
    edit: Callable[[torch.Tensor], torch.Tensor] = lambda t: t * -1.2 + 0.4  # noqa: E731
    hooks = [("blocks.0.mamba.hook_gate", lambda t, hook: edit(t))]
    _, edited = read_points(hm, IDS, "blocks.0.", (), hooks, inputs={"out_in": out_proj})
    torch.testing.assert_close(edited["out_in"].double(), before_gate * F.silu(edit(gate)), atol=1e-5, rtol=1e-4)
    assert (edited["out_in"] - seen["out_in"]).abs().max() > 1e-2
    check_cached_edit(hm, IDS[:, :4], "blocks.1.mamba.hook_gate", effect=1e-4)
    hm.unwrap()


# every model type whose mixer has the scan's form


@pytest.mark.parametrize(
    "model_type",
    ["mamba", "falcon_mamba", "mamba2", "bamba", "jamba", "zamba2", "nemotron_h", "granitemoehybrid", "falcon_h1"],
)
def test_every_layer_with_the_scans_points_gets_the_convolution_and_the_gate(model_type: str) -> None:
    """The census's tiny model of each type (Jamba without its CUDA kernels): each layer with hook_ssm_out has
    hook_conv and hook_gate; reading all five edits nothing; an edit of each changes the logits."""
    model: Any = tiny_model(model_type, **({"use_mamba_kernels": False} if model_type == "jamba" else {}))
    hm = _wrap(model)
    served = sorted(n[: -len(".hook_ssm_out")] for n in hm.hook_names if n.endswith(".hook_ssm_out"))
    if not served:  # GraniteMoeHybrid on transformers 4.57: not of the mixer form (the README says so)
        hm.unwrap()
        pytest.skip(f"{model_type}: no layer with the scan's points in this transformers")
    for prefix in served:
        assert {f"{prefix}.hook_conv", f"{prefix}.hook_gate"} <= set(hm.hook_names)
    ids = IDS[:, :5] % model.config.vocab_size
    names = ("hook_gate", "hook_conv", "hook_dt", "hook_ssm_state", "hook_ssm_out")
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with hm.hooks([(f"{s}.{n}", lambda t, hook: None) for s in served for n in names]):
            assert torch.equal(hm(ids, use_cache=False).logits, plain)
        for name in ("hook_conv", "hook_gate"):
            with hm.hooks([(f"{served[0]}.{name}", lambda t, hook: t * 1.5 + 0.5)]):
                assert (hm(ids, use_cache=False).logits - plain).abs().max() > 1e-4, name
    hm.unwrap()


def test_a_layer_whose_gated_norm_gets_another_gate_than_the_edit_has_none_of_the_scans_points() -> None:
    """A plain pre-hook (there before wrapping) gives layer 0's gated norm twice the gate it is called with: the
    probe's edit of hook_gate does not reach the norm as the edit says, so that layer gets none of the five points
    and the warning says why; layer 1 keeps them."""
    torch.manual_seed(0)
    model = Mamba2ForCausalLM(
        Mamba2Config(
            vocab_size=64,
            hidden_size=16,
            state_size=STATE,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            n_groups=GROUPS,
            num_hidden_layers=2,
        )  # fmt: skip
    ).eval()
    norm = model.backbone.layers[0].mixer.norm
    norm.register_forward_pre_hook(lambda m, a: (a[0], a[1] * 2.0, *a[2:]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model, registry=Registry())
    names = ("hook_gate", "hook_conv", "hook_dt", "hook_ssm_state", "hook_ssm_out")
    assert not any(f"blocks.0.mixer.{n}" in hm.hook_names for n in names)
    assert all(f"blocks.1.mixer.{n}" in hm.hook_names for n in names)
    said = " ".join(str(w.message) for w in caught)
    assert "an edit of hook_gate does not reach norm's input as the scan's form says (layers 0)" in said
    hm.unwrap()


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "mamba2", "jamba"])
def test_every_point_fires_in_the_order_hook_names_lists_it(model_type: str) -> None:
    """``hook_names`` is the order the points fire in (the contract's identity-hook property): Mamba's
    ``hook_gate``/``hook_conv`` fire at ``x_proj``'s input, before the mixer's ``hook_x_proj`` (they were listed
    after it)."""
    extra = {"use_mamba_kernels": False} if model_type == "jamba" else {}
    hm = _wrap(tiny_model(model_type, **extra))
    fired: list[str] = []

    def note(value: torch.Tensor, hook: Any) -> torch.Tensor:
        fired.append(hook.name)
        return value

    with hm.hooks([(name, note) for name in hm.hook_names]), torch.no_grad():
        hm(input_ids(), use_cache=False)
    assert any(n.endswith(".hook_conv") for n in fired)
    assert fired == list(hm.hook_names)
    hm.unwrap()
