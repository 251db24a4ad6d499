"""The verification of served hook points against plain PyTorch: what a point reads and what an edit at it does.

For each point, a *reference*: the module input or output (or the argument or result of the model's own eager
attention function) that the point's name means, found from the wiring's description, and how the point's value is
viewed from it (heads split, the norm's weight divided out). :func:`check_points` runs a forward pass with the
point hooked and one with plain PyTorch hooks on the model's modules (or the attention function), and compares:

* **value**: the point's value is the reference's, viewed as the point shows it;
* **edit**: adding a random delta at the point moves the logits exactly as adding it (viewed back) at the reference
  does, and moves them at all (an edit that is ignored fails).

References: ``hook_embed`` the embedding module's output (the first layer's input where the model scales it after
the module); ``hook_resid_pre``/``hook_resid_post`` the layer's input/output (``ln2``'s input in a post-LN block
with TransformerLens' ``BertBlock`` points); ``hook_attn_out``/``hook_mlp_out`` the branch modules' outputs;
``hook_resid_mid`` the input of ``ln2`` (or the MLP) together with the layer's output (an edit there reaches the
residual too); ``hook_attn_in``/``hook_mlp_in`` the input of ``ln1``/``ln2`` (one branch);
``attn.hook_q``/``hook_k``/``hook_v`` the projections' outputs split into heads; ``attn.hook_rot_q``/``hook_rot_k``
the query/key the attention function gets; ``attn.hook_attn_scores``/``hook_pattern`` ``q·kᵀ·scaling + mask`` (the
scores softcapped before the mask where the model passes ``softcap``; not under sdpa, which ignores it) and the
model's eager attention weights (an edit: softmax of the edited scores, with the per-head sink logit as one more
column where the model passes ``s_aux``, or the edited weights, times the values);
``attn.hook_z`` the output projection's input split into heads; ``mlp.hook_pre``/``hook_pre_linear`` the gate/up
projections' outputs, ``mlp.hook_post`` the down projection's input; ``*.hook_scale`` the scale that reproduces the
norm module's output from its input with its own weight and bias (an edit: the output recomputed with the edited
scale), ``*.hook_normalized`` the norm's output (LayerNorm) or the output over the weight (RMSNorm).
A point without a reference is reported as unchecked (``None`` reference): :func:`check_points` says so.

Points are checked many per forward pass: each point's edit, and its reference's, is in its own copy of the probe
input (a batch row; a recomputed tensor keeps the other rows bit for bit), and no two references in one pass hook
the same module. A batched verdict is the one-point-at-a-time verdict (a test compares them).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, Optional

import torch

from lensadapters.adapters.generic.eager_reference import (
    _attention,
    _plan,
)
from lensadapters.adapters.generic.plain_references import (  # noqa: F401  (their old import path)
    _logits,
    _norm_output,
    _run_reference,
    _run_references,
)
from lensadapters.adapters.generic.references import (  # noqa: F401  (OPAQUE_BRANCHES: the old import path)
    OPAQUE_BRANCHES,
    Reference,
    Unchecked,
    _norm_view,
    reference,
)
from lensadapters.errors import HookReturnError
from lensadapters.hooks.copying import original_value

Tensor = torch.Tensor


UNCHECKED = "unchecked: "
#: the start of the reason for a point whose adapter refuses the check's edit by name (a :class:`HookReturnError`):
#: readable, not editable there, so not served whole; not a wrong value either
REFUSED = "edit refused: "


# --- the checks ---------------------------------------------------------------------------------------------


#: how many roundings of the coarsest dtype the two computations take apart (their elementwise steps: a norm's
#: weight divided out, a delta added before or after a projection), and how many times ``sqrt(width)`` roundings of
#: float32 their reductions add, amplified by the layers after them (a length-``n`` dot product's typical rounding
#: is ``sqrt(n)`` roundings). Measured over every model type the census builds (transformers 5.x and 4.57): float32
#: values at most 7 roundings apart, edits within the logits' floor; bfloat16 edits at most 7 of bfloat16's, float16
#: ones 20 of float16's (fewer than 8 of bfloat16's); the largest, a tiny GraniteMoeShared of weights of scale 0.2
#: (width 128), an edit 67 roundings of float32 apart (the tolerance there: 121)
ROUNDINGS, REDUCTION_ROUNDINGS = 8, 10


class Precision(NamedTuple):
    """What a comparison allows for: ``dtype``, the model's own (the dtype it computes in), and ``width``, the
    longest reduction of its layers (the widest of its hidden size, MLP width and attention width)."""

    dtype: torch.dtype = torch.float32
    width: int = 1


def precision(hooked: Any) -> Precision:
    """The :class:`Precision` of a wiring's model."""
    model, cfg = hooked.hf_model, getattr(hooked, "cfg", None)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    sizes = [getattr(cfg, "d_model", 0), getattr(cfg, "d_mlp", 0)]
    sizes.append((getattr(cfg, "n_heads", 0) or 0) * (getattr(cfg, "d_head", 0) or 0))
    return Precision(dtype, max([int(n) for n in sizes if isinstance(n, int) and n > 0] or [1]))


def tolerance(dtypes: Iterable[Optional[torch.dtype]], width: int) -> float:
    """The relative tolerance of two computations of one value in ``dtypes`` (the dtypes they round in) through
    reductions of length ``width``: ``ROUNDINGS * eps + REDUCTION_ROUNDINGS * sqrt(width) * eps(float32)``, ``eps``
    the coarsest of those dtypes' and float32's (Hugging Face computes norms and softmaxes in float32 for wider
    models, and reductions accumulate in float32 for narrower ones); for a 16-bit dtype, bfloat16's (the coarser
    half format: what the two round apart is the half-precision activations' rounding amplified by the layers after
    it, measured alike in both formats). Float32 or float64 models of width 64: 88 roundings of float32, ``1.0e-5``
    (of width 4096, ``7.7e-5``): a value or an edit off by ``1e-4`` of its size is refused up to that width."""
    eps = max(
        [torch.finfo(torch.float32).eps] + [torch.finfo(d).eps for d in dtypes if d is not None and d.is_floating_point]
    )
    if eps > torch.finfo(torch.float32).eps:  # a 16-bit dtype
        eps = max(eps, torch.finfo(torch.bfloat16).eps)
    return ROUNDINGS * eps + REDUCTION_ROUNDINGS * math.sqrt(max(width, 1)) * torch.finfo(torch.float32).eps


def _same(
    a: Optional[Tensor],
    b: Optional[Tensor],
    scale: float,
    floor: float = 0.0,
    rounding: Optional[torch.dtype] = None,
    width: int = 1,
) -> bool:
    """``a == b`` up to rounding: every element within :func:`tolerance` of ``scale`` (the dtypes ``b``'s and
    ``rounding``'s, the dtype the two were computed in where that is not ``b``'s: a bfloat16 model's logits upcast
    to float32; ``width`` the longest reduction of the model's layers), plus ``floor`` (the rounding noise of the
    logits). No tolerance relative to each element: the tolerance is of the whole value's size."""
    if a is None or b is None or a.shape != b.shape:
        return False
    atol = tolerance((b.dtype, rounding), width) * max(scale, 1e-6) + floor
    finite = torch.isfinite(b) & (b.float() > -1e4)
    if not torch.equal(finite, torch.isfinite(a) & (a.float() > -1e4)):
        return False
    return bool(torch.allclose(a.float()[finite], b.float()[finite], atol=atol, rtol=0.0))


def _run_points(
    hooked: Any, ids: Tensor, edits: list[tuple[str, Tensor]], seen: Optional[dict[str, Tensor]] = None
) -> Tensor:
    """The logits with each ``(name, delta)`` of ``edits`` added at its point (every point must fire); ``seen``:
    each point's value before its edit (its first firing), recorded there."""
    fired: set[str] = set()
    points = []
    for name, delta in edits:

        def hook(value: Tensor, hook: Any, name: str = name, delta: Tensor = delta) -> Tensor:
            fired.add(name)
            if seen is not None and name not in seen:
                seen[name] = value.detach().clone()
            return value + delta.to(value.dtype)

        point = hooked.hook_dict[name]
        point.add(hook, "fwd")
        points.append(point)
    try:
        logits = _logits(hooked.hf_model, ids)
    finally:
        for point in points:
            point.remove_hooks()
    if len(fired) < len(edits):
        raise RuntimeError("the point did not fire")
    return logits


def _read_all(hooked: Any, ids: Tensor, names: list[str]) -> tuple[dict[str, Tensor], Tensor]:
    """Every point's value (its first firing) and the logits, in one forward pass with all of them hooked."""
    values: dict[str, Tensor] = {}
    points = [hooked.hook_dict[name] for name in names]

    def record(value: Tensor, hook: Any) -> None:
        values.setdefault(hook.name, value.detach().clone())

    for point in points:
        point.add(record, "fwd")
    try:
        logits = _logits(hooked.hf_model, ids)
    finally:
        for point in points:
            point.remove_hooks()
    return values, logits


def _delta(name: str, value: Tensor, ref: Reference, low: bool) -> Tensor:
    """A random edit of a point's value: a tenth of its spread (of its size, for a norm's scale; half in half
    precision), nothing where it is masked; an edit of a pattern keeps each row's sum."""
    if not value.is_floating_point():  # indices: the reference's own edit of them (ignoring one is caught as well)
        integer_delta = getattr(ref.spec, "integer_delta", None)
        return integer_delta(value) if integer_delta is not None else torch.zeros_like(value)
    generator = torch.Generator().manual_seed(len(name))
    finite = torch.isfinite(value) & (value.float() > -1e4)
    size = float(value.float()[finite].std()) if bool(finite.sum() > 1) else 1.0
    if ref.kind == "scale":  # a norm's scales can be nearly equal (post-LN): a tenth of their size, not spread
        size = max(size, float(value.float().abs().mean()))
    delta = torch.randn(value.shape, generator=generator).to(value.device) * ((0.5 if low else 0.1) * size + 1e-3)
    delta = torch.where(finite, delta, torch.zeros_like(delta))
    if ref.part == "weights":
        delta = (delta - delta.mean(-1, keepdim=True)) * finite
    return delta.to(value.dtype)


def check_point(
    hooked: Any, ids: Tensor, name: str, owner: dict[int, int], value: Tensor, plain: Tensor
) -> Optional[str]:
    """``None`` if ``name`` reads and edits as its reference does; why not otherwise (``value``: the point's value
    and ``plain`` the logits, of an unedited forward pass). Two forward passes: an edit at the point, the same edit
    at the reference (each reads its value before the edit)."""
    ref = reference(hooked, name)
    if ref is None:
        return UNCHECKED + "no independent reference to check it against"
    delta = _delta(name, value, ref, _low(value))
    try:
        edited = _run_points(hooked, ids, [(name, delta)])
    except HookReturnError as why:  # the adapter says by name that this edit cannot be made
        return REFUSED + str(why)
    try:
        expected, reference_edited = _run_reference(hooked.hf_model, ids, ref, owner, delta)
    except Exception as exc:  # the reference does not fit this point (its shape or layout): nothing is checked
        raise Unchecked(f"the reference ({ref.kind}) does not fit the point: {type(exc).__name__}: {exc}") from exc
    return _judge(ref, value, expected, edited, reference_edited, plain, precision(hooked))


def _low(value: Tensor) -> bool:
    return value.dtype not in (torch.float32, torch.float64)


def _judge(
    ref: Reference,
    value: Tensor,
    expected: Tensor,
    edited: Tensor,
    reference_edited: Tensor,
    plain: Tensor,
    model: Precision = Precision(),
) -> Optional[str]:
    """The verdict on a point from its value, its reference's (``expected``), the logits with the same delta added
    at the point (``edited``) and at the reference (``reference_edited``), and the unedited logits ``plain``
    (``model``: the model's dtype and width, which the tolerance allows for: :func:`tolerance`)."""
    # the logits' own rounding noise: an edit the model's later norms all but undo (a post-LN block's scale) moves
    # the logits by little more than the two ways of computing them round apart
    top = float(plain.float().abs().max())
    floor = 16 * torch.finfo(plain.dtype).eps * top
    if value.is_floating_point() and _low(value) and not _low(plain):  # a half-precision model's logits upcast to
        floor = max(floor, 2 * torch.finfo(value.dtype).eps * top)  # float32 carry its rounding: two of its steps
    if ref.kind == "scale":  # the served scale reproduces the module's output from its input
        output, x = expected[0], expected[1]
        got, expected = _norm_output(ref.spec, x, ref.view(value)), output
    else:
        got = value
    if not _same(got, expected, float(expected.float().abs().max()), rounding=model.dtype, width=model.width):
        what = type(ref.module).__name__ if ref.module is not None else f"the attention function's {ref.part}"
        return f"its value is not the reference's ({ref.kind} of {what})"
    scale = float((reference_edited - plain).abs().max())
    if scale == 0.0:
        return UNCHECKED + "an edit of the reference does not move the logits, so the edit cannot be checked"
    # the point's dtype is the one the model computes in from there on (the logits may be upcast after it)
    rounding = value.dtype if _low(value) else model.dtype
    if not _same(edited, reference_edited, scale, floor, rounding=rounding, width=model.width):
        moved = float((edited - plain).abs().max())
        return (
            "an edit at it is ignored"
            if moved == 0.0
            else "an edit at it does not move the logits as the same edit at the reference"
        )
    return None


#: how many points one batched check edits at once, each in its own copy of the probe input (a batch row)
POINTS_PER_PASS = 16


def _footprint(ref: Reference) -> set[Any]:
    """What a reference's plain hooks touch: its modules, or its attention layer. Two references with a common
    footprint are never checked in the same pass (their hooks would see each other's calls)."""
    if ref.kind == "attn":
        return {("attention", ref.layer)}
    modules = [ref.module]
    if ref.also is not None:
        modules.append(ref.also.module)
    if ref.kind == "head_input":
        norm, projections = ref.spec[:2]
        modules += [norm, *projections]
    if ref.kind == "hooks":
        modules += list(ref.spec.modules)
    return {id(m) for m in modules if m is not None}


def _batches(pending: list[tuple[str, Reference, Tensor]], size: int) -> list[list[tuple[str, Reference, Tensor]]]:
    """``pending`` cut into passes of at most ``size`` points with disjoint footprints (first fit)."""
    passes: list[tuple[list[tuple[str, Reference, Tensor]], set[Any]]] = []
    for item in pending:
        footprint = _footprint(item[1])
        for points, used in passes:
            if len(points) < size and not footprint & used:
                points.append(item)
                used |= footprint
                break
        else:
            passes.append(([item], set(footprint)))
    return [points for points, _ in passes]


def _in_rows(delta: Tensor, row: int, rows: int) -> Tensor:
    """``delta`` (batch 1) in batch row ``row`` of ``rows``, zeros in the others."""
    full = torch.zeros((rows, *delta.shape[1:]), dtype=delta.dtype, device=delta.device)
    full[row] = delta[0]
    return full


def _check_batch(
    hooked: Any,
    ids: Tensor,
    owner: dict[int, int],
    points: list[tuple[str, Reference, Tensor]],
    plain_by_rows: dict[int, Tensor],
) -> dict[str, Optional[str]]:
    """The verdicts on ``points`` (name, reference, value) from two forward passes over one copy of ``ids`` per
    point, each point edited in its own row, then each reference; and the unedited logits of as many rows (kept in
    ``plain_by_rows`` for the next pass of the same size)."""
    model, rows, model_is = hooked.hf_model, len(points), precision(hooked)
    batch = ids.expand(rows, *ids.shape[1:])
    deltas = [
        _in_rows(_delta(name, value, ref, _low(value)), row, rows) for row, (name, ref, value) in enumerate(points)
    ]
    if rows not in plain_by_rows:
        plain_by_rows[rows] = _logits(model, batch)
    plain = plain_by_rows[rows]
    # each point's value in its own row of this pass, before its edit: the reference's is read in a pass of as many
    # rows (a matrix product of another batch size rounds otherwise, which the layers after amplify)
    in_pass: dict[str, Tensor] = {}
    edited = _run_points(hooked, batch, [(name, delta) for (name, _, _), delta in zip(points, deltas)], in_pass)
    edits: list[tuple[Reference, Optional[Tensor], Optional[int]]] = [
        (ref, delta, row) for row, ((_, ref, _), delta) in enumerate(zip(points, deltas))
    ]
    expected, reference_edited = _run_references(model, batch, owner, edits)
    verdicts: dict[str, Optional[str]] = {}
    for row, ((name, ref, value), seen) in enumerate(zip(points, expected)):
        mine = seen[:, row : row + 1] if ref.kind == "scale" else seen[row : row + 1]
        batched = in_pass.get(name)
        if batched is not None and batched.shape[1:] == value.shape[1:] and batched.shape[0] == rows:
            value = batched[row : row + 1]
        verdicts[name] = _judge(
            ref, value, mine, edited[row : row + 1], reference_edited[row : row + 1], plain[row : row + 1], model_is
        )
    return verdicts


def check_points(
    hooked: Any, ids: Tensor, names: Iterable[str], points_per_pass: Optional[int] = None
) -> dict[str, Optional[str]]:
    """Check each of ``names`` (points of the wiring ``hooked``): ``None`` where it holds, why not otherwise (a
    reason starting with :data:`UNCHECKED` where there is no reference to check it against). Runs with the model's
    own eager attention (the attention implementation is restored afterwards); one forward pass reads every point
    and one the plain logits. Then the points are checked ``points_per_pass`` at a time (each in its own batch row,
    their references' hooks disjoint: two passes each, and one unedited; default :data:`POINTS_PER_PASS`); a pass
    that raises is redone one point at a time (two passes per point), so that one point's failure is its own."""
    per_pass = POINTS_PER_PASS if points_per_pass is None else points_per_pass
    model = hooked.hf_model
    names = list(names)
    owner = {id(m): i for i, layer in enumerate(hooked.block_modules) for m in layer.modules()}
    results: dict[str, Optional[str]] = {}
    modes = {m: m.training for m in model.modules()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    _plan.implementation = str(original_value(getattr(model.config, "_attn_implementation", None)))
    with torch.random.fork_rng(devices=devices), torch.no_grad(), _attention(model, "eager"):
        model.eval()
        try:
            try:
                plain = _logits(model, ids)
                values, read = _read_all(hooked, ids, names)
            except Exception as exc:  # the model does not run with its own eager attention: nothing is checked
                return dict.fromkeys(
                    names, f"{UNCHECKED}a forward pass with eager attention raised {type(exc).__name__}"
                )
            model_is = precision(hooked)
            scale = float(plain.float().abs().max())
            if not torch.equal(read, plain) and not _same(read, plain, scale, 0.0, model_is.dtype, model_is.width):
                return dict.fromkeys(names, "reading the points changes the logits")
            pending: list[tuple[str, Reference, Tensor]] = []
            routed_here: list[tuple[str, Reference]] = []
            for name in names:
                ref = reference(hooked, name) if name in values else None
                if name not in values:
                    results[name] = "the point did not fire"
                elif ref is None:
                    results[name] = UNCHECKED + "no independent reference to check it against"
                elif values[name].numel() == 0 and hasattr(ref.spec, "routed_here"):
                    routed_here.append((name, ref))  # an expert no token of the probe selects: checked last
                elif per_pass > 1 and values[name].shape[:1] == ids.shape[:1] == (1,):
                    pending.append((name, ref, values[name]))
                else:
                    results[name] = _check_one(hooked, ids, name, owner, values[name], plain)
            plain_by_rows: dict[int, Tensor] = {}
            # smaller passes first: a model keeping per-batch state in its modules (transformers 4.x's
            # RecurrentGemma) runs a smaller batch after a larger one only with its cache
            for points in sorted(_batches(pending, per_pass), key=len):
                try:
                    results.update(_check_batch(hooked, ids, owner, points, plain_by_rows))
                except Exception:  # one point's reference failed: each on its own says which and why
                    for name, _, value in points:
                        results[name] = _check_one(hooked, ids, name, owner, value, plain)
            for name, ref in routed_here:
                results[name] = _check_routed_here(hooked, ids, name, ref, owner, results)
        finally:
            for module, training in modes.items():
                module.training = training
    return {name: results[name] for name in names}


def _check_one(
    hooked: Any, ids: Tensor, name: str, owner: dict[int, int], value: Tensor, plain: Tensor
) -> Optional[str]:
    try:
        return check_point(hooked, ids, name, owner, value, plain)
    except Unchecked as why:
        return UNCHECKED + str(why)
    except Exception as exc:  # whatever fails, the point is not verified
        return f"checking it raised {type(exc).__name__}: {str(exc)[:200]}"


def _check_routed_here(
    hooked: Any, ids: Tensor, name: str, ref: Reference, owner: dict[int, int], results: dict[str, Optional[str]]
) -> Optional[str]:
    """The check of a per-expert point of an expert that no token of the probe selects: every token's first slot
    sent to it, on the point's side by an edit of the layer's ``mlp.hook_expert_indices`` (verified before), on the
    reference's by its plain hooks (``ref.spec.routed_here``); then as :func:`check_point`, both sides so routed."""
    indices = name.rsplit(".mlp.experts.", 1)[0] + ".mlp.hook_expert_indices"
    if indices not in results or results[indices] is not None:
        return UNCHECKED + "no token of the probe selects this expert, and the layer's indices are not verified"
    expert = ref.spec.e

    def send(t: Tensor, hook: Any) -> Tensor:
        t = t.clone()
        t[..., 0] = expert
        return t

    point = hooked.hook_dict[indices]
    try:
        point.add(send, "fwd")
        try:
            values, _ = _read_all(hooked, ids, [name])
            value = values[name]
            if value.numel() == 0:
                return UNCHECKED + "no token reaches this expert"
            delta = _delta(name, value, ref, _low(value))
            edited = _run_points(hooked, ids, [(name, delta)])
        finally:
            point.remove_hooks()
        ref.spec.routed_here = True  # the reference's side: its own plain hooks route the tokens, nothing served
        try:
            expected, plain = _run_reference(hooked.hf_model, ids, ref, owner, None)
            _, reference_edited = _run_reference(hooked.hf_model, ids, ref, owner, delta)
        finally:
            ref.spec.routed_here = False
        return _judge(ref, value, expected, edited, reference_edited, plain, precision(hooked))
    except Exception as exc:  # whatever fails, the point is not verified
        return f"checking it raised {type(exc).__name__}: {str(exc)[:200]}"
