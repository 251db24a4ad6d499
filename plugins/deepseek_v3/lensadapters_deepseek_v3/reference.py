"""The exactness reference of the DeepSeek-V3 plugin's tests (not imported by the plugin itself).

:func:`reference_run`: DeepSeek-V3's forward written out independently in float64 from a transformers model's
parameters (no lensadapters code): multi-head latent attention, grouped sigmoid routing with the correction bias,
shared experts, dense first layers; or DeepSeek-V2's (``model_type: "deepseek_v2"``: complex rotation of the
interleaved rope pairs, kept interleaved; a softmax router, greedy or group-limited greedy, not renormalized); every
hook point the plugin serves named as lensadapters names it, with an optional edit at each. TransformerLens 2.18 has
no DeepSeek model to compare with.
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
    """``(logits, values)`` of DeepSeek-V3 on unpadded ``input_ids``, in float64, from ``model``'s parameters;
    ``edits`` maps hook names to functions ``(value, hook) -> value`` applied where lensadapters applies them."""
    point = ReferencePoints(edits)
    values = point.values

    p = {name: t.detach().double() for name, t in model.named_parameters()}
    p.update({name: t.detach().double() for name, t in model.named_buffers() if "e_score_correction_bias" in name})
    c = model.config
    base = "model." if any(n.startswith("model.") for n in p) else ""
    b, n = input_ids.shape
    heads, nope, rope, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    positions = torch.arange(n)[None].expand(b, -1)
    v2 = c.model_type == "deepseek_v2"
    with torch.no_grad():  # the model's own angles, computed in float32 as the model does
        angles = model.get_submodule(base + "rotary_emb")(torch.zeros(1), positions)
        if v2:  # complex rotations e^{i theta} [b, p, rope/2]
            cos, sin = angles.real.double(), angles.imag.double()
        else:
            cos, sin = (t.double()[..., : rope // 2] for t in angles)
    interleave = bool(getattr(c, "rope_interleave", False))

    def rotate(x: Tensor) -> Tensor:
        if not v2:
            return rotate_by(x, cos, sin, interleave)
        x1, x2, co, si = x[..., 0::2], x[..., 1::2], cos[:, :, None, :], sin[:, :, None, :]
        return torch.stack([x1 * co - x2 * si, x1 * si + x2 * co], dim=-1).flatten(-2)  # (x1 + i x2) e^{i theta}

    def linear(x: Tensor, name: str) -> Tensor:
        return x @ p[name + ".weight"].T + p.get(name + ".bias", 0.0)

    def plain_rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight

    def rms(prefix: str, x: Tensor, weight: Tensor) -> Tensor:
        scale = point(f"{prefix}.hook_scale", (x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps).sqrt())
        return point(f"{prefix}.hook_normalized", x / scale) * weight

    allowed = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    x = point("hook_embed", p[base + "embed_tokens.weight"][input_ids])
    for layer in range(c.num_hidden_layers):
        pre, w = f"blocks.{layer}.", f"{base}layers.{layer}."
        a, ap = pre + "attn.", w + "self_attn."
        x = point(pre + "hook_resid_pre", x)
        h = rms(pre + "ln1", x, p[w + "input_layernorm.weight"])
        if c.q_lora_rank is None:
            q = linear(h, ap + "q_proj")
        else:
            latent = plain_rms(linear(h, ap + "q_a_proj"), p[ap + "q_a_layernorm.weight"], 1e-6)
            q = linear(point(a + "hook_q_latent", latent), ap + "q_b_proj")
        q = point(a + "hook_q", q.reshape(b, n, heads, nope + rope))
        q = point(a + "hook_rot_q", torch.cat([q[..., :nope], rotate(q[..., nope:])], -1))
        compressed = linear(h, ap + "kv_a_proj_with_mqa")
        k_rope = point(a + "hook_k_rope", compressed[..., c.kv_lora_rank :])
        kv = point(
            a + "hook_kv_latent", plain_rms(compressed[..., : c.kv_lora_rank], p[ap + "kv_a_layernorm.weight"], 1e-6)
        )
        kv = linear(kv, ap + "kv_b_proj").reshape(b, n, heads, nope + dv)
        k = point(a + "hook_k", torch.cat([kv[..., :nope], k_rope[:, :, None, :].expand(b, n, heads, rope)], -1))
        k = point(a + "hook_rot_k", torch.cat([k[..., :nope], rotate(k[..., nope:])], -1))
        v = point(a + "hook_v", kv[..., nope:])
        scaling = float(model.get_submodule(ap[:-1]).scaling)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scaling
        scores = point(a + "hook_attn_scores", scores.masked_fill(~allowed, float("-inf")))
        pattern = point(a + "hook_pattern", torch.softmax(scores, dim=-1))
        z = point(a + "hook_z", torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        W_O = p[ap + "o_proj.weight"].T.reshape(heads, dv, -1)
        result = point(a + "hook_result", torch.einsum("bqhd,hdm->bqhm", z, W_O))
        attn_out = point(pre + "hook_attn_out", result.sum(-2) + p.get(ap + "o_proj.bias", 0.0))
        x = point(pre + "hook_resid_mid", x + attn_out)
        h = rms(pre + "ln2", point(pre + "hook_mlp_in", x), p[w + "post_attention_layernorm.weight"])
        if layer < c.first_k_dense_replace:
            gate = point(pre + "mlp.hook_pre", linear(h, w + "mlp.gate_proj"))
            up = point(pre + "mlp.hook_pre_linear", linear(h, w + "mlp.up_proj"))
            out = linear(point(pre + "mlp.hook_post", torch.nn.functional.silu(gate) * up), w + "mlp.down_proj")
        else:
            out = _moe(point, pre, w, p, c, h)
        x = point(pre + "hook_resid_post", x + point(pre + "hook_mlp_out", out))
    x = rms("ln_final", x, p[base + "norm.weight"])
    head = p.get("lm_head.weight", p[base + "embed_tokens.weight"])
    return x @ head.T, values


def _moe(point: Callable[[str, Tensor], Tensor], pre: str, w: str, p: dict, c: Any, h: Tensor) -> Tensor:
    """The mixture of experts of one block on its (normed) input ``h`` ``[b, p, d_model]``, shared experts added."""
    lead, flat = h.shape[:-1], h.reshape(-1, h.shape[-1])
    m = pre + "mlp."
    n_experts, k, n_group, topk_group = c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group

    def shown(name: str, t: Tensor) -> Tensor:  # the routing points are shown as [b, p, ...]
        return point(name, t.reshape(*lead, t.shape[-1])).reshape(-1, t.shape[-1])

    logits = shown(m + "hook_router_logits", flat @ p[w + "mlp.gate.weight"].T)
    v2 = c.model_type == "deepseek_v2"
    if v2:  # a softmax, no correction bias; greedy is one group kept
        probs = shown(m + "hook_expert_weights", torch.softmax(logits, dim=-1))
        choice = probs
        if c.topk_method == "greedy":
            n_group, topk_group = 1, 1
        group_scores = choice.reshape(-1, n_group, n_experts // n_group).amax(-1)
    else:
        probs = shown(m + "hook_expert_weights", torch.sigmoid(logits))
        choice = probs + p[w + "mlp.gate.e_score_correction_bias"]
        group_scores = choice.reshape(-1, n_group, n_experts // n_group).topk(2, dim=-1).values.sum(-1)
    kept = torch.zeros_like(group_scores).scatter(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
    import transformers

    dropped = float("-inf") if int(transformers.__version__.split(".")[0]) >= 5 and not v2 else 0.0
    choice = choice.masked_fill(kept.repeat_interleave(n_experts // n_group, dim=1) == 0, dropped)
    index = choice.topk(k, dim=-1, sorted=False).indices
    weights = probs.gather(1, index)
    if c.norm_topk_prob and not v2:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    index = shown(m + "hook_expert_indices", index)
    weights = shown(m + "hook_routing_weights", weights * c.routed_scaling_factor)
    out = torch.zeros_like(flat)
    fused = w + "mlp.experts.gate_up_proj" in p
    for e in range(n_experts):
        slot, token = torch.where(index.T == e)
        rows = flat[token]
        if fused:
            gate_w, up_w = p[w + "mlp.experts.gate_up_proj"][e].chunk(2, dim=0)
            down_w = p[w + "mlp.experts.down_proj"][e]
        else:
            gate_w, up_w, down_w = (p[f"{w}mlp.experts.{e}.{x}_proj.weight"] for x in ("gate", "up", "down"))
        gate = point(f"{m}experts.{e}.hook_gate", rows @ gate_w.T)
        up = point(f"{m}experts.{e}.hook_pre", rows @ up_w.T)
        post = point(f"{m}experts.{e}.hook_post", torch.nn.functional.silu(gate) * up)
        result = point(f"{m}experts.{e}.hook_result", (post @ down_w.T) * weights[token, slot, None])
        out.index_add_(0, token, result)
    s = w + "mlp.shared_experts."
    shared = (torch.nn.functional.silu(flat @ p[s + "gate_proj.weight"].T) * (flat @ p[s + "up_proj.weight"].T)) @ p[
        s + "down_proj.weight"
    ].T
    return (out + shared).reshape(h.shape)
