"""The routing computation of a :class:`~lensadapters.moe.specs.Routing`, step by step, so each step can be hooked."""

from __future__ import annotations

import torch

from lensadapters.adapters.moe.specs import Routing

Tensor = torch.Tensor


def probabilities(routing: Routing, logits: Tensor) -> Tensor:
    """The probability of every expert ``[tokens, n_experts]`` (float32), as the model computes it."""
    return torch.softmax(logits.float(), dim=-1)


def select(routing: Routing, probs: Tensor, logits_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(top_k_weights, top_k_index)`` from the probabilities: top-k, renormalized if the family does, in the
    family's dtype."""
    weights, index = torch.topk(probs, routing.top_k, dim=-1)
    if routing.normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if routing.weights_dtype == "logits":
        weights = weights.to(logits_dtype)
    return weights, index


def route(routing: Routing, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(probabilities, top_k_weights, top_k_index)`` of router logits."""
    probs = probabilities(routing, logits)
    weights, index = select(routing, probs, logits.dtype)
    return probs, weights, index


def expert_rows(index: Tensor, expert: int) -> tuple[Tensor, Tensor]:
    """``(slot, token)`` of the rows expert ``expert`` computes, for top-k indices ``[tokens, k]``.

    Rows are ordered by top-k slot, then token (the order of transformers' and TransformerLens' expert loops):
    first the tokens that chose the expert first, then those that chose it second...
    """
    slot, token = torch.where(index.T == expert)
    return slot, token
