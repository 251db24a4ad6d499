"""An independent reference of Gemma 4's text forward for exactness tests: the eager forward written out from the
Hugging Face modules' live weights (only the rotary module is called, for its ``(cos, sin)``), every hook point's
value recorded and edits applied where the points are (:class:`Reference`), the edits the tests make at each point
(:func:`perturb`) and the reference's edits equal to them (:func:`reference_edit`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

__all__ = ["Edit", "HEAD_INPUTS", "N_EXPERTS", "Reference", "perturb", "reference_edit"]

Edit = Callable[[torch.Tensor], torch.Tensor]
F = torch.nn.functional


class Reference:
    """Gemma 4's eager forward from the formulas, with the points recorded and ``edits`` applied."""

    def __init__(self, model: Any, edits: Optional[dict[str, Edit]] = None) -> None:
        self.model, self.edits = model, edits or {}
        self.values: dict[str, torch.Tensor] = {}
        self.shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per layer type: the last computed k, v
        self.eps = model.config.rms_norm_eps

    def point(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if name in self.edits:
            value = self.edits[name](value)
        self.values[name] = value
        return value

    def rms(self, name: Optional[str], x: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
        scale = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        if name is not None:
            scale = self.point(name + ".hook_scale", scale)
        normalized = x / scale
        if name is not None:
            normalized = self.point(name + ".hook_normalized", normalized)
        return normalized if weight is None else normalized * weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m, c = self.model.model, self.model.config
        d, n_layers, ple = c.hidden_size, c.num_hidden_layers, getattr(c, "hidden_size_per_layer_input", 0)
        x = self.point("hook_embed", m.embed_tokens.weight[ids] * torch.tensor(math.sqrt(d)))
        if ple:
            tokens = (m.embed_tokens_per_layer.weight[ids] * torch.tensor(math.sqrt(ple))).unflatten(
                -1, (n_layers, ple)
            )
            context = self.rms(
                None,
                (x @ m.per_layer_model_projection.weight.T * d**-0.5).unflatten(-1, (n_layers, ple)),
                m.per_layer_projection_norm.weight,
            )
            per_layer = (context + tokens) * 2**-0.5
        positions = torch.arange(ids.shape[1])[None]
        for i, layer in enumerate(m.layers):
            kind = c.layer_types[i]
            cos, sin = m.rotary_emb(x, positions, kind)
            window = c.sliding_window if kind == "sliding_attention" else None
            x = self.block(i, layer, x, per_layer[:, :, i] if ple else None, cos, sin, window)
        final = self.rms("ln_final", x, m.norm.weight)
        logits = final @ self.model.lm_head.weight.T
        cap = c.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if cap else logits

    def block(
        self,
        i: int,
        layer: Any,
        x: torch.Tensor,
        given: Optional[torch.Tensor],
        cos: Any,
        sin: Any,
        window: Optional[int],
    ) -> torch.Tensor:
        p = f"blocks.{i}."
        if given is not None:
            given = self.point(p + "hook_per_layer_input", given)
        x = self.point(p + "hook_resid_pre", x)
        attn = layer.self_attn
        n = self.rms(p + "ln1", x, layer.input_layernorm.weight)

        def rope(t: torch.Tensor) -> torch.Tensor:
            half = t.shape[-1] // 2
            rotated = torch.cat([-t[..., half:], t[..., :half]], -1)
            return t * cos[:, :, None] + rotated * sin[:, :, None]

        hd = attn.head_dim
        q = self.point(p + "attn.hook_q", (n @ attn.q_proj.weight.T).unflatten(-1, (-1, hd)))
        q = self.point(p + "attn.hook_rot_q", rope(self.rms(p + "attn.q_norm", q, attn.q_norm.weight)))
        if attn.is_kv_shared_layer:  # the keys and values of the last earlier layer of this type
            k, v = self.shared[attn.layer_type]
        else:
            k = (n @ attn.k_proj.weight.T).unflatten(-1, (-1, hd))
            v = k if attn.v_proj is None else (n @ attn.v_proj.weight.T).unflatten(-1, (-1, hd))  # attention_k_eq_v
            k, v = self.point(p + "attn.hook_k", k), self.point(p + "attn.hook_v", v)
            k = self.point(p + "attn.hook_rot_k", rope(self.rms(p + "attn.k_norm", k, attn.k_norm.weight)))
            v = self.rms(p + "attn.v_norm", v, None)
            self.shared[attn.layer_type] = k, v
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)  # Gemma 4's attention scale is 1
        qpos, kpos = torch.arange(q.shape[1])[:, None], torch.arange(q.shape[1])[None]
        allowed = (kpos <= qpos) & ((qpos - kpos < window) if window else True)
        scores = self.point(p + "attn.hook_attn_scores", scores.masked_fill(~allowed, float("-inf")))
        pattern = self.point(p + "attn.hook_pattern", scores.softmax(-1))
        z = self.point(p + "attn.hook_z", torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        W_O = attn.o_proj.weight.T.unflatten(0, (-1, hd))
        result = self.point(p + "attn.hook_result", torch.einsum("bqhd,hdm->bqhm", z, W_O))
        attn_out = self.point(
            p + "hook_attn_out", self.rms(p + "ln1_post", result.sum(2), layer.post_attention_layernorm.weight)
        )
        mid = self.point(p + "hook_resid_mid", x + attn_out)
        mlp_in = self.point(p + "hook_mlp_in", mid)
        n2 = self.rms(p + "ln2", mlp_in, layer.pre_feedforward_layernorm.weight)
        pre = self.point(p + "mlp.hook_pre", n2 @ layer.mlp.gate_proj.weight.T)
        linear = self.point(p + "mlp.hook_pre_linear", n2 @ layer.mlp.up_proj.weight.T)
        post = self.point(p + "mlp.hook_post", F.gelu(pre, approximate="tanh") * linear)
        summed = post @ layer.mlp.down_proj.weight.T
        # the experts beside the dense MLP (none in a unified model), each branch normalized, then their sum
        if getattr(layer, "enable_moe_block", False):
            dense = self.rms(None, summed, layer.post_feedforward_layernorm_1.weight)
            summed = self.point(p + "mlp.hook_dense_out", dense) + self.experts(p, layer, mlp_in)
        mlp_out = self.point(
            p + "hook_mlp_out", self.rms(p + "ln2_post", summed, layer.post_feedforward_layernorm.weight)
        )
        h = mid + mlp_out
        if given is not None:
            gate = self.point(
                p + "hook_per_layer_gate", F.gelu(h @ layer.per_layer_input_gate.weight.T, approximate="tanh")
            )
            branch = (gate * given) @ layer.per_layer_projection.weight.T
            h = h + self.point(p + "hook_per_layer_out", self.rms(None, branch, layer.post_per_layer_input_norm.weight))
        return self.point(p + "hook_resid_post", h * layer.layer_scalar)

    def experts(self, p: str, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """The MoE branch on the residual stream ``x``: the router's own norm and scale, softmax, top-k,
        renormalized, times the per-expert scale; the experts on their own pre-norm, slot by slot then token."""
        router, experts = layer.router, layer.experts
        scaled = self.rms(None, x, None) * router.scale * x.shape[-1] ** -0.5
        logits = self.point(p + "mlp.hook_router_logits", scaled @ router.proj.weight.T)
        probs = self.point(p + "mlp.hook_expert_weights", logits.float().softmax(-1))
        top, index = probs.topk(router.config.top_k_experts, dim=-1)
        weights = top / top.sum(-1, keepdim=True) * router.per_expert_scale[index]
        index = self.point(p + "mlp.hook_expert_indices", index).flatten(0, 1)
        weights = self.point(p + "mlp.hook_routing_weights", weights).flatten(0, 1)
        rows_in = self.rms(None, x, layer.pre_feedforward_layernorm_2.weight).flatten(0, 1)
        out, m = torch.zeros_like(rows_in), experts.intermediate_dim
        for e in range(experts.num_experts):
            slot, token = torch.where(index.T == e)
            rows, at = rows_in[token], f"{p}mlp.experts.{e}."
            gate = self.point(at + "hook_gate", rows @ experts.gate_up_proj[e, :m].T)
            up = self.point(at + "hook_pre", rows @ experts.gate_up_proj[e, m:].T)
            post = self.point(at + "hook_post", F.gelu(gate, approximate="tanh") * up)
            result = self.point(at + "hook_result", post @ experts.down_proj[e].T * weights[token, slot, None])
            out = out.index_add(0, token, result)
        moe = self.rms(None, out.view_as(x), layer.post_feedforward_layernorm_2.weight)
        return self.point(p + "mlp.hook_moe_out", moe)


N_EXPERTS = 4


def perturb(name: str) -> Edit:
    seed = sum(map(ord, name))

    def edit(t: torch.Tensor) -> torch.Tensor:
        if name.endswith("hook_expert_indices"):  # every token to the next experts
            return (t + 1) % N_EXPERTS
        noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed), dtype=t.dtype)
        if name.endswith("hook_pattern"):
            return (t + 0.1 * noise.abs()) / (t + 0.1 * noise.abs()).sum(-1, keepdim=True) * (t.sum(-1, keepdim=True))
        if name.endswith("hook_scale"):
            return t * (1.5 + 0.25 * noise.abs())
        return t + 0.3 * noise.masked_fill(~torch.isfinite(t), 0)

    return edit


HEAD_INPUTS = {"hook_q_input": "q", "hook_k_input": "k", "hook_v_input": "v"}


def reference_edit(model: Any, name: str, values: dict[str, torch.Tensor]) -> dict[str, Edit]:
    """The reference's edits doing what ``perturb(name)`` at ``name`` does. A per-head input (``hook_q_input``...) is
    each head's copy of ``hook_resid_pre``, normalized by ln1 on its own (TransformerLens): its edit reaches that
    projection only, so the reference replaces the projection's output."""
    block, _, short = name.rpartition(".")
    if short not in HEAD_INPUTS:
        return {name: perturb(name)}
    x = HEAD_INPUTS[short]
    layer = model.model.layers[int(name.split(".")[1])]
    W = getattr(layer.self_attn, f"{x}_proj").weight

    def projected(t: torch.Tensor) -> torch.Tensor:
        heads = t.shape[2]
        per_head = perturb(name)(values[block + ".hook_resid_pre"].unsqueeze(-2).repeat_interleave(heads, -2))
        scale = (per_head.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps).sqrt()
        normed = per_head / scale * layer.input_layernorm.weight
        return torch.einsum("bphm,hdm->bphd", normed, W.unflatten(0, (heads, -1)))

    return {f"{block}.attn.hook_{x}": projected}
