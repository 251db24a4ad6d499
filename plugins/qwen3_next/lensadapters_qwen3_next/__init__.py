"""Qwen3-Next (``model_type`` ``qwen3_next``: ``Qwen3NextForCausalLM``, ``Qwen3NextModel``) for lensadapters, on
transformers 4.57 and 5.

A hybrid decoder: each layer's token mixer is either a gated full attention (``layer_types[i] ==
"full_attention"``) or a gated DeltaNet, a linear attention with a recurrent state (``"linear_attention"``), whose
input projections are fused (``in_proj_qkvz``, ``in_proj_ba``, grouped per key head); the MLP is a mixture of
experts with a gated shared expert (a SwiGLU in the layers ``mlp_only_layers`` and ``decoder_sparse_step`` make
dense, and in every layer of a model without experts). Norms are ``x / rms * (1 + w)``.

* **Every layer**: ``hook_resid_pre``, ``ln1.*``, ``hook_attn_out`` (the mixer's output, whichever kind),
  ``hook_resid_mid``, ``hook_mlp_in``, ``ln2.*``, the MLP's points, ``hook_mlp_out``, ``hook_resid_post``.
* **Full-attention layers**: ``attn.hook_q``/``hook_k``/``hook_v``, the per-head ``attn.q_norm.*``/``k_norm.*``,
  ``hook_rot_q``/``hook_rot_k`` (partial rotary: the first ``rotary_dim`` features of a head rotate), scores,
  pattern, ``hook_z``, ``hook_result``; GQA. ``q_proj`` computes, per head, the query and an output gate:
  ``attn.hook_gate`` ``[b, p, h, d_head]`` is that gate's logits, and ``attn.hook_z`` is what ``o_proj`` reads,
  ``(pattern @ v) * sigmoid(gate)``, so that ``hook_result`` is ``hook_z @ W_O`` per head as in TransformerLens.
* **Linear-attention layers**: the core's gated DeltaNet points (:mod:`lensadapters.adapters.gated_deltanet`, with
  :data:`~lensadapters.plugin_api.FUSED_PER_KEY_HEAD`): ``linear_attn.hook_qkv`` ``[b, p, 2*hk*dk + hv*dv]`` (the
  ``q``, ``k``, ``v`` columns of ``in_proj_qkvz``'s output regrouped per role, ``[q | k | v]``, the convolution's
  input as the model regroups it), ``hook_z`` ``[b, p, hv, dv]`` (its ``z`` columns per value head), ``hook_b``/
  ``hook_a`` ``[b, p, hv]`` (``in_proj_ba``'s columns per value head), ``hook_conv``, ``hook_q``/``hook_k``/
  ``hook_v``, ``hook_beta``, ``hook_decay``, ``hook_recurrent``, ``hook_gated``; no ``attn.*`` point. An edit of
  ``hook_qkv``/``hook_z``/``hook_b``/``hook_a`` is what the model continues with: the same as that edit made in the
  fused projection's output.
* **MoE layers**: the core's router and expert points, and the shared expert's: ``mlp.shared_expert.hook_gate``,
  ``hook_pre`` (up), ``hook_post`` ``[b, p, d_shared]``, ``hook_result`` ``[b, p, d_model]`` (before its gate), and
  ``mlp.hook_shared_gate`` ``[b, p, 1]`` (the gate's logit; the shared expert adds ``sigmoid`` of it times its
  result).

On transformers 4.57 the experts are a ``ModuleList`` and the core recomputes a hooked expert's layer at the MoE
module's output: the layout declares the shared expert and its gate (``MoELayout.shared``/``shared_gate``), so that
the recomputation adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` as the model does (edits of the shared
expert's points included).

Refused at wrap time: custom modeling code, rope types other than the default one, layer types other than these.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import torch
from torch import nn

from lensadapters import Architecture, BlockLayout, MLPLayout, UnsupportedModelError, hf, hookimpl
from lensadapters.moe import MoELayout, Routing, stored_moe_layout
from lensadapters.plugin_api import (
    FUSED_PER_KEY_HEAD,
    Hooked,
    gated_deltanet_paths,
    gated_deltanet_site,
    gated_query_weight,
    gated_query_weights,
    query_gate_site,
    shared_expert_sites,
)
from lensadapters.plugin_api import (
    WeightUnavailableError as WeightUnavailableError,  # re-exported: the W_Q/b_Q refusal's type
)

Tensor = torch.Tensor

__version__ = "0.1.0"
FAMILY = hf.DecoderFamily(
    "Qwen3Next",
    model_type="qwen3_next",
    packages=("qwen3_next",),
    norms=("Qwen3NextRMSNorm",),
    norm_weight_offset=1.0,
    qk_norms=hf.qk_norms("bphd"),  # of the full-attention layers
    mlp=None,
    partial_rotary=True,
)
ARCH = FAMILY.architecture(
    "Qwen3-Next (Qwen3NextForCausalLM, Qwen3NextModel): gated DeltaNet linear-attention layers with fused "
    "projections and gated full-attention layers, experts with a shared expert (or SwiGLU)",
    transformers=">=4.57,<6",
)
FULL, LINEAR = "full_attention", "linear_attention"
PROJECTIONS = FUSED_PER_KEY_HEAD
_SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")


def sparse_layers(config: Any) -> list[bool]:
    """Which layers the config makes mixtures of experts (transformers' rule: not in ``mlp_only_layers``, at least
    one expert, and ``(i + 1) % decoder_sparse_step == 0``)."""
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i not in only and config.num_experts > 0 and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]


def is_moe(config: Any) -> bool:
    return any(sparse_layers(config))


def layer_types(config: Any) -> list[str]:
    return list(config.layer_types[: config.num_hidden_layers])


def _mixer_paths(kind: str) -> tuple[str, ...]:
    if kind == FULL:
        return (*FAMILY.qkv, FAMILY.block.o_proj, *(n.module for n in FAMILY.qk_norms or ()))
    return tuple(f"linear_attn.{m}" for m in gated_deltanet_paths(PROJECTIONS))


def _mlp_paths(sparse: bool) -> tuple[str, ...]:
    if sparse:
        return _SHARED + ("mlp.gate", "mlp.experts", "mlp.shared_expert_gate")
    return tuple(p for p in (hf.SWIGLU_MLP.pre, hf.SWIGLU_MLP.pre_linear, hf.SWIGLU_MLP.out) if p is not None)


def config_fields(model: Any) -> dict[str, Any]:
    c = model.config
    sparse = sparse_layers(c)
    kinds = layer_types(c)
    return dict(
        model_type=c.model_type,
        d_mlp=c.moe_intermediate_size if any(sparse) else c.intermediate_size,
        num_experts=c.num_experts if any(sparse) else None,
        experts_per_token=c.num_experts_per_tok if any(sparse) else None,
        extra={
            "use_qk_norm": True,
            "layer_types": kinds,
            "full_attention_layers": [i for i, k in enumerate(kinds) if k == FULL],
            "attn_output_gate": True,
            "linear_num_key_heads": c.linear_num_key_heads,
            "linear_num_value_heads": c.linear_num_value_heads,
            "linear_key_head_dim": c.linear_key_head_dim,
            "linear_value_head_dim": c.linear_value_head_dim,
            "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
            "linear_projections": "fused per key head (in_proj_qkvz, in_proj_ba)",
            "moe_layers": [i for i, s in enumerate(sparse) if s],
            "dense_d_mlp": c.intermediate_size,
            "norm_topk_prob": bool(getattr(c, "norm_topk_prob", True)),
            "shared_expert_d_mlp": c.shared_expert_intermediate_size if any(sparse) else None,
        },
    )


def block(model: Any, layer: int) -> BlockLayout:
    if layer_types(model.config)[layer] == FULL:
        return FAMILY.block
    return BlockLayout(
        ln1="input_layernorm",
        attn="linear_attn",
        o_proj="linear_attn.out_proj",
        ln2="post_attention_layernorm",
        mlp="mlp",
    )


def attn_qkv(model: Any, layer: int) -> Any:
    if layer_types(model.config)[layer] != FULL:
        return None  # a gated DeltaNet: its points are the core's gated DeltaNet site's
    return FAMILY.attn_qkv(model)


def layer_mlp(layer: nn.Module, config: Any) -> Union[MLPLayout, MoELayout]:
    if not isinstance(getattr(layer, "mlp", None), nn.Module) or not hasattr(layer.mlp, "shared_expert"):
        return hf.SWIGLU_MLP
    routing = Routing(
        config.num_experts, config.num_experts_per_tok, normalize=bool(config.norm_topk_prob), weights_dtype="logits"
    )
    layout = stored_moe_layout(layer, "mlp", routing, ("gate_proj", "up_proj", "down_proj"))
    # what the MoE module adds to the routed experts: sigmoid(shared_expert_gate(x)) * shared_expert(x), which the
    # core adds where it recomputes the experts at the MoE module's output (transformers 4.57's ModuleList)
    return dataclasses.replace(layout, shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate")


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Hooked) -> list[Any]:
    sites: list[Any] = []
    kinds = hooked.cfg.extra["layer_types"]
    sparse = sparse_layers(hooked.hf_model.config)
    for i, (block, kind) in enumerate(zip(hooked.block_modules, kinds)):
        if kind == FULL:
            sites.append(query_gate_site(hooked, i, block))
        else:
            sites.append(gated_deltanet_site(hooked, i, block.linear_attn, PROJECTIONS))
        if sparse[i]:
            # transformers 5 runs the shared expert before the router; 4.57 (a ModuleList of experts) runs it after
            # the experts, whose points the core's MoE site then serves at the MoE module's output, after the gate's
            modules = isinstance(block.get_submodule("mlp.experts"), nn.ModuleList)
            sites += shared_expert_sites(hooked, i, block, after="mlp.hook_routing_weights" if modules else None)
    return sites


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Hooked, name: str) -> Any:
    softmax = [kind == FULL for kind in hooked.cfg.extra["layer_types"]]
    return gated_query_weight(hooked, name, softmax, "Qwen3-Next", "lensadapters_qwen3_next.query_weights")


def query_weights(hm: Any, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(W_Q, W_gate, b_Q, b_gate)`` of a full-attention layer: ``q_proj``'s query and output-gate rows of every
    head, ``[heads, d_model, d_head]`` and ``[heads, d_head]`` (zeros without a bias), from the live parameters
    (:func:`lensadapters.plugin_api.gated_query_weights`)."""
    return gated_query_weights(hm, layer)


#: the layer patterns of :func:`tiny_config` (``L`` a gated DeltaNet layer, ``F`` a full-attention one)
TINY_PATTERNS = ("LLLF", "LF", "FL", "LFLF", "FLL", "LLF")


def tiny_config(seed: int) -> Any:
    """A Qwen3-Next toy, width 64, vocabulary 512. Seed 0: 4 layers (three gated DeltaNet layers, then a
    full-attention one, the checkpoints' pattern), dense. Odd seeds are the MoE model (4 experts, top 2, a shared
    expert); the seed also picks the layer pattern (:data:`TINY_PATTERNS`), the DeltaNet's key/value heads and the
    attention's head size."""
    from lensadapters_qwen3_next.configs import qwen3_next_config

    pattern = TINY_PATTERNS[(seed // 2) % len(TINY_PATTERNS)]
    kinds = ["linear_attention" if k == "L" else "full_attention" for k in pattern]
    linear_heads = ((2, 4), (1, 2), (2, 2))[(seed // 3) % 3]
    return qwen3_next_config(
        moe=bool(seed % 2),
        layer_types=kinds,
        linear_heads=linear_heads,
        head_dim=(8, 16)[(seed // 5) % 2],
    )


PLUGIN = hf.DecoderPlugin(
    ARCH, FAMILY, tiny_config, config=config_fields, block=block, attn_qkv=attn_qkv, layer_mlp=layer_mlp
).export(globals())


def _kind(layer: nn.Module) -> str:
    # ``block_type`` on transformers 5, ``layer_type`` on 4.57
    return str(getattr(layer, "block_type", None) or getattr(layer, "layer_type", None))


# in place of the declared validation (after export): each layer's modules depend on its kind and its MLP
@hookimpl
def lensadapters_validate(arch: Architecture, model: Any) -> None:
    hf.require_transformers_class(model, FAMILY.family, FAMILY.packages or ())
    config, base = model.config, FAMILY.base(model)
    kinds = layer_types(config)
    unknown = sorted(set(kinds) - {FULL, LINEAR})
    if unknown:
        raise UnsupportedModelError(f"Qwen3-Next layer types {unknown} are not described (only {FULL}, {LINEAR})")
    sparse = sparse_layers(config)
    layers = FAMILY.layers(model)

    def missing(layer: nn.Module) -> list[str]:
        i = next(j for j, other in enumerate(layers) if other is layer)
        return hf.missing_paths(layer, (*_mixer_paths(_kind(layer)), *_mlp_paths(sparse[i])))

    hf.require_modules(
        model,
        base,
        FAMILY.family,
        ("embed_tokens", "norm", "rotary_emb"),
        ("input_layernorm", "post_attention_layernorm"),
        missing_in_layer=missing,
    )
    hf.require_rope_types([FAMILY.rope_type(model)], ("default",), FAMILY.family)
