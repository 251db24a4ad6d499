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


#: The default memory budget of one batched forward, in bytes: ``batch_size=None`` runs as many patched copies per
#: forward as :func:`copy_bytes` says fit (at least one). Set it to suit the device (e.g. a few GiB on a GPU).
MEMORY_BUDGET = 512 * 2**20


def copy_bytes(model: Any, corrupted_tokens: Tensor) -> int:
    """What one patched copy of ``corrupted_tokens`` adds to a batched forward, estimated from the model's shapes.

    A sweep runs without gradients and keeps nothing but each copy's logits, so a copy's cost is its logits plus the
    largest activations alive at once inside a block: per token ``d_vocab`` (the logits) + ``4 d_model`` (residual,
    normalized residual, attention and MLP outputs) + ``2 d_mlp`` (the MLP's hidden and gate activations, times the
    experts a token uses) + ``2 n_heads pos`` (attention scores and pattern), at the model's element size (the logits
    at 4 bytes).
    """
    cfg = model.cfg
    tokens = corrupted_tokens.numel()
    pos = corrupted_tokens.shape[-1]
    d_mlp = (getattr(cfg, "d_mlp", None) or 4 * cfg.d_model) * (getattr(cfg, "experts_per_token", None) or 1)
    dtype = getattr(cfg, "dtype", None)
    size = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4
    inner = 4 * cfg.d_model + 2 * d_mlp + 2 * cfg.n_heads * pos
    return tokens * (4 * cfg.d_vocab + size * inner)


def default_batch_size(model: Any, corrupted_tokens: Tensor, budget: Optional[int] = None) -> int:
    """Patched copies per forward for ``batch_size=None``: ``budget`` (default :data:`MEMORY_BUDGET`) divided by
    :func:`copy_bytes`, at least 1."""
    return max(1, (MEMORY_BUDGET if budget is None else budget) // copy_bytes(model, corrupted_tokens))


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
    batch_size: Optional[int] = None,
) -> Union[Tensor, tuple[Tensor, Any]]:
    """Patch ``activation_name`` from ``clean_cache`` into a run on ``corrupted_tokens``, once per index, and
    return ``patching_metric(logits)`` for each.

    ``corrupted_tokens`` may also be text (tokenized with ``model.to_tokens``). The indices are every combination
    over ``index_axis_names`` (``"layer"`` first, then ``"pos"``,
    ``"head"``/``"head_index"``, ``"dest_pos"``, ``"src_pos"``; the result has one dimension per axis), or the
    rows of ``index_df`` (the result is flat, one value per row). ``patch_setter(corrupted, index, clean)``
    writes the clean slice into the corrupted activation.

    ``batch_size`` patches run in one forward: the corrupted batch repeated ``batch_size`` times along the batch
    dimension (with it the attention mask and positions the model derives from the tokens), each copy patched at
    its own index by ``patch_setter`` on that copy's slice, and ``patching_metric`` called on each copy's logits
    (the shape of one corrupted run's logits, as in TransformerLens). The values equal the one-at-a-time sweep's
    (``batch_size=1``) up to floating-point reordering. ``None`` (the default) fits the copies to
    :data:`MEMORY_BUDGET` (see :func:`default_batch_size`). The sweep runs without gradients.
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
    _require_points(model, activation_name, rows)
    if batch_size is None:
        batch_size = default_batch_size(model, corrupted_tokens)
    elif int(batch_size) < 1:
        raise ValueError(f"batch_size must be a positive number of patches per forward, not {batch_size}")
    batch_size = max(1, min(int(batch_size), len(rows)))
    device = model.cfg.device
    values: list[float] = []
    with torch.no_grad(), tqdm(total=len(rows), desc=f"patching {activation_name}") as bar:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            values.extend(
                _patched_run(
                    model, corrupted_tokens, clean_cache, patching_metric, patch_setter, activation_name, chunk
                )
            )
            bar.update(len(chunk))
    result = torch.tensor(values, device=device)
    if not flat:
        result = result.reshape(shape)
    if not return_index_df:
        return result
    if index_df is None:
        index_df = make_df_from_ranges(shape, index_axis_names)  # type: ignore[arg-type]
    return result, index_df


def _require_points(model: Any, activation_name: str, rows: list[list[int]]) -> None:
    """Refuse a sweep over blocks without the patched point (a hybrid's linear-attention or state-space blocks have
    no ``attn.*`` point: no heads, queries, keys, values or pattern), naming them and the blocks that have it."""
    names = set(model.hook_names)
    layers = range(model.cfg.n_layers)
    missing = sorted({row[0] for row in rows if get_act_name(activation_name, layer=row[0]) not in names})
    if missing:
        present = [i for i in layers if get_act_name(activation_name, layer=i) in names]
        raise ValueError(
            f"blocks {missing} have no {get_act_name(activation_name, layer=missing[0]).split('.', 2)[-1]} point "
            f"(a block whose token mixer is not softmax attention has no attn.* point), so {activation_name!r} "
            f"cannot be patched there; patch the blocks that have it with index_df rows of blocks {present}"
        )


def _patched_run(
    model: Any,
    tokens: Tensor,
    clean_cache: Any,
    metric: Metric,
    setter: PatchSetter,
    activation_name: str,
    chunk: list[list[int]],
) -> list[float]:
    """One forward on ``len(chunk)`` copies of ``tokens``, copy ``j`` patched at ``chunk[j]``; each copy's metric."""
    copies = len(chunk)
    by_name: dict[str, list[tuple[int, list[int]]]] = {}
    for j, index in enumerate(chunk):
        by_name.setdefault(get_act_name(activation_name, layer=index[0]), []).append((j, index))
    if copies == 1:  # the one-at-a-time sweep, exactly as TransformerLens runs it

        def single(corrupted: Tensor, hook: Any, index: list[int], clean: Tensor) -> Tensor:
            return setter(corrupted, index, clean)

        ((name, [(_, index)]),) = by_name.items()
        hooks = [(name, partial(single, index=index, clean=clean_cache[name]))]
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks, return_type="logits")
        return [float(metric(logits).item())]

    batch = tokens.shape[0] if tokens.dim() > 1 else 1
    repeated = tokens.repeat(copies, *([1] * (tokens.dim() - 1))) if tokens.dim() > 1 else tokens.repeat(copies, 1)

    def batched(corrupted: Tensor, hook: Any, entries: list[tuple[int, list[int]]], clean: Tensor) -> Tensor:
        if corrupted.shape[0] != copies * batch:
            raise ValueError(
                f"{hook.name if hasattr(hook, 'name') else activation_name} has {corrupted.shape[0]} rows along its "
                f"first dimension, not the {copies} x {batch} of a batched sweep (its first dimension is not the "
                f"batch); pass batch_size=1"
            )
        for j, index in entries:
            part = corrupted[j * batch : (j + 1) * batch]
            patched = setter(part, index, clean)
            if patched is not part:  # a setter that returns a new tensor instead of writing in place
                corrupted[j * batch : (j + 1) * batch] = patched
        return corrupted

    hooks = [(name, partial(batched, entries=entries, clean=clean_cache[name])) for name, entries in by_name.items()]
    logits = model.run_with_hooks(repeated, fwd_hooks=hooks, return_type="logits")
    return [float(metric(logits[j * batch : (j + 1) * batch]).item()) for j in range(copies)]


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
        f"Arguments: (model, corrupted_tokens, clean_cache, patching_metric, batch_size=None); see "
        f"generic_activation_patch."
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


def _every_head_sweep(sweeps: Sequence[Callable[..., Tensor]], *args: Any, batch_size: Optional[int]) -> list[Tensor]:
    """The results of the output, query, key, value and pattern ``sweeps``, keys and values padded to the query
    heads."""
    out, q, k, v, pattern = (sweep(*args, batch_size=batch_size) for sweep in sweeps)
    return [out, q, _pad_heads(k, q), _pad_heads(v, q), pattern]


def get_act_patch_attn_head_all_pos_every(
    model: Any, corrupted_tokens: Tensor, clean_cache: Any, metric: Metric, batch_size: Optional[int] = None
) -> Tensor:
    """Every head's output, queries, keys, values and pattern, each at all positions: ``[5, n_layers, n_heads]``."""
    sweeps = (
        get_act_patch_attn_head_out_all_pos,
        get_act_patch_attn_head_q_all_pos,
        get_act_patch_attn_head_k_all_pos,
        get_act_patch_attn_head_v_all_pos,
        get_act_patch_attn_head_pattern_all_pos,
    )
    return torch.stack(_every_head_sweep(sweeps, model, corrupted_tokens, clean_cache, metric, batch_size=batch_size))


def get_act_patch_attn_head_by_pos_every(
    model: Any, corrupted_tokens: Tensor, clean_cache: Any, metric: Metric, batch_size: Optional[int] = None
) -> Tensor:
    """The same by position: ``[5, n_layers, pos, n_heads]`` (the pattern by destination position)."""
    sweeps = (
        get_act_patch_attn_head_out_by_pos,
        get_act_patch_attn_head_q_by_pos,
        get_act_patch_attn_head_k_by_pos,
        get_act_patch_attn_head_v_by_pos,
        get_act_patch_attn_head_pattern_by_pos,
    )
    *heads, pattern = _every_head_sweep(sweeps, model, corrupted_tokens, clean_cache, metric, batch_size=batch_size)
    return torch.stack([*heads, pattern.transpose(-2, -1)], dim=0)


def get_act_patch_block_every(
    model: Any, corrupted_tokens: Tensor, clean_cache: Any, metric: Metric, batch_size: Optional[int] = None
) -> Tensor:
    """The residual stream at each block's start, each attention output and each MLP output, by position:
    ``[3, n_layers, pos]``."""
    return torch.stack(
        [
            get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric, batch_size=batch_size),
            get_act_patch_attn_out(model, corrupted_tokens, clean_cache, metric, batch_size=batch_size),
            get_act_patch_mlp_out(model, corrupted_tokens, clean_cache, metric, batch_size=batch_size),
        ],
        dim=0,
    )
