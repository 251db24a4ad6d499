"""The routing computation of a :class:`~lensadapters.moe.specs.Routing`, step by step, so each step can be hooked."""

from __future__ import annotations

from typing import Optional

import torch

from lensadapters.adapters.moe.specs import Routing

Tensor = torch.Tensor


def probabilities(routing: Routing, logits: Tensor) -> Tensor:
    """The probability of every expert ``[tokens, n_experts]``, as the model computes it: the softmax over every
    expert in float32 (the sigmoid of each logit for ``probabilities="sigmoid"``), or (``order="topk_softmax"``)
    the softmax over the top-k logits, scattered over the experts (zeros elsewhere), in ``weights_dtype``
    (``order="topk_sigmoid"``: the sigmoid of each top-k logit, in float32 and then ``weights_dtype``)."""
    if routing.order == "topk_sigmoid":  # the sigmoid of the logits, those not selected at -inf (zero after it)
        top, index = torch.topk(logits, routing.top_k, dim=-1)
        dtype = top.dtype if routing.weights_dtype == "logits" else torch.float32
        kept = torch.full_like(logits, float("-inf")).scatter_(-1, index, top)
        return kept.float().sigmoid().to(dtype)
    if routing.order == "topk_softmax":
        top, index = torch.topk(logits, routing.top_k, dim=-1)
        dtype = top.dtype if routing.weights_dtype == "logits" else torch.float32
        weights = torch.nn.functional.softmax(top, dim=-1, dtype=dtype)
        return torch.zeros_like(logits, dtype=dtype).scatter_(-1, index, weights)
    if routing.probabilities == "sigmoid":
        return logits.float().sigmoid()
    return torch.softmax(logits.float(), dim=-1)


def _grouped_choice(routing: Routing, probs: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The top-k indices of grouped routing (``Routing.groups``, ``selection_bias``), in the model's operations."""
    choice = probs if bias is None else probs + bias
    if routing.groups is not None:
        n_group, topk_group = routing.groups
        grouped = choice.view(-1, n_group, routing.n_experts // n_group)
        scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if routing.group_score == "top2_sum" else grouped.max(-1).values
        group_idx = torch.topk(scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, routing.n_experts).bool()
        choice = choice.masked_fill(~keep, routing.masked_score)
    return torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]


def select(
    routing: Routing,
    probs: Tensor,
    logits: Tensor,
    bias: Optional[Tensor] = None,
    expert_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``(top_k_weights, top_k_index)`` from the probabilities: top-k, renormalized if the family does, in the
    family's dtype; for ``order="topk_softmax"`` the experts selected from the logits, weighted by the
    probabilities there; for grouped routing (``Routing.groups`` or ``selection_bias``, whose value is ``bias``)
    the experts chosen within the kept groups, weighted by their unbiased probabilities, renormalized and scaled;
    ``expert_scale`` (the value of ``Routing.expert_scale``) multiplies each selected weight by its expert's."""
    if routing.order in ("topk_softmax", "topk_sigmoid"):
        index = torch.topk(logits, routing.top_k, dim=-1).indices
        return probs.gather(-1, index), index
    if routing.groups is not None or routing.selection_bias is not None:
        index = _grouped_choice(routing, probs, bias)
        weights = probs.gather(1, index)
    else:
        weights, index = torch.topk(probs, routing.top_k, dim=-1)
    if routing.normalize:
        denominator = weights.sum(dim=-1, keepdim=True)
        weights /= denominator + routing.normalize_eps if routing.normalize_eps else denominator
    if routing.scale != 1.0:
        weights = weights * routing.scale
    if expert_scale is not None:
        weights = weights * expert_scale[index]
    if routing.weights_dtype == "logits":
        weights = weights.to(logits.dtype)
    return weights, index


def route(routing: Routing, logits: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(probabilities, top_k_weights, top_k_index)`` of router logits (``bias``: the router's ``selection_bias``)."""
    probs = probabilities(routing, logits)
    weights, index = select(routing, probs, logits, bias)
    return probs, weights, index


def expert_rows(index: Tensor, expert: int) -> tuple[Tensor, Tensor]:
    """``(slot, token)`` of the rows expert ``expert`` computes, for top-k indices ``[tokens, k]``.

    Rows are ordered by top-k slot, then token (the order of transformers' and TransformerLens' expert loops):
    first the tokens that chose the expert first, then those that chose it second...
    """
    slot, token = torch.where(index.T == expert)
    return slot, token


def ungrouped(order: Tensor, row_weights: Tensor, rows_per_expert: list[int], top_k: int) -> tuple[Tensor, Tensor]:
    """``(top_k_weights, top_k_index)`` ``[tokens, k]`` of a routing given grouped by expert
    (``MoELayout.router_output="grouped"``): row ``r`` is top-k slot ``order[r]`` of the flattened ``[tokens, k]``
    routing, its expert the group it is in, its weight ``row_weights[r]``."""
    sizes = torch.as_tensor(rows_per_expert, device=order.device)
    experts = torch.repeat_interleave(torch.arange(len(rows_per_expert), device=order.device), sizes)
    index = torch.empty_like(order).scatter_(0, order, experts)
    weights = torch.empty_like(row_weights).scatter_(0, order, row_weights)
    return weights.reshape(-1, top_k), index.reshape(-1, top_k)


def grouped(weights: Tensor, index: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """``(order, row_tokens, row_weights, rows_per_expert)`` of a top-k routing ``[tokens, k]`` grouped by expert, as
    such a router computes them (the flattened indices sorted, each row's token their slot divided by ``k``, the
    weights gathered in that order); ``rows_per_expert`` counts every slot (an expert chosen in two slots of a token
    has two rows)."""
    k = index.shape[-1]
    flat = index.flatten()
    _, order = flat.sort(0)
    rows_per_expert = torch.bincount(flat, minlength=n_experts).tolist()
    return order, order.div(k, rounding_mode="trunc"), weights.flatten()[order], rows_per_expert
