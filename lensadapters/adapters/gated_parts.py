"""Two gated parts of a decoder, in the description language, for a plugin to attach in
``lensadapters_extra_sites``:

* a query projection whose output holds per head the query and an output gate (``view(b, p, h, 2 * d_head)``,
  ``[q_h | gate_h]``; the attention output is multiplied by ``sigmoid(gate)`` before the output projection):
  :func:`query_gate_site` serves ``attn.hook_q`` and ``attn.hook_gate`` ``[b, p, h, d_head]`` on that output (and
  declares the projection's parts, :class:`~lensadapters.hooks.specs.ProjectionParts`: a LoRA delta on it is shown
  split alike);
* a mixture of experts' shared expert, a gated MLP ``shared_expert`` (``gate_proj``/``up_proj``/``down_proj``) whose
  output the MoE module adds times ``sigmoid`` of a one-unit linear ``shared_expert_gate``:
  :func:`shared_expert_sites` serves ``mlp.shared_expert.hook_gate``, ``hook_pre`` (up), ``hook_post``
  ``[b, p, d_shared]``, ``hook_result`` ``[b, p, d_model]`` (before its gate) and ``mlp.hook_shared_gate``
  ``[b, p, 1]`` (the gate's logit).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lensadapters.adapters.protocol import Hooked
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import InputSite, OutputSite, Site, first_output, replace_first_output
from lensadapters.hooks.specs import ProjectionParts

Tensor = torch.Tensor


class QueryGateSite(Site):
    """``attn.hook_q`` and ``attn.hook_gate`` ``[b, p, h, d_head]`` on ``q_proj``'s output, which holds per head the
    query then the gate (``view(b, p, h, 2 * d_head)``); an edit of either is written back into that output."""

    def __init__(self, module: nn.Module, q: HookPoint, gate: HookPoint, heads: int) -> None:
        self.module, self.q, self.gate, self.heads = module, q, gate, heads
        self.points = (q, gate)

    def install(self) -> list[Any]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        split, merge = query_gate_split(self.heads)
        query, gate = split(first_output(output))
        query, q_changed = self.q.apply(query, protect=True)
        gate, gate_changed = self.gate.apply(gate, protect=True)
        if not (q_changed or gate_changed):
            return None
        return replace_first_output(output, merge(query, gate))


def query_gate_site(hooked: Hooked, layer: int, block: Any) -> Site:
    """The query/gate site of a full-attention layer (claiming ``attn.hook_q``, the layer gets no per-head input
    points ``hook_q_input``...: the core's head-input site does not split the gate from the queries)."""
    pre = f"blocks.{layer}.attn."
    q = hooked.claim_point(pre + "hook_q")
    gate = hooked.new_point(pre + "hook_gate", after=pre + "hook_q")
    heads = hooked.cfg.n_heads
    hooked.declare_projection_parts(
        ProjectionParts(block.self_attn.q_proj, (q.name, gate.name), *query_gate_split(heads))
    )
    return QueryGateSite(block.self_attn.q_proj, q, gate, heads)


def query_gate_split(heads: int) -> tuple[Any, Any]:
    """``(split, merge)`` of a gated query projection's output (``[.., heads * 2 * d_head]``, per head the query then
    the gate): ``split(t)`` is ``(query, gate)``, each ``[.., heads, d_head]``, and ``merge`` its inverse."""

    def split(t: Tensor) -> tuple[Tensor, Tensor]:
        both = t.unflatten(-1, (heads, 2, -1))
        return both[..., 0, :], both[..., 1, :]

    def merge(q: Tensor, gate: Tensor) -> Tensor:
        return torch.stack((q, gate), dim=-2).flatten(-3)

    return split, merge


class _TokenShape(Site):
    """Records the MoE block's ``(b, p)`` for the shared expert's points, which see tokens flattened."""

    def __init__(self, moe: nn.Module, points: list[HookPoint], state: Any) -> None:
        self.module, self.state, self.points = moe, state, tuple(points)
        for point in points:
            point.token_shape = self.shape

    def shape(self) -> Optional[tuple[int, ...]]:
        return self.state.site_values(self).get("lead")

    def install(self) -> list[Any]:
        return [self.module.register_forward_pre_hook(self._record)]

    def _record(self, module: nn.Module, args: tuple) -> None:
        self.state.site_values(self)["lead"] = tuple(args[0].shape[:-1])


SHARED_EXPERT_POINTS = (
    "shared_expert.hook_gate",
    "shared_expert.hook_pre",
    "shared_expert.hook_post",
    "shared_expert.hook_result",
)


def shared_expert_sites(hooked: Hooked, layer: int, block: Any, after: Optional[str] = None) -> list[Site]:
    """The shared expert's points and its gate's, in the order they fire: by default the shared expert's before
    the router's points (the MoE module runs it first) and its gate's after the routed experts'; with ``after`` (a
    point of the layer, relative to ``blocks.{layer}.``) all of them right after that point, the gate's last."""
    pre, moe = f"blocks.{layer}.mlp.", block.mlp
    points: dict[str, HookPoint] = {}
    if after is None:
        for name in SHARED_EXPERT_POINTS:
            points[name] = hooked.new_point(pre + name, before=pre + "hook_router_logits")
        points["hook_shared_gate"] = hooked.new_point(pre + "hook_shared_gate", before=f"blocks.{layer}.hook_mlp_out")
    else:
        previous = f"blocks.{layer}.{after}"
        for name in (*SHARED_EXPERT_POINTS, "hook_shared_gate"):
            points[name] = hooked.new_point(pre + name, after=previous)
            previous = pre + name
    expert = moe.shared_expert
    return [
        _TokenShape(moe, list(points.values()), hooked.forward_state),
        OutputSite(expert.gate_proj, points["shared_expert.hook_gate"]),
        OutputSite(expert.up_proj, points["shared_expert.hook_pre"]),
        InputSite(expert.down_proj, points["shared_expert.hook_post"]),
        OutputSite(expert, points["shared_expert.hook_result"]),
        OutputSite(moe.shared_expert_gate, points["hook_shared_gate"]),
    ]
