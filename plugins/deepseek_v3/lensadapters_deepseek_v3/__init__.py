"""DeepSeek-V3 (``model_type: "deepseek_v3"``: DeepSeek-V3, R1, Kimi-K2-shaped checkpoints) for lensadapters.

Multi-head latent attention (MLA), with TransformerLens' names where they exist and these for the latents:

* ``attn.hook_q_latent`` ``[b, p, q_lora_rank]``: the compressed query, ``q_a_layernorm(q_a_proj(x))`` (only where
  ``q_lora_rank`` is set; otherwise ``q_proj`` projects the residual directly).
* ``attn.hook_k_rope`` ``[b, p, qk_rope_head_dim]``: the key part every head shares, the last columns of
  ``kv_a_proj_with_mqa``'s output, before rotary.
* ``attn.hook_kv_latent`` ``[b, p, kv_lora_rank]``: the compressed keys and values, ``kv_a_layernorm``'s output
  (what transformers 5 caches).
* ``attn.hook_q`` ``[b, p, h, qk_nope_head_dim + qk_rope_head_dim]``: each head's query, ``[no-rope | rope]`` as the
  up-projection (``q_b_proj`` or ``q_proj``) outputs it, before rotary: the rope columns are in the checkpoint's
  order (interleaved pairs where ``rope_interleave``).
* ``attn.hook_k`` (same shape): ``[k_nope_h | k_rope]``, the head's no-rope key from ``kv_b_proj`` and the shared
  ``hook_k_rope``; ``attn.hook_v`` ``[b, p, h, v_head_dim]`` the head's value from ``kv_b_proj``.
* ``attn.hook_rot_q``/``hook_rot_k``: the query and key attention multiplies, rotary applied to the rope columns
  only, in transformers' output layout (with ``rope_interleave`` the rotated pairs come out de-interleaved,
  ``[x_even' | x_odd']``, as transformers computes them).
* ``hook_attn_scores``, ``hook_pattern``, ``hook_z`` ``[b, p, h, v_head_dim]``, ``hook_result``: as usual
  (``cfg.d_head`` is the query/key head size, ``cfg.extra["v_head_dim"]`` the value head size).

An edit of a point changes everything downstream as if the model had computed it. The rope columns of
``hook_k``/``hook_rot_k`` are one key the model shares over the heads, computed before the per-head keys exist: a
per-head edit of them is made on the keys the attention function gets, and a backward hook there gets the gradient
of those keys per head, so the core's activation and attribution patching of one head's keys are exact. Refused by
name: under transformers 5, whose cache keeps the latents, an edit of ``hook_k``/``hook_rot_k``/``hook_v`` during
cached generation would be lost at the next step (edit the latents, or generate without the cache). ``W_Q`` is
served where ``q_proj`` projects the residual
directly; ``W_Q`` with a query latent and ``W_K``/``W_V`` are refused (an RMS norm of the latent lies between the
down- and up-projections, so no matrix maps the residual to them); :func:`latent_weights` gives the exact per-head
maps from the latents. The per-head inputs (``hook_attn_in``, ``hook_q_input``, ``hook_k_input``,
``hook_v_input``, TransformerLens' ``use_split_qkv_input``) are the block input once per head, each head's query
(``q_a_proj`` -> ``q_a_layernorm`` -> its slice of ``q_b_proj``, or of ``q_proj``), key (``kv_a_proj_with_mqa`` ->
``kv_a_layernorm`` -> its slice of ``kv_b_proj``, and its own rope key from the same down-projection) and value
computed from its own copy, so edge attribution scores query, key and value edges; their key and value edits are
refused during cached generation under transformers 5, as ``hook_k``'s. The attention is declared in the core's form
(:func:`latent_attention`, a ``plugin_api.LatentAttention``), from which the core serves all of the above.

Mixture of experts: the first ``first_k_dense_replace`` layers have a dense SwiGLU MLP; the others route each token
with a sigmoid over the experts, the correction bias ``e_score_correction_bias`` added for the choice only, grouped
top-k (``n_group`` groups scored by their two best experts, ``topk_group`` kept), the chosen sigmoids renormalized
(``norm_topk_prob``) and scaled by ``routed_scaling_factor``; ``mlp.shared_experts`` (a dense SwiGLU) is added to
the routed experts' sum. The core's router and per-expert points serve them (``Routing(probabilities="sigmoid",
groups=..., selection_bias=...)``); ``mlp.hook_expert_weights`` is the sigmoid of every expert.

DeepSeek-V2 (``model_type: "deepseek_v2"``: DeepSeek-V2, V2-Lite, V2-Chat, Coder-V2) has the same MLA and the
same points, with three differences, each declared here: its rotary module returns complex rotations
(``freqs_cis``) that multiply the interleaved pairs of the rope columns as complex numbers, in float32, the
rotated pairs staying interleaved (``hook_rot_q``/``hook_rot_k`` hold ``[x0', x1', x2', x3'...]``, not V3's
de-interleaved layout); its router takes a softmax over the experts (no correction bias), then the top-k
(``topk_method="greedy"``) or the top-k within the ``topk_group`` groups of the largest maximum
(``"group_limited_greedy"``, the others' scores set to 0), never renormalized (``norm_topk_prob`` is not read by the
model), times ``routed_scaling_factor``: ``Routing(probabilities="softmax", groups=..., group_score="max",
masked_score=0.0)``; transformers 4.57 keeps the per-head keys and values in its cache (5.x the latents).

Refused at wrap time: custom code registered as ``deepseek_v3``/``deepseek_v2``, ``num_key_value_heads`` other
than ``num_attention_heads``, a DeepSeek-V2 ``topk_method`` other than ``greedy``/``group_limited_greedy``, and a
group-limited top-k larger than the kept groups' experts (the model would pick masked experts at weight 0). Flash
and flex attention: every hook point but ``hook_attn_scores``/``hook_pattern``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lensadapters import hf
from lensadapters.errors import UnsupportedModelError
from lensadapters.moe import ExpertModules, FusedExperts, MoELayout, Routing
from lensadapters.plugin_api import LatentAttention, RotarySpec, latent_rotary
from lensadapters.plugin_api import latent_weights as _latent_weights

__version__ = "0.1.0"
# the modules every layer has (the attention's query path depends on q_lora_rank and is checked per layer); the
# first one has no output width, so the family's head-shape check (one q_proj of heads * head_dim) does not apply
FAMILY = hf.DecoderFamily.named(
    "DeepseekV3",
    "deepseek_v3",
    packages=("deepseek_v3", "deepseek_v2"),
    norms=("DeepseekV3RMSNorm", "DeepseekV2RMSNorm"),
    qkv=("self_attn.kv_a_layernorm", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"),
    mlp=None,
)
ARCH = FAMILY.architecture(
    "DeepSeek-V3 (DeepseekV3ForCausalLM, DeepseekV3Model): multi-head latent attention, grouped top-k routing with "
    "a correction bias, shared experts, dense first layers; DeepSeek-V2 (DeepseekV2ForCausalLM, DeepseekV2Model): "
    "the same attention with complex rotary, a softmax router (greedy or group-limited greedy)",
    model_types=("deepseek_v3", "deepseek_v2"),
)
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _sizes(c: Any) -> tuple[int, int, int]:
    return c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim


def is_v2(config: Any) -> bool:
    return getattr(config, "model_type", None) == "deepseek_v2"


def mla_rotary(config: Any) -> RotarySpec:
    """Rotary on the rope columns ``[nope:]`` of ``[b, p, h, nope + rope]`` as transformers applies it: interleaved
    pairs rotated and laid out ``[even' | odd']`` (``rope_interleave``), or rotate-half; DeepSeek-V2's pairs
    ``(x[2i], x[2i+1])`` as complex numbers times ``cos + i sin`` (``[b, p, rope/2]``: the real and imaginary parts
    of its rotary module's ``freqs_cis``), in float32, kept interleaved and cast back."""
    nope, rope, _ = _sizes(config)
    layout = "complex" if is_v2(config) else "interleaved" if getattr(config, "rope_interleave", False) else None
    return latent_rotary(nope, rope, layout or "rotate_half")


def latent_attention(model: Any, layer: int) -> LatentAttention:
    """The layer's multi-head latent attention, in the core's form: the query latent where ``q_lora_rank`` is set
    (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; ``q_proj`` otherwise), ``kv_a_proj_with_mqa`` to
    ``[latent | rope key]``, ``kv_a_layernorm``, ``kv_b_proj`` to ``[no-rope key | value]`` per head."""
    c = hf.text_config(model)
    nope, rope, v = _sizes(c)
    latent = c.q_lora_rank is not None
    return LatentAttention(
        "self_attn.q_b_proj" if latent else "self_attn.q_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_a_layernorm",
        "self_attn.kv_b_proj",
        heads=c.num_attention_heads,
        kv_rank=c.kv_lora_rank,
        nope=nope,
        rope=rope,
        v_head_dim=v,
        rotary=mla_rotary(c),
        q_down="self_attn.q_a_proj" if latent else None,
        q_norm="self_attn.q_a_layernorm" if latent else None,
    )


def latent_weights(hm: Any, layer: int) -> dict[str, Any]:
    """The exact per-head linear maps of layer ``layer``'s MLA from the latents (``W_Q_latent``, ``W_K_latent``,
    ``W_V_latent``, ``W_K_rope``/``b_K_rope``, ``W_Q_down``/``W_KV_down``; ``W_Q`` without a query latent): the
    core's :func:`lensadapters.plugin_api.latent_weights`."""
    return _latent_weights(hm, layer)


def mlp(model: Any, layer: int) -> Any:
    c = hf.text_config(model)
    if layer < c.first_k_dense_replace:
        return hf.SWIGLU_MLP
    block = FAMILY.layers(model)[layer]
    fused = not isinstance(block.get_submodule("mlp.experts"), nn.ModuleList)
    import transformers

    v5 = int(transformers.__version__.split(".")[0]) >= 5
    experts: Any = (
        FusedExperts("mlp.experts") if fused else ExpertModules("mlp.experts", "gate_proj", "up_proj", "down_proj")
    )
    routing = (
        v2_routing(c)
        if is_v2(c)
        else Routing(
            c.n_routed_experts,
            c.num_experts_per_tok,
            normalize=bool(c.norm_topk_prob),
            probabilities="sigmoid",
            weights_dtype="float32",
            selection_bias="e_score_correction_bias",
            groups=(c.n_group, c.topk_group),
            masked_score=float("-inf") if v5 else 0.0,  # transformers 4.57 fills the dropped groups with 0
            normalize_eps=1e-20,
            scale=float(c.routed_scaling_factor),
        )
    )
    return MoELayout(
        router="mlp.gate",
        routing=routing,
        experts=experts,
        router_output="routing" if v5 else "index_weights",
        shared="mlp.shared_experts",
    )


def v2_routing(c: Any) -> Routing:
    """DeepSeek-V2's router: a float32 softmax over every expert, the top-k of all (``greedy``: one group kept) or of
    the ``topk_group`` groups with the largest maximum (``group_limited_greedy``, the others' scores set to 0), not
    renormalized, times ``routed_scaling_factor``."""
    grouped = c.topk_method == "group_limited_greedy"
    return Routing(
        c.n_routed_experts,
        c.num_experts_per_tok,
        normalize=False,
        probabilities="softmax",
        weights_dtype="float32",
        groups=(c.n_group, c.topk_group) if grouped else (1, 1),
        group_score="max",
        masked_score=0.0,
        scale=float(c.routed_scaling_factor),
    )


def missing_in_layer(layer: nn.Module) -> list[str]:
    attn = layer.get_submodule("self_attn")
    paths = ["self_attn.o_proj"]
    paths += (
        ["self_attn.q_proj"]
        if getattr(attn, "q_lora_rank", None) is None
        else [
            "self_attn.q_a_proj",
            "self_attn.q_a_layernorm",
            "self_attn.q_b_proj",
        ]
    )
    return hf.missing_paths(layer, tuple(paths))


def check(model: Any) -> None:
    c = hf.text_config(model)
    if hf.n_kv_heads(c) != c.num_attention_heads:
        raise UnsupportedModelError(
            f"num_key_value_heads={hf.n_kv_heads(c)} differs from num_attention_heads={c.num_attention_heads}: "
            "multi-head latent attention decompresses one key and value per query head"
        )
    if c.qk_rope_head_dim % 2:
        raise UnsupportedModelError(f"qk_rope_head_dim={c.qk_rope_head_dim} is odd; rotary rotates pairs")
    if is_v2(c) and c.n_routed_experts and c.first_k_dense_replace < c.num_hidden_layers:
        if c.topk_method not in V2_TOPK_METHODS:
            raise UnsupportedModelError(
                f"topk_method={c.topk_method!r}: transformers' DeepSeek-V2 router implements "
                f"{' and '.join(V2_TOPK_METHODS)} only; set one of them in the config"
            )
        if c.topk_method == "group_limited_greedy":
            kept = c.topk_group * (c.n_routed_experts // c.n_group)
            if c.num_experts_per_tok > kept:
                raise UnsupportedModelError(
                    f"num_experts_per_tok={c.num_experts_per_tok} exceeds the {kept} experts of the topk_group="
                    f"{c.topk_group} kept groups: the router would choose dropped experts at weight 0; raise "
                    "topk_group or lower num_experts_per_tok"
                )


def config_fields(model: Any) -> dict[str, Any]:
    c = hf.text_config(model)
    nope, rope, v = _sizes(c)
    return dict(
        d_head=nope + rope,
        rotary_dim=rope,
        d_mlp=c.intermediate_size,
        num_experts=c.n_routed_experts,
        experts_per_token=c.num_experts_per_tok,
        extra={
            "multi_head_latent_attention": True,
            "q_lora_rank": c.q_lora_rank,
            "kv_lora_rank": c.kv_lora_rank,
            "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope,
            "v_head_dim": v,
            "rope_interleave": bool(getattr(c, "rope_interleave", False)),
            "complex_rotary": is_v2(c),
            "topk_method": getattr(c, "topk_method", None),
            "first_k_dense_replace": c.first_k_dense_replace,
            "n_shared_experts": c.n_shared_experts,
            "moe_intermediate_size": c.moe_intermediate_size,
            "n_group": c.n_group,
            "topk_group": c.topk_group,
            "routed_scaling_factor": float(c.routed_scaling_factor),
            "norm_topk_prob": bool(c.norm_topk_prob) and not is_v2(c),  # DeepSeek-V2 never renormalizes
        },
    )


def tiny_config(seed: int) -> Any:
    """A DeepSeek-V3-like toy, width 64, vocabulary 512: 4 heads with no-rope 8, rope 4, value 6 columns, a query
    latent of 16 and a key/value latent of 12, one dense layer then MoE layers of 8 experts in 4 groups (top-2 of the
    2 best groups), one shared expert. Seed 0 is the demo's model (2 layers); other seeds vary the depth, drop the
    query latent and vary top-k."""
    import random

    from transformers import DeepseekV3Config

    rng = random.Random(seed)
    layers = 2 if seed == 0 else rng.choice([2, 3])
    q_lora = 16 if seed == 0 else rng.choice([None, 16])
    return hf.toy_config(
        DeepseekV3Config,
        layers,
        4,
        4,
        intermediate_size=48,
        moe_intermediate_size=16,
        q_lora_rank=q_lora,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        head_dim=4,
        v_head_dim=6,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2 if seed == 0 else rng.choice([1, 2, 3]),
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
    )


PLUGIN = hf.DecoderPlugin(
    ARCH,
    FAMILY,
    tiny_config,
    config=config_fields,
    check=check,
    missing_in_layer=missing_in_layer,
    latent_attention=latent_attention,
    mlp=mlp,
).export(globals())
