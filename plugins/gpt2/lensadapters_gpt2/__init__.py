"""GPT-2 for lensadapters: fused ``c_attn`` (``Conv1D``, weights stored ``[in, out]``), learned positions.

Handles ``scale_attn_by_inverse_layer_idx`` and ``reorder_and_upcast_attn`` in explicit attention
(patterns match Hugging Face's eager attention). Cross-attention GPT-2 (``add_cross_attention``)
is refused at wrap time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lensadapters import (
    Architecture,
    BlockLayout,
    FusedQKV,
    LinearWeight,
    MLPLayout,
    UnsupportedModelError,
    hf,
    hookimpl,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
ARCH = hf.architecture("gpt2", "GPT-2 (GPT2LMHeadModel, GPT2Model)")
hf.plugin_module(globals(), ARCH, hookspec="1", contract="GPT2Contract")


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    if getattr(model.config, "add_cross_attention", False):
        raise UnsupportedModelError("GPT-2 with add_cross_attention=True is not supported by lensadapters-gpt2")


def _config_fields(model: PreTrainedModel) -> dict[str, Any]:
    """GPT-2's ``hm.cfg`` fields beyond the shared ones (``hf.hooked_config``): LayerNorm, learned positions."""
    c = model.config
    return dict(
        d_head=c.n_embd // c.n_head,
        d_mlp=c.n_inner if c.n_inner is not None else 4 * c.n_embd,
        act_fn=c.activation_function,
        normalization_type="LN",
        positional_embedding_type="standard",
        eps=c.layer_norm_epsilon,
    )


lensadapters_config = hf.hooked_config(_config_fields)
lensadapters_embed = hf.model_layout(blocks="h", embed="wte", pos_embed="wpe", ln_final="ln_f")


def _qkv(model: PreTrainedModel, layer: int) -> FusedQKV:
    d_model, n_heads = model.config.n_embd, model.config.n_head

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split(d_model, dim=-1)
        return q.unflatten(-1, (n_heads, -1)), k.unflatten(-1, (n_heads, -1)), v.unflatten(-1, (n_heads, -1))

    def merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)

    return FusedQKV("attn.c_attn", split, merge)


BLOCK = BlockLayout(ln1="ln_1", attn="attn", o_proj="attn.c_proj", ln2="ln_2", mlp="mlp")
globals().update(hf.layer_hooks(BLOCK, _qkv, MLPLayout(pre="mlp.c_fc", out="mlp.c_proj")))


@hookimpl
def lensadapters_linear_weight(module: nn.Module, read: Any) -> Optional[LinearWeight]:
    from transformers.pytorch_utils import Conv1D

    if type(module) is Conv1D:  # stored [in, out] already
        return LinearWeight(module.weight, module.bias)
    return None


@hookimpl
def lensadapters_attn_scores(
    arch: Architecture,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: Optional[float],
    implementation: str,
) -> torch.Tensor:
    """Scores as the configured implementation computes them.

    transformers 5.x passes ``scaling`` (which includes both scale flags). transformers 4.57 passes
    none: its eager path applies ``scale_attn_weights`` and ``scale_attn_by_inverse_layer_idx`` itself,
    while its sdpa path ignores both flags and scales by ``1/sqrt(d_head)``; mirror whichever runs.
    """
    if module.reorder_and_upcast_attn and implementation == "eager":
        scale = scaling if scaling is not None else _eager_457_scale(module, query)
        return torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if scaling is not None:
        return torch.matmul(query, key.transpose(-1, -2)) * scaling
    if implementation == "eager":  # 4.57: divided (not multiplied), in the scores' dtype, flag by flag
        scores = torch.matmul(query, key.transpose(-1, -2))
        if module.scale_attn_weights:
            scores = scores / torch.full([], query.shape[-1] ** 0.5, dtype=scores.dtype, device=scores.device)
        if module.scale_attn_by_inverse_layer_idx:
            scores = scores / float(module.layer_idx + 1)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.dtype == torch.bool and not module.is_cross_attention:
            # 4.57's eager path masks future keys with the dtype's minimum itself, before adding the attention mask:
            # a row the mask leaves empty then spreads over the earlier keys only (min + min is -inf)
            q_len, k_len = scores.shape[-2], scores.shape[-1]
            causal = bias[:, :, k_len - q_len : k_len, :k_len]
            scores = torch.where(causal, scores, torch.full([], torch.finfo(scores.dtype).min, dtype=scores.dtype))
        return scores
    return torch.matmul(query, key.transpose(-1, -2)) * query.shape[-1] ** -0.5


@hookimpl
def lensadapters_attn_original(arch: Architecture, module: nn.Module, implementation: str) -> Optional[Any]:
    """Eager attention with ``reorder_and_upcast_attn`` bypasses the attention interface: GPT-2 calls
    ``_upcast_and_reordered_attn`` itself (transformers 4.57 passes it ``head_mask``, 5.x does not)."""
    if implementation != "eager" or not getattr(module, "reorder_and_upcast_attn", False):
        return None
    upcast = type(module)._upcast_and_reordered_attn
    takes_head_mask = "head_mask" in upcast.__code__.co_varnames[: upcast.__code__.co_argcount]

    def original(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        head_mask: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> Any:
        if takes_head_mask:
            return module._upcast_and_reordered_attn(query, key, value, attention_mask, head_mask)
        return module._upcast_and_reordered_attn(query, key, value, attention_mask)

    return original


def _eager_457_scale(module: nn.Module, query: torch.Tensor) -> float:
    """transformers 4.57's upcast path (``_upcast_and_reordered_attn``): one factor folded into ``baddbmm``."""
    scale = query.shape[-1] ** -0.5 if module.scale_attn_weights else 1.0
    if module.scale_attn_by_inverse_layer_idx:
        scale /= float(module.layer_idx + 1)
    return scale


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """Width 64, vocabulary 512. Seed 0 is the demo's model (2 layers of 4 heads, gelu_new); other seeds vary
    the depth (1-3 layers), the heads (2, 4 or 8) and the activation, deterministically."""
    import random

    from transformers import GPT2Config

    rng = random.Random(seed)
    layers, heads, act = (
        (2, 4, "gelu_new")
        if seed == 0
        else (rng.choice([1, 2, 3]), rng.choice([2, 4, 8]), rng.choice(["gelu_new", "gelu", "relu"]))
    )
    sizes = hf.size_fields(hidden=64, layers=layers, heads=heads, positions=128, vocab=512)
    return hf.without_dropout(GPT2Config, **sizes, activation_function=act, bos_token_id=0, eos_token_id=0)
