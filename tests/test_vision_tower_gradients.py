"""Gradients through the vision tower's edits, and the tower's points in bfloat16.

Gradients: in a float64 copy of each tiny model, an edit ``x + s * d`` at a tower point (``d`` a fixed random
direction of the point's shape, ``s`` a float64 scalar, hooked at ``s = 0``, where an edit that is told apart from
the unedited value by comparing them would lose its gradient) changes the sum of squares of the projector's input
(the tower's features, read by a plain PyTorch pre-hook, which ends the forward there: the language model is not
needed; Gemma 3's and Mistral 3's projectors start with float32 RMSNorms) with the derivative autograd gives:
finite differences agree (Richardson-extrapolated central differences, see :func:`_numeric`) and it is not zero;
it is what autograd gives through the same edit made by plain PyTorch hooks on the model (the projections', the
blocks' and their children's, and an attention function's: the tower's own given the edited rotated query or key, a
hand-written eager one editing its scores or pattern); and with every point of the family edited in one forward,
each by its own scalar, each derivative is the one it has edited alone.

bfloat16: the model converted to bfloat16 serves the tower points its float32 copy serves (names and order), reading
every one of them changes nothing bitwise, and an edit at a tower point gives the logits the same edit by plain hooks
gives, bitwise.

The families: the attention points (``hook_q/k/v/z``, ``hook_attn_scores``, ``hook_pattern``, Pixtral's
``hook_rot_q/k``) of the CLIP, SigLIP, Idefics3 and Pixtral towers (tests/test_vision_tower_attention.py), the
residual and sub-block points of Qwen's towers (tests/test_vision_tower_qwen.py), Gemma 4's residual points
(tests/test_vision_tower.py) and its sandwich norms' ``ln1_post``/``ln2_post.hook_scale``/``hook_normalized``
(tests/test_vision_tower_gemma4.py).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lensadapters import HookedModel
from lensadapters.testing.vlm import hm_projector_path, inputs, tower_block_points, tower_blocks_of, vlm
from tests.test_vision_tower import RECORDED_INSIDE_ON_4, TRANSFORMERS_4
from tests.test_vision_tower_attention import O_PROJ
from tests.test_vision_tower_parts import CHILDREN, DEFAULT_CHILDREN
from tests.test_vision_tower_qwen import CHILDREN as QWEN_CHILDREN
from tests.vision_tower_helpers import (
    GEMMA4_POST_NORMS,
    block_references,
    plain_hook,
    post_norm_hook,
    projection_hook,
    tower_attention,
    written_out_attention,
    z_hook,
)

Tensor = torch.Tensor

_ATTENTION = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z")
_SUB_BLOCK = tower_block_points(output=False)
#: each family's edited points: block 0's attention points (Pixtral's rotated queries and keys too), Qwen's block 0
#: residual and sub-block points and block 1's output, Gemma 4's residual points and sandwich norms' (not an
#: ``ln2_post.hook_scale``: its values, 0.02 to 0.07 here, are nearly zeroed by a step of a unit direction, where
#: finite differences do not hold; ``ln1_post``'s are about 0.2 to 0.5)
ATTENTION_FAMILIES = ("llava", "llava_next", "gemma3", "idefics3", "smolvlm", "mistral3")
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
POINTS: dict[str, tuple[str, ...]] = {
    **{f: tuple(f"vision.blocks.0.{p}" for p in _ATTENTION) for f in ATTENTION_FAMILIES},
    "mistral3": tuple(f"vision.blocks.0.{p}" for p in (*_ATTENTION, "attn.hook_rot_q", "attn.hook_rot_k")),
    **{f: (*(f"vision.blocks.0.{p}" for p in _SUB_BLOCK), "vision.blocks.1.hook_resid_post") for f in QWEN},
    "gemma4": (
        "vision.hook_embed",
        "vision.blocks.0.hook_resid_pre",
        "vision.blocks.0.ln1_post.hook_normalized",
        "vision.blocks.0.hook_resid_post",
        "vision.blocks.1.hook_resid_pre",
        "vision.blocks.1.ln1_post.hook_scale",
        "vision.blocks.1.ln2_post.hook_normalized",
        "vision.blocks.1.hook_resid_post",
    ),
}
#: the points a bfloat16 edit is compared at, bitwise (a projection, a pattern, the attention's output projection's
#: input; a residual, its rebuilt output, the MLP's input, a norm's scale and normalized value: Qwen2.5-VL's
#: RMSNorms', the other Qwen towers' LayerNorms'). Not Pixtral's ``hook_rot_q/k``: their edit is rotated back and
#: added to the projection's bfloat16 output, which the model rotates again, so it rounds unlike the same edit handed
#: to the attention function (by about a quarter of its effect on the logits here); float64 shows it exact (above)
BF16_POINTS: dict[str, tuple[str, ...]] = {
    **{f: tuple(f"vision.blocks.0.attn.{p}" for p in ("hook_v", "hook_pattern", "hook_z")) for f in ATTENTION_FAMILIES},
    **{
        f: (
            "vision.blocks.0.ln1.hook_scale",
            "vision.blocks.0.hook_resid_mid",
            "vision.blocks.0.hook_mlp_in",
            "vision.blocks.0.ln2.hook_normalized",
            "vision.blocks.1.hook_resid_post",
        )
        for f in QWEN
    },
    "gemma4": (
        "vision.hook_embed",
        "vision.blocks.0.ln1_post.hook_scale",
        "vision.blocks.0.ln2_post.hook_normalized",
        "vision.blocks.0.hook_resid_post",
    ),
}
FAMILIES = tuple(POINTS)
#: finite differences: central differences at ``STEP`` and ``STEP / 2``, Richardson-extrapolated (error ``O(h^4)``):
#: a step large enough that the float32 rounding inside a float64 model (Hugging Face's RMSNorms, Qwen's vision
#: rotary and the explicit softmax of hooked scores and patterns compute in float32) stays small against it; the
#: tolerance ``RTOL`` of the derivative plus float32's unit roundoff of the metric over the step (as
#: ``lensadapters.testing.gradients.gradient_check``'s)
STEP = 1e-2
RTOL = 1e-4
#: every point edited in one forward against each alone: the same derivatives but for the float32 rounding of the
#: softmax that the explicit attention of a hooked ``hook_attn_scores``/``hook_pattern`` computes (as eager does),
#: relative to the family's largest derivative
TOGETHER = 1e-5
#: the largest differences measured here (the report's numbers), by family and check
MEASURED: dict[str, float] = {}


def _measure(key: str, error: float) -> float:
    MEASURED[key] = max(MEASURED.get(key, 0.0), error)
    return error


def _family(name: str) -> tuple[Any, int]:
    if TRANSFORMERS_4 and name in RECORDED_INSIDE_ON_4:
        pytest.skip(f"transformers 4.x's {name} tower records its hidden_states inside its blocks: no tower points")
    return vlm(name)  # skips where the family is not in this transformers


def _cast(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def _direction(shape: torch.Size, dtype: torch.dtype, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _along(scale: Tensor, seed: int) -> Callable[[Tensor], Tensor]:
    """The edit ``x + scale * d``, ``d`` the fixed direction ``seed`` of ``x``'s shape."""
    return lambda x: x + scale.to(x.dtype) * _direction(x.shape, x.dtype, seed)


class _Stop(Exception):
    """Raised by the projector's reading hook: the forward ends there."""


@contextlib.contextmanager
def _read_projector(model: Any) -> Iterator[list]:
    seen: list = []

    def read(module: Any, args: tuple, kwargs: dict) -> None:
        seen.append(args[0] if args else next(iter(kwargs.values())))
        raise _Stop

    handle = model.get_submodule(hm_projector_path(model)).register_forward_pre_hook(read, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _metric(model: Any, run: Callable[[], Any]) -> Tensor:
    """The sum of squares of the projector's input in ``run()`` (the forward stopped there)."""
    with _read_projector(model) as seen:
        with contextlib.suppress(_Stop):
            run()
    assert len(seen) == 1
    return seen[0].double().pow(2).sum()


def _hooked(hm: HookedModel, batch: dict, edits: dict[str, Callable[[Tensor], Tensor]]) -> Tensor:
    hooks = [(point, lambda x, hook, edit=edit: edit(x)) for point, edit in edits.items()]
    return _metric(hm.model, lambda: hm.run_with_hooks(**batch, fwd_hooks=hooks))


def _eager_with(target: Any, edits: dict[str, Callable[[Tensor], Tensor]], implementation: str) -> Callable[..., Any]:
    """The attention function of the tower's own ``implementation`` that, in the module ``target``, is handed the
    edited rotated query and key (``rot_q``/``rot_k``, as ``[b, p, h, d]``); where its scores (masked, before the
    softmax) or pattern (after it) are edited, eager attention written out (:func:`written_out_attention`)."""
    written = written_out_attention(target, {k: e for k, e in edits.items() if k in ("scores", "pattern")})

    def attention(module: Any, query: Tensor, key: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if module is target and "rot_q" in edits:
            query = edits["rot_q"](query.transpose(1, 2)).transpose(1, 2)
        if module is target and "rot_k" in edits:
            key = edits["rot_k"](key.transpose(1, 2)).transpose(1, 2)
        if module is not target or not {"scores", "pattern"} & set(edits):
            own = (
                ALL_ATTENTION_FUNCTIONS.get(implementation)
                or sys.modules[type(module).__module__].eager_attention_forward
            )
            return own(module, query, key, *args, **kwargs)
        return written(module, query, key, *args, **kwargs)

    return attention


@contextlib.contextmanager
def _plain_edits(model: Any, name: str, edits: dict[str, Callable[[Tensor], Tensor]]) -> Iterator[None]:
    """The ``edits`` (by point) made by plain PyTorch hooks on the model (and, for the rotated queries and keys,
    scores and patterns, by an attention function registered for the tower's config, :func:`_eager_with`)."""
    blocks, handles, in_function = tower_blocks_of(model), [], {}
    config = model.config.vision_config
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None)
    children = QWEN_CHILDREN if name.startswith("qwen") else CHILDREN.get(name, DEFAULT_CHILDREN)
    for point, edit in edits.items():
        if point == "vision.hook_embed":
            handles.append(plain_hook(blocks[0], "pre", [], edit))
            continue
        i, rest = int(point.split(".")[2]), ".".join(point.split(".")[3:])
        block = blocks[i]
        attention = block.get_submodule(children[0])
        if rest.split(".")[0] in GEMMA4_POST_NORMS:  # a sandwich norm's scale or normalized value
            norm, which = rest.split(".")
            handles.append(post_norm_hook(block.get_submodule(GEMMA4_POST_NORMS[norm]), which, [], edit))
        elif rest in ("hook_resid_pre", "hook_resid_post"):
            handles.append(plain_hook(block, "pre" if rest == "hook_resid_pre" else "post", [], edit))
        elif rest in ("attn.hook_q", "attn.hook_k", "attn.hook_v"):
            handles.append(projection_hook(getattr(attention, f"{rest[-1]}_proj"), heads, [], edit))
        elif rest == "attn.hook_z":
            handles.append(z_hook(getattr(attention, O_PROJ.get(name, "out_proj")), heads, [], edit))
        elif rest.startswith("attn."):
            role = {"hook_attn_scores": "scores", "hook_pattern": "pattern"}.get(rest[5:], rest[10:])
            in_function[role] = (attention, edit)
        else:
            handles += block_references(block, children)[rest]([], edit)
    in_tower: Any = contextlib.nullcontext()
    if in_function:
        targets = {id(t) for t, _ in in_function.values()}
        assert len(targets) == 1  # one block's attention
        target = next(iter(in_function.values()))[0]
        function = _eager_with(target, {role: e for role, (_, e) in in_function.items()}, config._attn_implementation)
        in_tower = tower_attention(model, f"lensadapters_test_gradients_{id(target)}", function)
    try:
        with in_tower:
            yield
    finally:
        for handle in handles:
            handle.remove()


def _grad(value: Tensor, scale: Tensor) -> Tensor:
    (grad,) = torch.autograd.grad(value, scale)
    return grad


def _numeric(f: Callable[[float], Tensor]) -> float:
    """``df/ds`` at 0: central differences at ``STEP`` and ``STEP / 2`` combined (Richardson: the ``h^2`` terms
    cancel)."""

    def central(h: float) -> float:
        return float(f(h) - f(-h)) / (2 * h)

    coarse, fine = central(STEP), central(STEP / 2)
    return (4 * fine - coarse) / 3


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_through_tower_edits_are_finite_differences_and_the_plain_hooks(name: str) -> None:
    model, n_image = _family(name)
    model = model.double()
    # sdpa: attention in float64 (eager's softmax is float32), but in a layer whose scores or pattern are hooked
    # (explicit attention, which computes its softmax in float32 as eager does)
    model.set_attn_implementation("sdpa")
    batch = _cast(inputs(model, n_image), torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model)
    points = POINTS[name]
    assert set(points) <= set(hm.hook_dict)
    zero = torch.zeros((), dtype=torch.float64)
    scales = torch.zeros(len(points), dtype=torch.float64, requires_grad=True)
    together = _grad(_hooked(hm, batch, {p: _along(scales[k], k) for k, p in enumerate(points)}), scales)
    with torch.no_grad():
        base = float(_metric(model, lambda: model(**batch)))
    for k, point in enumerate(points):
        scale = zero.clone().requires_grad_()
        hooked = _grad(_hooked(hm, batch, {point: _along(scale, k)}), scale)
        with _plain_edits(model, name, {point: _along(scale, k)}):
            plain = _grad(_metric(model, lambda: model(**batch)), scale)
        with torch.no_grad():
            numeric = _numeric(lambda h, p=point, k=k: _hooked(hm, batch, {p: _along(torch.tensor(h).double(), k)}))
        g = float(hooked)
        # the float32 rounding inside the float64 model (at most float32's unit roundoff of the metric) over the step
        tolerance = RTOL * abs(g) + 2**-24 * base / STEP
        # not zero: the edit reaches the projector (and a zero from autograd would be told from finite differences)
        assert abs(g) > 2 * tolerance, (point, g, tolerance)
        assert abs(g - numeric) <= tolerance, (point, g, numeric, tolerance)
        _measure(f"{name} vs finite differences", abs(g - numeric) / abs(g))
        assert _measure(f"{name} vs plain hooks", abs(g - float(plain)) / abs(g)) <= 1e-12, (point, g, plain)
        _measure(f"{name} together vs alone", abs(g - float(together[k])) / abs(g))
        assert abs(g - float(together[k])) <= TOGETHER * float(together.abs().max()), point
    hm.unwrap()


def _vision_points(model: Any) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model)
    served = [p for p in hm.hook_dict if p.startswith("vision.")]
    hm.unwrap()
    return served


@pytest.mark.parametrize("name", FAMILIES)
def test_a_bfloat16_model_serves_its_float32_copys_tower_points_and_edits_as_plain_hooks_do(name: str) -> None:
    model, n_image = _family(name)
    full = _vision_points(model)
    model = model.to(torch.bfloat16)
    batch = _cast(inputs(model, n_image), torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model)
    low = [p for p in hm.hook_dict if p.startswith("vision.")]
    assert low == full and set(POINTS[name]) <= set(low), sorted(set(full) - set(low))
    with torch.no_grad():
        hf = model(**batch).logits
        logits, cache = hm.run_with_cache(**batch, names_filter=low)
        assert torch.equal(logits, hf) and set(cache.keys()) == set(low)  # reading every point changes nothing
        assert all(cache[p].dtype == torch.bfloat16 for p in low)
        for k, point in enumerate(BF16_POINTS[name]):
            edit = _along(torch.tensor(0.5), k)
            got = hm.run_with_hooks(**batch, fwd_hooks=[(point, lambda x, hook, edit=edit: edit(x))])
            with _plain_edits(model, name, {point: edit}):
                plain = model(**batch).logits
            assert torch.equal(got, plain) and not torch.equal(got, hf), point
        assert torch.equal(model(**batch).logits, hf)
    hm.unwrap()
