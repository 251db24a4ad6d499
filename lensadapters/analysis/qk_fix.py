"""The QK fix of attribution patching (AtP*, Kramár et al. 2024): a query or key change acts through the attention
softmax, where the linear estimate is worst, so the new attention pattern is computed exactly and only the pattern's
effect on the metric is linearized (see :mod:`.attribution`). It needs scores that are ``scale * q . k``, checked on
the run (:class:`QKFixUnavailable` otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


class QKFixUnavailable(ValueError):
    """The QK fix needs attention scores that are ``scale * q . k`` (with masking); this model's are not."""


def qk_fixed(result: Any, which: str, layer: int, axes: list[str], variant: int) -> Tensor:
    """The QK-fixed scores of layer ``layer``'s heads' queries or keys (``which``) from ``result`` (an
    :class:`~lensadapters.analysis.attribution.Attribution`), with the gradient of backward ``variant``."""
    if axes not in (["head"], ["head_index"], ["pos", "head"], ["pos", "head_index"]):
        raise ValueError(f"qk_fix scores heads: index axes ('layer', 'head') or ('layer', 'pos', 'head'), not {axes}")
    by_pos = axes[0] == "pos"
    base, other = result.base, result.other
    norm = base.get(f"blocks.{layer}.attn.{which}_norm.hook_scale")
    if norm is not None and norm.dim() == 3:  # [b, p, 1]: one norm over every head's queries (or keys)
        raise QKFixUnavailable(
            f"qk_fix patches one head's {'queries' if which == 'q' else 'keys'}, but layer {layer}'s {which}_norm "
            f"normalizes every head's together (patching one head changes the others'): pass qk_fix=False"
        )
    q_name, k_name = qk_names(result.model, layer)
    q, k = base[q_name].double(), base[k_name].double()  # [b, p, h, d], [b, p, kv, d]
    scores = base[f"blocks.{layer}.attn.hook_attn_scores"].double()  # [b, h, dest, src]
    pattern = base[f"blocks.{layer}.attn.hook_pattern"].double()
    g = result.grads[variant][f"blocks.{layer}.attn.hook_pattern"].double()
    groups = q.shape[2] // k.shape[2]
    live = torch.isfinite(scores) & (scores > -1e4)
    scale = check_scores(q, k.repeat_interleave(groups, dim=2), scores, pattern, live, layer)
    sign = 1.0 if result.at == "corrupted" else -1.0
    if which == "q":
        delta_q = other[q_name].double() - q
        delta = scale * torch.einsum("bihd,bjhd->bhij", delta_q, k.repeat_interleave(groups, dim=2))
        new = torch.where(live, scores + delta, scores).softmax(-1)
        per_dest = ((new - pattern) * g).sum(-1)  # [b, h, dest]: rows are independent, so by position is exact
        out = per_dest.sum(0).transpose(0, 1) if by_pos else per_dest.sum((0, 2))
        return sign * out
    delta_k = (other[k_name].double() - k).repeat_interleave(groups, dim=2)
    delta = torch.where(live, scale * torch.einsum("bihd,bjhd->bhij", q, delta_k), torch.zeros_like(scores))
    if not by_pos:  # every key at once
        new = torch.where(live, scores + delta, scores).softmax(-1)
        per_head = ((new - pattern) * g).sum((0, 2, 3))  # [h]
        return sign * per_head.reshape(-1, groups).sum(-1)
    # one key position j at a time: only column j of each row changes, softmax in closed form
    grown = pattern * torch.expm1(delta)  # p_j (e^d - 1)
    z = 1 + grown
    mean_g = (pattern * g).sum(-1, keepdim=True)  # sum_k p_k g_k per row
    effect = (1 / z - 1) * mean_g + g * grown / z  # [b, h, dest, j]
    per_key = effect.sum((0, 2))  # [h, src]
    return sign * per_key.reshape(-1, groups, per_key.shape[-1]).sum(1).transpose(0, 1)


def qk_names(model: Any, layer: int) -> tuple[str, str]:
    """The queries and keys the scores are computed from: after rotary embeddings (and q/k norms) where served."""
    names = []
    for which in ("q", "k"):
        rot = f"blocks.{layer}.attn.hook_rot_{which}"
        names.append(rot if rot in model.hook_dict else f"blocks.{layer}.attn.hook_{which}")
    return names[0], names[1]


def check_scores(q: Tensor, k: Tensor, scores: Tensor, pattern: Tensor, live: Tensor, layer: int) -> Tensor:
    """The scale with ``scores = scale * q . k`` on the unmasked entries; refuses where that (or the softmax) fails."""
    raw = torch.einsum("bihd,bjhd->bhij", q, k)
    num = (scores * raw)[live].sum()
    den = (raw * raw)[live].sum()
    scale = num / den if den > 0 else torch.tensor(0.0, dtype=scores.dtype)
    residual = (scores - scale * raw)[live].abs().max() if live.any() else torch.tensor(0.0)
    if residual > 1e-4 * max(1.0, float(scores[live].abs().max())):
        raise QKFixUnavailable(
            f"qk_fix needs attention scores equal to scale * q . k; layer {layer}'s differ by up to "
            f"{float(residual):.3g} (softcapped or position-biased scores): pass qk_fix=False"
        )
    if (scores.softmax(-1) - pattern).abs().max() > 1e-5:
        raise QKFixUnavailable(
            f"qk_fix needs hook_pattern = softmax(hook_attn_scores); layer {layer}'s differ: pass qk_fix=False"
        )
    return scale
