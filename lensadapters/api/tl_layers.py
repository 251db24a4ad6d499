"""Running a forward from or to a block: ``start_at_layer`` (the given residual stream enters at a block, the
blocks before it silenced) and ``stop_at_layer`` (the residual stream at a block's input is captured and the forward
ends there), and ``return_type=None`` (the unembedding does not run). Used by :func:`.tl_call.forward`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

import torch

from lensadapters.hooks.sites import first_input, first_output, replace_first_input, replace_first_output

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.analysis.model import HookedModelLike

Tensor = torch.Tensor


class Stop(Exception):
    """Raised inside the model to end a forward at ``stop_at_layer`` (caught by the caller, never seen by users)."""


@contextlib.contextmanager
def silenced_before(hm: "HookedModelLike", layer: int) -> Iterator[None]:
    """Hooks of every point that fires before block ``layer`` (block ``n_layers``: after the last block) do not
    run: those blocks only carry placeholder input when a forward starts at ``layer``."""
    names = hm.hook_names
    boundary = next((i for i, n in enumerate(names) if n.startswith(f"blocks.{layer}.")), None)
    if boundary is None:  # after the last block: every point up to the last block's
        last = hm.cfg.n_layers - 1
        boundary = max((i for i, n in enumerate(names) if n.startswith(f"blocks.{last}.")), default=-1) + 1
    saved = []
    for name in names[:boundary]:
        point = hm.point(name)
        if point.fwd_hooks or point.bwd_hooks:
            saved.append((point, point.fwd_hooks, point.bwd_hooks))
            point.fwd_hooks, point.bwd_hooks = [], []
    try:
        yield
    finally:
        for point, fwd, bwd in saved:
            point.fwd_hooks, point.bwd_hooks = fwd, bwd


def start_tokens(hm: "HookedModelLike", first: int, tokens: Optional[Tensor], batch: int, pos: int) -> Tensor:
    """The token ids a run from the residual at block ``first`` gives the model. The blocks before ``first`` run
    with their hook points silenced and the residual replaces block ``first``'s input, so placeholders do where
    the residual stream is all the blocks from ``first`` on read. Where they also read what the model computes
    from the token ids (``ModelLayout.side_inputs``) or keys and values of a block before ``first``
    (``kv_from``), the run needs the token ids the residual was computed from (``tokens=``): it is then the
    model's run on them with block ``first``'s ``hook_resid_pre`` replaced by the residual."""
    n = hm.cfg.n_layers
    needs = [f"blocks.L.{name}" for name in hm.layout.side_inputs] if first < n else []
    needs += [
        f"block {i} attends with the keys and values of block {qkv.kv_from}"
        for i, qkv in enumerate(hm.wiring.qkv_layouts)
        if i >= first and getattr(qkv, "kv_from", None) is not None and qkv.kv_from < first
    ]
    if not needs:
        return torch.zeros(batch, pos, dtype=torch.long, device=hm.device)  # placeholders: replaced at `first`
    what = "; ".join(needs)
    if tokens is None:
        raise ValueError(
            f"from block {first} on, this model's blocks read more than the residual stream ({what}), which it "
            f"computes from the token ids: a residual alone does not determine the run; pass tokens= (the "
            f"[batch, pos] token ids the residual was computed from) with start_at_layer"
        )
    if not isinstance(tokens, Tensor) or tuple(tokens.shape) != (batch, pos) or tokens.is_floating_point():
        raise ValueError(
            f"tokens= must be the [batch, pos] = [{batch}, {pos}] token ids the residual was computed from (the "
            f"blocks read {what}), not {type(tokens).__name__} of shape {tuple(getattr(tokens, 'shape', ()))}"
        )
    return tokens.to(hm.device)


@contextlib.contextmanager
def _at_block(hm: "HookedModelLike", layer: int, pre: Callable[..., Any], post: Callable[..., Any]) -> Iterator[None]:
    """``pre`` as block ``layer``'s first forward pre-hook (before the block's own hook points), or ``post`` as a
    forward hook of the last block for ``layer == n_layers`` (after its own hooks), for the duration."""
    n = hm.cfg.n_layers
    if layer < n:
        handle = hm.block_modules[layer].register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    else:
        handle = hm.block_modules[n - 1].register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()


def _embed_site(hm: "HookedModelLike", layer: int) -> Any:
    """The site serving ``hook_embed`` at block 0's input (see ``Wiring.embed_at_first_block``), for ``layer == 0``."""
    return hm.wiring.embed_at_first_block() if layer == 0 else None


def inject(hm: "HookedModelLike", layer: int, residual: Tensor) -> ContextManager[None]:
    """The residual stream enters at block ``layer`` (after the last block when ``layer == n_layers``); hook_resid_pre
    sees the given residual."""
    embed_site = _embed_site(hm, layer)

    def pre(module: Any, args: tuple, kwargs: dict) -> Any:
        if embed_site is not None:  # hook_embed served at block 0's input: the given residual is no embedding
            embed_site.skip()
        value = first_input(args, kwargs)
        return replace_first_input(args, kwargs, _conform(residual, value, "start_at_layer"))

    def post(module: Any, args: tuple, output: Any) -> Any:
        return replace_first_output(output, _conform(residual, first_output(output), "start_at_layer"))

    return _at_block(hm, layer, pre, post)


def capture(hm: "HookedModelLike", layer: int, captured: list) -> ContextManager[None]:
    """Record the residual stream at the input of block ``layer`` (the model's output stream for
    ``n_layers``, after the last block's own hooks such as hook_resid_post) and end the forward there; none of
    block ``layer``'s hook points fires."""
    # where hook_embed is served at the first block's input (a model scaling its embeddings in its own forward),
    # stopping at block 0 serves it first: it fires and its edit is in the result, and no other hook of block 0 runs
    embed_site = _embed_site(hm, layer)

    def pre(module: Any, args: tuple, kwargs: dict) -> None:
        served = None if embed_site is None else embed_site.serve(module, args, kwargs)
        captured.append(first_input(*served) if served is not None else first_input(args, kwargs))
        raise Stop()

    def post(module: Any, args: tuple, output: Any) -> None:
        captured.append(first_output(output))
        raise Stop()

    return _at_block(hm, layer, pre, post)


@contextlib.contextmanager
def skip_unembed(hm: "HookedModelLike") -> Iterator[None]:
    def pre(module: Any, args: tuple) -> None:
        raise Stop()

    handle = hm.hf_model.get_submodule(hm.layout.unembed).register_forward_pre_hook(pre, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def _conform(residual: Tensor, like: Tensor, what: str) -> Tensor:
    if tuple(residual.shape) != tuple(like.shape):
        raise ValueError(
            f"{what}: the residual stream has shape {tuple(residual.shape)}, the model's is "
            f"{tuple(like.shape)} at that point"
        )
    return residual.to(dtype=like.dtype, device=like.device)
