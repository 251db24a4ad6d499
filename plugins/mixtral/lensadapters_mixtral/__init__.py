"""Mixtral (Mixtral 8x7B, 8x22B and other ``model_type: "mixtral"`` checkpoints) for lensadapters.

Attention, norms and residuals are Mistral's (GQA, rotate-half RoPE with ``model.rotary_emb``'s cos/sin, RMSNorm,
an optional sliding window); the MLP of every block is a sparse mixture of experts, described to the core as a
:class:`lensadapters.moe.MoELayout`:

* transformers 5: ``mlp.gate`` (``MixtralTopKRouter``) returns ``(logits, top_k_weights, top_k_index)`` and
  ``mlp.experts`` (``MixtralExperts``) stores every expert in 3-D parameters ``gate_up_proj``
  ``[n_experts, 2 * d_mlp, d_model]`` and ``down_proj`` ``[n_experts, d_model, d_mlp]``, run by transformers'
  fused / grouped-GEMM implementations. The routing weights stay float32.
* transformers 4.57: ``block_sparse_moe.gate`` is a linear layer (logits only; the MoE block routes itself) and
  ``block_sparse_moe.experts`` a ``ModuleList`` of ``w1`` (gate), ``w3`` (up), ``w2`` (down).

Routing: softmax over all experts (float32), top-``num_experts_per_tok``, the selected probabilities renormalized to
sum to one. Hook points, weights and edit semantics are the core's (``lensadapters.moe``); ``W_in`` is ``w3``/the up
rows, ``W_gate`` ``w1``/the gate rows, ``W_out`` ``w2``/``down_proj``, ``W_router`` the router.

Refused at wrap time: rope types whose rotation is not rotate-half, attention implementations other than ``eager`` and
``sdpa``, modules without Mixtral's layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from lensadapters import hf
from lensadapters.moe import MoELayout, Routing, stored_moe_layout

__version__ = "0.1.0"
# attention and norms as Mistral's; the MoE block's path depends on the transformers version (see _moe_path)
FAMILY = hf.DecoderFamily(
    "Mixtral", model_type="mixtral", block=replace(hf.DECODER_BLOCK, mlp=None), mlp=None, attention=("eager", "sdpa")
)
ARCH = FAMILY.architecture("Mixtral (MixtralForCausalLM, MixtralModel): sparse mixture of experts, GQA, RoPE, RMSNorm")


def _moe_path(layer: nn.Module) -> str:
    """transformers 5 names the MoE block ``mlp``, 4.57 ``block_sparse_moe``."""
    return "mlp" if hasattr(layer, "mlp") else "block_sparse_moe"


def moe_layout(layer: nn.Module, config: Any) -> MoELayout:
    """The MoE description of one decoder layer, for the transformers version that built it."""
    moe = _moe_path(layer)
    n, k = config.num_local_experts, config.num_experts_per_tok
    # transformers 4.x casts the routing weights back to the logits' dtype, transformers 5 keeps them in float32
    return stored_moe_layout(
        layer,
        moe,
        Routing(n, k, normalize=True, weights_dtype="logits"),
        ("w1", "w3", "w2"),
        fused_routing=Routing(n, k, normalize=True, weights_dtype="float32"),
    )


def tiny_config(seed: int) -> Any:
    """A Mixtral-like toy, width 64, vocabulary 512, 4 experts of width 96. Seed 0 is the demo's model: 2 layers,
    GQA (4 query heads, 2 kv heads), top-2 routing. Other seeds vary the depth (1-3), the number of experts (2-8),
    top-k (1 to 3) and the heads, deterministically."""
    from transformers import MixtralConfig

    layers, (heads, kv_heads), experts, top_k = hf.toy_draw(
        seed,
        (2, (4, 2), 4, 2),
        [1, 2, 3],
        [(4, 2), (4, 4), (4, 1)],
        [2, 4, 8],
        lambda rng, layers, heads, experts: rng.randint(1, min(3, experts)),
    )
    return hf.toy_config(
        MixtralConfig,
        layers,
        heads,
        kv_heads,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        **hf.router_fields(MixtralConfig, experts, top_k),
        sliding_window=None,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )


def config_fields(model: Any) -> dict[str, Any]:
    c = model.config
    return {
        "num_experts": c.num_local_experts,
        "experts_per_token": c.num_experts_per_tok,
        "extra": {
            "sliding_window": getattr(c, "sliding_window", None),
            "router_jitter_noise": getattr(c, "router_jitter_noise", 0.0),
        },
    }


PLUGIN = hf.DecoderPlugin(
    ARCH,
    FAMILY,
    tiny_config,
    config=config_fields,
    missing_in_layer=lambda layer: hf.missing_expert_paths(layer, _moe_path(layer), ("w1", "w2", "w3")),
    block=lambda model, layer: replace(FAMILY.block, mlp=_moe_path(FAMILY.layers(model)[layer])),
    layer_mlp=moe_layout,
).export(globals())
