"""The independent reference the MoE contract and MoE plugins' tests check against: the output of a mixture of
experts computed in float64 from the read weights (``W_gate``, ``W_in``, ``W_out`` of each expert) and the routing
the family describes, plus checks built on it."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from lensadapters.adapters.moe import MoELayout, router_bias
from lensadapters.adapters.moe.experts import unwrapped
from lensadapters.testing.contract_support import assert_close
from lensadapters.wiring.weights import mlp_weights

Tensor = torch.Tensor


def activation(name: str) -> Any:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def expert_glu(hm: Any, layer: int) -> Any:
    """What expert ``e`` of block ``layer`` computes from its gate and up projections: the layout's ``glu`` (with
    the live experts module) or ``act(gate) * up``."""
    layout = hm.mlp_layouts[layer]
    custom = getattr(layout.experts, "glu", None)
    if custom is not None:
        module = unwrapped(hm.wiring, hm.block_modules[layer].get_submodule(layout.experts.module))
        return lambda gate, up: custom(module, gate, up)
    act = activation(hm.cfg.act_fn)
    return lambda gate, up: act(gate) * up


def moe_reference(hm: Any, layer: int, x: Tensor, weights: Tensor, index: Tensor) -> Tensor:
    """The MoE output of block ``layer`` for MLP inputs ``x`` ``[..., d_model]`` routed to ``index`` ``[..., k]`` with
    ``weights``, computed from the read weights and biases (``W_gate``, ``W_in``, ``W_out``, ``b_*`` of each expert)
    in float64."""
    (W_in, b_in), (W_gate, b_gate), (W_out, b_out) = (
        tuple(t.double() for t in mlp_weights(hm.wiring, layer, role)) for role in ("in", "gate", "out")
    )
    glu = expert_glu(hm, layer)
    xs = x.double()
    scaled = getattr(hm.mlp_layouts[layer].experts, "scaled_input", False)  # the weights scale the experts' input
    xk = xs[..., None, :] * weights.double()[..., None] if scaled else xs[..., None, :].expand(*index.shape, -1)
    gate = torch.einsum("...kd,...kdm->...km", xk, W_gate[index]) + b_gate[index]
    up = torch.einsum("...kd,...kdm->...km", xk, W_in[index]) + b_in[index]
    out = torch.einsum("...km,...kmd->...kd", glu(gate, up), W_out[index]) + b_out[index]
    if not scaled:
        out = out * weights.double()[..., None]
    return out.sum(-2) + shared_output(hm, layer, x)


def shared_output(hm: Any, layer: int, x: Tensor) -> Any:
    """What block ``layer``'s MoE module adds to its routed experts (``MoELayout.shared``, run on the MLP inputs
    ``x`` as the model runs it, in float64, times the sigmoid of ``MoELayout.shared_gate``'s logit where declared),
    or 0."""
    shared = hm.mlp_layouts[layer].shared
    if shared is None:
        return 0
    block = hm.block_modules[layer]
    module = block.get_submodule(shared)
    x = x.to(next(module.parameters()).dtype)
    with torch.no_grad():
        out = module(x).double()
        gate = hm.mlp_layouts[layer].shared_gate  # MoELayout.shared_gate: times the sigmoid of its logit
        return out if gate is None else torch.sigmoid(block.get_submodule(gate)(x).double()) * out


def selection_bias(hm: Any, layer: int) -> Optional[Tensor]:
    """The router attribute block ``layer``'s routing adds to the probabilities for choosing (``None`` without)."""
    layout = hm.mlp_layouts[layer]
    name = layout.routing.selection_bias
    return None if name is None else getattr(hm.block_modules[layer].get_submodule(layout.router), name)


def router_bias_or_zero(hm: Any, layer: int) -> Any:
    """The router's bias of block ``layer`` (0 where it has none)."""
    bias = router_bias(hm.wiring, layer)
    return 0 if bias is None else bias


def mlp_input(hm: Any, cache: Any, layer: int) -> Tensor:
    """What the MLP of ``layer`` reads: ``ln2.hook_normalized`` times the norm's weight."""
    return mlp_input_of(hm, cache, layer, "ln2")


def mlp_points(name: str) -> bool:
    """A ``names_filter`` for what :func:`assert_moe_reference` reads: every MLP point, ``ln2``'s output and
    ``hook_mlp_out``."""
    return ".mlp." in name or name.endswith(("ln2.hook_normalized", "hook_mlp_out"))


def assert_moe_reference(hm: Any, cache: Any, layers: Iterable[int], what: str, atol: float = 1e-4) -> None:
    """Each of ``layers``' ``hook_mlp_out`` is :func:`moe_reference` of its cached MLP input and routing (``cache``
    holds :func:`mlp_points`)."""
    for layer in layers:
        pre = f"blocks.{layer}.mlp."
        index = cache[pre + "hook_expert_indices"]
        expected = moe_reference(hm, layer, mlp_input(hm, cache, layer), cache[pre + "hook_routing_weights"], index)
        assert_close(cache["mlp_out", layer], expected, f"layer {layer}: {what}", atol=atol)


def wrap_adapted_experts(peft_model: Any, ids: Tensor, registry: Any) -> tuple[Any, Tensor]:
    """Wrap a PEFT model with LoRA on its experts and read every MLP point: the logits stay bitwise and each
    layer's ``hook_mlp_out`` is the reference MoE computed from the adapted expert weights. Returns the wrapper and
    the model's logits."""
    from lensadapters.api.hooked_model import HookedModel

    with torch.no_grad():
        reference = peft_model(ids).logits
        hm = HookedModel.wrap(peft_model, registry=registry)
        logits, cache = hm.run_with_cache(ids, names_filter=mlp_points)
        assert torch.equal(logits, reference), "reading the adapted experts changed the output"
        assert_moe_reference(hm, cache, range(hm.cfg.n_layers), "adapted experts")
    return hm, reference


def route(layout: MoELayout, logits: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Reference routing: softmax over every expert (or a sigmoid of each), top-k, renormalized when the family does;
    or (routers that select first) the top-k logits, the softmax over them (or the sigmoid of each), scattered over
    the experts. ``bias``:
    the router's selection bias (:func:`selection_bias`)."""
    if layout.routing.order in ("topk_softmax", "topk_sigmoid"):
        values, index = torch.topk(logits.double(), layout.routing.top_k, dim=-1)
        top = torch.softmax(values, dim=-1) if layout.routing.order == "topk_softmax" else torch.sigmoid(values)
        return torch.zeros_like(logits, dtype=torch.float64).scatter(-1, index, top), top, index
    if layout.routing.probabilities == "sigmoid":
        probs = torch.sigmoid(logits.double())
    else:
        probs = torch.softmax(logits.double(), dim=-1)
    top, index = select(layout, probs, bias)
    return probs, top, index


def select(layout: MoELayout, probs: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Reference selection from the probabilities of every expert: ``(top_k_weights, top_k_index)``, the top-k
    (of the probabilities plus the selection bias, within the best groups where the family groups its experts),
    renormalized when the family does, scaled by its factor."""
    r = layout.routing
    probs = probs.double()
    if r.groups is None and bias is None:
        top, index = torch.topk(probs, r.top_k, dim=-1)
    else:
        choice = probs if bias is None else probs + bias.double()
        if r.groups is not None:
            n_group, keep = r.groups
            grouped = choice.unflatten(-1, (n_group, -1))
            score = grouped.topk(2, dim=-1).values.sum(-1) if r.group_score == "top2_sum" else grouped.amax(-1)
            kept = torch.zeros_like(score).scatter(-1, score.topk(keep, dim=-1, sorted=False).indices, 1.0)
            dropped = kept.repeat_interleave(r.n_experts // n_group, dim=-1) == 0
            choice = choice.masked_fill(dropped, r.masked_score)
        index = choice.topk(r.top_k, dim=-1, sorted=False).indices
        top = probs.gather(-1, index)
    if r.normalize:
        top = top / (top.sum(-1, keepdim=True) + r.normalize_eps)
    return top * r.scale, index


def mlp_input_of(hm: Any, cache: Any, layer: Optional[int], norm: str) -> Tensor:
    """The output of a norm (``ln1``/``ln2`` of ``layer``, or ``ln_final``): ``hook_normalized`` times its weight."""
    prefix = "ln_final" if layer is None else f"blocks.{layer}.{norm}"
    module = hm.norm_module(prefix)
    spec = hm.norm_spec(module)
    normalized = cache[f"{prefix}.hook_normalized"]
    return normalized if spec.kind == "LN" or spec.weight is None else normalized * (spec.weight + spec.weight_offset)
