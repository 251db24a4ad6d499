"""The gated DeltaNet (linear attention) layers of Qwen 3.5: their points and the site that serves them.

Points (relative to ``blocks.{i}.``; ``hk``/``hv`` key/value heads, ``dk``/``dv`` their sizes), in the order they
fire:

* ``linear_attn.hook_qkv`` ``[b, p, 2*hk*dk + hv*dv]``: ``in_proj_qkv``'s output (queries, keys, values before the
  convolution);
* ``linear_attn.hook_z`` ``[b, p, hv, dv]``: ``in_proj_z``'s output, the gate of the output norm;
* ``linear_attn.hook_b`` / ``hook_a`` ``[b, p, hv]``: ``in_proj_b``/``in_proj_a``'s outputs;
* ``linear_attn.hook_conv`` ``[b, p, 2*hk*dk + hv*dv]``: the causal depthwise convolution's output after its
  activation;
* ``linear_attn.hook_q`` / ``hook_k`` ``[b, p, hk, dk]``, ``hook_v`` ``[b, p, hv, dv]``: that output split per head
  (before the delta rule's L2 norm of queries and keys);
* ``linear_attn.hook_beta`` ``[b, p, hv]``: ``sigmoid(b)``, the write strength;
* ``linear_attn.hook_decay`` ``[b, p, hv]`` (float32): ``g = -exp(A_log) * softplus(a + dt_bias)``, the log of the
  state's decay per token;
* ``linear_attn.hook_recurrent`` ``[b, p, hv, dv]``: the delta rule's output, before the gated norm;
* ``linear_attn.hook_gated`` ``[b, p, hv, dv]``: the gated norm's output (``norm(recurrent) * silu(z)``), the input
  of ``out_proj``;
* the mixer's output is the block's ``hook_attn_out`` (a core point).

While one of them is hooked, the mixer is computed a second time here from the module's input, with transformers'
own functions of the modeling module (its torch implementations of the convolution and the delta rule, as the
model runs them without the ``fla``/``causal-conv1d`` kernels), in the model's order, each point applied where its
value is made; the model's own output is replaced only when a hook changed something, and then the layer's
convolution and recurrent states in the cache are the edited computation's (generation continues from them).

The recurrent state ``[b, hv, dk, dv]`` is not a point: transformers' delta rule keeps it inside the function (the
chunked form never has the per-token states) and returns only the last one, and only with a cache.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch.nn import functional as F

from lensadapters.plugin_api import HookPoint, Site, completes_output, first_output, replace_first_output

Tensor = torch.Tensor
POINTS = (
    "hook_qkv",
    "hook_z",
    "hook_b",
    "hook_a",
    "hook_conv",
    "hook_q",
    "hook_k",
    "hook_v",
    "hook_beta",
    "hook_decay",
    "hook_recurrent",
    "hook_gated",
)
PREFIX = "linear_attn."


def point_names() -> list[str]:
    return [PREFIX + p for p in POINTS]


class _CacheSnapshot:
    """One linear-attention layer's cache as it is now (its states, flags and lazily set fields), to go back to."""

    def __init__(self, cache: Any, layer: int) -> None:
        self.layer = cache.layers[layer]
        self.fields = {name: _copy(value) for name, value in vars(self.layer).items()}

    def restore(self) -> None:
        for name, saved in self.fields.items():
            current = getattr(self.layer, name, None)
            if isinstance(saved, dict) and isinstance(current, dict):  # per state index (transformers 5.2x)
                for key in [key for key in current if key not in saved]:
                    del current[key]
                for key, value in saved.items():
                    current[key] = _into(current.get(key), value)
            elif isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
                current[:] = [_into(old, value) for old, value in zip(current, saved)]
            else:
                setattr(self.layer, name, saved)


def _into(current: Any, value: Any) -> Any:
    """``value`` written into the cache's tensor ``current`` when the shapes agree (the cache keeps its static
    addresses), else ``value`` itself."""
    if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
        return current.copy_(value)
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _copy(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


class DeltaNetSite(Site):
    """Every ``linear_attn.*`` point of one gated DeltaNet layer (see the module docstring)."""

    def __init__(self, mixer: Any, points: dict[str, HookPoint], state: Any) -> None:
        self.module, self.state = mixer, state
        self.p = points
        self.points = tuple(points[PREFIX + n] for n in POINTS)
        self.modeling = sys.modules[type(mixer).__module__]

    def install(self) -> list[Any]:
        return [
            self.module.register_forward_pre_hook(self._record, with_kwargs=True),
            completes_output(self.module, self._recompute, with_kwargs=True),
        ]

    def _record(self, module: Any, args: tuple, kwargs: dict) -> None:
        values = self.state.site_values(self)
        values.clear()
        hidden = args[0] if args else kwargs["hidden_states"]
        # the layer's cache: ``cache`` from transformers 5.24, ``cache_params`` before (read as None there, a hooked
        # decoding step was recomputed without the convolution and recurrent states)
        cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("cache_params")
        values["call"] = (hidden, cache, kwargs.get("attention_mask"))
        values["snapshot"] = _CacheSnapshot(cache, module.layer_idx) if cache is not None else None

    def _recompute(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        values = self.state.site_values(self)
        hidden, cache, mask = values.pop("call")
        snapshot: Optional[_CacheSnapshot] = values.pop("snapshot")
        if snapshot is not None:  # run from the states the module started from; they end as the edited run's
            kept = _CacheSnapshot(cache, module.layer_idx)
            snapshot.restore()
        out, changed = self.forward(module, hidden, cache, mask)
        if not changed:
            if snapshot is not None:
                kept.restore()  # bitwise the model's own states
            return None
        return replace_first_output(output, out.to(first_output(output).dtype))

    def _apply(self, name: str, value: Tensor, changed: bool) -> tuple[Tensor, bool]:
        new, edit = self.p[name].apply(value, protect=True)
        return new, changed or edit

    def forward(self, m: Any, hidden: Tensor, cache: Any, mask: Optional[Tensor]) -> tuple[Tensor, bool]:
        """Qwen 3.5's ``GatedDeltaNet.forward`` with the points applied where their values are made."""
        f, ap, changed = self.modeling, self._apply, False
        hidden = f.apply_mask_to_padding_states(hidden, mask)
        bsz, seq, _ = hidden.shape
        conv_state = cache.get_conv_state(m.layer_idx, state_idx=0) if cache is not None else None
        recurrent_state = cache.get_recurrent_state(m.layer_idx, state_idx=0) if cache is not None else None
        qkv, changed = ap(PREFIX + "hook_qkv", m.in_proj_qkv(hidden), changed)
        z, changed = ap(PREFIX + "hook_z", m.in_proj_z(hidden).reshape(bsz, seq, -1, m.head_v_dim), changed)
        b, changed = ap(PREFIX + "hook_b", m.in_proj_b(hidden), changed)
        a, changed = ap(PREFIX + "hook_a", m.in_proj_a(hidden), changed)
        mixed = qkv.transpose(1, 2)
        weight = m.conv1d.weight.squeeze(1)
        if conv_state is not None and seq == 1 and not cache.is_recording_past(m.layer_idx):
            mixed = f.causal_conv1d_update(mixed, conv_state, weight, m.conv1d.bias, m.activation)
        else:
            if cache is not None:
                mixed = cache.update_conv_state(mixed, m.layer_idx, conv_kernel_size=m.conv_kernel_size)
            mixed = f.causal_conv1d_fn(mixed, weight, m.conv1d.bias, activation=m.activation)
            if cache is not None:
                mixed = mixed[:, :, -seq:]
        conv, changed = ap(PREFIX + "hook_conv", mixed.transpose(1, 2), changed)
        query, key, value = torch.split(conv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        query, changed = ap(PREFIX + "hook_q", query.reshape(bsz, seq, -1, m.head_k_dim), changed)
        key, changed = ap(PREFIX + "hook_k", key.reshape(bsz, seq, -1, m.head_k_dim), changed)
        value, changed = ap(PREFIX + "hook_v", value.reshape(bsz, seq, -1, m.head_v_dim), changed)
        beta, changed = ap(PREFIX + "hook_beta", b.sigmoid(), changed)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        g, changed = ap(PREFIX + "hook_decay", g, changed)
        rule = f.torch_recurrent_gated_delta_rule if recurrent_state is not None and seq == 1 else None
        rule = rule or f.torch_chunk_gated_delta_rule
        core, last = rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            output_final_state=cache is not None,
            use_qk_l2norm_in_kernel=True,
        )
        if cache is not None:
            cache.update_recurrent_state(last, m.layer_idx)
        core, changed = ap(PREFIX + "hook_recurrent", core, changed)
        gated = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(core.shape)
        gated, changed = ap(PREFIX + "hook_gated", gated, changed)
        return m.out_proj(gated.reshape(bsz, seq, -1)), changed
