"""The attention points of a vision tower's blocks (``vision.blocks.{i}.attn.*``), found from the values of a probe
forward (no name is known).

The tower's attention modules call transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``) as the language
models' do; the probe routes that call through the core's :class:`~lensadapters.hooks.attention.InterfacePatternBackend`
(on the tower's own config: the language model's implementation is untouched) and records, in every block, what
the attention function gets: ``query``, ``key``, ``value`` (``[b, h, p, d]``), the mask and the other arguments. A
tower that calls the function several times in a block, once per block of its sequence (Qwen's: once per image, or
per window, as its ``cu_seqlens`` cut the flattened patches of all images), is seen as one call: the calls' tensors
concatenated along the positions (the probe's two images make two calls at least). Among the attention module's
children (each called once):

- ``hook_v``: the child reading the attention's input whose output, seen as ``[b, p, h, d]``, is the function's
  ``value`` exactly; ``hook_q``/``hook_k`` likewise for ``query``/``key``; or one child whose output's thirds are
  the query, key and value (a fused projection, Qwen's ``qkv``: :class:`~lensadapters.hooks.sites.FusedQKVSite`).
  A tower running its images' patches as one flat sequence (``[p, features]``, Qwen's) has a batch of 1: its
  points are ``[1, p, h, d]`` (``[1, h, p, p]``). Where the module rotates them first
  (rotary embeddings, Pixtral's and Qwen's 2-D ones: it gets their ``(cos, sin)`` as ``position_embeddings``), the
  child whose output, rotated as Hugging Face's ``apply_rotary_pos_emb`` does (rotate-half, in the queries' dtype
  or, as Qwen's ``apply_rotary_pos_emb_vision``, in float32: :data:`ROTATIONS`), is the ``query`` (``key``) exactly:
  TransformerLens' ``hook_q``/``hook_k`` are before rotary, ``hook_rot_q``/``hook_rot_k`` the rotated values (an edit
  of those is rotated back and added to the projection's output as a difference, as on the language models). An edit
  of ``hook_q`` is an edit of the projection's output, as a forward hook on it is (the module then rotates it).
  Where a child called once normalizes a projection's output per head before the rotation (Gemma 4's ``q_norm``,
  ``k_norm`` and ``v_norm``), ``hook_q`` (``hook_k``, ``hook_v``) stays the projection's output and
  ``attn.q_norm.hook_scale``/``hook_normalized`` (``k_norm``, ``v_norm``; ``[b, p, h, 1]``/``[b, p, h, d]``) are
  the norm's scale and its input divided by it, before the norm's weight, as TransformerLens' RMSNorm and the
  language models' ``q_norm`` have them (the core's ``NormSite``; served where the norm's ``NormSpec`` is known, and
  refused by name where it is not); the norm's output (after the weight) is what is rotated into ``hook_rot_q`` (or,
  for values, what the attention mixes). A norm without a weight (Gemma 4's ``v_norm``) outputs
  ``hook_normalized``. Gemma 4's rotation is recognised as rotate-half on each half of a head (its 2-D rotary over
  the patches' ``(x, y)`` positions: :func:`~lensadapters.hooks.rotary.axial_rotate_half_spec`), exactly. A fused
  projection followed by per-head norms is refused by name (its norms' points are not served);
- ``hook_z``: the input of the child whose input is the function's output (``[b, p, h, d]``, heads merged) and whose
  output is the attention module's;
- ``hook_attn_scores``/``hook_pattern`` (``[b, h, query, key]``): computed explicitly in the layers they are hooked
  in (:func:`~lensadapters.hooks.attention.explicit_attention`: ``q k^T * scaling``, the tower's mask, softmax), every
  other layer keeping the tower's own implementation. The towers' attention is bidirectional (their modules say
  ``is_causal = False``): no causal mask. The tower's own mask is honoured as the model builds it: none for one image
  of a fixed size (CLIP, SigLIP), Pixtral's block-diagonal mask where several images share one sequence (a query
  sees only its own image's patches; blocked scores are ``-inf``, their pattern 0), Idefics3's padding-patch mask.
  Where the tower attends block by block (several calls), the patterns are of the whole sequence, block-diagonal
  over the calls (:func:`gathered_attention`; the sites gather the hooked layer's calls:
  :class:`~lensadapters.wiring.vision_attention_sites.GatheredAttentionSite`).
  Served only where the probe's explicit attention gives the tower's own output (to rounding) and refuses none of the
  tower's arguments; eager and sdpa only (the tower's implementation, not the language model's).

No hook is installed until a point is hooked; with none, the tower runs its own implementation untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import torch
from torch import nn

from lensadapters.errors import UnsupportedModelError
from lensadapters.hooks.attention import KEY_PREFIX, InterfacePatternBackend, original_function
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.rotary import axial_rotate_half_spec, float32_rotate_half_spec, rotate_half_spec
from lensadapters.hooks.specs import RotarySpec

Tensor = torch.Tensor

#: the points of a tower block's attention (relative to ``vision.blocks.{i}.``), in the order they fire
QKV_POINTS = ("attn.hook_q", "attn.hook_k", "attn.hook_v")
ROTARY_POINTS = ("attn.hook_rot_q", "attn.hook_rot_k")
PATTERN_POINTS = ("attn.hook_attn_scores", "attn.hook_pattern")
Z_POINT = "attn.hook_z"
#: the rotary embeddings a tower's attention may apply: Hugging Face's rotate-half ``apply_rotary_pos_emb`` (in
#: the queries' dtype), and the same computed in float32 and cast back (Qwen's ``apply_rotary_pos_emb_vision``)
ROTATE_HALF = rotate_half_spec()
ROTATE_HALF_FLOAT32 = float32_rotate_half_spec()


#: the rotations the probe recognises, by the name ``AttnParts.rotary`` keeps, tried in this order: rotate-half over
#: the whole head (Pixtral), the same in float32 (Qwen's; in float32 towers it is ``rotate_half``'s numbers and found as
#: that), or over each half of it (Gemma 4's axial 2-D rotary)
ROTATIONS = {"rotate_half": ROTATE_HALF, "rotate_half_float32": ROTATE_HALF_FLOAT32, "axial": axial_rotate_half_spec(2)}
#: the implementations whose masks explicit attention reads
IMPLEMENTATIONS = ("eager", "sdpa")
#: the largest difference the probe accepts between the tower's attention output and explicit attention's (and
#: between the norms of a rotated query's heads and its projection's), in float32; more in a coarser dtype
TOLERANCE = 1e-4


@dataclass(frozen=True)
class AttnParts:
    """A block's attention: the names of its projections (children of the attention module), its heads, whether
    the explicit attention of ``hook_attn_scores``/``hook_pattern`` reproduces it, how it rotates its queries and
    keys (``None``: it does not; else a key of :data:`ROTATIONS`, with the ``position_embeddings`` it gets), and the
    per-head norms between a projection and the rotation (Gemma 4's ``q_norm``/``k_norm``/``v_norm``), if any.

    ``fused``: ``q``, ``k`` and ``v`` name one child, whose output's thirds (``fused[0]``-th for the query...) are
    the query, key and value (never with norms: the probe refuses those). ``batched``: the tensors have a batch
    dimension (``False``: the tower runs its images' patches as one flat sequence, ``[pos, features]``; the points add
    a batch dimension of 1). ``gathered``: the attention function is called once per block of the sequence (an image,
    a window: ``cu_seqlens``), and the patterns are computed over the whole sequence with the block-diagonal mask of
    those calls (:func:`gathered_attention`)."""

    q: str
    k: str
    v: str
    o: str
    heads: int
    kv_heads: int
    patterns: bool
    rotary: Optional[str] = None
    q_norm: Optional[str] = None
    k_norm: Optional[str] = None
    v_norm: Optional[str] = None
    fused: Optional[tuple[int, int, int]] = None
    batched: bool = True
    gathered: bool = False

    def norm(self, x: str) -> Optional[str]:
        """The norm after projection ``x`` (``"q"``, ``"k"`` or ``"v"``)."""
        return cast(Optional[str], getattr(self, f"{x}_norm"))


class _Pass:
    """A point that runs no hook (the probe's explicit attention)."""

    may_edit = False

    def apply(self, value: Tensor, protect: bool = False) -> tuple[Tensor, bool]:
        return value, False


class _Recorder:
    """The probe's site on every layer: live, so the attention function hands it the layer's call."""

    def is_live(self) -> bool:
        return True


def _no_scores(module: nn.Module, query: Tensor, key: Tensor, scaling: Optional[float], impl: str) -> None:
    return None  # the default: q k^T * scaling


class TowerPatternBackend(InterfacePatternBackend):
    """The pattern backend of a vision tower: the core's, on the tower's config (``config._attn_implementation``
    routes the tower's attention only), refusing implementations whose masks explicit attention does not read, and
    recording the attention function's calls in the probe (``recording``: each layer's arguments and output, the
    layer computed by the tower's own implementation)."""

    def __init__(self, config: Any, attention_modules: list[nn.Module]) -> None:
        super().__init__(config, attention_modules, _no_scores)
        self.recording: Optional[dict[int, list[dict[str, Any]]]] = None

    def activate(self, layer: int, site: Any) -> Any:
        impl = str(self.original or self.config._attn_implementation)
        impl = impl[len(KEY_PREFIX) :] if impl.startswith(KEY_PREFIX) else impl  # another wrapper's routing
        if self.recording is None and impl not in IMPLEMENTATIONS:
            raise UnsupportedModelError(
                f"the vision tower's hook_attn_scores and hook_pattern are computed explicitly with the masks of the "
                f"eager or sdpa attention implementation; the tower uses {impl!r}. Call "
                f"model.set_attn_implementation('sdpa') to hook them (every other vision point works with {impl!r})"
            )
        return super().activate(layer, site)

    def attend(
        self,
        layer: int,
        site: Any,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        if self.recording is None:
            gather = getattr(site, "gather", None)  # a layer attending block by block (GatheredAttentionSite)
            if gather is not None:
                return cast(tuple[Tensor, Tensor], gather(module, query, key, value, attention_mask, **kwargs))
            return super().attend(layer, site, module, query, key, value, attention_mask, **kwargs)
        out = original_function(self.original or "sdpa", module)(module, query, key, value, attention_mask, **kwargs)
        seen = {"query": query, "key": key, "value": value, "mask": attention_mask, "kwargs": kwargs}
        self.recording.setdefault(layer, []).append({**seen, "module": module, "out": out[0]})
        return cast(tuple[Tensor, Tensor], out)


#: a call of the attention function: ``(query, key, value, attention_mask, kwargs, module)``
Chunk = tuple[Tensor, Tensor, Tensor, Optional[Tensor], dict, nn.Module]


def gathered_attention(
    backend: InterfacePatternBackend, chunks: list[Chunk], scores: HookPoint, pattern: HookPoint
) -> Tensor:
    """Explicit attention over the whole sequence of a layer that called its attention function once per block of
    it (``chunks``, in order: each an image's, or a window's, patches, as the tower's ``cu_seqlens`` cut them):
    their queries, keys and values concatenated along the positions, and a block-diagonal mask (a query sees the
    keys of its own call only: the others' scores are ``-inf``, their pattern 0), through ``scores``/``pattern``
    (``[batch, head, query, key]`` of the whole sequence). The output ``[batch, pos, head, d_head]``, the calls'
    outputs concatenated. Refused by name (:class:`UnsupportedModelError`) where a call has a mask of its own, its
    keys are not its queries' positions, or the calls' other arguments differ (a tensor argument is the same one in
    every call)."""
    query, key, value, _, kwargs, module = chunks[0]
    for q, k, _, mask, other, _ in chunks:
        if mask is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} calls its attention function once per block of the sequence with a mask "
                f"of each block's own; explicit attention over the whole sequence reads no such masks"
            )
        if (
            k.shape[2] != q.shape[2]
            or other.keys() != kwargs.keys()
            or any(v is not kwargs[n] and (isinstance(v, Tensor) or v != kwargs[n]) for n, v in other.items())
        ):
            raise UnsupportedModelError(
                f"{type(module).__name__} calls its attention function once per block of the sequence with keys "
                f"other than the block's queries or arguments that differ between the blocks"
            )
    lengths = torch.tensor([c[0].shape[2] for c in chunks], device=query.device)
    ids = torch.repeat_interleave(torch.arange(len(chunks), device=query.device), lengths)
    mask = (ids[:, None] == ids[None, :])[None, None]  # [1, 1, pos, pos]: True where the query may see the key
    query, key, value = (
        torch.cat([c[0] for c in chunks], dim=2),
        torch.cat([c[1] for c in chunks], dim=2),
        torch.cat([c[2] for c in chunks], dim=2),
    )
    return backend.explicit(module, (query, key, value, mask), scores, pattern, **kwargs)[0]


def merge_calls(backend: InterfacePatternBackend, calls: Optional[list[dict]]) -> Optional[dict]:
    """A layer's attention function calls in the probe as one: the queries, keys, values (``[b, h, p, d]``) and
    outputs (``[b, p, h, d]``) concatenated along the positions, ``gathered`` where there were several (blocks of
    the sequence), and the explicit attention of them (:func:`gathered_attention` of the blocks; of the one call's
    mask) or why it is refused."""
    if not calls:
        return None
    first = calls[0]
    merged: dict[str, Any] = {
        "query": torch.cat([c["query"] for c in calls], dim=2),
        "key": torch.cat([c["key"] for c in calls], dim=2),
        "value": torch.cat([c["value"] for c in calls], dim=2),
        "out": torch.cat([c["out"] for c in calls], dim=1),
        "gathered": len(calls) > 1,
        "explicit": None,
        "error": None,
    }
    pass_through = cast(HookPoint, _Pass())
    try:
        if merged["gathered"]:
            chunks = [(c["query"], c["key"], c["value"], c["mask"], c["kwargs"], c["module"]) for c in calls]
            merged["explicit"] = gathered_attention(backend, chunks, pass_through, pass_through)
        else:
            qkv_mask = (first["query"], first["key"], first["value"], first["mask"])
            explicit = backend.explicit(first["module"], qkv_mask, pass_through, pass_through, **first["kwargs"])
            merged["explicit"] = explicit[0]
    except UnsupportedModelError as exc:
        merged["error"] = str(exc)
    return merged


def tower_backend(modules: list[nn.Module]) -> Optional[TowerPatternBackend]:
    """The backend of the tower's attention modules: on their config (one for all), or ``None``."""
    configs = {id(getattr(m, "config", None)) for m in modules}
    config = getattr(modules[0], "config", None)
    if len(configs) != 1 or config is None or not hasattr(config, "_attn_implementation"):
        return None
    return TowerPatternBackend(config, modules)


def watch_attention(attention: nn.Module, seen: dict) -> list:
    """Hooks recording the attention module's first input and output and its children's (and their call counts)."""
    seen.update(child_in={}, child_out={}, calls={})

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        value = args[0] if args else next(iter(kwargs.values()), None)
        seen.setdefault("in", value)
        seen.setdefault("kwargs", kwargs)

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        seen.setdefault("out", output[0] if isinstance(output, tuple) else output)

    handles = [attention.register_forward_pre_hook(pre, with_kwargs=True), attention.register_forward_hook(post)]
    for name, child in attention.named_children():

        def child_pre(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            seen["calls"][name] = seen["calls"].get(name, 0) + 1
            value = args[0] if args else next(iter(kwargs.values()), None)
            seen["child_in"].setdefault(name, value)

        def child_post(module: nn.Module, args: tuple, output: Any, name: str = name) -> None:
            seen["child_out"].setdefault(name, output[0] if isinstance(output, tuple) else output)

        handles += [
            child.register_forward_pre_hook(child_pre, with_kwargs=True),
            child.register_forward_hook(child_post),
        ]
    return handles


def _as_heads(t: Any, heads: int, like: Tensor) -> Optional[Tensor]:
    """A child's output ``[b, p, h * d]`` (``[p, h * d]``: a batch of 1) as the attention function's
    ``[b, h, p, d]``, or ``None``."""
    if isinstance(t, Tensor) and t.dim() == 2:
        t = t.unsqueeze(0)
    if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] % heads:
        return None
    t = t.unflatten(-1, (heads, -1)).transpose(1, 2)
    return t if t.shape == like.shape else None


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def _angles(kwargs: dict) -> Optional[tuple[Tensor, Tensor]]:
    """The ``(cos, sin)`` the attention module got as ``position_embeddings``, or ``None``."""
    value = kwargs.get("position_embeddings")
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(t, Tensor) for t in value):
        return value[0], value[1]
    return None


def _rotated(t: Optional[Tensor], angles: Optional[tuple[Tensor, Tensor]], spec: RotarySpec) -> Optional[Tensor]:
    """``t`` (``[b, h, p, d]``) rotated by ``spec`` with ``angles``, or ``None`` where they do not fit."""
    if t is None or angles is None:
        return None
    try:
        return spec.apply(t.transpose(1, 2), *angles).transpose(1, 2)
    except RuntimeError:  # angles of another shape: not this rotation of these heads
        return None


def _outputs(seen: dict, once: set[str]) -> dict[tuple[str, Optional[int]], Any]:
    """The outputs of the children called once on the attention's input, by ``(name, None)``, and the thirds of
    those whose features split in three (a fused projection's query, key and value), by ``(name, third)``."""
    found: dict[tuple[str, Optional[int]], Any] = {}
    for name in sorted(once):
        t = seen["child_out"].get(name)
        found[(name, None)] = t
        if isinstance(t, Tensor) and t.dim() in (2, 3) and t.shape[-1] % 3 == 0:
            for third, part in enumerate(t.chunk(3, dim=-1)):
                found[(name, third)] = part
    return found


#: where a query, key or value comes from: ``(projection, third of its output or None, norm after it or None)``
Source = tuple[str, Optional[int], Optional[str]]


def _chains(seen: dict, once: set[str], heads: int, like: Tensor) -> list[tuple[Source, Tensor]]:
    """Each projection output among ``once`` (the children reading the attention's input; and each third of one:
    :func:`_outputs`) that is ``[b, p, heads, d]`` (``[p, heads, d]``: a batch of 1), with that output (``[b, h, p,
    d]``), and then each child called once that reads that output per head (a norm after the projection) with the
    norm's output."""
    found: list[tuple[Source, Tensor]] = []
    for (name, third), t in _outputs(seen, once).items():
        viewed = _as_heads(t, heads, like)
        if viewed is None:
            continue
        found.append(((name, third, None), viewed))
        per_head = viewed.transpose(1, 2) if t.dim() == 3 else viewed.transpose(1, 2).squeeze(0)
        for norm, count in seen["calls"].items():
            out = seen["child_out"].get(norm)
            if count == 1 and norm not in once and _same(seen["child_in"].get(norm), per_head):
                if isinstance(out, Tensor) and out.shape == per_head.shape:
                    found.append(((name, third, norm), (out if t.dim() == 3 else out.unsqueeze(0)).transpose(1, 2)))
    return found


def find_attention(seen: dict, call: Optional[dict], path: str) -> tuple[Optional[AttnParts], list[str]]:
    """The block's attention parts from the attention module's recorded values and its attention function's call,
    or ``None`` and why."""
    if call is None or "in" not in seen:
        return None, [f"{path}: its attention did not call transformers' attention interface in the probe"]
    once = {n for n, c in seen["calls"].items() if c == 1 and _same(seen["child_in"].get(n), seen["in"])}
    heads, kv_heads = call["query"].shape[1], call["key"].shape[1]
    found: dict[str, Source] = {}
    rotary: Optional[str] = None
    angles = _angles(seen.get("kwargs", {}))
    for role, heads_of in (("query", heads), ("key", kv_heads), ("value", kv_heads)):
        chains = _chains(seen, once, heads_of, call[role])
        matches = [s for s, t in chains if _same(t, call[role])]
        if not matches and role != "value":  # rotated: as the query was, or as the first rotation that gives it
            for kind in [rotary] if rotary is not None else list(ROTATIONS):
                matches = [s for s, t in chains if _same(_rotated(t, angles, ROTATIONS[kind]), call[role])]
                if matches:
                    rotary = kind
                    break
        if len(matches) != 1:
            return None, [f"{path}: no one child of its attention gives the attention function's {role}"]
        found[role] = matches[0]
    q, k, v = (found[r] for r in ("query", "key", "value"))
    names = {s[0] for s in (q, k, v)}
    thirds = (q[1], k[1], v[1])
    norms = [s[2] for s in (q, k, v) if s[2] is not None]
    fused = len(names) == 1 and None not in thirds and len(set(thirds)) == 3
    if not fused and (len(names) != 3 or any(t is not None for t in thirds)):
        return None, [f"{path}: its attention's query, key and value do not come from three children or one's thirds"]
    if len(set(norms)) != len(norms) or names & set(norms):
        return None, [f"{path}: its attention's query, key and value are not normed by norms of their own"]
    if fused and norms:
        return None, [
            f"{path}: its attention's fused projection {q[0]!r} is followed by per-head norms "
            f"({', '.join(repr(n) for n in norms)}); the points of a fused projection's norms are not served"
        ]
    batched = cast(Tensor, seen["child_out"][q[0]]).dim() == 3
    if not batched and not fused:
        return None, [f"{path}: its attention's separate projections give no batch dimension"]
    z = call["out"].flatten(-2)
    z = z if batched else z.squeeze(0)
    o = [
        n
        for n, c in seen["calls"].items()
        if c == 1 and _same(seen["child_in"].get(n), z) and _same(seen["child_out"].get(n), seen.get("out"))
    ]
    if len(o) != 1:
        return None, [f"{path}: no one child of its attention reads the attention function's output"]
    reasons = []
    if call["error"] is not None:
        reasons.append(f"{path}: {call['error']}")
    elif call["explicit"] is None or not torch.allclose(
        call["explicit"], call["out"], atol=_tolerance(z.dtype), rtol=_tolerance(z.dtype)
    ):
        reasons.append(f"{path}: explicit attention does not give the attention's own output")
    parts = AttnParts(
        q[0],
        k[0],
        v[0],
        o[0],
        heads,
        kv_heads,
        not reasons,
        rotary,
        q[2],
        k[2],
        v[2],
        fused=cast(tuple[int, int, int], thirds) if fused else None,
        batched=batched,
        gathered=bool(call["gathered"]),
    )
    return parts, reasons


def attention_names(parts: Optional[AttnParts], norms: bool = True) -> list[str]:
    """The attention points of a block (relative to ``vision.blocks.{i}.``), in the order they fire: each
    projection's, then its norm's (``hook_scale`` and ``hook_normalized``; none where ``norms`` is false: how the
    norms normalize is not known) and its rotation's (as on the language models)."""
    if parts is None:
        return []
    qkv: list[str] = []
    for x, point in zip("qkv", QKV_POINTS):
        qkv.append(point)
        if parts.norm(x) is not None and norms:
            qkv += [f"attn.{x}_norm.hook_scale", f"attn.{x}_norm.hook_normalized"]
        if parts.rotary is not None and x != "v" and parts.fused is None:
            qkv.append(ROTARY_POINTS["qk".index(x)])
    if parts.fused is not None and parts.rotary is not None:  # the fused projection's three parts, then rotations
        qkv += ROTARY_POINTS
    return [*qkv, *(PATTERN_POINTS if parts.patterns else ()), Z_POINT]


def _tolerance(dtype: torch.dtype) -> float:
    return max(TOLERANCE, torch.finfo(dtype).eps * 16) if dtype.is_floating_point else TOLERANCE


def probe_attention(
    blocks: nn.ModuleList, attn_paths: list[str], run: Callable[[], Any], path: str
) -> tuple[Optional[list[AttnParts]], Optional[TowerPatternBackend], list[str]]:
    """Each block's attention parts (``None``: no attention point), the tower's pattern backend, and the reasons of
    what is not served, from one probe forward ``run()`` with every layer's attention call recorded."""
    attentions = [block.get_submodule(name) for block, name in zip(blocks, attn_paths)]
    backend = tower_backend(attentions)
    if backend is None:
        return None, None, [f"{path}: its blocks' attention modules share no config (its attention implementation)"]
    seen: list[dict] = [{} for _ in attentions]
    handles = [h for attention, s in zip(attentions, seen) for h in watch_attention(attention, s)]
    recording: dict[int, list[dict[str, Any]]] = {}
    backend.recording = recording
    routes: list[Any] = []
    try:
        routes = [backend.activate(i, _Recorder()) for i in range(len(attentions))]
        run()
    finally:
        for handle in (*handles, *routes):
            handle.remove()
        backend.recording = None
    calls = [merge_calls(backend, recording.get(i)) for i in range(len(seen))]
    found = [find_attention(s, calls[i], f"{path}: block {i}") for i, s in enumerate(seen)]
    parts = [p for p, _ in found]
    reasons = [r for _, rs in found for r in rs]
    if any(p is None for p in parts):
        return None, None, reasons
    return cast(list[AttnParts], parts), backend, reasons


class TowerRotary:
    """The ``(cos, sin)`` of a tower's attention in this forward (``rotary``), kept apart from the language model's
    (``ForwardState.rotary``): an object with the ``rotary`` of a forward state, for the core's rotary sites."""

    def __init__(self, state: Any) -> None:
        self._state = state

    @property
    def rotary(self) -> Optional[tuple[Tensor, Tensor]]:
        return cast(Optional[tuple[Tensor, Tensor]], self._state.site_values(self).get("rotary"))

    @rotary.setter
    def rotary(self, value: Optional[tuple[Tensor, Tensor]]) -> None:
        self._state.site_values(self)["rotary"] = value
