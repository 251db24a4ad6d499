"""GPT-NeoX / Pythia for lensadapters.

Quirks handled:

* ``query_key_value`` is fused **per head, interleaved**: its output viewed as ``[..., heads, 3 * d_head]``
  holds ``q | k | v`` of each head side by side. ``hook_q/k/v`` (and ``W_Q/W_K/W_V``, ``b_Q/b_K/b_V``,
  by the same split on weight columns) are sliced out of that view and re-fused after edits.
* Partial rotary (``rotary_pct`` in 4.x, ``rope_parameters["partial_rotary_factor"]`` in 5.x): only the
  first ``rotary_ndims`` dimensions of each head rotate, rotate-half style, with the ``(cos, sin)``
  returned by ``gpt_neox.rotary_emb``. ``hook_rot_q/k`` edits are inverted back into the projection
  output, so the KV cache stores the edited keys.
* ``use_parallel_residual``: ``x + attn(ln1 x) + mlp(ln2 x)`` has no ``hook_resid_mid`` and
  ``hook_mlp_in`` is the block input; sequential blocks have ``hook_resid_mid``.
* Unembedding is ``embed_out`` (transformers 4.x) or ``lm_head`` (5.x), found on the model.

Attention implementations other than ``eager`` and ``sdpa`` are refused at wrap time (untested).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lensadapters import Architecture, BlockLayout, FusedQKV, MLPLayout, UnsupportedModelError, hf, hookimpl
from lensadapters.rotary import rotate_half_spec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
ARCH = hf.architecture("gpt_neox", "GPT-NeoX / Pythia (GPTNeoXForCausalLM, GPTNeoXModel)")
hf.plugin_module(globals(), ARCH, hookspec="1", contract="GPTNeoXContract")
SUPPORTED_ATTENTION = ("eager", "sdpa")
_ATTN_PREFIX = "lensadapters:"


def _attention(model: PreTrainedModel, layer: int) -> nn.Module:
    return hf.base_model(model).layers[layer].attention


def _out_features(module: nn.Module) -> Optional[int]:
    """``out_features`` of a linear layer, looking through adapter wrappers (``base_layer``)."""
    for _ in range(4):
        if hasattr(module, "out_features") and isinstance(module.out_features, int):
            return module.out_features
        module = getattr(module, "base_layer", None)
        if module is None:
            return None
    return None


def split_qkv(t: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[..., 3 * d_model]`` (per-head interleaved) → ``q, k, v`` as ``[..., heads, d_head]`` views."""
    per_head = t.unflatten(-1, (n_heads, -1))  # [..., h, 3 * d_head]
    q, k, v = per_head.chunk(3, dim=-1)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    return torch.cat([q, k, v], dim=-1).flatten(-2)


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    from transformers.models.gpt_neox import modeling_gpt_neox as modeling

    c = model.config
    impl = getattr(c, "_attn_implementation", None) or "eager"
    if impl.startswith(_ATTN_PREFIX):
        impl = impl[len(_ATTN_PREFIX) :]
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"lensadapters-gpt-neox is tested with the attention implementations {SUPPORTED_ATTENTION}, and this "
            f"model uses {impl!r}. Call model.set_attn_implementation('sdpa') (or load it with "
            f"attn_implementation='sdpa') before wrapping."
        )
    if c.hidden_size % c.num_attention_heads:
        raise UnsupportedModelError(
            f"GPT-NeoX with hidden_size={c.hidden_size} not divisible by num_attention_heads={c.num_attention_heads}"
        )
    base = hf.base_model(model)
    for attr in ("embed_in", "layers", "final_layer_norm", "rotary_emb"):
        if not hasattr(base, attr):
            raise UnsupportedModelError(
                f"this GPT-NeoX model has no {attr!r} module: its layout differs from transformers' GPTNeoXModel, "
                f"which lensadapters-gpt-neox expects"
            )
    d_head = c.hidden_size // c.num_attention_heads
    stock = {
        modeling.GPTNeoXLayer: "GPTNeoXLayer",
        modeling.GPTNeoXAttention: "GPTNeoXAttention",
        modeling.GPTNeoXMLP: "GPTNeoXMLP",
    }
    for i, layer in enumerate(base.layers):
        attn = getattr(layer, "attention", None)
        mlp = getattr(layer, "mlp", None)
        for module, cls in (
            (layer, modeling.GPTNeoXLayer),
            (attn, modeling.GPTNeoXAttention),
            (mlp, modeling.GPTNeoXMLP),
        ):
            if not isinstance(module, cls):
                raise UnsupportedModelError(
                    f"layer {i}: expected a transformers {stock[cls]}, found {type(module).__name__}; "
                    f"lensadapters-gpt-neox supports only transformers' own GPT-NeoX modules"
                )
            if type(module).forward is not cls.forward:
                warnings.warn(
                    f"layer {i}: {type(module).__name__} overrides {stock[cls]}.forward; lensadapters-gpt-neox "
                    f"assumes the stock computation and hook points may not mean what their names say",
                    stacklevel=2,
                )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if not isinstance(getattr(layer, norm, None), nn.LayerNorm):
                raise UnsupportedModelError(f"layer {i}: {norm} is not an nn.LayerNorm")
        if bool(layer.use_parallel_residual) != bool(c.use_parallel_residual):
            raise UnsupportedModelError(
                f"layer {i}: use_parallel_residual={layer.use_parallel_residual} differs from the config's "
                f"{c.use_parallel_residual}"
            )
        if attn.head_size != d_head:
            raise UnsupportedModelError(
                f"layer {i}: head size {attn.head_size} differs from hidden_size/heads={d_head}"
            )
        qkv_out = _out_features(attn.query_key_value)
        if qkv_out is not None and qkv_out != 3 * c.hidden_size:
            raise UnsupportedModelError(
                f"layer {i}: query_key_value has {qkv_out} output features, expected 3 * hidden_size = "
                f"{3 * c.hidden_size} (per-head interleaved q, k, v)"
            )
        if attn.rotary_ndims % 2 or attn.rotary_ndims > d_head:
            raise UnsupportedModelError(
                f"layer {i}: rotary_ndims={attn.rotary_ndims} must be even and at most d_head={d_head}"
            )
    inv_freq = getattr(base.rotary_emb, "inv_freq", None)
    rotary_ndims = base.layers[0].attention.rotary_ndims if len(base.layers) else 0
    if inv_freq is not None and 2 * inv_freq.shape[-1] != rotary_ndims:
        raise UnsupportedModelError(
            f"the rotary module rotates {2 * inv_freq.shape[-1]} dimensions but attention declares rotary_ndims="
            f"{rotary_ndims} (config.head_dim differs from hidden_size / num_attention_heads?)"
        )


def _config_fields(model: PreTrainedModel) -> dict[str, Any]:
    """GPT-NeoX's ``hm.cfg`` fields beyond the shared ones (``hf.hooked_config``): rotary on ``rotary_ndims`` of
    each head, parallel or sequential blocks."""
    c = model.config
    rotary_dim = _attention(model, 0).rotary_ndims if c.num_hidden_layers else 0
    return dict(
        d_head=c.hidden_size // c.num_attention_heads,
        act_fn=c.hidden_act,
        normalization_type="LN",
        positional_embedding_type="rotary",
        rotary_dim=rotary_dim,
        parallel_attn_mlp=bool(c.use_parallel_residual),
        eps=c.layer_norm_eps,
    )


lensadapters_config = hf.hooked_config(_config_fields)
lensadapters_embed = hf.model_layout(
    blocks="layers", embed="embed_in", ln_final="final_layer_norm", rotary="rotary_emb"
)


def _block(model: PreTrainedModel, layer: int) -> BlockLayout:
    block = model.get_submodule(hf.base_prefix(model) + "layers")[layer]
    # the block adds post_mlp_dropout(mlp(...)) to the residual: resid_mid edits are carried in there
    mlp_residual = "post_mlp_dropout" if hasattr(block, "post_mlp_dropout") else None
    return BlockLayout(
        ln1="input_layernorm",
        attn="attention",
        o_proj="attention.dense",
        ln2="post_attention_layernorm",
        mlp="mlp",
        parallel=bool(model.config.use_parallel_residual),
        mlp_residual=mlp_residual,
    )


def _qkv(model: PreTrainedModel, layer: int) -> FusedQKV:
    n_heads = model.config.num_attention_heads
    rotary_ndims = _attention(model, layer).rotary_ndims

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_qkv(t, n_heads)

    return FusedQKV("attention.query_key_value", split, merge_qkv, rotary=rotate_half_spec(rotary_ndims))


globals().update(hf.layer_hooks(_block, _qkv, MLPLayout(pre="mlp.dense_h_to_4h", out="mlp.dense_4h_to_h")))


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """Width 64, vocabulary 512. Seed 0 is the demo's model (2 parallel layers of 4 heads, rotary_pct 0.25);
    other seeds vary the depth (1-3), the heads (2, 4 or 8), rotary_pct (0.25, 0.5, 1) and parallel vs
    sequential blocks, deterministically."""
    import random

    from transformers import GPTNeoXConfig

    rng = random.Random(seed)
    layers, heads, pct, parallel = (
        (2, 4, 0.25, True)
        if seed == 0
        else (rng.choice([1, 2, 3]), rng.choice([2, 4, 8]), rng.choice([0.25, 0.5, 1.0]), rng.random() < 0.5)
    )
    sizes = hf.size_fields(vocab=512, hidden=64, layers=layers, heads=heads, d_mlp=256, positions=128)
    return hf.without_dropout(GPTNeoXConfig, **sizes, rotary_pct=pct, use_parallel_residual=parallel)
