"""TransformerLens' small utilities, with its names and semantics: ``get_act_name``, ``Slice``, the language-model loss.

Code written for ``transformer_lens.utils`` runs unchanged against these (``from lensadapters import utils``).
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

Tensor = torch.Tensor
SliceInput = Union[None, int, tuple, slice, Sequence[int], Tensor, np.ndarray]

__all__ = [
    "get_act_name",
    "Slice",
    "SliceInput",
    "lm_cross_entropy_loss",
    "lm_accuracy",
    "get_attention_mask",
    "position_ids_from_mask",
    "composition_scores",
    "to_numpy",
    "get_corner",
    "remove_batch_dim",
    "transpose",
    "is_square",
    "is_lower_triangular",
]

_LAYER_TYPE_ALIAS = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}
_ACT_NAME_ALIAS = {
    "attn": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_mid": "mid",
    "mlp_post": "post",
}
_ATTN_NAMES = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores")
_MLP_NAMES = ("pre", "post", "mid", "pre_linear")


def get_act_name(name: str, layer: Optional[Union[int, str]] = None, layer_type: Optional[str] = None) -> str:
    """A full hook name from TransformerLens shorthand, exactly as ``transformer_lens.utils.get_act_name``.

    ``get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"``, ``get_act_name("pre5") == "blocks.5.mlp.hook_pre"``,
    ``get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"``, ``get_act_name("normalized") ==
    "ln_final.hook_normalized"``; a full name (with a dot, or starting with ``hook_``) comes back unchanged.
    """
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    match = re.match(r"([a-z]+)(\d+)([a-z]?.*)", name)
    if match is not None:
        name, layer, layer_type = match.groups(0)  # type: ignore[assignment]
    name = _ACT_NAME_ALIAS.get(name, name)
    full = f"blocks.{layer}." if layer is not None else ""
    if name in _ATTN_NAMES:
        layer_type = "attn"
    elif name in _MLP_NAMES:
        layer_type = "mlp"
    elif layer_type in _LAYER_TYPE_ALIAS:
        layer_type = _LAYER_TYPE_ALIAS[layer_type]
    if layer_type:
        full += f"{layer_type}."
    full += f"hook_{name}"
    if name in ("scale", "normalized") and layer is None:
        full = f"ln_final.{full}"
    return full


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array of a tensor, list, number or array (as TransformerLens' ``to_numpy``)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, (list, tuple)):
        return np.array(tensor)
    if isinstance(tensor, Tensor):
        return tensor.detach().cpu().numpy()
    if isinstance(tensor, (int, float, bool, str)):
        return np.array(tensor)
    raise ValueError(f"input of type {type(tensor).__name__} is not supported by to_numpy")


class Slice:
    """TransformerLens' slice of one dimension: ``None`` keeps it, an ``int`` indexes (dropping the dimension),
    a tuple ``(k,)``/``(m, k)``/``(m, k, n)`` is ``slice(*tuple)``, a ``slice`` is itself, and a list, tensor or
    array picks those indices."""

    def __init__(self, input_slice: SliceInput = None) -> None:
        if isinstance(input_slice, tuple):
            self.slice: Any = slice(*input_slice)
            self.mode = "slice"
        elif isinstance(input_slice, (bool, np.bool_)):
            raise ValueError(f"invalid slice {input_slice!r}: a bool is not an index")
        elif isinstance(input_slice, (int, np.integer)):
            self.slice = int(input_slice)
            self.mode = "int"
        elif isinstance(input_slice, slice):
            self.slice = input_slice
            self.mode = "slice"
        elif isinstance(input_slice, (list, Tensor, np.ndarray)):
            self.slice = to_numpy(input_slice)
            self.mode = "array"
        elif input_slice is None:
            self.slice = slice(None)
            self.mode = "identity"
        else:
            raise ValueError(f"invalid slice {input_slice!r}: use None, an int, a tuple, a slice or a list of indices")

    def apply(self, tensor: Tensor, dim: int = 0) -> Tensor:
        """``tensor`` sliced along ``dim`` (negative dims count from the end)."""
        slices: list[Any] = [slice(None)] * tensor.ndim
        slices[dim] = self.slice
        return tensor[tuple(slices)]

    def indices(self, max_ctx: Optional[int] = None) -> np.ndarray:
        """The indices this slice selects (``max_ctx``: the length of the axis, needed unless it is an int)."""
        if self.mode == "int":
            return np.array([self.slice], dtype=np.int64)
        if max_ctx is None:
            raise ValueError("max_ctx must be given for a slice that is not an int")
        return np.arange(max_ctx, dtype=np.int64)[self.slice]

    def __repr__(self) -> str:
        return f"Slice: {self.slice} Mode: {self.mode} "

    @classmethod
    def unwrap(cls, slice_input: Union["Slice", SliceInput]) -> "Slice":
        """A ``Slice`` of ``slice_input``; an int becomes ``[int]`` so that the dimension is kept."""
        if isinstance(slice_input, Slice):
            return slice_input
        if isinstance(slice_input, int):
            slice_input = [slice_input]
        return Slice(slice_input)


def as_slice(value: Union[Slice, SliceInput]) -> Slice:
    return value if isinstance(value, Slice) else Slice(value)


def lm_cross_entropy_loss(
    logits: Tensor, tokens: Tensor, attention_mask: Optional[Tensor] = None, per_token: bool = False
) -> Tensor:
    """Next-token cross-entropy as TransformerLens computes it.

    ``per_token``: ``[batch, pos - 1]`` losses (positions whose token or next token is padding are 0);
    otherwise their mean over the counted positions.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    tokens = tokens.to(logits.device)
    predicted = log_probs[..., :-1, :].gather(dim=-1, index=tokens[..., 1:, None])[..., 0]
    if attention_mask is not None:
        mask = attention_mask.to(logits.device)
        keep = torch.logical_and(mask[:, :-1], mask[:, 1:])
        predicted = predicted * keep
        n_tokens = keep.sum().item()
    else:
        n_tokens = predicted.numel()
    if per_token:
        return -predicted
    return -predicted.sum() / n_tokens


def lm_accuracy(logits: Tensor, tokens: Tensor, per_token: bool = False) -> Tensor:
    """Top-1 next-token accuracy (TransformerLens' ``lm_accuracy``)."""
    correct = logits[:, :-1].argmax(dim=-1) == tokens[:, 1:].to(logits.device)
    return correct if per_token else correct.sum() / correct.numel()


def _cumsum(tensor: Tensor, dim: int, reverse: bool = False) -> Tensor:
    if reverse:
        tensor = tensor.flip(dims=(dim,))
    out = tensor.cumsum(dim=dim)
    return out.flip(dims=(dim,)) if reverse else out


def get_attention_mask(tokenizer: Any, tokens: Tensor, prepend_bos: bool, padding_side: Optional[str] = None) -> Tensor:
    """The attention mask TransformerLens infers from pad tokens: only leading pads (left padding) or trailing
    pads (right padding) are padding; a BOS equal to the pad token right after left padding is kept."""
    mask = torch.ones_like(tokens)
    if tokenizer is None or tokenizer.pad_token_id is None:
        return mask
    side = padding_side or tokenizer.padding_side
    not_pad = tokens.ne(tokenizer.pad_token_id)
    if side == "right":
        mask[_cumsum(not_pad, -1, reverse=True) == 0] = 0
    else:
        leading = _cumsum(not_pad, -1) == 0
        mask[leading] = 0
        if prepend_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:
            bos_at = leading.sum(-1) - 1
            rows = torch.arange(mask.shape[0], device=mask.device)
            has_pad = bos_at >= 0
            mask[rows[has_pad], bos_at[has_pad]] = 1
    return mask


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, as ``generate`` derives them (padding gets position 1)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def transpose(tensor: Tensor) -> Tensor:
    return tensor.transpose(-1, -2)


def composition_scores(left: Any, right: Any, broadcast_dims: bool = True) -> Tensor:
    """Composition scores of two ``FactoredMatrix`` (``||left right|| / (||left|| ||right||)``, Frobenius),
    broadcasting their leading dimensions against each other (TransformerLens' ``composition_scores``)."""
    if broadcast_dims:
        r_leading, l_leading = right.ndim - 2, left.ndim - 2
        for i in range(l_leading):
            right = right.unsqueeze(i)
        for i in range(r_leading):
            left = left.unsqueeze(i + l_leading)
    if left.rdim != right.ldim:
        raise ValueError(f"composition scores need left.rdim == right.ldim; shapes were {left.shape} and {right.shape}")
    new_right, new_left = right.collapse_r(), left.collapse_l()
    r_norms = new_right.norm(dim=[-2, -1])
    l_norms = new_left.norm(dim=[-2, -1])
    comp_norms = (new_left @ new_right).norm(dim=[-2, -1])
    return comp_norms / r_norms / l_norms


def get_corner(tensor: Any, n: int = 3) -> Any:
    """The top-left ``n x n x ...`` corner of a tensor or ``FactoredMatrix``."""
    from lensadapters.analysis.factored_matrix import FactoredMatrix

    if isinstance(tensor, Tensor):
        return tensor[tuple(slice(n) for _ in range(tensor.ndim))]
    if isinstance(tensor, FactoredMatrix):
        return tensor.get_corner(n)
    raise TypeError(f"get_corner takes a tensor or a FactoredMatrix, not {type(tensor).__name__}")


def remove_batch_dim(tensor: Tensor) -> Tensor:
    """Drop a leading dimension of size 1 (a tensor with another batch size comes back unchanged)."""
    return tensor[0] if tensor.shape[0] == 1 else tensor


def is_square(x: Tensor) -> bool:
    return x.ndim == 2 and x.shape[0] == x.shape[1]


def is_lower_triangular(x: Tensor) -> bool:
    return is_square(x) and bool(x.equal(x.tril()))
