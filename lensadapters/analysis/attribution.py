"""Attribution patching: every component's activation-patching effect estimated from two forwards and one backward.

Activation patching (:mod:`lensadapters.analysis.patching`) runs the model once per patched component. Attribution
patching (Nanda 2023; Syed et al. 2023) replaces each run by its first-order Taylor estimate::

    score(node) = (clean_act - corrupted_act) . d metric / d act        (the gradient taken on the corrupted run)

which estimates ``metric(corrupted run with node patched from the clean run) - metric(corrupted run)``: the value an
activation-patching sweep returns minus the corrupted run's metric. Every node of every requested hook point comes
from one forward on each input and one backward on the corrupted run. ``at="clean"`` takes the gradient on the clean
run instead (as EAP does, Hanna et al. 2024), estimating ``metric(clean run) - metric(clean run with node patched
from the corrupted run)``; the same sign means the same thing either way.

The AtP* corrections of Kramár et al. 2024 are options:

* ``qk_fix=True`` (queries and keys, per head): a query or key change acts through the attention softmax, where the
  linear estimate is worst. The new attention pattern is computed exactly (the other run's queries or keys against
  this run's keys or queries, this run's scores otherwise, one softmax per patched key position) and only the
  pattern's effect on the metric is linearized: ``sum (pattern_patched - pattern) . d metric / d pattern``. It needs
  attention scores that are ``scale * q . k`` (plus masking), which is checked on the run: softcapped or biased
  scores (Gemma 2's softcap, ALiBi) are refused with that reason, and so are query/key norms over all heads together
  (OLMo 2's), where patching one head's queries changes every head's.
* ``grad_drop=True``: the gradient is taken ``n_layers`` more times, each with the gradient flowing through one
  block's residual contributions (``hook_attn_out`` and ``hook_mlp_out``) set to zero, and the score is
  ``1 / (n_layers - 1) * sum over layers of |estimate with that layer dropped|``: a node whose effect cancels
  along different paths no longer scores near zero. Scores are then magnitudes (never negative).

Memory: the activations and gradients of the requested hook points (one gradient set per backward with
``grad_drop``), for both runs; nothing else is kept. Model parameters get no ``.grad``: the gradient is taken with
respect to the residual stream only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from lensadapters.adapters.moe import expert_tokens
from lensadapters.analysis.utils import get_act_name
from lensadapters.wiring.names import non_attention_blocks, shared_key_blocks

Tensor = torch.Tensor
Metric = Callable[[Tensor], Tensor]

__all__ = [
    "AttributionUnavailable",
    "Attribution",
    "QKFixUnavailable",
    "attribute",
    "forward_backward",
    "require_per_head_keys",
    "get_attr_patch_resid_pre",
    "get_attr_patch_resid_mid",
    "get_attr_patch_attn_out",
    "get_attr_patch_mlp_out",
    "get_attr_patch_attn_head_out_all_pos",
    "get_attr_patch_attn_head_out_by_pos",
    "get_attr_patch_attn_head_result_all_pos",
    "get_attr_patch_attn_head_q_all_pos",
    "get_attr_patch_attn_head_k_all_pos",
    "get_attr_patch_attn_head_v_all_pos",
    "get_attr_patch_attn_head_q_by_pos",
    "get_attr_patch_attn_head_k_by_pos",
    "get_attr_patch_attn_head_v_by_pos",
    "get_attr_patch_attn_head_pattern_all_pos",
    "get_attr_patch_mlp_neurons",
    "get_attr_patch_experts",
]

#: the dimensions of each kind of activation an index axis names (``layer`` is the stack over blocks)
_AXES: dict[str, dict[str, int]] = {
    "resid": {"batch": 0, "pos": 1},
    "heads": {"batch": 0, "pos": 1, "head": 2, "head_index": 2},
    "pattern": {"batch": 0, "head": 1, "head_index": 1, "dest_pos": 2, "src_pos": 3},
    "neurons": {"batch": 0, "pos": 1, "neuron": 2},
}
_HEADS = ("z", "q", "k", "v", "result", "rot_q", "rot_k")
_PATTERN = ("pattern", "attn_scores")
_NEURONS = ("pre", "post", "pre_linear")
EXPERTS = "experts"


class QKFixUnavailable(ValueError):
    """The QK fix needs attention scores that are ``scale * q . k`` (with masking); this model's are not."""


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


def require_per_head_keys(model: Any, names: Sequence[str]) -> None:
    """Refuse one head's keys (``"k"``, ``"rot_k"``) on blocks where every head shares key columns (multi-head latent
    attention's rope key, ``SeparateQKV.shared_key_columns``): the model computes them once, before the heads exist,
    so the gradient with respect to one head's copy is not a value of its backward."""
    blocks = shared_key_blocks(model) if any(n in ("k", "rot_k") for n in names) else []
    if blocks:
        raise AttributionUnavailable(
            f"blocks {blocks} share key columns across their heads (multi-head latent attention's rope key, computed "
            f"once for every head): one head's keys have no gradient of their own. Score the queries, values or "
            f"outputs per head, or the shared key itself (attn.hook_k_rope) by name"
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


@dataclass
class Attribution:
    """What :func:`attribute` measured: the hook points' values on both runs and the gradients on one of them.

    :meth:`scores` turns them into per-node estimates; ``clean_metric``/``corrupted_metric`` are the two runs'
    metric values (the estimate of a full patch is about their difference).
    """

    model: Any
    at: str
    clean: dict[str, Tensor]
    corrupted: dict[str, Tensor]
    grads: list[dict[str, Tensor]]  # one per backward: the plain gradient, or one per dropped layer
    grad_drop: bool
    clean_metric: float
    corrupted_metric: float

    @property
    def base(self) -> dict[str, Tensor]:
        """The values of the run the gradient was taken on."""
        return self.corrupted if self.at == "corrupted" else self.clean

    @property
    def other(self) -> dict[str, Tensor]:
        return self.clean if self.at == "corrupted" else self.corrupted

    def layers_of(self, name: str) -> list[int]:
        return [layer for layer in range(self.model.cfg.n_layers) if get_act_name(name, layer) in self.clean]

    def scores(
        self, activation_name: str, index_axis_names: Sequence[str] = ("layer",), qk_fix: bool = False
    ) -> Tensor:
        """Per-node estimates ``[len(layers), ...]`` over ``index_axis_names`` (``"layer"`` first; the other axes
        are summed over, as an activation-patching sweep patches them all at once): e.g. ``("layer", "head")`` for
        ``"z"`` gives one score per head (every position), ``("layer", "pos")`` for ``"resid_pre"`` one per
        residual position. ``activation_name="experts"``: ``("layer", "expert")``."""
        axes = list(index_axis_names)
        if not axes or axes[0] != "layer":
            raise ValueError(f"index_axis_names must start with 'layer', not {index_axis_names}")
        if activation_name == EXPERTS:
            return self._combine([self._experts(v) for v in range(len(self.grads))])
        layers = self.layers_of(activation_name)
        if not layers:
            raise KeyError(f"{activation_name!r} was not measured: pass it to attribute(names=...)")
        if qk_fix and activation_name in ("q", "k"):
            per_variant = [
                torch.stack([self._qk_fixed(activation_name, layer, axes[1:], v) for layer in layers])
                for v in range(len(self.grads))
            ]
            return self._combine(per_variant)
        kind = _kind(activation_name)
        dims = _AXES[kind]
        unknown = [a for a in axes[1:] if a not in dims]
        if unknown:
            raise ValueError(f"{activation_name!r} has no axes {unknown}; use {sorted(dims)}")
        keep = [dims[a] for a in axes[1:]]
        per_variant = []
        for grads in self.grads:
            rows = []
            for layer in layers:
                name = get_act_name(activation_name, layer)
                product = (self.clean[name].double() - self.corrupted[name].double()) * grads[name].double()
                rows.append(_reduce(product, keep))
            per_variant.append(torch.stack(rows))
        return self._combine(per_variant)

    def _combine(self, per_variant: list[Tensor]) -> Tensor:
        if not self.grad_drop:
            return per_variant[0]
        n = len(per_variant)  # one per layer: GD_l
        return torch.stack(per_variant).abs().sum(0) / max(n - 1, 1)

    def _experts(self, variant: int) -> Tensor:
        """Expert ``e`` of a layer: its contribution to the MLP output on each run, scattered to ``[b, p, d]``; one
        row per mixture-of-experts layer (dense layers, DeepSeek's first ones, have no experts). Shared experts
        (``MoELayout.shared``, always on) are in ``hook_mlp_out``'s score and in no routed expert's."""
        rows = []
        cfg = self.model.cfg
        for layer in range(cfg.n_layers):
            grad = self.grads[variant].get(f"blocks.{layer}.hook_mlp_out")
            if grad is None or f"blocks.{layer}.mlp.hook_expert_indices" not in self.clean:
                continue
            scores = []
            for e in range(cfg.num_experts):
                diff = torch.zeros_like(grad, dtype=torch.float64)
                for run, sign in ((self.clean, 1.0), (self.corrupted, -1.0)):
                    b, p, _ = expert_tokens(run[f"blocks.{layer}.mlp.hook_expert_indices"], e)
                    diff.index_put_((b, p), sign * run[f"blocks.{layer}.mlp.experts.{e}.hook_result"].double(), True)
                scores.append((diff * grad.double()).sum())
            rows.append(torch.stack(scores))
        return torch.stack(rows)

    # --- the QK fix ----------------------------------------------------------------------------------------

    def _qk_fixed(self, which: str, layer: int, axes: list[str], variant: int) -> Tensor:
        if axes not in (["head"], ["head_index"], ["pos", "head"], ["pos", "head_index"]):
            raise ValueError(
                f"qk_fix scores heads: index axes ('layer', 'head') or ('layer', 'pos', 'head'), not {axes}"
            )
        by_pos = axes[0] == "pos"
        base, other = self.base, self.other
        norm = base.get(f"blocks.{layer}.attn.{which}_norm.hook_scale")
        if norm is not None and norm.dim() == 3:  # [b, p, 1]: one norm over every head's queries (or keys)
            raise QKFixUnavailable(
                f"qk_fix patches one head's {'queries' if which == 'q' else 'keys'}, but layer {layer}'s {which}_norm "
                f"normalizes every head's together (patching one head changes the others'): pass qk_fix=False"
            )
        q_name, k_name = _qk_names(self.model, layer)
        q, k = base[q_name].double(), base[k_name].double()  # [b, p, h, d], [b, p, kv, d]
        scores = base[f"blocks.{layer}.attn.hook_attn_scores"].double()  # [b, h, dest, src]
        pattern = base[f"blocks.{layer}.attn.hook_pattern"].double()
        g = self.grads[variant][f"blocks.{layer}.attn.hook_pattern"].double()
        groups = q.shape[2] // k.shape[2]
        live = torch.isfinite(scores) & (scores > -1e4)
        scale = _check_scores(q, k.repeat_interleave(groups, dim=2), scores, pattern, live, layer)
        sign = 1.0 if self.at == "corrupted" else -1.0
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


def _reduce(product: Tensor, keep: list[int]) -> Tensor:
    drop = [d for d in range(product.dim()) if d not in keep]
    out = product.sum(drop) if drop else product
    order = sorted(keep)
    return out.permute([order.index(d) for d in keep]) if keep else out


def _kind(name: str) -> str:
    if name in _HEADS:
        return "heads"
    if name in _PATTERN:
        return "pattern"
    if name in _NEURONS:
        return "neurons"
    return "resid"


def _qk_names(model: Any, layer: int) -> tuple[str, str]:
    """The queries and keys the scores are computed from: after rotary embeddings (and q/k norms) where served."""
    names = []
    for which in ("q", "k"):
        rot = f"blocks.{layer}.attn.hook_rot_{which}"
        names.append(rot if rot in model.hook_dict else f"blocks.{layer}.attn.hook_{which}")
    return names[0], names[1]


def _check_scores(q: Tensor, k: Tensor, scores: Tensor, pattern: Tensor, live: Tensor, layer: int) -> Tensor:
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


def _names_for(model: Any, name: str) -> list[str]:
    found = [
        get_act_name(name, layer) for layer in range(model.cfg.n_layers) if get_act_name(name, layer) in model.hook_dict
    ]
    if not found:
        raise ValueError(f"{name!r}: no such hook point on this model (blocks.0 has {_block_names(model)})")
    return found


def _block_names(model: Any) -> list[str]:
    return [n[len("blocks.0.") :] for n in model.hook_names if n.startswith("blocks.0.")]


def attribute(
    model: Any,
    clean_tokens: Any,
    corrupted_tokens: Any,
    metric: Metric,
    names: Union[str, Sequence[str]],
    *,
    at: str = "corrupted",
    grad_drop: bool = False,
    qk_fix: bool = False,
    progress: bool = True,
) -> Attribution:
    """Run the clean and the corrupted input once each and take the metric's gradient on one of them (``at``),
    reading every block's ``names`` (TransformerLens short names: ``"resid_pre"``, ``"z"``, ``"result"``, ``"q"``,
    ``"post"``, ``"mlp_out"``..., or ``"experts"`` for each mixture-of-experts expert's contribution).

    ``metric(logits)`` returns one number (sum or mean over the batch inside it), as for activation patching.
    ``qk_fix`` reads what the QK fix needs for ``"q"`` and ``"k"``; ``grad_drop`` takes one more gradient per
    layer (see the module's documentation). Returns an :class:`Attribution`: ``.scores(name, axes)``.
    """
    if at not in ("corrupted", "clean"):
        raise ValueError(f"at must be 'corrupted' (Nanda's attribution patching) or 'clean', not {at!r}")
    names = [names] if isinstance(names, str) else list(names)
    require_per_head_keys(model, names)
    clean_tokens, corrupted_tokens = _tokens(model, clean_tokens), _tokens(model, corrupted_tokens)
    cfg = model.cfg
    values: list[str] = []
    grads: list[str] = []
    for name in names:
        if name == EXPERTS:
            if not getattr(cfg, "num_experts", None):
                raise ValueError("'experts' needs a mixture-of-experts model (this one has no experts)")
            for layer in range(cfg.n_layers):
                if f"blocks.{layer}.mlp.hook_expert_indices" not in model.hook_dict:
                    continue
                if getattr(model.block_layouts[layer], "ln2_post", None) is not None:
                    raise ValueError(
                        "'experts' adds each expert's contribution to hook_mlp_out's gradient, but this model "
                        "normalizes the MLP output before the residual (ln2_post)"
                    )
                values.append(f"blocks.{layer}.mlp.hook_expert_indices")
                values += [f"blocks.{layer}.mlp.experts.{e}.hook_result" for e in range(cfg.num_experts)]
                grads.append(f"blocks.{layer}.hook_mlp_out")
            continue
        found = _names_for(model, name)
        values += found
        grads += found
        if qk_fix and name in ("q", "k"):
            for layer in range(cfg.n_layers):
                values += [*_qk_names(model, layer), f"blocks.{layer}.attn.hook_attn_scores"]
                norm = f"blocks.{layer}.attn.{name}_norm.hook_scale"
                values += [norm] if norm in model.hook_dict else []
                values.append(f"blocks.{layer}.attn.hook_pattern")
                grads.append(f"blocks.{layer}.attn.hook_pattern")
    values, grads = list(dict.fromkeys(values)), list(dict.fromkeys(grads))
    drops: list[Optional[int]] = list(range(cfg.n_layers)) if grad_drop else [None]
    with tqdm(total=1 + len(drops), desc="attribution patching", disable=not progress) as bar:
        with torch.no_grad():
            other_tokens = corrupted_tokens if at == "clean" else clean_tokens
            other_logits, other_cache = model.run_with_cache(other_tokens, names_filter=values, return_type="logits")
            other_metric = float(_scalar(metric(other_logits)))
        bar.update(1)
        base_tokens = clean_tokens if at == "clean" else corrupted_tokens
        base_metric, base_values, per_drop = forward_backward(model, base_tokens, metric, values, grads, drops)
        bar.update(len(drops))
    other_values = {n: other_cache[n] for n in values}
    clean, corrupted = (base_values, other_values) if at == "clean" else (other_values, base_values)
    clean_metric, corrupted_metric = (base_metric, other_metric) if at == "clean" else (other_metric, base_metric)
    return Attribution(model, at, clean, corrupted, per_drop, grad_drop, clean_metric, corrupted_metric)


def _sweep(activation: str, axes: tuple[str, ...], doc: str, fixable: bool = False) -> Any:
    def sweep(
        model: Any,
        clean_tokens: Any,
        corrupted_tokens: Any,
        metric: Metric,
        *,
        at: str = "corrupted",
        grad_drop: bool = False,
        qk_fix: bool = False,
        progress: bool = True,
    ) -> Tensor:
        if qk_fix and not fixable:
            raise ValueError(f"qk_fix applies to queries and keys, not {activation!r}")
        result = attribute(
            model,
            clean_tokens,
            corrupted_tokens,
            metric,
            [activation],
            at=at,
            grad_drop=grad_drop,
            qk_fix=qk_fix,
            progress=progress,
        )
        return result.scores(activation, axes, qk_fix=qk_fix)

    sweep.__doc__ = (
        f"{doc} Returns a tensor of shape [{', '.join(axes)}]: the attribution-patching estimate of what the "
        f"matching ``get_act_patch_*`` sweep returns minus the corrupted run's metric.\n\nArguments: (model, "
        f"clean_tokens, corrupted_tokens, metric, at='corrupted', grad_drop=False"
        + (", qk_fix=False" if fixable else "")
        + ", progress=True); see attribute."
    )
    return sweep


get_attr_patch_resid_pre = _sweep("resid_pre", ("layer", "pos"), "The residual stream at each block's start.")
get_attr_patch_resid_mid = _sweep("resid_mid", ("layer", "pos"), "The residual stream between attention and MLP.")
get_attr_patch_attn_out = _sweep("attn_out", ("layer", "pos"), "Each attention layer's output, by position.")
get_attr_patch_mlp_out = _sweep("mlp_out", ("layer", "pos"), "Each MLP layer's output, by position.")
get_attr_patch_attn_head_out_all_pos = _sweep("z", ("layer", "head"), "Each head's output (hook_z), every position.")
get_attr_patch_attn_head_out_by_pos = _sweep("z", ("layer", "pos", "head"), "Each head's output (hook_z), by position.")
get_attr_patch_attn_head_result_all_pos = _sweep(
    "result", ("layer", "head"), "Each head's contribution to the residual (hook_result), every position."
)
get_attr_patch_attn_head_q_all_pos = _sweep("q", ("layer", "head"), "Each head's queries.", fixable=True)
get_attr_patch_attn_head_k_all_pos = _sweep(
    "k", ("layer", "head"), "Each key head's keys (n_key_value_heads under GQA).", fixable=True
)
get_attr_patch_attn_head_v_all_pos = _sweep("v", ("layer", "head"), "Each value head's values.")
get_attr_patch_attn_head_q_by_pos = _sweep("q", ("layer", "pos", "head"), "Each head's queries, by position.", True)
get_attr_patch_attn_head_k_by_pos = _sweep("k", ("layer", "pos", "head"), "Each key head's keys, by position.", True)
get_attr_patch_attn_head_v_by_pos = _sweep("v", ("layer", "pos", "head"), "Each value head's values, by position.")
get_attr_patch_attn_head_pattern_all_pos = _sweep("pattern", ("layer", "head_index"), "Each head's whole pattern.")
get_attr_patch_mlp_neurons = _sweep(
    "post", ("layer", "neuron"), "Each MLP neuron (mlp.hook_post), every position: [layer, d_mlp]."
)
get_attr_patch_experts = _sweep(
    EXPERTS,
    ("layer", "expert"),
    "Each routed expert's contribution to its layer's MLP output (one row per mixture-of-experts layer; shared "
    "experts, always on, are in the MLP output's score only).",
)
