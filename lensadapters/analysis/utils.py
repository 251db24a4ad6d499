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
    "get_device",
    "test_prompt",
    "sample_logits",
    "get_cumsum_along_dim",
    "repeat_along_head_dimension",
    "get_nested_attr",
    "set_nested_attr",
    "get_offset_position_ids",
    "get_tokens_with_bos_removed",
    "override_or_use_default_value",
    "print_gpu_mem",
    "gelu_new",
    "gelu_fast",
    "gelu_pytorch_tanh",
    "solu",
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


# --- the rest of transformer_lens.utils that analysis code calls (model-independent) -------------------------


def get_device() -> torch.device:
    """The device TransformerLens picks by default: CUDA if available, else MPS (PyTorch 2 and later) where
    ``TRANSFORMERLENS_ALLOW_MPS=1`` or PyTorch has no known MPS problem, else CPU."""
    import os

    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available() and mps.is_built():
        if os.environ.get("TRANSFORMERLENS_ALLOW_MPS", "") == "1":
            return torch.device("mps")
    return torch.device("cpu")


def test_prompt(
    prompt: str,
    answer: Union[str, list[str]],
    model: Any,
    prepend_space_to_answer: bool = True,
    print_details: bool = True,
    prepend_bos: Optional[bool] = None,
    top_k: int = 10,
) -> None:
    """TransformerLens' ``test_prompt``: print how the model ranks ``answer`` (one or several answers, then only
    their first token) after ``prompt``, with the tokenization and the ``top_k`` next tokens, in TransformerLens'
    format. ``model``: a HookedModel with a tokenizer."""
    answers = [answer] if isinstance(answer, str) else list(answer)
    n_answers = len(answers)
    multiple = n_answers > 1
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    prompt_tokens = model.to_tokens(prompt, prepend_bos=prepend_bos)
    answer_tokens = model.to_tokens(answers, prepend_bos=False)
    if multiple:
        answer_tokens = answer_tokens[:, :1]
    prompt_tokens = prompt_tokens.repeat(answer_tokens.shape[0], 1)
    tokens = torch.cat((prompt_tokens, answer_tokens.to(prompt_tokens.device)), dim=1)
    prompt_str_tokens = model.to_str_tokens(prompt, prepend_bos=prepend_bos)
    answer_str_tokens_list = [model.to_str_tokens(a, prepend_bos=False) for a in answers]
    prompt_length = len(prompt_str_tokens)
    answer_length = 1 if multiple else len(answer_str_tokens_list[0])
    if print_details:
        print("Tokenized prompt:", prompt_str_tokens)
        if multiple:
            print("Tokenized answers:", answer_str_tokens_list)
        else:
            print("Tokenized answer:", answer_str_tokens_list[0])
    with torch.no_grad():
        logits = model(tokens, return_type="logits")
    probs = logits.softmax(dim=-1)
    answer_ranks = []
    for index in range(prompt_length, prompt_length + answer_length):
        answer_ids = tokens[:, index]
        answer_str_tokens = [a[index - prompt_length] for a in answer_str_tokens_list]
        token_probs = probs[:, index - 1]
        sorted_probs, sorted_positions = token_probs.sort(descending=True)
        ranks = sorted_positions.argsort(-1)[range(n_answers), answer_ids.cpu()].tolist()
        answer_ranks.append(list(zip(answer_str_tokens, ranks)))
        if print_details:
            print(  # TransformerLens prints this bold with rich: the same text off a terminal
                f"Performance on answer token{'s' if n_answers > 1 else ''}:\n"
                + "\n".join(
                    f"Rank: {ranks[i]: <8} Logit: {logits[i, index - 1, answer_ids[i]].item():5.2f} "
                    f"Prob: {token_probs[i, answer_ids[i]].item():6.2%} Token: |{answer_str_tokens[i]}|"
                    for i in range(n_answers)
                )
            )
            for i in range(top_k):
                print(
                    f"Top {i}th token. Logit: {logits[0, index - 1, sorted_positions[0, i]].item():5.2f} "
                    f"Prob: {sorted_probs[0, i].item():6.2%} Token: |{model.to_string(sorted_positions[0, i])}|"
                )
    if not multiple:
        print(f"Ranks of the answer tokens: {[r[0] for r in answer_ranks]}")
    else:
        print(f"Ranks of the answer tokens: {answer_ranks}")


test_prompt.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def sample_logits(
    final_logits: Tensor,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    temperature: float = 1.0,
    freq_penalty: float = 0.0,
    tokens: Optional[Tensor] = None,
) -> Tensor:
    """TransformerLens' ``sample_logits``: one token per row of ``final_logits [batch, d_vocab]`` (greedy at
    temperature 0; else sampled after the frequency penalty, then ``top_k`` or else ``top_p``)."""
    if temperature == 0.0:
        return final_logits.argmax(dim=-1)
    final_logits = final_logits / temperature
    if freq_penalty > 0:
        if tokens is None or tokens.dim() != 2:
            raise ValueError("sample_logits(freq_penalty>0) needs tokens= [batch, pos]")
        counts = torch.stack([torch.bincount(row, minlength=final_logits.shape[-1]) for row in tokens])
        final_logits = final_logits - freq_penalty * counts[:, : final_logits.shape[-1]].to(final_logits.dtype)
    if top_k is not None:
        if top_k <= 0:
            raise ValueError("top_k has to be greater than 0")
        top_logits, _ = final_logits.topk(top_k, dim=-1)
        final_logits = final_logits.masked_fill(final_logits < top_logits[..., -1:], -float("inf"))
    elif top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError("top_p has to be in (0, 1]")
        sorted_logits, sorted_indices = torch.sort(final_logits, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        final_logits = final_logits.masked_fill(remove.scatter(-1, sorted_indices, remove), -float("inf"))
    return torch.distributions.categorical.Categorical(logits=final_logits.to(torch.float32)).sample()


def get_cumsum_along_dim(tensor: Tensor, dim: int, reverse: bool = False) -> Tensor:
    """Cumulative sum along ``dim`` (from the end when ``reverse``)."""
    return _cumsum(tensor, dim, reverse)


def repeat_along_head_dimension(tensor: Tensor, n_heads: int, clone_tensor: bool = True) -> Tensor:
    """``[batch, pos, d_model]`` -> ``[batch, pos, n_heads, d_model]`` (a copy unless ``clone_tensor=False``)."""
    repeated = tensor.unsqueeze(-2).expand(*tensor.shape[:-1], n_heads, tensor.shape[-1])
    return repeated.clone() if clone_tensor else repeated


def get_nested_attr(obj: Any, attr_str: str) -> Any:
    """``get_nested_attr(model, "blocks.0.attn")``: attributes along a dotted path."""
    for attr in attr_str.split("."):
        obj = getattr(obj, attr)
    return obj


def set_nested_attr(obj: Any, attr_str: str, value: Any) -> None:
    """Set the last attribute of a dotted path."""
    *path, last = attr_str.split(".")
    setattr(get_nested_attr(obj, ".".join(path)) if path else obj, last, value)


def get_offset_position_ids(past_kv_pos_offset: int, attention_mask: Tensor) -> Tensor:
    """Positions counted over the attended tokens (left padding at 0), from ``past_kv_pos_offset`` on."""
    shifted = attention_mask.cumsum(dim=1) - 1
    return shifted.masked_fill(shifted < 0, 0)[:, past_kv_pos_offset:]


def get_tokens_with_bos_removed(tokenizer: Any, tokens: Tensor) -> Tensor:
    """``tokens`` without the BOS of each row (after left padding too), as TransformerLens finds it."""
    if tokenizer.padding_side == "right":
        return tokens[..., 1:]
    shape = list(tokens.shape)
    shape[-1] -= 1
    if tokenizer.bos_token_id == tokenizer.pad_token_id:
        leading_pad = _cumsum(tokens.ne(tokenizer.pad_token_id), -1) == 0
        bos_positions = leading_pad.sum(-1) - 1
    else:
        bos_positions = (tokens == tokenizer.bos_token_id).int().argmax(-1)
    keep = torch.ones_like(tokens, dtype=torch.bool).scatter(1, bos_positions.unsqueeze(-1), False)
    return tokens[keep].view(*shape)


def override_or_use_default_value(default_flag: Any, override: Optional[Any] = None) -> Any:
    """``override`` unless it is ``None``."""
    return override if override is not None else default_flag


def print_gpu_mem(step_name: str = "") -> None:
    """Print the GPU memory allocated (GiB). TransformerLens divides by 2e30 here, printing 0 for any realistic
    amount; this divides by 2**30."""
    print(f"{step_name} ~ {np.round(torch.cuda.memory_allocated() / 2**30, 2)} GiB allocated on GPU.")


def gelu_new(input: Tensor) -> Tensor:
    """GPT-2's tanh approximation of GELU (TransformerLens' ``gelu_new``)."""
    return 0.5 * input * (1.0 + torch.tanh(np.sqrt(2.0 / np.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


def gelu_fast(input: Tensor) -> Tensor:
    return 0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input * input)))


def gelu_pytorch_tanh(input: Tensor) -> Tensor:
    return torch.nn.functional.gelu(input, approximate="tanh")


def solu(input: Tensor) -> Tensor:
    """SoLU: ``x * softmax(x)`` over the last dimension."""
    return input * torch.softmax(input, dim=-1)
