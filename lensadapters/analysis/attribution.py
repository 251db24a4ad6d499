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

The forward and backward runs are :mod:`.attribution_runs`, the QK fix :mod:`.qk_fix`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from lensadapters.adapters.moe import expert_tokens
from lensadapters.analysis.attribution_runs import (  # noqa: F401  (re-exported: this module's public names)
    AttributionUnavailable,
    Metric,
    _scalar,
    _tokens,
    forward_backward,
    require_softmax_attention,
)
from lensadapters.analysis.qk_fix import QKFixUnavailable, qk_fixed, qk_names
from lensadapters.analysis.utils import get_act_name

Tensor = torch.Tensor

__all__ = [
    "AttributionUnavailable",
    "Attribution",
    "QKFixUnavailable",
    "attribute",
    "forward_backward",
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
                torch.stack([qk_fixed(self, activation_name, layer, axes[1:], v) for layer in layers])
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
                values += [*qk_names(model, layer), f"blocks.{layer}.attn.hook_attn_scores"]
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
