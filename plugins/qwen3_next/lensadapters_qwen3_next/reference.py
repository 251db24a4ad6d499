"""An independent reference of a Qwen3-Next gated DeltaNet layer's values, for the tests: plain PyTorch on the
Hugging Face module's parameters, with its own token-by-token delta rule (the model runs transformers' chunked one)
and its own reading of the fused projections' per-key-head layout (no cache: a full sequence from a zero state)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.nn import functional as F

Tensor = torch.Tensor
Edit = Callable[[str, Tensor], Tensor]


def unfuse(m: Any, qkvz: Tensor, ba: Tensor) -> dict[str, Tensor]:
    """The per-role views of ``in_proj_qkvz``'s and ``in_proj_ba``'s outputs, read key head by key head: for key
    head ``g``, ``qkvz`` holds ``[q_g | k_g | v_g | z_g]`` (``dk``, ``dk``, ``r*dv``, ``r*dv``), ``ba`` holds
    ``[b_g | a_g]`` (``r``, ``r``), ``r`` value heads per key head."""
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    r, width = hv // hk, 2 * dk + 2 * (hv // hk) * dv
    qs, ks, vs, zs, bs, as_ = [], [], [], [], [], []
    for g in range(hk):
        row = qkvz[..., g * width : (g + 1) * width]
        qs.append(row[..., :dk])
        ks.append(row[..., dk : 2 * dk])
        for j in range(r):
            vs.append(row[..., 2 * dk + j * dv : 2 * dk + (j + 1) * dv])
            zs.append(row[..., 2 * dk + r * dv + j * dv : 2 * dk + r * dv + (j + 1) * dv])
        bs.append(ba[..., g * 2 * r : g * 2 * r + r])
        as_.append(ba[..., g * 2 * r + r : (g + 1) * 2 * r])
    return {
        "hook_qkv": torch.cat(qs + ks + vs, dim=-1),
        "hook_z": torch.stack(zs, dim=-2),
        "hook_b": torch.cat(bs, dim=-1),
        "hook_a": torch.cat(as_, dim=-1),
    }


def refuse(m: Any, views: dict[str, Tensor], qkvz: Tensor, ba: Tensor) -> tuple[Tensor, Tensor]:
    """The fused outputs with the per-role ``views`` written back where :func:`unfuse` read them."""
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    r, width = hv // hk, 2 * dk + 2 * (hv // hk) * dv
    qkvz, ba = qkvz.clone(), ba.clone()
    qkv, z, b, a = views["hook_qkv"], views["hook_z"], views["hook_b"], views["hook_a"]
    kd = hk * dk
    for g in range(hk):
        base = g * width
        qkvz[..., base : base + dk] = qkv[..., g * dk : (g + 1) * dk]
        qkvz[..., base + dk : base + 2 * dk] = qkv[..., kd + g * dk : kd + (g + 1) * dk]
        for j in range(r):
            h = g * r + j
            qkvz[..., base + 2 * dk + j * dv : base + 2 * dk + (j + 1) * dv] = qkv[
                ..., 2 * kd + h * dv : 2 * kd + (h + 1) * dv
            ]
            qkvz[..., base + 2 * dk + r * dv + j * dv : base + 2 * dk + r * dv + (j + 1) * dv] = z[..., h, :]
            ba[..., g * 2 * r + j] = b[..., h]
            ba[..., g * 2 * r + r + j] = a[..., h]
    return qkvz, ba


def _l2(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The gated delta rule token by token, in float32, from a zero state: ``q``/``k`` ``[b, p, hk, dk]`` (L2
    normalized here, the queries scaled by ``dk ** -0.5``, each key head shared by ``hv / hk`` value heads), ``v``
    ``[b, p, hv, dv]``, ``g``/``beta`` ``[b, p, hv]``; the output ``[b, p, hv, dv]`` in ``q``'s dtype."""
    ratio = v.shape[2] // q.shape[2]
    q, k = (_l2(x.float()).repeat_interleave(ratio, dim=2) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = v.float(), g.float(), beta.float()
    b, p, h, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1])
    out = []
    for t in range(p):
        state = state * g[:, t, :, None, None].exp()
        remembered = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1)


def deltanet_reference(m: Any, hidden: Tensor, edit: Optional[Edit] = None) -> tuple[dict[str, Tensor], Tensor]:
    """``({point: value}, output)`` of the gated DeltaNet ``m`` on its input ``hidden`` ``[b, p, d_model]``;
    ``edit(name, value)`` replaces a point's value (names as in
    :data:`~lensadapters.plugin_api.GATED_DELTANET_POINTS`, without the ``linear_attn.`` prefix)."""
    values: dict[str, Tensor] = {}

    def at(name: str, value: Tensor) -> Tensor:
        value = edit(name, value) if edit is not None else value
        values[name] = value
        return value

    bsz, p, _ = hidden.shape
    views = unfuse(m, hidden @ m.in_proj_qkvz.weight.T, hidden @ m.in_proj_ba.weight.T)
    qkv, z = at("hook_qkv", views["hook_qkv"]), at("hook_z", views["hook_z"])
    beta_logit, a = at("hook_b", views["hook_b"]), at("hook_a", views["hook_a"])
    kernel = m.conv1d.weight.shape[-1]
    conv = F.conv1d(F.pad(qkv.transpose(1, 2), (kernel - 1, 0)), m.conv1d.weight, groups=qkv.shape[-1])
    conv = at("hook_conv", F.silu(conv).transpose(1, 2))
    kd = m.num_k_heads * m.head_k_dim
    q, k, v = conv[..., :kd], conv[..., kd : 2 * kd], conv[..., 2 * kd :]
    q = at("hook_q", q.unflatten(-1, (m.num_k_heads, m.head_k_dim)))
    k = at("hook_k", k.unflatten(-1, (m.num_k_heads, m.head_k_dim)))
    v = at("hook_v", v.unflatten(-1, (m.num_v_heads, m.head_v_dim)))
    beta = at("hook_beta", torch.sigmoid(beta_logit))
    decay = at("hook_decay", -torch.exp(m.A_log.float()) * F.softplus(a.float() + m.dt_bias))
    core = at("hook_recurrent", delta_rule(q, k, v, decay, beta).to(q.dtype))
    rms = core.float().pow(2).mean(-1, keepdim=True).add(m.norm.variance_epsilon).rsqrt()
    gated = at("hook_gated", (m.norm.weight * (core.float() * rms).to(core.dtype)) * F.silu(z.float()))
    return values, gated.reshape(bsz, p, -1).to(hidden.dtype) @ m.out_proj.weight.T
