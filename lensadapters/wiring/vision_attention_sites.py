"""The sites of a vision tower's attention points (but the pre-hook recording its rotary angles), for the forms
:mod:`lensadapters.wiring.vision_attention` finds: separate projections on a batch of sequences (CLIP, SigLIP,
Pixtral: :class:`~lensadapters.hooks.sites.ProjectionSite`, ``AttentionSite``, ``InputSite``), and

- per-head norms after separate projections (Gemma 4's ``q_norm``/``k_norm``/``v_norm``): ``hook_q/k/v`` stay the
  projections' outputs, ``attn.{x}_norm.hook_scale``/``hook_normalized`` the norms' scale and input over it,
  before the weight (the core's :class:`~lensadapters.hooks.sites.NormSite`, as the language models' ``q_norm``),
  and ``hook_rot_q/k`` the norms' outputs rotated (:class:`~lensadapters.hooks.sites.NormedRotarySite`);

- a fused projection (Qwen's towers' ``qkv``): ``hook_q/k/v`` are the thirds of its output, per head, read and
  edited as a forward hook on it (:class:`~lensadapters.hooks.sites.FusedQKVSite`, with :func:`fused_layout`),
  ``hook_rot_q/k`` those rotated with the ``(cos, sin)`` the attention module gets;
- a flat sequence (``[pos, features]``: the patches of all the images as one sequence): the points add a batch
  dimension of 1, ``[1, pos, head, d_head]``, and take it off again for the tower (:func:`fused_layout`,
  :class:`HeadsInputSite`);
- an attention that calls its attention function once per block of the sequence (each image, or each window,
  ``cu_seqlens``): ``hook_attn_scores``/``hook_pattern`` of the whole sequence, ``[1, head, pos, pos]``,
  block-diagonal (:class:`GatheredAttentionSite`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.frames import ForwardState
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import (
    AttentionSite,
    FusedQKVSite,
    InputSite,
    NormedRotarySite,
    NormSite,
    ProjectionSite,
    Site,
    first_input,
    replace_first_input,
)
from lensadapters.hooks.specs import FusedQKV, NormSpec, ProjectionNorm, RotarySpec
from lensadapters.wiring.vision_attention import AttnParts, Chunk, TowerPatternBackend, gathered_attention

Tensor = torch.Tensor


def _batched(t: Tensor, batched: bool) -> Tensor:
    return t if batched else t.unsqueeze(0)


def _unbatched(t: Tensor, batched: bool) -> Tensor:
    return t if batched else t.squeeze(0)


def fused_layout(parts: AttnParts, rotary: Optional[RotarySpec]) -> FusedQKV:
    """The layout of a fused projection's output: its thirds (in the order ``parts.fused`` gives) as the query,
    key and value ``[b, pos, head, d_head]`` (a batch of 1 added to a flat sequence's), and back."""
    assert parts.fused is not None
    order, batched = parts.fused, parts.batched
    heads = (parts.heads, parts.kv_heads, parts.kv_heads)

    def split(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        thirds = _batched(t, batched).chunk(3, dim=-1)
        q, k, v = (thirds[j].unflatten(-1, (h, -1)) for j, h in zip(order, heads))
        return q, k, v

    def merge(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        by_third = dict(zip(order, (q, k, v)))
        return _unbatched(torch.cat([by_third[j].flatten(-2) for j in range(3)], dim=-1), batched)

    return FusedQKV(parts.q, split, merge, rotary=rotary)


class HeadsInputSite(Site):
    """A module's first input viewed as heads, ``[b, pos, head, d_head]``; a flat sequence's (``[pos, features]``)
    with a batch dimension of 1 (``hook_z`` at the output projection's input)."""

    def __init__(self, module: nn.Module, point: HookPoint, heads: int, batched: bool) -> None:
        self.module, self.point, self.heads, self.batched = module, point, heads, batched
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_pre_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        value = _batched(first_input(args, kwargs), self.batched).unflatten(-1, (self.heads, -1))
        value, changed = self.point.apply(value)
        if not changed:
            return None
        return replace_first_input(args, kwargs, _unbatched(value.flatten(-2), self.batched))


class GatheredAttentionSite(Site):
    """``hook_attn_scores``/``hook_pattern`` of a layer whose attention calls its attention function once per block
    of the sequence, served over the whole sequence (``[b, head, pos, pos]``, block-diagonal).

    While a hook of either is live, the tower's pattern backend hands this site each call of the layer's attention
    function (:meth:`gather`): it keeps the block's query, key and value and gives the attention module zeros of the
    block's output's shape, which the module concatenates and reshapes into its output projection's input. A
    pre-hook on that projection (prepended: before ``hook_z``'s) replaces its input by the explicit attention of the
    whole sequence (:func:`~lensadapters.wiring.vision_attention.gathered_attention`, through the two points),
    heads merged as the module merges them (the probe proved that projection's input is the calls' outputs
    concatenated). A layer whose points have no live hook runs the tower's own implementation, block by block.
    """

    def __init__(
        self,
        layer: int,
        backend: TowerPatternBackend,
        scores: HookPoint,
        pattern: HookPoint,
        attention: nn.Module,
        out_proj: nn.Module,
        state: ForwardState,
        batched: bool,
    ) -> None:
        self.layer, self.backend, self.scores, self.pattern = layer, backend, scores, pattern
        self.attention, self.out_proj, self.state, self.batched = attention, out_proj, state, batched
        self.points = (scores, pattern)

    def install(self) -> list[Any]:
        return [
            self.backend.activate(self.layer, self),
            self.attention.register_forward_pre_hook(self._start),
            self.out_proj.register_forward_pre_hook(self._finish, with_kwargs=True, prepend=True),
        ]

    def _chunks(self) -> list[Chunk]:
        return self.state.site_values(self).setdefault("chunks", [])  # type: ignore[no-any-return]

    def _start(self, module: nn.Module, args: tuple) -> None:
        self.state.site_values(self)["chunks"] = []

    def gather(
        self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], **kwargs: Any
    ) -> tuple[Tensor, None]:
        """Keep one block's call; zeros of its output's shape (``[b, pos, head, d_head]``) for the module."""
        self._chunks().append((query, key, value, mask, kwargs, module))
        b, h, p, _ = query.shape
        return query.new_zeros(b, p, h, value.shape[-1]), None

    def _finish(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        chunks = self.state.site_values(self).pop("chunks", None)
        if not chunks:  # no call was gathered in this forward: the tower's own outputs
            return None
        z = _unbatched(gathered_attention(self.backend, chunks, self.scores, self.pattern).flatten(-2), self.batched)
        value = first_input(args, kwargs)
        if z.shape != value.shape:
            raise RuntimeError(
                f"{self.scores.name}: the attention's output projection got {tuple(value.shape)}, not the "
                f"{tuple(z.shape)} of its attention function's calls; the patterns cannot be served"
            )
        return replace_first_input(args, kwargs, z.to(value.dtype))


def attention_sites(
    parts: AttnParts,
    attention: nn.Module,
    backend: Optional[TowerPatternBackend],
    state: ForwardState,
    rotary: Optional[ForwardState],
    rotation: Optional[RotarySpec],
    layer: int,
    pt: Callable[[str], HookPoint],
    norm_spec: Optional[Callable[[nn.Module], Callable[[], NormSpec]]] = None,
) -> list[Site]:
    """The sites of a block's attention points but its rotary angles' (``rotary``: the state they are recorded
    in, and ``rotation`` the rotation; ``None`` where the attention rotates nothing): its projections' (separate,
    with the per-head norms after them where it has them, or one fused), its patterns' (gathered where it attends
    block by block) and its ``hook_z``. ``norm_spec`` gives a per-head norm's ``NormSpec`` (the wiring's look-up) for
    its ``hook_scale``/``hook_normalized``; ``None``: those points are not served (their normalization is unknown)."""
    get = attention.get_submodule
    sites: list[Site] = []
    rotated = (rotary, rotation) if rotary is not None and rotation is not None else None
    if parts.fused is not None:
        if any(parts.norm(x) is not None for x in "qkv"):  # the probe refuses these: no site splits a fused norm
            raise ValueError(f"{parts.q}: a fused projection followed by per-head norms has no attention sites")
        rot_q, rot_k = (pt("attn.hook_rot_q"), pt("attn.hook_rot_k")) if rotated is not None else (None, None)
        q, k, v = (pt(f"attn.hook_{x}") for x in "qkv")
        layout = fused_layout(parts, rotated[1] if rotated is not None else None)
        angles = rotated[0] if rotated is not None else state
        sites.append(FusedQKVSite(get(parts.q), layout, q, k, v, angles, rot_q, rot_k))
    else:
        projections = (("q", parts.q, parts.heads), ("k", parts.k, parts.kv_heads), ("v", parts.v, parts.kv_heads))
        for x, child, heads in projections:
            point, norm = pt(f"attn.hook_{x}"), parts.norm(x)
            rot = pt(f"attn.hook_rot_{x}") if rotated is not None and x != "v" else None
            if norm is not None:  # the projection, its norm, and the normed values rotated
                sites.append(ProjectionSite(get(child), point, heads, state))
                if norm_spec is not None:  # x / scale before the weight, as the language models' q_norm
                    prefix = f"attn.{x}_norm"
                    scale, normalized = pt(f"{prefix}.hook_scale"), pt(f"{prefix}.hook_normalized")
                    sites.append(NormSite(get(norm), norm_spec(get(norm)), scale, normalized))
                if rot is not None and rotated is not None:
                    normed = ProjectionNorm(norm, "bphd")
                    sites.append(NormedRotarySite(get(norm), normed, heads, rot, rotated[1], rotated[0]))
            elif rot is not None and rotated is not None:
                sites.append(ProjectionSite(get(child), point, heads, rotated[0], rot, rotated[1]))
            else:
                sites.append(ProjectionSite(get(child), point, heads, state))
    if parts.patterns and backend is not None:
        scores, pattern = pt("attn.hook_attn_scores"), pt("attn.hook_pattern")
        if parts.gathered:
            site: Site = GatheredAttentionSite(
                layer, backend, scores, pattern, attention, get(parts.o), state, parts.batched
            )
        else:
            site = AttentionSite(layer, backend, scores, pattern)
        sites.append(site)
    z = pt("attn.hook_z")
    o = get(parts.o)
    sites.append(InputSite(o, z, heads=parts.heads) if parts.batched else HeadsInputSite(o, z, parts.heads, False))
    return sites
