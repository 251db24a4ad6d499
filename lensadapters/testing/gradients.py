"""Gradients through edits: the contract property that every hook point passes a gradient check.

Attribution patching, edge attribution patching and every other gradient method differentiate the model with
respect to an edit: ``d(metric)/dp`` of ``x + p * c`` at ``p = 0``. At ``p = 0`` the edit leaves the value as it
was, so an implementation that tells edited values from unedited ones by comparing them (and keeps the unedited
numbers off the autograd graph) gives a zero gradient there without any error. The property here checks, for every
hook point of the drawn model, that the gradient autograd gives equals finite differences of the same metric.

:class:`GradientContract` is mixed into :class:`lensadapters.testing.AdapterContract` (and so into every plugin's
contract and the cross-cutting matrices) and :class:`lensadapters.testing.generic.GenericContract`; a contract
whose models cannot be differentiated numerically (8-bit weights, whose activations are quantized: the metric is
piecewise constant) sets ``gradient_dtype = None``. It runs a sixth of the profile's examples (at least one):
each checks every point.

How one example is checked, cheaply (five forwards of one batch, one backward, a few more for drawn points):

* the drawn model is converted to ``gradient_dtype`` (float64) and given one row per hook point (row ``k`` is row
  ``k mod batch`` of the drawn inputs, padding included), edited at point ``k`` only (``x + p_k * c_k`` on that row,
  ``c_k`` a random direction of the point's shape): one forward runs one edit per point, side by side, every point
  hooked;
* the metric of row ``k`` is a random linear functional of its logits (real tokens only); one backward gives
  ``d(metric_k)/d(p_k)`` for every ``k``;
* finite differences: central differences at ``h`` and ``h/2`` combined by Richardson extrapolation (error
  ``O(h^4)``: large steps, so that the float32 rounding of norms and softmaxes Hugging Face computes in float32 even
  for a float64 model stays small); an edit whose path crosses a kink (a ReLU, a top-k routing switch) within
  ``h`` is tried again with smaller central differences before it counts as a mismatch; where they still disagree
  and an integer point (an MoE's expert choice) differs between ``+h`` and ``-h`` at the smallest step, the value
  sits on a routing tie (no central difference is a derivative there) and the point is left out of that example
  (``GradientCheck.tied``, noted); where they still disagree and the central differences at the two smallest steps
  disagree with each other beyond both their tolerances, finite differences have not converged (the metric is far
  from linear within the smallest step: a scale-invariant norm reading a nearly-zero head) and the point is left
  out too (``GradientCheck.unconverged``, noted); a wrong gradient at a smooth point, where the small steps agree
  with each other, still fails;
* a point whose value is not batch-first is checked on its own, on the drawn batch; at most
  ``gradient_solo_points`` of them per example, drawn. Batch-first is told by the point's layout, never by its size
  alone: per-expert activations (``mlp.experts.{e}.*``) are declared rows of routed tokens, and are never
  batch-first (their token count may equal the copies'); any other point is batch-first where its leading dimension
  is observed to follow the input's rows (1 in a forward of one copy, every copy's in the batched one, the other
  dimensions the same);
* ``gradient_single_points`` drawn points are also checked hooked alone (only that point's site installed), as an
  attribution method hooks them.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from lensadapters.adapters.moe import is_expert_point

__all__ = ["GradientContract", "GradientCheck", "gradient_check"]

#: a sixth of the profile's examples (at least one): every example checks every point
_SETTINGS = settings(
    max_examples=max(1, getattr(settings.default, "max_examples", 100) // 6),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
)


class GradientCheck:
    """Autograd and finite-difference derivatives of one metric per edited point, side by side."""

    def __init__(
        self,
        names: list[str],
        autograd: torch.Tensor,
        numeric: torch.Tensor,
        tolerance: torch.Tensor,
        tied: Optional[list[str]] = None,
        unconverged: Optional[list[str]] = None,
    ):
        self.names, self.autograd, self.numeric, self.tolerance = names, autograd, numeric, tolerance
        #: points left out: the expert choice switches within the smallest step (a routing tie at the value)
        self.tied = tied or []
        #: points left out: finite differences at the two smallest steps disagree with each other (not converged)
        self.unconverged = unconverged or []

    @property
    def failures(self) -> list[str]:
        bad = (self.autograd - self.numeric).abs() > self.tolerance
        bad |= ~torch.isfinite(self.autograd)
        return [
            f"{name}: autograd {a:+.6g}, finite differences {n:+.6g} (tolerance {t:.2g})"
            for name, a, n, t, b in zip(
                self.names, self.autograd.tolist(), self.numeric.tolist(), self.tolerance.tolist(), bad.tolist()
            )
            if b
        ]


def _direction(shape: torch.Size, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)


def gradient_check(
    hm: Any,
    kwargs: dict,
    valid: torch.Tensor,
    names: list[str],
    seed: int = 0,
    step: float = 1e-2,
    rtol: float = 1e-4,
    atol: float = 3e-7,
    batched: bool = True,
    scaled: tuple[str, ...] = (),
) -> tuple[GradientCheck, list[str]]:
    """Check ``d(metric)/dp`` of the edit ``x + p * c`` at ``p = 0`` at each of ``names`` against finite differences.

    ``kwargs``: the model's inputs (``input_ids``, ``attention_mask``), ``valid``: ``[batch, pos]`` real tokens.
    ``batched``: every point at once, each in its own row (a row of the batch; points whose value is not
    batch-first are returned as the second item, unchecked: per-expert points, whose rows are routed tokens, and
    points whose leading dimension is not observed to follow the input's rows, see :func:`_one_copy_shapes`); else
    each point alone. ``scaled``: name endings of
    points whose direction is scaled, per position, by the value's root mean square over its last dimension (points
    that a scale-invariant norm reads: where a head's value is small, a unit-scale step leaves the linear regime of
    the norm that follows and finite differences miss the derivative). The tolerance of a point is
    ``atol`` times the metric's scale (the sum of its terms' magnitudes) divided by the step (the rounding of the
    metric, float32 where the model computes in float32, over the step) plus ``rtol`` times the derivative.
    """
    if batched:  # copy k: one row of the drawn batch (row k mod batch), edited at point k
        copies = len(names)
        pick = torch.arange(copies) % kwargs["input_ids"].shape[0]
        inputs = {k: v[pick] for k, v in kwargs.items()}
        valid = valid[pick]
        batch = 1
    else:
        copies, inputs, batch = 1, dict(kwargs), kwargs["input_ids"].shape[0]
    rows = batch * copies
    skipped: set[str] = set()
    # each point's shapes in a forward of one copy (before the larger batches: a model keeping per-batch state)
    one_copy = _one_copy_shapes(hm, inputs, names) if batched and rows > 1 else None

    def batch_first(name: str, t: torch.Tensor) -> bool:
        """Whether ``t`` (a value of ``name`` in a forward of ``rows`` copies) has the copies as its first dim."""
        if is_expert_point(name) or t.dim() == 0 or t.shape[0] != rows:  # declared routed tokens, or not rows
            return False
        if one_copy is None:  # one copy: its value is the whole batch
            return True
        shapes = one_copy.get(name) or []
        return bool(shapes) and all(s[:1] == (1,) and s[1:] == tuple(t.shape[1:]) for s in shapes)

    def hooks(p: torch.Tensor, seen: Optional[dict[str, torch.Tensor]] = None) -> list[tuple[str, Callable]]:
        out = []
        for k, name in enumerate(names):

            def edit(t: torch.Tensor, hook: Any, k: int = k) -> Optional[torch.Tensor]:
                if not t.is_floating_point():  # indices (an MoE's routing): no edit x + p * c, but recorded
                    if seen is not None:
                        seen[hook.name] = t.detach().clone()
                    return None
                c = _direction(t.shape, t.dtype, t.device, seed * 7919 + k)
                if hook.name.endswith(scaled):  # the value's own scale (the same at p = 0 and at each step)
                    c = c * t.detach().pow(2).mean(-1, keepdim=True).sqrt()
                if batched:
                    if not batch_first(hook.name, t):
                        skipped.add(hook.name)
                        return None
                    mask = torch.zeros(rows, dtype=t.dtype, device=t.device)
                    mask[k * batch : (k + 1) * batch] = 1
                    c = c * mask.view(-1, *[1] * (t.dim() - 1))
                return t + p[k].to(t.dtype) * c

            out.append((name, edit))
        return out

    with torch.no_grad():
        base = hm(**inputs).logits
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(base.shape, generator=generator, dtype=torch.float64).to(base.device)
    real = valid[..., None].expand(base.shape).to(base.device)

    def terms(logits: torch.Tensor) -> torch.Tensor:  # padding positions left out (their logits may be nan)
        return torch.where(real, logits.double() * weights, torch.zeros((), dtype=torch.float64)).reshape(copies, -1)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return terms(logits).sum(-1)

    scale = terms(base).abs().sum(-1)

    def derivatives(h: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Central differences at ``h``, and which copies' integer points (an MoE's expert choice) differ between
        ``+h`` and ``-h``: their step crosses a discontinuity, where no finite difference is a derivative."""
        seen_plus: dict[str, torch.Tensor] = {}
        seen_minus: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            p = torch.full((len(names),), h, dtype=torch.float64)
            plus = metric(hm.run_with_hooks(**inputs, fwd_hooks=hooks(p, seen_plus)))
            minus = metric(hm.run_with_hooks(**inputs, fwd_hooks=hooks(-p, seen_minus)))
        return (plus - minus).double() / (2 * h), _switched(seen_plus, seen_minus, copies)

    p = torch.zeros(len(names), dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        values = metric(hm.run_with_hooks(**inputs, fwd_hooks=hooks(p)))
        (grad,) = torch.autograd.grad(values.sum(), p, allow_unused=True)
    autograd = torch.zeros_like(p) if grad is None else grad.detach()
    (coarse, _), (fine, _) = derivatives(step), derivatives(step / 2)
    numeric = (4 * fine - coarse) / 3  # Richardson: the h^2 terms cancel
    tolerance = atol * scale / step + rtol * numeric.abs()
    # a kink within the step (ReLU, a routing switch): smaller central differences, where Richardson disagrees
    bad = (autograd - numeric).abs() > tolerance
    switched = torch.zeros_like(bad)
    estimates: list[tuple[torch.Tensor, torch.Tensor]] = []  # (central difference, its tolerance) per small step
    for h in (step / 10, step / 100):
        if not bad.any():
            break
        small, switched = derivatives(h)
        tol = atol * scale / h + 10 * rtol * small.abs()  # no Richardson: a larger truncation error
        estimates.append((small, tol))
        agree = (autograd - small).abs() <= tol
        numeric = torch.where(bad & agree, small, numeric)
        tolerance = torch.where(bad & agree, tol, tolerance)
        bad = bad & ~agree
    # still apart, and the expert choice differs between +h and -h at the smallest step: a routing switch within
    # h / 100 of the value (a tie); the derivative there is one side's, which no central difference gives
    tied = {names[i] for i in range(len(names)) if bool(bad[i] & switched[i])}
    # still apart, and the central differences at h / 10 and h / 100 disagree with each other beyond both their
    # tolerances: finite differences have not converged at any step the check takes (the metric is far from linear
    # within h / 100 of the value, e.g. a scale-invariant norm reading a head of norm 4e-4), so they give no
    # derivative to compare with; where they agree with each other and not with autograd, that is a failure
    unconverged: set[str] = set()
    if len(estimates) == 2:
        (a, ta), (b, tb) = estimates
        apart = (a - b).abs() > ta + tb
        unconverged = {names[i] for i in range(len(names)) if bool(bad[i] & apart[i]) and names[i] not in tied}
    kept = [i for i, n in enumerate(names) if n not in skipped and n not in tied and n not in unconverged]
    check = GradientCheck(
        [names[i] for i in kept], autograd[kept], numeric[kept], tolerance[kept], sorted(tied), sorted(unconverged)
    )
    return check, sorted(skipped)


def _one_copy_shapes(hm: Any, inputs: dict, names: list[str]) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of each of ``names``' values (each firing) in a forward of the first row of ``inputs`` alone: a
    batch-first point's leading dimension is 1 there (a point whose leading dimension only happens to be the batch's
    rows in the batched forward is not)."""
    shapes: dict[str, list[tuple[int, ...]]] = {}

    def record(t: torch.Tensor, hook: Any) -> None:
        shapes.setdefault(hook.name, []).append(tuple(t.shape) if isinstance(t, torch.Tensor) else ())

    with torch.no_grad():
        hm.run_with_hooks(**{k: v[:1] for k, v in inputs.items()}, fwd_hooks=[(n, record) for n in names])
    return shapes


def _switched(plus: dict[str, torch.Tensor], minus: dict[str, torch.Tensor], copies: int) -> torch.Tensor:
    """``[copies]``: whether an integer point of copy ``k`` differs between the ``+h`` and ``-h`` runs (a point whose
    first dimension is not the copies', or a multiple of them, counts for every copy)."""
    out = torch.zeros(copies, dtype=torch.bool)
    for name, a in plus.items():
        b = minus.get(name)
        if b is None or a.shape != b.shape:
            out[:] = True
            continue
        differs = (a != b).cpu()
        if differs.dim() > 0 and differs.shape[0] % copies == 0:
            out |= differs.reshape(copies, -1).any(-1)
        elif bool(differs.any()):
            out[:] = True
    return out


def _differentiable(model: torch.nn.Module, kwargs: dict, valid: torch.Tensor) -> bool:
    """Whether the unhooked model's logits at real tokens, and their gradient for the embeddings, are finite."""
    embedded: list[torch.Tensor] = []

    def grab(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if not output.requires_grad:  # frozen embeddings (PEFT's base model)
            output = output.detach().requires_grad_()
        embedded.append(output)
        return output

    embeddings: torch.nn.Module = model.get_input_embeddings()  # type: ignore[operator]
    handle = embeddings.register_forward_hook(grab)
    try:
        with torch.enable_grad():
            logits = model(**kwargs).logits[valid]
            if not torch.isfinite(logits).all():
                return False
            if not embedded or not embedded[0].is_floating_point():
                return True
            (grad,) = torch.autograd.grad(logits.sum(), embedded[0], allow_unused=True)
    finally:
        handle.remove()
    return grad is None or bool(torch.isfinite(grad).all())


class GradientContract:
    """The gradient property of the contract suite (mixed into ``AdapterContract``; see the module docstring)."""

    #: the dtype the drawn model is converted to for the gradient property (``None``: the property does not apply)
    gradient_dtype: ClassVar[Optional[torch.dtype]] = torch.float64
    #: finite-difference step (the edit's direction has unit scale per element)
    gradient_step: ClassVar[float] = 1e-2
    #: tolerance: ``gradient_atol`` times the metric's scale over the step (rounding: Hugging Face's norms compute in
    #: float32 even in a float64 model) plus ``gradient_rtol`` times the derivative
    gradient_rtol: ClassVar[float] = 1e-4
    gradient_atol: ClassVar[float] = 3e-7
    #: points checked hooked alone per example (drawn), and points whose value is not batch-first (drawn)
    gradient_single_points: ClassVar[int] = 1
    gradient_solo_points: ClassVar[int] = 2
    #: name endings of points edited along a direction scaled by their value (``gradient_check``'s ``scaled``)
    gradient_scaled_points: ClassVar[tuple[str, ...]] = ()

    def gradient_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The drawn model as the gradient property differentiates it: converted to ``gradient_dtype`` (fused expert
        kernels replaced by transformers' eager experts)."""
        assert self.gradient_dtype is not None
        if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
            model.set_experts_implementation("eager")  # type: ignore[operator]  # fused kernels take no float64
        return model.to(self.gradient_dtype)

    @_SETTINGS
    @given(data=st.data())
    def test_gradients_through_edits_match_finite_differences(self, data: st.DataObject) -> None:
        """At every hook point, ``d(metric)/dp`` of the edit ``x + p * c`` at ``p = 0`` (which leaves the value as it
        was) equals finite differences of the same metric, a random linear functional of the logits: the edit stays
        on the autograd path, as attribution patching needs. Float64 models; see :mod:`lensadapters.testing.gradients`
        for how every point is covered in a few forwards."""
        if self.gradient_dtype is None:
            return
        *_, model, inputs = self.draw(data)  # type: ignore[attr-defined]  # (the generic contract's: config first)
        dtype = next(model.parameters()).dtype
        model = self.gradient_model(model)
        if not _differentiable(model, inputs.kwargs(), inputs.valid):
            # the model's own float64 forward is not finite (transformers' eager masks add the dtype's minimum
            # twice, which overflows in float64 and spreads nan from padding): checked in the drawn dtype instead
            note(f"the unhooked {self.gradient_dtype} model gives non-finite logits or gradients: checked in {dtype}")
            model = model.to(dtype)
        hm = self.wrap(model)  # type: ignore[attr-defined]
        try:
            seed = data.draw(st.integers(0, 2**16), label="gradient seed")
            options: dict[str, Any] = dict(
                step=self.gradient_step,
                rtol=self.gradient_rtol,
                atol=self.gradient_atol,
                seed=seed,
                scaled=self.gradient_scaled_points,
            )
            kwargs, valid = inputs.kwargs(), inputs.valid
            names = list(hm.hook_names)
            check, solo = gradient_check(hm, kwargs, valid, names, **options)
            failures = check.failures
            if solo:
                drawn = data.draw(
                    st.lists(st.sampled_from(solo), max_size=self.gradient_solo_points, unique=True), label="solo"
                )
                for name in drawn:
                    alone, _ = gradient_check(hm, kwargs, valid, [name], batched=False, **options)
                    failures += alone.failures
            single = data.draw(
                st.lists(st.sampled_from(names), max_size=self.gradient_single_points, unique=True), label="single"
            )
            for name in single:
                alone, _ = gradient_check(hm, kwargs, valid, [name], batched=False, **options)
                failures += [f"{f} (hooked alone)" for f in alone.failures]
            note(f"checked {len(check.names)} points side by side, {len(solo)} not batch-first")
            if check.tied:
                note(f"not compared, a routing switch within the smallest step (a tie): {check.tied}")
            if check.unconverged:
                note(f"not compared, finite differences not converged at the smallest steps: {check.unconverged}")
            assert not failures, "gradients through edits differ from finite differences:\n" + "\n".join(failures)
        finally:
            hm.unwrap()
