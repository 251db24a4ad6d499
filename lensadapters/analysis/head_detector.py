"""Find heads by their attention pattern: ``detect_head`` with TransformerLens' name, signature and scores.

A detection pattern is a lower-triangular ``[pos, pos]`` matrix of where a kind of head attends: the previous
token (``"previous_token_head"``), earlier copies of the current token (``"duplicate_token_head"``), or the
token after an earlier copy of the current one (``"induction_head"``). Each head's score is how much of its
attention falls where the pattern says (``error_measure="mul"``), or one minus its mean absolute deviation from
the pattern, scaled by the length (``"abs"``).

Differences from TransformerLens: the sequence may also be token ids (``[pos]`` or ``[1, pos]``; text needs
``hm.tokenizer``), and a ``cache`` passed in is never modified (TransformerLens zeroes the BOS column of the
cached patterns in place with ``exclude_bos``).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Literal, Optional, Union

import torch

from lensadapters.analysis.utils import is_lower_triangular, is_square

Tensor = torch.Tensor
HeadName = Literal["previous_token_head", "duplicate_token_head", "induction_head"]
HEAD_NAMES = ("previous_token_head", "duplicate_token_head", "induction_head")
ErrorMeasure = Literal["abs", "mul"]


def get_previous_token_head_detection_pattern(tokens: Tensor) -> Tensor:
    """1 where a position attends to the one before it."""
    n = tokens.shape[-1]
    return torch.ones(n, n).tril(-1).triu(-1)


def get_duplicate_token_head_detection_pattern(tokens: Tensor) -> Tensor:
    """1 where a position attends to an earlier position holding the same token."""
    seq = tokens.reshape(-1).cpu()
    same = (seq[:, None] == seq[None, :]).float()
    return same.tril(-1)


def get_induction_head_detection_pattern(tokens: Tensor) -> Tensor:
    """1 where a position attends to the token right after an earlier copy of its own token."""
    duplicate = get_duplicate_token_head_detection_pattern(tokens)
    shifted = torch.zeros_like(duplicate)
    shifted[:, 1:] = duplicate[:, :-1]
    return shifted.tril()


_PATTERNS = {
    "previous_token_head": get_previous_token_head_detection_pattern,
    "duplicate_token_head": get_duplicate_token_head_detection_pattern,
    "induction_head": get_induction_head_detection_pattern,
}


def get_supported_heads() -> None:
    """Print the supported head names (as TransformerLens)."""
    print(f"Supported heads: {HEAD_NAMES}")


def compute_head_attention_similarity_score(
    attention_pattern: Tensor,
    detection_pattern: Tensor,
    *,
    exclude_bos: bool,
    exclude_current_token: bool,
    error_measure: ErrorMeasure,
) -> float:
    """The score of one head's ``[pos, pos]`` pattern against a detection pattern."""
    if not is_square(attention_pattern):
        raise ValueError(f"the attention pattern must be square, got {tuple(attention_pattern.shape)}")
    detection_pattern = detection_pattern.to(attention_pattern.device, attention_pattern.dtype)
    if error_measure == "mul":
        pattern = attention_pattern.clone()
        if exclude_bos:
            pattern[:, 0] = 0
        if exclude_current_token:
            pattern.fill_diagonal_(0)
        return ((pattern * detection_pattern).sum() / pattern.sum()).item()
    diff = (attention_pattern - detection_pattern).abs()
    if not torch.equal(diff, diff.tril()):
        raise ValueError("the attention pattern is not lower triangular (causal)")
    if exclude_bos:
        diff[:, 0] = 0
    if exclude_current_token:
        diff.fill_diagonal_(0)
    return 1 - round((diff.mean() * len(diff)).item(), 3)


def _tokens(model: Any, seq: Any) -> Tensor:
    if isinstance(seq, Tensor):
        tokens = seq[None] if seq.dim() == 1 else seq
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"token ids must be [pos] or [1, pos], not {tuple(seq.shape)}")
        return tokens.to(model.device)
    return model.to_tokens(seq)


def detect_head(
    model: Any,
    seq: Union[str, list, Tensor],
    detection_pattern: Union[Tensor, HeadName],
    heads: Optional[Union[list[tuple[int, int]], dict[int, list[int]]]] = None,
    cache: Any = None,
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    error_measure: ErrorMeasure = "mul",
) -> Tensor:
    """Score every head (or ``heads``: ``[(layer, head)]`` or ``{layer: [heads]}``) against a detection pattern
    on ``seq``: ``[n_layers, n_heads]``, ``-1`` for heads not scored. A list of texts with a named pattern is
    scored text by text and averaged. The blocks without an attention pattern (a hybrid model's linear-attention or
    state-space layers) have no heads to score: all their entries are ``-1``, and naming one in ``heads`` is an
    error."""
    cfg = model.cfg
    if error_measure not in ("abs", "mul"):
        raise ValueError(f"error_measure must be 'abs' or 'mul', not {error_measure!r}")
    if isinstance(detection_pattern, str):
        if detection_pattern not in _PATTERNS:
            raise ValueError(f"detection_pattern must be a tensor or one of {HEAD_NAMES}, not {detection_pattern!r}")
        if isinstance(seq, list):
            scores = [
                detect_head(
                    model,
                    s,
                    detection_pattern,
                    heads,
                    exclude_bos=exclude_bos,
                    exclude_current_token=exclude_current_token,
                    error_measure=error_measure,
                )
                for s in seq
            ]
            return torch.stack(scores).mean(0)
        tokens = _tokens(model, seq)
        detection_pattern = _PATTERNS[detection_pattern](tokens.cpu())
    else:
        tokens = _tokens(model, seq)
    seq_len = tokens.shape[-1]
    if error_measure == "mul" and not set(detection_pattern.unique().tolist()) <= {0, 1}:
        warnings.warn("a detection pattern with values other than 0 and 1 under error_measure='mul'", stacklevel=2)
    if not 1 < seq_len < cfg.n_ctx:
        raise ValueError(
            f"the sequence must have more than one token and fit the context ({cfg.n_ctx}); it has {seq_len}"
        )
    if not (is_lower_triangular(detection_pattern) and detection_pattern.shape[0] == seq_len):
        raise ValueError(
            f"the detection pattern must be lower triangular of shape ({seq_len}, {seq_len}); got "
            f"{tuple(detection_pattern.shape)}"
        )
    patterned = [layer for layer in range(cfg.n_layers) if f"blocks.{layer}.attn.hook_pattern" in model.hook_names]
    if heads is None:
        layer_heads: dict[int, list[int]] = {layer: list(range(cfg.n_heads)) for layer in patterned}
    elif isinstance(heads, list):
        layer_heads = defaultdict(list)
        for layer, head in heads:
            layer_heads[layer].append(head)
    else:
        layer_heads = dict(heads)
    unpatterned = sorted(set(layer_heads) - set(patterned))
    if unpatterned:
        raise ValueError(
            f"blocks {unpatterned} have no attention pattern (blocks.L.attn.hook_pattern): their token mixer is not "
            f"softmax attention. Score heads of the blocks that have one: {patterned}"
        )
    if cache is None:
        names = [f"blocks.{layer}.attn.hook_pattern" for layer in layer_heads]
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=names, return_type="logits")
    matches = -torch.ones(cfg.n_layers, cfg.n_heads, dtype=cfg.dtype or torch.float32)
    for layer, head_list in layer_heads.items():
        patterns = cache["pattern", layer, "attn"]
        if patterns.dim() == 4:  # a cache with a batch dimension (of one)
            patterns = patterns[0]
        for head in head_list:
            matches[layer, head] = compute_head_attention_similarity_score(
                patterns[head],
                detection_pattern,
                exclude_bos=exclude_bos,
                exclude_current_token=exclude_current_token,
                error_measure=error_measure,
            )
    return matches
