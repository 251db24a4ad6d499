"""GPT-OSS (``model_type: "gpt_oss"``: gpt-oss-20b, gpt-oss-120b) for lensadapters.

Quirks handled, with TransformerLens' hook names:

* Attention sinks: each head has a learned logit (``self_attn.sinks``) that joins the softmax as an extra key
  with no value. ``attn.hook_attn_scores`` is ``[b, h, q, k]`` over the real keys only (scaled, masked with
  ``-inf``), before the softmax; an edit there goes through the softmax with the sink column appended.
  ``attn.hook_pattern`` is the probability of each real key: its rows sum to less than one, the sink's share
  ``1 - pattern.sum(-1)`` is what is missing (no hook point: it multiplies no value, so an edit of it could change
  nothing downstream). The core's explicit attention serves these through transformers' ``s_aux`` argument.
* Alternating sliding-window (``sliding_attention``, 128 tokens in the checkpoints) and full layers from
  ``config.layer_types``; GQA; biases on ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (``b_Q``...``b_O``).
* RoPE (YaRN in the checkpoints) whose rotary module returns each frequency once (``cos``/``sin`` of
  ``d_head / 2``): rotate-half on the halves of a head (``half_table_rotate_half_spec``).
* Every MLP is a mixture of experts (``mlp.router`` with a bias, ``mlp.experts``): the router selects the top-k
  *logits* first, then takes the softmax over them (``Routing(order="topk_softmax")``), so the routing weights sum
  to one. ``mlp.hook_expert_weights`` is that softmax scattered over the experts (zeros elsewhere; TransformerLens
  2.18's value), and an edit of it reweights the selected experts. Experts are stored transposed
  (``gate_up_proj`` ``[E, d_model, 2 * d_mlp]`` with gate and up features interleaved, ``down_proj``
  ``[E, d_mlp, d_model]``) with biases, and compute a clamped SwiGLU: ``gate = min(g, limit)``,
  ``up = clamp(u, -limit, limit)``, ``post = (up + 1) * gate * sigmoid(alpha * gate)``. ``experts.{e}.hook_gate``/
  ``hook_pre`` are the projections before the clamps (an edit is clamped as the model's own values are),
  ``hook_post`` the clamped GLU, ``hook_result`` the weighted expert output (down bias included).
* transformers 5: ``mlp.router`` returns ``(logits, top-k weights, top-k indices)``; transformers 4.57: it returns
  ``(scores [tokens, E], indices)`` without its logits, which the core recomputes from the router's input and live
  parameters (``router_output="scores"``).

Refused at wrap time with an explanation: rope types whose rotation is not rotate-half, custom modeling code
registered as ``gpt_oss``, a model without GPT-OSS's layout. Flash and flex attention: every hook point but
``hook_attn_scores``/``hook_pattern`` (which name the fix).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lensadapters import hf
from lensadapters.moe import FusedExperts, MoELayout, Routing
from lensadapters.plugin_api import half_table_rotate_half_spec

__version__ = "0.1.0"
FAMILY = hf.DecoderFamily.named("GptOss", "gpt_oss", mlp=None, rotary=half_table_rotate_half_spec)
ARCH = FAMILY.architecture(
    "GPT-OSS (GptOssForCausalLM, GptOssModel): attention sinks, alternating sliding windows, a mixture of biased "
    "experts with a clamped SwiGLU, top-k-then-softmax routing"
)
_EXPERT_PARAMETERS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def clamped_swiglu(experts: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's expert activation, the operations of ``GptOssExperts`` in its order, with its live ``limit`` and
    ``alpha``."""
    gate = gate.clamp(min=None, max=experts.limit)
    up = up.clamp(min=-experts.limit, max=experts.limit)
    glu = gate * torch.sigmoid(gate * experts.alpha)
    return (up + 1) * glu


def _router_returns_logits() -> bool:
    """transformers 5's router returns its logits with the routing; 4.57's returns dense scores and indices."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def moe_layout(model: Any, layer: int) -> MoELayout:
    c = model.config
    return MoELayout(
        router="mlp.router",
        routing=Routing(c.num_local_experts, c.num_experts_per_tok, normalize=False, order="topk_softmax"),
        experts=FusedExperts(
            "mlp.experts",
            transposed=True,
            interleaved=True,
            gate_up_bias="gate_up_proj_bias",
            down_bias="down_proj_bias",
            glu=clamped_swiglu,
        ),
        router_output="routing" if _router_returns_logits() else "scores",
    )


def missing_in_layer(layer: nn.Module) -> list[str]:
    from lensadapters import innermost_layer

    missing = hf.missing_paths(layer, ("mlp.router", "mlp.experts"))
    if missing:
        return missing
    experts = innermost_layer(layer.get_submodule("mlp.experts"))
    needed = (*_EXPERT_PARAMETERS, "alpha", "limit")
    return [f"mlp.experts.{p}" for p in needed if not hasattr(experts, p)]


def config_fields(model: Any) -> dict[str, Any]:
    c = model.config
    return dict(
        num_experts=c.num_local_experts,
        experts_per_token=c.num_experts_per_tok,
        **hf.window_fields(hf.layer_windows(c)),
        extra={
            "attention_sinks": True,
            "attention_bias": bool(getattr(c, "attention_bias", True)),
            "swiglu_alpha": float(getattr(c, "swiglu_alpha", 1.702)),
            "swiglu_limit": float(getattr(c, "swiglu_limit", 7.0)),
            "router_order": "topk_softmax",
        },
    )


def tiny_config(seed: int) -> Any:
    """A GPT-OSS-like toy, width 64, vocabulary 512, head_dim 16, experts of width 32. Seed 0 is the demo's model:
    2 layers (sliding then full, as GPT-OSS), GQA (4 query heads, 2 kv heads), a 4-token window, top-2 of 4
    experts, YaRN RoPE. Other seeds vary the depth, heads, experts and top-k."""
    import random

    from transformers import GptOssConfig

    rng = random.Random(seed)
    layers, (heads, kv), experts = (2, (4, 2), 4) if seed == 0 else (rng.choice([1, 2, 3]), (4, 1), rng.choice([2, 8]))
    top_k = 2 if seed == 0 else rng.randint(1, min(3, experts))
    rope = {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    rope.update(original_max_position_embeddings=64)
    if _router_returns_logits():
        rope["rope_theta"] = 10000.0
    return hf.toy_config(
        GptOssConfig,
        layers,
        heads,
        kv,
        intermediate_size=32,
        head_dim=16,
        sliding_window=4,
        **hf.router_fields(GptOssConfig, experts, top_k),
        tie_word_embeddings=False,
        **({"rope_parameters": rope} if _router_returns_logits() else {"rope_scaling": rope, "rope_theta": 10000.0}),
    )


PLUGIN = hf.DecoderPlugin(
    ARCH, FAMILY, tiny_config, config=config_fields, missing_in_layer=missing_in_layer, mlp=moe_layout
).export(globals())
