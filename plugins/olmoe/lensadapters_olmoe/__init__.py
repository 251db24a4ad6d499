"""OLMoE (``model_type: "olmoe"``: OLMoE-1B-7B and other checkpoints of transformers' ``Olmoe*`` classes) for
lensadapters.

TransformerLens 2.x has no OLMoE; the hook names follow its names for the same pieces elsewhere:

* Pre-norm blocks (``input_layernorm`` = ``ln1``, ``post_attention_layernorm`` = ``ln2``), GQA, rotate-half RoPE on
  ``model.rotary_emb``'s cos/sin.
* RMSNorm on queries and keys over the whole projection width (``q_norm`` over ``n_heads * d_head``, ``k_norm``
  over ``n_kv_heads * d_head``), between projection and RoPE, as OLMo 2: ``attn.q_norm.hook_scale`` is
  ``[b, p, 1]`` and ``attn.q_norm.hook_normalized`` ``[b, p, n_heads * d_head]``; ``hook_q``/``hook_k`` are the
  projection output, ``hook_rot_q``/``hook_rot_k`` the normed and rotated values attention uses.
* The MLP of every block is a sparse mixture of experts, described to the core as a
  :class:`lensadapters.moe.MoELayout`. transformers 5: ``mlp.gate`` (``OlmoeTopKRouter``) returns ``(logits,
  top_k_weights, top_k_index)`` and ``mlp.experts`` (``OlmoeExperts``) keeps every expert in ``gate_up_proj``
  ``[E, 2 * d_mlp, d_model]`` and ``down_proj`` ``[E, d_model, d_mlp]``; transformers 4.57: ``mlp.gate`` is a
  linear layer (the MoE block routes itself) and ``mlp.experts`` a ``ModuleList`` of ``gate_proj``/``up_proj``/
  ``down_proj`` MLPs.
* Routing: softmax over all experts in float32, top-``num_experts_per_tok``, renormalized only when
  ``norm_topk_prob`` (OLMoE-1B-7B does not: the experts' outputs are weighted by the raw probabilities), cast
  back to the router logits' dtype.
* transformers 4.57 computes OLMoE attention inside its attention classes (``OlmoeAttention``,
  ``OlmoeSdpaAttention``), not through transformers' attention interface: while a layer's ``hook_attn_scores``/
  ``hook_pattern`` is hooked, that layer's attention instance runs :class:`OlmoePatternBackend`'s forward
  (OLMoE's eager attention with the scores and pattern written out); transformers 5 uses the interface and the
  core's pattern backend.

Refused at wrap time with an explanation: ``clip_qkv`` (the model clamps queries, keys and values after their norms,
where ``hook_rot_q``/``hook_rot_k`` edits could not be honoured exactly; released OLMoE checkpoints have none),
``head_dim`` other than ``hidden_size / num_attention_heads`` (OLMoE's q/k norms assume it), rope types whose
rotation is not rotate-half, custom modeling code registered as ``olmoe``, a model without OLMoE's layout. Flash and
flex attention: every hook point but ``hook_attn_scores``/``hook_pattern`` (which name the fix).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from lensadapters import Architecture, LensAdaptersError, UnsupportedModelError, hf, hookimpl
from lensadapters.moe import MoELayout, Routing, stored_moe_layout

__version__ = "0.1.0"
# pre-norm blocks; q/k norms over the whole projection width as OLMo 2's (q_proj -> q_norm -> k_proj -> k_norm ->
# v_proj, then RoPE on the normed queries and keys); the MLP of every block is a mixture of experts (moe_layout)
FAMILY = hf.DecoderFamily.named("Olmoe", "olmoe", qk_norms=hf.qk_norms("bpf"), mlp=None)
ARCH = FAMILY.architecture(
    "OLMoE (OlmoeForCausalLM, OlmoeModel): sparse mixture of experts, q/k norms over the projection width, GQA, RoPE"
)
Tensor = torch.Tensor


def moe_layout(layer: nn.Module, config: Any) -> MoELayout:
    """The MoE description of one decoder layer, for the transformers version that built it."""
    routing = Routing(
        config.num_experts, config.num_experts_per_tok, normalize=bool(config.norm_topk_prob), weights_dtype="logits"
    )
    return stored_moe_layout(layer, "mlp", routing, ("gate_proj", "up_proj", "down_proj"))


# --- attention patterns under transformers 4.57 (attention computed inside OLMoE's attention classes) ------------


def _olmoe_scores(module: Any, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
    """Pre-mask scores as transformers 4.57's ``OlmoeAttention`` computes them: divided by ``sqrt(head_dim)``."""
    return torch.matmul(query, key.transpose(2, 3)) / math.sqrt(module.head_dim)


class OlmoePatternBackend:
    """Serves ``hook_attn_scores``/``hook_pattern`` for transformers 4.57's OLMoE, whose attention classes compute
    attention themselves.

    ``activate(layer, site)`` stores a ``forward`` in *that attention module instance's* ``__dict__`` (Python finds
    it before the class's): OLMoE's eager attention forward, step by step as transformers 4.57 writes it
    (projections, q/k norms, RoPE, KV-cache update, then the core's explicit attention: scores →
    ``hook_attn_scores`` → softmax → ``hook_pattern`` → values, then ``o_proj``). The projections and norms are the
    module's own submodules, so their hook points fire as usual. The returned handle's ``remove()`` deletes the
    instance attribute again (when the layer's last score/pattern hook goes, when a hook raises, on ``unwrap()``);
    the class, other instances and other layers are never touched.
    """

    def __init__(self, hooked: Any) -> None:
        self.modules: list[nn.Module] = list(hooked.attention_modules)
        self.config = hooked.hf_model.config

    def activate(self, layer: int, site: Any) -> Any:
        from transformers.models.olmoe import modeling_olmoe

        from lensadapters.plugin_api import override_instance_method, site_attention

        module: Any = self.modules[layer]  # OLMoE's attention: head_dim, num_heads, q_norm... read below
        if not issubclass(type(module), modeling_olmoe.OlmoeAttention) or "forward" in vars(module):
            raise LensAdaptersError(
                f"layer {layer}: hook_attn_scores/hook_pattern need transformers' OLMoE attention module; this "
                f"layer's is {type(module).__name__}"
                + (" with an instance 'forward' set by another tool" if "forward" in vars(module) else "")
            )
        implementation = hf.attention_implementation(self.config)
        attend = site_attention(site, module, _olmoe_scores)

        def forward(
            hidden_states: Tensor,
            attention_mask: Optional[Tensor] = None,
            position_ids: Optional[Tensor] = None,
            past_key_values: Any = None,
            output_attentions: bool = False,
            use_cache: bool = False,
            cache_position: Optional[Tensor] = None,
            position_embeddings: Optional[tuple[Tensor, Tensor]] = None,
            **kwargs: Any,
        ) -> tuple[Tensor, Optional[Tensor]]:
            if past_key_values is None:
                past_key_values = kwargs.pop("past_key_value", None)
            bsz, q_len, _ = hidden_states.size()
            query = module.q_norm(module.q_proj(hidden_states))
            key = module.k_norm(module.k_proj(hidden_states))
            value = module.v_proj(hidden_states)
            query = query.view(bsz, q_len, module.num_heads, module.head_dim).transpose(1, 2)
            key = key.view(bsz, q_len, module.num_key_value_heads, module.head_dim).transpose(1, 2)
            value = value.view(bsz, q_len, module.num_key_value_heads, module.head_dim).transpose(1, 2)
            if position_embeddings is None:  # transformers 4.57's decoder layers always pass them
                raise LensAdaptersError(f"layer {layer}: OLMoE attention called without position_embeddings")
            cos, sin = position_embeddings
            query, key = modeling_olmoe.apply_rotary_pos_emb(query, key, cos, sin)
            if past_key_values is not None:
                cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
                key, value = past_key_values.update(key, value, module.layer_idx, cache_kwargs)
            mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
            out, pattern = attend(
                query, key, value, mask, implementation=implementation, dropout=module.attention_dropout
            )
            out = module.o_proj(out.reshape(bsz, q_len, module.hidden_size))
            return out, (pattern if output_attentions else None)

        return override_instance_method(module, "forward", forward)  # a copy of the model gets the class's forward


def _computes_attention_itself(model: nn.Module) -> bool:
    """transformers 4.x: the attention classes compute attention without transformers' attention interface."""
    from transformers.models.olmoe import modeling_olmoe

    return hasattr(modeling_olmoe, "OlmoeSdpaAttention")


# --- adapter hooks -----------------------------------------------------------------------------------------------


def check(model: Any) -> None:
    """After the family's checks (which found each layer's ``mlp.gate`` and ``mlp.experts``): the experts, no
    ``clip_qkv``, q/k norms sized for the heads."""
    config = model.config
    missing = [
        f"{hf.join(FAMILY.base(model), 'layers')}.{i}.{p}"
        for i, layer in enumerate(FAMILY.layers(model))
        for p in hf.missing_expert_paths(layer, "mlp", ("gate_proj", "up_proj", "down_proj"))
    ]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__} has model_type 'olmoe' but not transformers' {FAMILY.family} experts layout "
            f"(missing: {', '.join(missing[:6])}); the {FAMILY.family} plugin supports transformers' {FAMILY.family} "
            f"classes"
        )
    if getattr(config, "clip_qkv", None) is not None:
        raise UnsupportedModelError(
            f"this OLMoE model clamps queries, keys and values to +-clip_qkv={config.clip_qkv} after the q/k norms: "
            f"an edit of hook_rot_q/hook_rot_k (or of a normed query) would be clamped again after the hook, so the "
            f"attention would not use the edited value. lensadapters-olmoe supports clip_qkv=None (every released "
            f"OLMoE checkpoint); set model.config.clip_qkv = None only if the checkpoint was trained without it"
        )
    n_heads, d_head = config.num_attention_heads, hf.head_dim(config)
    if d_head * n_heads != config.hidden_size:
        raise UnsupportedModelError(
            f"head_dim={d_head} with {n_heads} heads is not hidden_size={config.hidden_size}: OLMoE's "
            f"q/k norms are sized for head_dim = hidden_size / num_attention_heads"
        )


def config_fields(model: Any) -> dict[str, Any]:
    c = model.config
    extra = {"use_qk_norm": True, "qk_norm_over_heads": True, "norm_topk_prob": bool(c.norm_topk_prob)}
    return {
        "num_experts": c.num_experts,
        "experts_per_token": c.num_experts_per_tok,
        "extra": {**extra, "attention_bias": bool(getattr(c, "attention_bias", False))},
    }


@hookimpl
def lensadapters_attn_pattern(arch: Architecture, hooked: Any) -> Optional[OlmoePatternBackend]:
    if arch.name != ARCH.name or not _computes_attention_itself(hooked.hf_model):
        return None  # transformers 5: the attention interface, served by the core
    return OlmoePatternBackend(hooked)


def tiny_config(seed: int) -> Any:
    """An OLMoE-like toy, width 64, vocabulary 512, experts of width 48. Seed 0 is the demo's model: 2 layers, 4
    heads (OLMoE-1B-7B uses full multi-head attention), top-2 of 4 experts, no renormalization (as OLMoE-1B-7B).
    Other seeds vary the depth (1-3), the heads (GQA), the experts (2-8), top-k (1-3) and ``norm_topk_prob``."""
    from transformers import OlmoeConfig

    layers, (heads, kv), experts, top_k, norm = hf.toy_draw(
        seed,
        (2, (4, 4), 4, 2, False),
        [1, 2, 3],
        [(4, 2), (4, 4), (8, 2)],
        [2, 4, 8],
        lambda rng, layers, heads, experts: rng.randint(1, min(3, experts)),
        0.5,
    )
    return hf.toy_config(
        OlmoeConfig,
        layers,
        heads,
        kv,
        intermediate_size=48,
        rms_norm_eps=1e-5,
        **hf.router_fields(OlmoeConfig, experts, top_k),
        norm_topk_prob=norm,
        clip_qkv=None,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )


def _missing_moe(layer: nn.Module) -> list[str]:
    return hf.missing_paths(layer, ("mlp.gate", "mlp.experts"))


PLUGIN = hf.DecoderPlugin(
    ARCH, FAMILY, tiny_config, config=config_fields, check=check, missing_in_layer=_missing_moe, layer_mlp=moe_layout
).export(globals())
