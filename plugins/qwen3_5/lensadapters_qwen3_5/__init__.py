"""Qwen 3.5 (``model_type`` ``qwen3_5_text`` and ``qwen3_5_moe_text``: ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM`` and their ``*TextModel``) for lensadapters, on transformers 5.

A hybrid decoder: each layer's token mixer is either a gated full attention (``layer_types[i] ==
"full_attention"``) or a gated DeltaNet, a linear attention with a recurrent state (``"linear_attention"``); the
MLP is a SwiGLU (dense models) or a mixture of experts with a gated shared expert (MoE models). Norms are
``x / rms * (1 + w)``.

* **Every layer**: ``hook_resid_pre``, ``ln1.*``, ``hook_attn_out`` (the mixer's output, whichever kind),
  ``hook_resid_mid``, ``hook_mlp_in``, ``ln2.*``, the MLP's points, ``hook_mlp_out``, ``hook_resid_post``.
* **Full-attention layers**: ``attn.hook_q``/``hook_k``/``hook_v``, the per-head ``attn.q_norm.*``/``k_norm.*``,
  ``hook_rot_q``/``hook_rot_k`` (partial rotary: the first ``rotary_dim`` features of a head rotate), scores,
  pattern, ``hook_z``, ``hook_result``; GQA. ``q_proj`` computes, per head, the query and an output gate:
  ``attn.hook_gate`` ``[b, p, h, d_head]`` is that gate's logits, and ``attn.hook_z`` is what ``o_proj`` reads,
  ``(pattern @ v) * sigmoid(gate)``, so that ``hook_result`` is ``hook_z @ W_O`` per head as in TransformerLens.
* **Linear-attention layers**: the ``linear_attn.*`` points of the core's gated DeltaNet site with separate
  projections (:mod:`lensadapters_qwen3_5.mixer`): projections, convolution, beta and decay gates, the delta rule's
  output, the gated norm's output; no ``attn.*`` point.
* **MoE layers**: the core's router and expert points, and the shared expert's: ``mlp.shared_expert.hook_gate``,
  ``hook_pre`` (up), ``hook_post`` ``[b, p, d_shared]``, ``hook_result`` ``[b, p, d_model]`` (before its gate), and
  ``mlp.hook_shared_gate`` ``[b, p, 1]`` (the gate's logit; the shared expert adds ``sigmoid`` of it times its
  result).

Also the language model of the multimodal ``Qwen3_5ForConditionalGeneration`` and
``Qwen3_5MoeForConditionalGeneration`` (``vision_language``: sizes from the text config; its rotary points read the
(cos, sin) the model computes from its 3-D multimodal positions). Refused at wrap time: the multimodal base model
``Qwen3_5Model`` (no language-model head), custom modeling code, rope types other than the default one.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from lensadapters import Architecture, BlockLayout, MLPLayout, UnsupportedModelError, hf, hookimpl
from lensadapters.moe import MoELayout, Routing, stored_moe_layout
from lensadapters.plugin_api import (
    Hooked,
    gated_deltanet_paths,
    gated_deltanet_site,
    gated_query_weight,
    gated_query_weights,
)
from lensadapters.plugin_api import (
    WeightUnavailableError as WeightUnavailableError,  # re-exported: the W_Q/b_Q refusal's type
)
from lensadapters_qwen3_5 import attention, mixer

Tensor = torch.Tensor

__version__ = "0.1.0"
TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")
VLM_CLASSES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
FAMILY = hf.DecoderFamily(
    "Qwen3_5",
    model_type="qwen3_5_text",
    packages=("qwen3_5", "qwen3_5_moe"),
    norms=("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"),
    norm_weight_offset=1.0,
    qk_norms=hf.qk_norms("bphd"),  # of the full-attention layers
    mlp=None,
    partial_rotary=True,
)
ARCH = FAMILY.architecture(
    "Qwen 3.5 text, dense and MoE (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM): gated DeltaNet linear-attention "
    "layers and gated full-attention layers, SwiGLU or experts with a shared expert; the language model of "
    "Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration",
    name="qwen3_5",
    model_types=TEXT_TYPES + MULTIMODAL_TYPES,
    transformers=">=5.0,<6",
    vision_language=True,
)
FULL, LINEAR = "full_attention", "linear_attention"
_SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")


def is_moe(config: Any) -> bool:
    return getattr(config, "num_experts", 0) > 0 and hasattr(config, "shared_expert_intermediate_size")


def layer_types(config: Any) -> list[str]:
    return list(config.layer_types[: config.num_hidden_layers])


def _mixer_paths(kind: str) -> tuple[str, ...]:
    if kind == FULL:
        return (*FAMILY.qkv, FAMILY.block.o_proj, *(n.module for n in FAMILY.qk_norms or ()))
    return tuple(f"linear_attn.{m}" for m in gated_deltanet_paths(mixer.PROJECTIONS))


def config_fields(model: Any) -> dict[str, Any]:
    c = hf.text_config(model)
    moe = is_moe(c)
    kinds = layer_types(c)
    return dict(
        model_type=c.model_type,
        d_mlp=c.moe_intermediate_size if moe else c.intermediate_size,
        num_experts=c.num_experts if moe else None,
        experts_per_token=c.num_experts_per_tok if moe else None,
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
            "shared_expert_d_mlp": c.shared_expert_intermediate_size if moe else None,
        },
    )


def block(model: Any, layer: int) -> BlockLayout:
    if layer_types(hf.text_config(model))[layer] == FULL:
        return FAMILY.block
    return BlockLayout(
        ln1="input_layernorm",
        attn="linear_attn",
        o_proj="linear_attn.out_proj",
        ln2="post_attention_layernorm",
        mlp="mlp",
    )


def attn_qkv(model: Any, layer: int) -> Any:
    if layer_types(hf.text_config(model))[layer] != FULL:
        return None  # a gated DeltaNet: its points are the plugin's (lensadapters_qwen3_5.mixer)
    return FAMILY.attn_qkv(model)


def layer_mlp(layer: nn.Module, config: Any) -> Union[MLPLayout, MoELayout]:
    if not is_moe(config):
        return hf.SWIGLU_MLP
    routing = Routing(config.num_experts, config.num_experts_per_tok, normalize=True, weights_dtype="logits")
    return stored_moe_layout(layer, "mlp", routing, ("gate_proj", "up_proj", "down_proj"))


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Hooked) -> list[Any]:
    sites: list[Any] = []
    kinds = hooked.cfg.extra["layer_types"]
    for i, (block, kind) in enumerate(zip(hooked.block_modules, kinds)):
        if kind == FULL:
            sites.append(attention.query_gate_site(hooked, i, block))
        else:
            sites.append(gated_deltanet_site(hooked, i, block.linear_attn, mixer.PROJECTIONS))
        if is_moe(hf.text_config(hooked.hf_model)):
            sites += attention.shared_expert_sites(hooked, i, block)
    return sites


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Hooked, name: str) -> Any:
    softmax = [kind == FULL for kind in hooked.cfg.extra["layer_types"]]
    return gated_query_weight(hooked, name, softmax, "Qwen 3.5", "lensadapters_qwen3_5.query_weights")


def query_weights(hm: Any, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(W_Q, W_gate, b_Q, b_gate)`` of a full-attention layer: ``q_proj``'s query and output-gate rows of every
    head, ``[heads, d_model, d_head]`` and ``[heads, d_head]`` (zeros without a bias), from the live parameters
    (:func:`lensadapters.plugin_api.gated_query_weights`)."""
    return gated_query_weights(hm, layer)


#: the layer patterns of :func:`tiny_config` (``L`` a gated DeltaNet layer, ``F`` a full-attention one)
TINY_PATTERNS = ("LLLF", "LF", "FL", "LFLF", "FLL", "LLF")


def tiny_config(seed: int) -> Any:
    """A Qwen 3.5 toy, width 64, vocabulary 512. Seed 0: 4 layers (three gated DeltaNet layers, then a
    full-attention one, the checkpoints' pattern), dense. Odd seeds are the MoE model (4 experts, top 2, a shared
    expert); the seed also picks the layer pattern (:data:`TINY_PATTERNS`), the DeltaNet's key/value heads and the
    attention's head size."""
    from lensadapters_qwen3_5.configs import qwen3_5_config

    pattern = TINY_PATTERNS[(seed // 2) % len(TINY_PATTERNS)]
    kinds = ["linear_attention" if k == "L" else "full_attention" for k in pattern]
    linear_heads = ((2, 4), (1, 2), (2, 2))[(seed // 3) % 3]
    return qwen3_5_config(
        moe=bool(seed % 2), layer_types=kinds, linear_heads=linear_heads, head_dim=(8, 16)[(seed // 5) % 2]
    )


PLUGIN = hf.DecoderPlugin(
    ARCH, FAMILY, tiny_config, config=config_fields, block=block, attn_qkv=attn_qkv, layer_mlp=layer_mlp
).export(globals())


# in place of the declared validation (after export): each layer's modules depend on its kind
@hookimpl
def lensadapters_validate(arch: Architecture, model: Any) -> None:
    if model.config.model_type in MULTIMODAL_TYPES and type(model).__name__ not in VLM_CLASSES:
        raise UnsupportedModelError(
            f"{type(model).__name__} is the multimodal Qwen 3.5 base model (no language-model head); the qwen3_5 "
            f"plugin describes the language model of {' and '.join(VLM_CLASSES)}: load the checkpoint with "
            f"AutoModelForImageTextToText (or AutoModelForCausalLM for the text model alone)"
        )
    hf.require_transformers_class(model, FAMILY.family, FAMILY.packages or ())
    config, base = hf.text_config(model), FAMILY.base(model)
    kinds = layer_types(config)
    unknown = sorted(set(kinds) - {FULL, LINEAR})
    if unknown:
        raise UnsupportedModelError(f"Qwen 3.5 layer types {unknown} are not described (only {FULL}, {LINEAR})")
    mlp_paths = (
        _SHARED + ("mlp.gate", "mlp.experts", "mlp.shared_expert_gate")
        if is_moe(config)
        else (hf.SWIGLU_MLP.pre, hf.SWIGLU_MLP.pre_linear, hf.SWIGLU_MLP.out)
    )
    hf.require_modules(
        model,
        base,
        FAMILY.family,
        ("embed_tokens", "norm", "rotary_emb"),
        ("input_layernorm", "post_attention_layernorm", *mlp_paths),
        missing_in_layer=lambda layer: hf.missing_paths(layer, _mixer_paths(str(layer.block_type))),
    )
    hf.require_rope_types([FAMILY.rope_type(model)], ("default",), FAMILY.family)
