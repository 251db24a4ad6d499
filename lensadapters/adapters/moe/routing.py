"""The routing computation of a :class:`~lensadapters.moe.specs.Routing`, step by step, so each step can be hooked."""

from __future__ import annotations

import torch

from lensadapters.adapters.moe.specs import Routing

Tensor = torch.Tensor


def probabilities(routing: Routing, logits: Tensor) -> Tensor:
    """The probability of every expert ``[tokens, n_experts]``, as the model computes it: the softmax over every
    expert in float32, or (``order="topk_softmax"``) the softmax over the top-k logits, scattered over the experts
    (zeros elsewhere), in ``weights_dtype``."""
    if routing.order == "topk_softmax":
        top, index = torch.topk(logits, routing.top_k, dim=-1)
        dtype = top.dtype if routing.weights_dtype == "logits" else torch.float32
        weights = torch.nn.functional.softmax(top, dim=-1, dtype=dtype)
        return torch.zeros_like(logits, dtype=dtype).scatter_(-1, index, weights)
    return torch.softmax(logits.float(), dim=-1)


def select(routing: Routing, probs: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(top_k_weights, top_k_index)`` from the probabilities: top-k, renormalized if the family does, in the
    family's dtype; for ``order="topk_softmax"`` the experts selected from the logits, weighted by the
    probabilities there."""
    if routing.order == "topk_softmax":
        index = torch.topk(logits, routing.top_k, dim=-1).indices
        return probs.gather(-1, index), index
    weights, index = torch.topk(probs, routing.top_k, dim=-1)
    if routing.normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if routing.weights_dtype == "logits":
        weights = weights.to(logits.dtype)
    return weights, index


def route(routing: Routing, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(probabilities, top_k_weights, top_k_index)`` of router logits."""
    probs = probabilities(routing, logits)
    weights, index = select(routing, probs, logits)
    return probs, weights, index


def expert_rows(index: Tensor, expert: int) -> tuple[Tensor, Tensor]:
    """``(slot, token)`` of the rows expert ``expert`` computes, for top-k indices ``[tokens, k]``.

    Rows are ordered by top-k slot, then token (the order of transformers' and TransformerLens' expert loops):
    first the tokens that chose the expert first, then those that chose it second...
    """
    slot, token = torch.where(index.T == expert)
    return slot, token
