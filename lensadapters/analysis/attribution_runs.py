"""The runs gradient attribution is made of: :func:`forward_backward` (one forward reading hook points, one backward
per GradDrop variant reading their gradients, from the residual stream so no parameter gets a ``.grad``), the
refusals of structures whose gradients are not verified (:class:`AttributionUnavailable`), and the checks of the
inputs and the metric. Shared by node attribution (:mod:`.attribution`) and edge attribution
(:mod:`.edge_attribution`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from lensadapters.wiring.names import non_attention_blocks

Tensor = torch.Tensor
Metric = Callable[[Tensor], Tensor]


class AttributionUnavailable(ValueError):
    """Gradient attribution is not verified for this model's structure (named in the message)."""


def require_softmax_attention(model: Any) -> None:
    """Refuse a model with blocks whose token mixer is not softmax attention (hybrid linear-attention or state-space
    layers): their gradients are not verified against patched runs yet, and they have no attention points."""
    mixers = non_attention_blocks(model)
    if mixers:
        raise AttributionUnavailable(
            f"blocks {mixers} of this model mix tokens with something other than softmax attention (linear attention "
            f"or a state-space layer): attribution patching and EAP are not verified there yet. Use activation "
            f"patching (lensadapters.patching), which runs the model itself"
        )


def _tokens(model: Any, tokens: Any) -> Tensor:
    if isinstance(tokens, (str, list)):
        return model.to_tokens(tokens)
    return tokens


def _scalar(value: Tensor) -> Tensor:
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise ValueError(
            f"the metric must return one number (a 0-d tensor), not {getattr(value, 'shape', type(value).__name__)}: "
            f"reduce over the batch inside it (sum or mean)"
        )
    return value.reshape(())


def forward_backward(
    model: Any,
    tokens: Tensor,
    metric: Metric,
    read: Sequence[str],
    grads: Sequence[str],
    drops: Sequence[Optional[int]] = (None,),
    embed: Optional[Callable[[Tensor], Tensor]] = None,
    edits: Sequence[tuple[str, Callable[..., Any]]] = (),
) -> tuple[float, dict[str, Tensor], list[dict[str, Tensor]]]:
    """One forward of ``tokens`` reading the values at ``read``, and one backward of ``metric(logits)`` per entry of
    ``drops``, reading the gradients at ``grads``: ``(metric, values, [gradients per backward])``.

    ``drops``: ``None`` is the plain gradient, a layer index the gradient with what flows through that block's
    ``hook_attn_out`` and ``hook_mlp_out`` set to zero (GradDrop). The backward starts at the residual stream
    (``blocks.0.hook_resid_pre`` is made a leaf), so no parameter gets a ``.grad``; ``embed`` maps that residual
    first (EAP-IG's interpolated inputs). ``edits``: more forward hooks (run before the readers).
    """
    require_softmax_attention(model)
    values: dict[str, Tensor] = {}
    state: dict[str, Any] = {"grads": {}, "drop": None}
    leaf: list[Tensor] = []

    def make_leaf(x: Tensor, hook: Any) -> Tensor:
        x = x.detach()
        if embed is not None:
            x = embed(x)
        x = x.detach().requires_grad_(True)
        leaf.append(x)
        return x

    def read_value(x: Tensor, hook: Any) -> None:
        values[hook.name] = x.detach()

    def read_grad(g: Tensor, hook: Any) -> None:
        state["grads"][hook.name] = g.detach()

    def dropper(layer: int) -> Callable[..., Optional[Tensor]]:
        def drop(g: Tensor, hook: Any) -> Optional[Tensor]:
            return torch.zeros_like(g) if state["drop"] == layer else None

        return drop

    n_layers = model.cfg.n_layers
    drop_hooks = [
        (f"blocks.{layer}.hook_{which}", dropper(layer))
        for layer in sorted({d for d in drops if d is not None})
        for which in ("attn_out", "mlp_out")
        if f"blocks.{layer}.hook_{which}" in model.hook_dict
    ]
    if any(d is not None and not 0 <= d < n_layers for d in drops):
        raise ValueError(f"layers to drop must be in [0, {n_layers})")
    with torch.enable_grad(), model.hooks([("blocks.0.hook_resid_pre", make_leaf), *edits], drop_hooks):
        with model.hooks([(n, read_value) for n in read], [(n, read_grad) for n in grads], _readonly=True):
            logits = model(tokens, return_type="logits")
            value = _scalar(metric(logits))
            per_drop: list[dict[str, Tensor]] = []
            for i, drop in enumerate(drops):
                state["grads"], state["drop"] = {}, drop
                torch.autograd.grad(value, leaf[:1], retain_graph=i < len(drops) - 1, allow_unused=True)
                per_drop.append(state["grads"])
    return float(value.detach()), values, per_drop
