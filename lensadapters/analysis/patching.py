"""Activation patching on a HookedModel, with the names and signatures of ``transformer_lens.patching``.

Run the model on a corrupted input while one activation (one layer, position and/or head at a time) is
replaced by its value from a clean run, and measure a metric of the logits for every choice: which activations
carry what makes the clean answer. ``generic_activation_patch`` does the sweep; the ``get_act_patch_*``
functions are it with a fixed activation and index axes. Every sweep shows a progress bar (tqdm).

``index_df`` and ``return_index_df`` work with pandas DataFrames as in TransformerLens (pandas is needed only
for them); ``index_df`` may also be any array-like of index rows.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from lensadapters.analysis.utils import get_act_name

Tensor = torch.Tensor
Metric = Callable[[Tensor], Tensor]
PatchSetter = Callable[[Tensor, Sequence[int], Tensor], Tensor]

__all__ = [
    "make_df_from_ranges",
    "generic_activation_patch",
    "layer_pos_patch_setter",
    "layer_pos_head_vector_patch_setter",
    "layer_head_vector_patch_setter",
    "layer_head_pattern_patch_setter",
    "layer_head_pos_pattern_patch_setter",
    "layer_head_dest_src_pos_pattern_patch_setter",
    "get_act_patch_resid_pre",
    "get_act_patch_resid_mid",
    "get_act_patch_attn_out",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_q_by_pos",
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos",
    "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_k_all_pos",
    "get_act_patch_attn_head_v_all_pos",
    "get_act_patch_attn_head_pattern_all_pos",
    "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every",
    "get_act_patch_block_every",
]


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "index DataFrames need pandas: pip install pandas (or pass index_df as a list of index "
            "rows and leave return_index_df=False)"
        ) from None
    return pandas


def make_df_from_ranges(column_max_ranges: Sequence[int], column_names: Sequence[str]) -> Any:
    """A pandas DataFrame of every combination of ``range(max)`` per column (the last column varies fastest)."""
    rows = list(itertools.product(*[range(m) for m in column_max_ranges]))
    return _pandas().DataFrame(rows, columns=list(column_names))


def _axis_ranges(model: Any, corrupted_tokens: Tensor, activation_name: str) -> dict[str, int]:
    cfg = model.cfg
    heads = cfg.n_heads
    if activation_name in ("k", "v") and cfg.n_key_value_heads is not None:
        heads = cfg.n_key_value_heads  # key/value heads under grouped-query attention
    pos = corrupted_tokens.shape[-1]
    return {"layer": cfg.n_layers, "pos": pos, "src_pos": pos, "dest_pos": pos, "head_index": heads, "head": heads}


def _rows(index_df: Any) -> list[list[int]]:
    values = index_df.values if hasattr(index_df, "values") and not callable(index_df.values) else index_df
    return [[int(v) for v in row] for row in values]


def generic_activation_patch(
    model: Any,
    corrupted_tokens: Tensor,
    clean_cache: Any,
    patching_metric: Metric,
    patch_setter: PatchSetter,
    activation_name: str,
    index_axis_names: Optional[Sequence[str]] = None,
    index_df: Any = None,
    return_index_df: bool = False,
) -> Union[Tensor, tuple[Tensor, Any]]:
    """Patch ``activation_name`` from ``clean_cache`` into a run on ``corrupted_tokens``, once per index, and
    return ``patching_metric(logits)`` for each.

    ``corrupted_tokens`` may also be text (tokenized with ``model.to_tokens``). The indices are every combination
    over ``index_axis_names`` (``"layer"`` first, then ``"pos"``,
    ``"head"``/``"head_index"``, ``"dest_pos"``, ``"src_pos"``; the result has one dimension per axis), or the
    rows of ``index_df`` (the result is flat, one value per row). ``patch_setter(corrupted, index, clean)``
    writes the clean slice into the corrupted activation.
    """
    if isinstance(corrupted_tokens, (str, list)):  # text, tokenized as the model would (hm.to_tokens)
        corrupted_tokens = model.to_tokens(corrupted_tokens)
    if index_df is None:
        if index_axis_names is None:
            raise ValueError("pass index_axis_names or index_df")
        ranges = _axis_ranges(model, corrupted_tokens, activation_name)
        unknown = [a for a in index_axis_names if a not in ranges]
        if unknown:
            raise ValueError(f"unknown index axes {unknown}; use {sorted(ranges)}")
        shape = [ranges[a] for a in index_axis_names]
        rows = [list(r) for r in itertools.product(*[range(m) for m in shape])]
        flat = False
    else:
        if index_axis_names is not None:
            raise ValueError("pass index_axis_names or index_df, not both")
        rows = _rows(index_df)
        flat = True
    device = model.cfg.device
    result = torch.zeros(len(rows) if flat else shape, device=device)

    def patching_hook(corrupted: Tensor, hook: Any, index: list[int], clean: Tensor) -> Tensor:
        return patch_setter(corrupted, index, clean)

    for i, index in enumerate(tqdm(rows, desc=f"patching {activation_name}")):
        name = get_act_name(activation_name, layer=index[0])
        hook = partial(patching_hook, index=index, clean=clean_cache[name])
        logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, hook)], return_type="logits")
        value = patching_metric(logits).item()
        if flat:
            result[i] = value
        else:
            result[tuple(index)] = value
    if not return_index_df:
        return result
    if index_df is None:
        index_df = make_df_from_ranges(shape, index_axis_names)  # type: ignore[arg-type]
    return result, index_df


# --- patch setters (indices as in TransformerLens) ------------------------------------------------------


def layer_pos_patch_setter(corrupted_activation: Tensor, index: Sequence[int], clean_activation: Tensor) -> Tensor:
    """``index = [layer, pos]``; activations ``[batch, pos, ...]``."""
    _, pos = index
    corrupted_activation[:, pos, ...] = clean_activation[:, pos, ...]
    return corrupted_activation


def layer_pos_head_vector_patch_setter(
    corrupted_activation: Tensor, index: Sequence[int], clean_activation: Tensor
) -> Tensor:
    """``index = [layer, pos, head]``; activations ``[batch, pos, head, ...]`` (q, k, v, z, result)."""
    _, pos, head = index
    corrupted_activation[:, pos, head] = clean_activation[:, pos, head]
    return corrupted_activation


def layer_head_vector_patch_setter(
    corrupted_activation: Tensor, index: Sequence[int], clean_activation: Tensor
) -> Tensor:
    """``index = [layer, head]``, every position; activations ``[batch, pos, head, ...]``."""
    _, head = index
    corrupted_activation[:, :, head] = clean_activation[:, :, head]
    return corrupted_activation


def layer_head_pattern_patch_setter(
    corrupted_activation: Tensor, index: Sequence[int], clean_activation: Tensor
) -> Tensor:
    """``index = [layer, head]``; patterns ``[batch, head, dest_pos, src_pos]``."""
    _, head = index
    corrupted_activation[:, head, :, :] = clean_activation[:, head, :, :]
    return corrupted_activation


def layer_head_pos_pattern_patch_setter(
    corrupted_activation: Tensor, index: Sequence[int], clean_activation: Tensor
) -> Tensor:
    """``index = [layer, head, dest_pos]``; patterns ``[batch, head, dest_pos, src_pos]``."""
    _, head, dest = index
    corrupted_activation[:, head, dest, :] = clean_activation[:, head, dest, :]
    return corrupted_activation


def layer_head_dest_src_pos_pattern_patch_setter(
    corrupted_activation: Tensor, index: Sequence[int], clean_activation: Tensor
) -> Tensor:
    """``index = [layer, head, dest_pos, src_pos]``; patterns ``[batch, head, dest_pos, src_pos]``."""
    _, head, dest, src = index
    corrupted_activation[:, head, dest, src] = clean_activation[:, head, dest, src]
    return corrupted_activation


# --- the standard sweeps ---------------------------------------------------------------------------------


def _sweep(activation: str, setter: PatchSetter, axes: tuple[str, ...], doc: str) -> Any:
    fn = partial(generic_activation_patch, patch_setter=setter, activation_name=activation, index_axis_names=axes)
    fn.__doc__ = (
        f"{doc} Returns a tensor of shape [{', '.join(axes)}].\n\n"
        f"Arguments: (model, corrupted_tokens, clean_cache, patching_metric); see generic_activation_patch."
    )
    return fn


get_act_patch_resid_pre = _sweep(
    "resid_pre",
    layer_pos_patch_setter,
    ("layer", "pos"),
    "Patch the residual stream at the start of each block, by position.",
)
get_act_patch_resid_mid = _sweep(
    "resid_mid",
    layer_pos_patch_setter,
    ("layer", "pos"),
    "Patch the residual stream between attention and MLP, by position.",
)
get_act_patch_attn_out = _sweep(
    "attn_out", layer_pos_patch_setter, ("layer", "pos"), "Patch each attention layer's output, by position."
)
get_act_patch_mlp_out = _sweep(
    "mlp_out", layer_pos_patch_setter, ("layer", "pos"), "Patch each MLP layer's output, by position."
)
get_act_patch_attn_head_out_by_pos = _sweep(
    "z", layer_pos_head_vector_patch_setter, ("layer", "pos", "head"), "Patch each head's output (hook_z), by position."
)
get_act_patch_attn_head_q_by_pos = _sweep(
    "q", layer_pos_head_vector_patch_setter, ("layer", "pos", "head"), "Patch each head's queries, by position."
)
get_act_patch_attn_head_k_by_pos = _sweep(
    "k",
    layer_pos_head_vector_patch_setter,
    ("layer", "pos", "head"),
    "Patch each key head's keys, by position (n_key_value_heads under GQA).",
)
get_act_patch_attn_head_v_by_pos = _sweep(
    "v",
    layer_pos_head_vector_patch_setter,
    ("layer", "pos", "head"),
    "Patch each value head's values, by position (n_key_value_heads under GQA).",
)
get_act_patch_attn_head_pattern_by_pos = _sweep(
    "pattern",
    layer_head_pos_pattern_patch_setter,
    ("layer", "head_index", "dest_pos"),
    "Patch each head's attention pattern, by destination position.",
)
get_act_patch_attn_head_pattern_dest_src_pos = _sweep(
    "pattern",
    layer_head_dest_src_pos_pattern_patch_setter,
    ("layer", "head_index", "dest_pos", "src_pos"),
    "Patch each head's attention from each destination to each source position.",
)
get_act_patch_attn_head_out_all_pos = _sweep(
    "z", layer_head_vector_patch_setter, ("layer", "head"), "Patch each head's output (hook_z) at every position."
)
get_act_patch_attn_head_q_all_pos = _sweep(
    "q", layer_head_vector_patch_setter, ("layer", "head"), "Patch each head's queries at every position."
)
get_act_patch_attn_head_k_all_pos = _sweep(
    "k", layer_head_vector_patch_setter, ("layer", "head"), "Patch each key head's keys at every position."
)
get_act_patch_attn_head_v_all_pos = _sweep(
    "v", layer_head_vector_patch_setter, ("layer", "head"), "Patch each value head's values at every position."
)
get_act_patch_attn_head_pattern_all_pos = _sweep(
    "pattern", layer_head_pattern_patch_setter, ("layer", "head_index"), "Patch each head's whole attention pattern."
)


def _pad_heads(results: Tensor, like: Tensor) -> Tensor:
    """Key/value results over fewer (GQA) heads, zero-padded to the query heads."""
    return torch.nn.functional.pad(results, (0, like.size(-1) - results.size(-1)))


def get_act_patch_attn_head_all_pos_every(
    model: Any, corrupted_tokens: Tensor, clean_cache: Any, metric: Metric
) -> Tensor:
    """Every head's output, queries, keys, values and pattern, each at all positions: ``[5, n_layers, n_heads]``."""
    out = get_act_patch_attn_head_out_all_pos(model, corrupted_tokens, clean_cache, metric)
    q = get_act_patch_attn_head_q_all_pos(model, corrupted_tokens, clean_cache, metric)
    k = get_act_patch_attn_head_k_all_pos(model, corrupted_tokens, clean_cache, metric)
    v = get_act_patch_attn_head_v_all_pos(model, corrupted_tokens, clean_cache, metric)
    pattern = get_act_patch_attn_head_pattern_all_pos(model, corrupted_tokens, clean_cache, metric)
    return torch.stack([out, q, _pad_heads(k, q), _pad_heads(v, q), pattern], dim=0)


def get_act_patch_attn_head_by_pos_every(
    model: Any, corrupted_tokens: Tensor, clean_cache: Any, metric: Metric
) -> Tensor:
    """The same by position: ``[5, n_layers, pos, n_heads]`` (the pattern by destination position)."""
    out = get_act_patch_attn_head_out_by_pos(model, corrupted_tokens, clean_cache, metric)
    q = get_act_patch_attn_head_q_by_pos(model, corrupted_tokens, clean_cache, metric)
    k = get_act_patch_attn_head_k_by_pos(model, corrupted_tokens, clean_cache, metric)
    v = get_act_patch_attn_head_v_by_pos(model, corrupted_tokens, clean_cache, metric)
    pattern = get_act_patch_attn_head_pattern_by_pos(model, corrupted_tokens, clean_cache, metric)
    return torch.stack([out, q, _pad_heads(k, q), _pad_heads(v, q), pattern.transpose(-2, -1)], dim=0)


def get_act_patch_block_every(model: Any, corrupted_tokens: Tensor, clean_cache: Any, metric: Metric) -> Tensor:
    """The residual stream at each block's start, each attention output and each MLP output, by position:
    ``[3, n_layers, pos]``."""
    return torch.stack(
        [
            get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric),
            get_act_patch_attn_out(model, corrupted_tokens, clean_cache, metric),
            get_act_patch_mlp_out(model, corrupted_tokens, clean_cache, metric),
        ],
        dim=0,
    )
