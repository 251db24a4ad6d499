"""Phi-3, Phi-3.5 and Phi-4-mini (``model_type: "phi3"``) for lensadapters.

Quirks handled:

* One fused ``qkv_proj`` with grouped heads: its output is ``[q (n_heads * d) | k (n_kv * d) | v (n_kv * d)]``
  (unequal widths under GQA); ``hook_q``/``hook_k``/``hook_v``, ``W_Q``/``_W_K``/``_W_V`` and a LoRA adapter's
  ``hook_q_lora``/``hook_k_lora``/``hook_v_lora`` are split with that layout (``FusedQKV``).
* One fused ``gate_up_proj``: its output is ``[gate | up]``; ``mlp.hook_pre`` is the gate before the activation
  (``W_gate``), ``mlp.hook_pre_linear`` the up projection (``W_in``), ``mlp.hook_post`` ``up * act(gate)``
  (``FusedGateUp``). A LoRA on ``gate_up_proj`` gets one delta point per half (``mlp.hook_pre_lora``,
  ``mlp.hook_pre_linear_lora``); ``lora_factors(hm, layer, "gate")``/``"in"`` split B the same way.
* Partial rotary (``partial_rotary_factor``, Phi-4-mini: 0.75): only the first ``cfg.rotary_dim`` dimensions of
  each head rotate; ``hook_rot_q``/``hook_rot_k`` pass the rest through.
* LongRoPE (Phi-3/3.5 128k, Phi-4-mini): the short or long factors and the attention factor are in the
  ``(cos, sin)`` the model computes, so ``hook_rot_q/k`` are exact and inverting an edit divides the factor out.
* Sliding window (``config.sliding_window``, every layer): ``hook_attn_scores``/``hook_pattern`` show the
  model's window mask.
* Dropout after the attention and MLP outputs (``resid_attn_dropout``/``resid_mlp_dropout``, identity in eval):
  ``hook_attn_out``/``hook_mlp_out`` are before it, as the outputs of the attention and MLP modules.

Refused at wrap time with an explanation: rope types other than ``default`` and ``longrope``, custom modeling code
registered as ``phi3`` (the Phi-3 checkpoints' own ``modeling_phi3.py`` with ``trust_remote_code=True``: load
with transformers' implementation instead), a model without Phi-3's layout.
Flash and flex attention: every hook point but ``hook_attn_scores``/``hook_pattern`` (which name the fix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from lensadapters import (
    Architecture,
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    HookedConfig,
    ModelLayout,
    NormSpec,
    UnsupportedModelError,
    hf,
    hookimpl,
)
from lensadapters.rotary import rotate_half_spec
from lensadapters.specs import cat_gate_up, chunk_gate_up

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
LENSADAPTERS_CONTRACT = "lensadapters_phi3.testing:Phi3Contract"
ARCH = Architecture(
    name="phi3",
    model_types=("phi3",),
    description="Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM, Phi3Model): fused qkv_proj and gate_up_proj, "
    "partial rotary, LongRoPE, sliding window",
    transformers=">=4.57,<6",
)
FAMILY = "Phi3"
SUPPORTED_ROPE_TYPES = ("default", "longrope")
NORMS = ("Phi3RMSNorm",)
Tensor = torch.Tensor

_BLOCK = BlockLayout(
    ln1="input_layernorm",
    attn="self_attn",
    o_proj="self_attn.o_proj",
    ln2="post_attention_layernorm",
    mlp="mlp",
    mlp_residual="resid_mlp_dropout",
)
_MLP = FusedGateUp(module="mlp.gate_up_proj", out="mlp.down_proj", split=chunk_gate_up, merge=cat_gate_up)
_QKV_PATH = "self_attn.qkv_proj"


def _base(model: PreTrainedModel) -> str:
    return hf.base_path(model, FAMILY)


def _rope_type(model: PreTrainedModel) -> str:
    return hf.rope_type(model.get_submodule(hf.join(_base(model), "rotary_emb")))


def partial_rotary_factor(config: Any) -> float:
    factor = hf.rope_parameters(config).get("partial_rotary_factor")
    return float(factor if factor is not None else getattr(config, "partial_rotary_factor", 1.0) or 1.0)


def rotary_dim(config: Any) -> int:
    return int(hf.head_dim(config) * partial_rotary_factor(config))


def window(config: Any) -> Optional[int]:
    return getattr(config, "sliding_window", None) or None


def qkv_split(
    n_heads: int, n_kv: int, d_head: int
) -> tuple[Callable[[Tensor], tuple[Tensor, Tensor, Tensor]], Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """``(split, merge)`` of ``[q | k | v]`` along the last dimension, each part viewed as ``[heads, d_head]``."""
    q_width, kv_width = n_heads * d_head, n_kv * d_head

    def split(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = t.split([q_width, kv_width, kv_width], dim=-1)
        return q.unflatten(-1, (n_heads, d_head)), k.unflatten(-1, (n_kv, d_head)), v.unflatten(-1, (n_kv, d_head))

    def merge(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)

    return split, merge


@hookimpl
def lensadapters_architectures() -> list[Architecture]:
    return [ARCH]


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    hf.require_transformers_class(model, FAMILY, ("phi3",))
    base = _base(model)
    layers = hf.require_modules(
        model,
        base,
        FAMILY,
        ("embed_tokens", "norm", "rotary_emb"),
        (
            _BLOCK.ln1,
            _BLOCK.attn,
            _BLOCK.o_proj,
            _BLOCK.ln2,
            _BLOCK.mlp,
            _BLOCK.mlp_residual,
            _QKV_PATH,
            _MLP.module,
            _MLP.out,
        ),
    )
    hf.require_rope_types([_rope_type(model)], SUPPORTED_ROPE_TYPES, FAMILY)
    config = model.config
    n_heads, n_kv, d = config.num_attention_heads, hf.n_kv_heads(config), hf.head_dim(config)
    if n_heads % n_kv:
        raise UnsupportedModelError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    out = getattr(layers[0].get_submodule(_QKV_PATH), "out_features", None)
    if isinstance(out, int) and out != (n_heads + 2 * n_kv) * d:
        raise UnsupportedModelError(
            f"qkv_proj has {out} output features, but the config says {n_heads} query and {n_kv} key/value heads of "
            f"size {d}"
        )
    gate_up = getattr(layers[0].get_submodule(_MLP.module), "out_features", None)
    if isinstance(gate_up, int) and gate_up != 2 * config.intermediate_size:
        raise UnsupportedModelError(f"gate_up_proj has {gate_up} output features, not 2 * intermediate_size")


@hookimpl
def lensadapters_config(arch: Architecture, model: PreTrainedModel) -> HookedConfig:
    c = model.config
    w = window(c)
    return HookedConfig(
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        n_heads=c.num_attention_heads,
        d_head=hf.head_dim(c),
        d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size,
        n_ctx=c.max_position_embeddings,
        act_fn=c.hidden_act,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        model_type="phi3",
        n_key_value_heads=hf.n_kv_heads(c),
        rotary_dim=rotary_dim(c),
        gated_mlp=True,
        eps=c.rms_norm_eps,
        original_architecture=type(model).__name__,
        window_size=w,
        attn_types=("local",) * c.num_hidden_layers if w else None,
        extra={
            "rope_theta": hf.rope_theta(c),
            "rope_type": _rope_type(model),
            "partial_rotary_factor": partial_rotary_factor(c),
            "original_max_position_embeddings": getattr(c, "original_max_position_embeddings", None),
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
        },
    )


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    base = _base(model)
    return ModelLayout(
        blocks=hf.join(base, "layers"),
        embed=hf.join(base, "embed_tokens"),
        ln_final=hf.join(base, "norm"),
        rotary=hf.join(base, "rotary_emb"),
        unembed=hf.unembed_path(model),
    )


@hookimpl
def lensadapters_block(arch: Architecture, model: PreTrainedModel, layer: int) -> BlockLayout:
    return _BLOCK


@hookimpl
def lensadapters_attn_qkv(arch: Architecture, model: PreTrainedModel, layer: int) -> FusedQKV:
    c = model.config
    split, merge = qkv_split(c.num_attention_heads, hf.n_kv_heads(c), hf.head_dim(c))
    # the first rotary_dim dims of each head rotate (the rest pass through); cos/sin come from model.rotary_emb
    return FusedQKV(_QKV_PATH, split, merge, rotary=rotate_half_spec(rotary_dim(c)))


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: PreTrainedModel, layer: int) -> FusedGateUp:
    return _MLP


@hookimpl
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    return hf.norm_spec_for(module, NORMS)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """A Phi-4-mini-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, GQA (4 query heads,
    2 kv heads), partial rotary 0.75, tied embeddings. Other seeds vary depth, heads, the rotary fraction, a sliding
    window and the embedding tie."""
    import random

    from transformers import Phi3Config

    rng = random.Random(seed)
    layers, (heads, kv), partial, sliding, tied = (
        (2, (4, 2), 0.75, None, True)
        if seed == 0
        else (
            rng.choice([1, 2, 3]),
            rng.choice([(4, 2), (4, 4), (4, 1)]),
            rng.choice([0.5, 0.75, 1.0]),
            rng.choice([None, 4]),
            rng.random() < 0.5,
        )
    )
    return Phi3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=512,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        partial_rotary_factor=partial,
        sliding_window=sliding,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
