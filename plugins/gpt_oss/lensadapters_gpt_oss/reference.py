"""References for GPT-OSS comparisons (not imported by the plugin itself).

* :func:`reference_run`: GPT-OSS's forward written out independently in float64 from a transformers model's
  parameters (no lensadapters code), with every hook point the plugin serves named as lensadapters names it and an
  optional edit at each: the exactness reference of the plugin's tests.
* :func:`tl_gpt_oss`: TransformerLens 2.18's own GPT-OSS (``HookedTransformer`` with its ``GptOssMoE``, config as
  its ``GptOssForCausalLM`` entry builds it, weights by its ``convert_gpt_oss_weights``, no weight processing);
  needs ``transformer-lens`` 2.x (transformers 4.x). TransformerLens 2.18 has no attention sinks, no sliding window
  and no YaRN: it agrees with the model only where those change nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from lensadapters.testing.reference import ReferencePoints, rotate_by

Tensor = torch.Tensor
Edit = Callable[[Tensor, Any], Tensor]


def reference_run(
    model: Any, input_ids: Tensor, edits: Optional[dict[str, Edit]] = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(logits, values)`` of GPT-OSS on unpadded ``input_ids``, in float64, from ``model``'s parameters; ``edits``
    maps hook names to functions ``(value, hook) -> value`` applied where lensadapters applies them."""
    point = ReferencePoints(edits)
    values = point.values

    p = {name: t.detach().double() for name, t in model.named_parameters()}
    c = model.config
    base = "model." if any(n.startswith("model.") for n in p) else ""
    b, n = input_ids.shape
    heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    positions = torch.arange(n)[None].expand(b, -1)
    rotary = model.get_submodule(base + "rotary_emb")
    with torch.no_grad():  # the model's own angles (YaRN included), computed in float32 as the model does
        cos, sin = (t.double() for t in rotary(torch.zeros(1), positions))

    def rms(prefix: str, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        scale = point(f"{prefix}.hook_scale", (x.pow(2).mean(-1, keepdim=True) + eps).sqrt())
        return point(f"{prefix}.hook_normalized", x / scale) * weight

    i_idx, j_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    x = point("hook_embed", p[base + "embed_tokens.weight"][input_ids])
    for layer in range(c.num_hidden_layers):
        pre, w = f"blocks.{layer}.", f"{base}layers.{layer}."
        x = point(pre + "hook_resid_pre", x)
        h = rms(pre + "ln1", x, p[w + "input_layernorm.weight"], c.rms_norm_eps)

        def proj(name: str, n_heads: int, h: Tensor = h, w: str = w) -> Tensor:
            out = h @ p[f"{w}self_attn.{name}_proj.weight"].T + p[f"{w}self_attn.{name}_proj.bias"]
            return out.reshape(b, n, n_heads, d)

        q = point(pre + "attn.hook_rot_q", rotate_by(point(pre + "attn.hook_q", proj("q", heads)), cos, sin))
        k = point(pre + "attn.hook_rot_k", rotate_by(point(pre + "attn.hook_k", proj("k", kv)), cos, sin))
        v = point(pre + "attn.hook_v", proj("v", kv))
        k, v = (t.repeat_interleave(heads // kv, dim=2) for t in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
        allowed = j_idx <= i_idx
        if c.layer_types[layer] == "sliding_attention":
            allowed = allowed & (i_idx - j_idx < c.sliding_window)
        scores = point(pre + "attn.hook_attn_scores", scores.masked_fill(~allowed, float("-inf")))
        sink = p[w + "self_attn.sinks"].reshape(1, -1, 1, 1).expand(b, -1, n, 1)
        pattern = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        pattern = point(pre + "attn.hook_pattern", pattern)
        z = point(pre + "attn.hook_z", torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        W_O = p[w + "self_attn.o_proj.weight"].T.reshape(heads, d, -1)
        result = point(pre + "attn.hook_result", torch.einsum("bqhd,hdm->bqhm", z, W_O))
        attn_out = point(pre + "hook_attn_out", result.sum(-2) + p[w + "self_attn.o_proj.bias"])
        x = point(pre + "hook_resid_mid", x + attn_out)
        h = rms(pre + "ln2", point(pre + "hook_mlp_in", x), p[w + "post_attention_layernorm.weight"], c.rms_norm_eps)
        x = point(pre + "hook_resid_post", x + point(pre + "hook_mlp_out", _moe(point, pre, w, p, c, h)))
    x = rms("ln_final", x, p[base + "norm.weight"], c.rms_norm_eps)
    head = p.get("lm_head.weight", p[base + "embed_tokens.weight"])
    return x @ head.T, values


def _moe(point: Callable[[str, Tensor], Tensor], pre: str, w: str, p: dict, c: Any, h: Tensor) -> Tensor:
    """The mixture of experts of one block on its (normed) input ``h`` ``[b, p, d_model]``."""
    lead, flat = h.shape[:-1], h.reshape(-1, h.shape[-1])
    m = pre + "mlp."
    k, n_experts = c.num_experts_per_tok, c.num_local_experts

    def shown(name: str, t: Tensor) -> Tensor:  # the routing points are shown as [b, p, ...]
        return point(name, t.reshape(*lead, t.shape[-1])).reshape(-1, t.shape[-1])

    logits = shown(m + "hook_router_logits", flat @ p[w + "mlp.router.weight"].T + p[w + "mlp.router.bias"])
    top, index = torch.topk(logits, k, dim=-1)
    probs = torch.zeros_like(logits).scatter(-1, index, torch.softmax(top, dim=-1))
    probs = shown(m + "hook_expert_weights", probs)
    index = shown(m + "hook_expert_indices", index)
    weights = shown(m + "hook_routing_weights", probs.gather(-1, torch.topk(logits, k, dim=-1).indices))
    gate_up, gate_up_b = p[w + "mlp.experts.gate_up_proj"], p[w + "mlp.experts.gate_up_proj_bias"]
    down, down_b = p[w + "mlp.experts.down_proj"], p[w + "mlp.experts.down_proj_bias"]
    limit, alpha = float(c.swiglu_limit), float(c.swiglu_alpha)
    out = torch.zeros_like(flat)
    for e in range(n_experts):
        slot, token = torch.where(index.T == e)
        rows = flat[token]
        gate = point(f"{m}experts.{e}.hook_gate", rows @ gate_up[e][:, ::2] + gate_up_b[e][::2])
        up = point(f"{m}experts.{e}.hook_pre", rows @ gate_up[e][:, 1::2] + gate_up_b[e][1::2])
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        post = point(f"{m}experts.{e}.hook_post", (u + 1) * g * torch.sigmoid(alpha * g))
        result = point(f"{m}experts.{e}.hook_result", (post @ down[e] + down_b[e]) * weights[token, slot, None])
        out.index_add_(0, token, result)
    return out.reshape(h.shape)


def tl_gpt_oss(model: Any) -> Any:
    """TransformerLens 2.18's ``HookedTransformer`` for ``model`` (its GPT-OSS config entry and weight conversion,
    float32, no processing)."""
    from transformer_lens.pretrained.weight_conversions import convert_gpt_oss_weights

    from lensadapters.testing.tl_compare import hooked_transformer, tl_config_from_hf

    fields = tl_config_from_hf(model)
    return hooked_transformer(model, convert_gpt_oss_weights, fields)
