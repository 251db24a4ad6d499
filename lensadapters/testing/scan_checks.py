"""Checks the tests of the selective-scan points share (``tests/test_generic_scan.py``, Mamba's form,
``tests/test_generic_scan_norm.py``, its normalized form, and ``tests/test_generic_scan_heads.py``, Mamba-2's): hooks
that record or set a state, what the mixer's modules see, the gradient through an edit against finite differences,
cached generation with an edit against one full pass."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lensadapters.testing.contract_support import check_edited_generation
from lensadapters.testing.strategies import Inputs


def keep(into: dict, key: str, value: Any) -> None:
    """Record ``value`` (a hook that returns nothing: it edits nothing)."""
    into.setdefault(key, value)


def recorded(
    run: Callable[[], Any], outputs: Mapping[str, nn.Module] = {}, inputs: Mapping[str, nn.Module] = {}
) -> dict[str, Any]:
    """What ``run()`` gives each module of ``outputs`` as its output and each of ``inputs`` as its first input (the
    first call of each), by key: plain PyTorch hooks, removed after."""
    seen: dict[str, Any] = {}
    handles = [m.register_forward_hook(lambda m, a, o, key=key: keep(seen, key, o)) for key, m in outputs.items()]
    handles += [m.register_forward_pre_hook(lambda m, a, key=key: keep(seen, key, a[0])) for key, m in inputs.items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def mamba_mixer_io(model: Any, mixer: Any, ids: torch.Tensor) -> dict[str, Any]:
    """What a Mamba-form ``mixer`` gives, in one pass of ``model`` on ``ids`` (no gradients, no cache), in_proj's output
    (``in``), x_proj's input and output (``x``, ``xp``) and out_proj's input (``out_in``)."""

    def run() -> None:
        with torch.no_grad():
            model(ids, use_cache=False)

    outputs = {"in": mixer.in_proj, "xp": mixer.x_proj}
    return recorded(run, outputs, inputs={"x": mixer.x_proj, "out_in": mixer.out_proj})


def recurrence(
    h: torch.Tensor,
    step: Callable[[torch.Tensor, int], torch.Tensor],
    read: Callable[[torch.Tensor, int], torch.Tensor],
    length: int,
    state_at: Any = None,
    out_edit: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A scan one position at a time from the state ``h``: ``h = step(h, t)`` (or the state of ``state_at = (t,
    state)`` at its position ``t``), the output ``read(h, t)``. Returns the states and the outputs stacked along
    positions (dimension 1), the outputs through ``out_edit`` (optional), as the scan points' edits mean."""
    states, ys = [], []
    for t in range(length):
        h = step(h, t)
        if state_at is not None and state_at[0] == t:
            h = state_at[1]
        states.append(h)
        ys.append(read(h, t))
    y = torch.stack(ys, 1)
    if out_edit is not None:
        y = out_edit(y)
    return torch.stack(states, 1), y


def ssd_recurrence(
    dt: torch.Tensor,
    a: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state_at: Any = None,
    out_edit: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's per-head scan (Dao and Gu 2024, the SSD recurrence) one position at a time from a zero state:
    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t (x) B_t``, ``y_t = h_t . C_t``; ``dt`` ``[batch, pos, heads]``, ``a``
    (``A``) ``[heads]``, ``x`` ``[batch, pos, heads, head_dim]``, ``b`` and ``c`` ``[batch, pos, heads, state]`` (the
    groups' already repeated per head); ``state_at``, ``out_edit``: as :func:`recurrence`'s. Returns the states
    ``[batch, pos, heads, head_dim, state]`` and the outputs ``[batch, pos, heads, head_dim]``."""
    batch, length, heads, head_dim = x.shape
    return recurrence(
        torch.zeros(batch, heads, head_dim, b.shape[-1], dtype=x.dtype, device=x.device),
        lambda h, t: (
            torch.exp(dt[:, t] * a)[:, :, None, None] * h + torch.einsum("bh,bhd,bhn->bhdn", dt[:, t], x[:, t], b[:, t])
        ),
        lambda h, t: torch.einsum("bhdn,bhn->bhd", h, c[:, t]),
        length,
        state_at,
        out_edit,
    )


def mamba_reference(
    mixer: Any,
    seen: dict[str, Any],
    parts: Optional[Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]] = None,
    dt_edit: Any = None,
    state_at: Any = None,
    out_edit: Any = None,
) -> dict[str, torch.Tensor]:
    """Mamba's selective scan in float64 from the published equations (Gu and Dao 2023, Algorithm 2), one position at
    a time, from what :func:`mamba_mixer_io` saw, with an optional edit: ``dt_edit(dt)``, ``state_at = (t, new state
    at t)``, ``out_edit(y)``. ``parts`` maps x_proj's output split into the step input, B and C (float64) to what the
    scan reads (a mixer that normalizes them: their norms; default, as they are). Returns ``dt``, ``state``, ``y`` and
    out_proj's input ``out_in``."""
    x, gate = seen["x"].double(), seen["in"][..., mixer.intermediate_size :].double()
    r, n = mixer.time_step_rank, mixer.ssm_state_size
    split = seen["xp"].double().split([r, n, n], -1)
    delta_in, b, c = split if parts is None else parts(split)
    dt = F.softplus(delta_in @ mixer.dt_proj.weight.double().T + mixer.dt_proj.bias.double())
    if dt_edit is not None:
        dt = dt_edit(dt)
    a = -torch.exp(mixer.A_log.double())
    states, y = recurrence(
        torch.zeros(x.shape[0], x.shape[2], n, dtype=torch.float64),
        lambda h, t: torch.exp(dt[:, t, :, None] * a) * h + dt[:, t, :, None] * b[:, t, None, :] * x[:, t, :, None],
        lambda h, t: torch.einsum("bdn,bn->bd", h, c[:, t]),
        x.shape[1],
        state_at,
        out_edit,
    )
    return {"dt": dt, "state": states, "y": y, "out_in": (y + x * mixer.D.double()) * F.silu(gate)}


def read_points(
    hm: Any,
    ids: torch.Tensor,
    prefix: str,
    points: Sequence[str],
    hooks: list,
    outputs: Mapping[str, nn.Module] = {},
    inputs: Mapping[str, nn.Module] = {},
    **kwargs: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One pass of ``hm`` on ``ids`` (no gradients, no cache, ``kwargs`` passed on) with ``hooks`` added: a copy of
    each of ``points`` (named ``prefix + point``) by point, and what :func:`recorded` saw of ``outputs`` and
    ``inputs``."""
    got: dict[str, torch.Tensor] = {}

    def read(point: str) -> Any:
        return lambda t, hook: keep(got, point, t.detach().clone())

    def run() -> None:
        with torch.no_grad(), hm.hooks([(f"{prefix}{p}", read(p)) for p in points] + hooks):
            hm(ids, use_cache=False, **kwargs)

    return got, recorded(run, outputs, inputs)


def set_state(t: int, value: torch.Tensor) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """A hook on ``hook_ssm_state`` that makes the state at position ``t`` ``value``."""

    def hook(states: torch.Tensor, hook: Any) -> torch.Tensor:
        states = states.clone()
        states[:, t] = value.to(states.dtype)
        return states

    return hook


def edits(which: str, new_state: torch.Tensor) -> tuple[str, Any, dict[str, Any]]:
    """An edit of each point (``which``: ``dt``, ``state``, ``out``): the point, its hook, and the keyword arguments
    that make a test's hand-written recurrence make it (``dt_edit``, ``state_at``: position 3, ``out_edit``)."""
    table: dict[str, tuple[str, Any, dict[str, Any]]] = {
        "dt": ("mixer.hook_dt", lambda t, hook: t * 30.0, {"dt_edit": lambda d: d * 30.0}),
        "state": ("mixer.hook_ssm_state", set_state(3, new_state), {"state_at": (3, new_state)}),
        "out": ("mixer.hook_ssm_out", lambda t, hook: t - 0.5, {"out_edit": lambda y: y - 0.5}),
    }
    return table[which]


def check_gradient_through_an_edit(hm: Any, ids: torch.Tensor, point: str, module: nn.Module, at_input: bool) -> None:
    """Position 2 of ``point`` moved along a fixed direction by a float64 scale: the gradient of the squared sum of
    ``module``'s output (``at_input``: its first input), read by a plain PyTorch hook, equals finite differences, and
    is not zero (the edit reaches it)."""
    torch.manual_seed(1)
    direction = torch.randn(4096, dtype=torch.float64)

    def loss(scale: torch.Tensor) -> torch.Tensor:
        def hook(t: torch.Tensor, hook: Any) -> torch.Tensor:
            t = t.clone()
            t[:, 2] = t[:, 2] + scale * direction[: t[:, 2].numel()].reshape(t[:, 2].shape)
            return t

        seen: list = []
        if at_input:
            handle = module.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        else:
            handle = module.register_forward_hook(lambda m, a, o: seen.append(o))
        try:
            with hm.hooks([(point, hook)]):
                hm(ids, use_cache=False)
        finally:
            handle.remove()
        return seen[0].pow(2).sum()

    scale = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(loss, (scale,), eps=1e-6, atol=1e-8, rtol=1e-5)
    (grad,) = torch.autograd.grad(loss(scale), scale)
    assert grad.abs() > 1e-8


def check_cached_edit(hm: Any, ids: torch.Tensor, point: str, edit: Any = None, effect: float = 0.0) -> None:
    """Greedy generation from ``ids`` with ``edit`` (default: times 1.5) at ``point``, the cache on, gives at each step
    the logits of one full pass with the same edit (to float32 rounding), and the edit changes them (by more than
    ``effect``)."""
    one_pass, unedited, _ = check_edited_generation(
        hm,
        Inputs(ids, torch.ones_like(ids), [0]),
        point,
        edit or (lambda t, hook: t * 1.5),
        atol=lambda logits: 1e-5 * float(logits.abs().max()) + 1e-6,
    )
    assert not torch.allclose(one_pass, unedited)
    assert (one_pass - unedited).abs().max() > effect
