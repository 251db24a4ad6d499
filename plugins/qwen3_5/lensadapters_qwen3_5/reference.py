"""An independent reference of a gated DeltaNet layer's values, from the Hugging Face module's parameters and
transformers' token-by-token delta rule (the model runs the chunked one), for the tests (no cache: a full
sequence from a zero state)."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch.nn import functional as F

Tensor = torch.Tensor
Edit = Callable[[str, Tensor], Tensor]


def deltanet_reference(m: Any, hidden: Tensor, edit: Optional[Edit] = None) -> tuple[dict[str, Tensor], Tensor]:
    """``({point: value}, output)`` of the gated DeltaNet ``m`` on its input ``hidden`` ``[b, p, d_model]``;
    ``edit(name, value)`` replaces a point's value (names as in :mod:`lensadapters_qwen3_5.mixer`, without the
    ``linear_attn.`` prefix)."""
    modeling = sys.modules[type(m).__module__]
    values: dict[str, Tensor] = {}

    def at(name: str, value: Tensor) -> Tensor:
        value = edit(name, value) if edit is not None else value
        values[name] = value
        return value

    b, p, _ = hidden.shape
    qkv = at("hook_qkv", hidden @ m.in_proj_qkv.weight.T)
    z = at("hook_z", (hidden @ m.in_proj_z.weight.T).unflatten(-1, (-1, m.head_v_dim)))
    beta_logit = at("hook_b", hidden @ m.in_proj_b.weight.T)
    a = at("hook_a", hidden @ m.in_proj_a.weight.T)
    kernel = m.conv1d.weight.shape[-1]
    conv = F.conv1d(F.pad(qkv.transpose(1, 2), (kernel - 1, 0)), m.conv1d.weight, groups=qkv.shape[-1])
    conv = at("hook_conv", F.silu(conv).transpose(1, 2))
    q, k, v = conv.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = at("hook_q", q.unflatten(-1, (-1, m.head_k_dim)))
    k = at("hook_k", k.unflatten(-1, (-1, m.head_k_dim)))
    v = at("hook_v", v.unflatten(-1, (-1, m.head_v_dim)))
    beta = at("hook_beta", torch.sigmoid(beta_logit))
    decay = at("hook_decay", -torch.exp(m.A_log.float()) * F.softplus(a.float() + m.dt_bias))
    core, _ = modeling.torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    core = at("hook_recurrent", core)
    rms = core.float().pow(2).mean(-1, keepdim=True).add(m.norm.variance_epsilon).rsqrt()
    gated = at("hook_gated", (m.norm.weight * (core.float() * rms).to(core.dtype)) * F.silu(z.float()))
    return values, gated.reshape(b, p, -1).to(hidden.dtype) @ m.out_proj.weight.T
