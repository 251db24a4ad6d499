"""Qwen3 (``model_type: "qwen3"``: Qwen3 0.6B-32B dense checkpoints) for lensadapters.

Quirks handled (otherwise Llama's layout: GQA, rotate-half RoPE, RMSNorm, SwiGLU):

* Per-head RMSNorm on queries and keys between projection and RoPE (``q_norm``/``k_norm``), with
  TransformerLens' hook points ``attn.q_norm.hook_scale``/``hook_normalized`` and ``attn.k_norm.*`` (editable
  like every norm): ``hook_q``/``hook_k`` are the projection output (before the norm), ``hook_rot_q``/
  ``hook_rot_k`` what attention uses (normed and rotated; an edit of ``hook_rot_k`` reaches the KV cache). The
  norm points keep lensadapters' per-head layout ``[b, p, h, 1]``/``[b, p, h, d_head]`` where TransformerLens
  flattens them to ``[b*p*h, ...]`` (the same values, in the same order).
* Optional ``attention_bias`` on q/k/v/o.
* Per-layer sliding windows (``use_sliding_window``: layers from ``max_window_layers`` on use
  ``sliding_window``; ``config.layer_types`` says which): ``hook_attn_scores``/``hook_pattern`` show each layer's
  own mask. ``cfg.window_size``/``cfg.attn_types`` (TransformerLens' names) describe them.
* Tied (the small Qwen3 checkpoints) or untied embeddings.

Refused at wrap time with an explanation: rope types whose rotation is not rotate-half on the rotary module's
``(cos, sin)``, custom modeling code registered as ``qwen3``, a model without Qwen3's layout.
Flash and flex attention: every hook point but ``hook_attn_scores``/``hook_pattern`` (which name the fix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from lensadapters import (
    Architecture,
    BlockLayout,
    HookedConfig,
    MLPLayout,
    ModelLayout,
    NormSpec,
    ProjectionNorm,
    SeparateQKV,
    UnsupportedModelError,
    hf,
    hookimpl,
)
from lensadapters.rotary import rotate_half_spec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
LENSADAPTERS_CONTRACT = "lensadapters_qwen3.testing:Qwen3Contract"
ARCH = Architecture(
    name="qwen3",
    model_types=("qwen3",),
    description="Qwen3 (Qwen3ForCausalLM, Qwen3Model): per-head q/k norms before RoPE, sliding windows, GQA",
    transformers=">=4.57,<6",
)
FAMILY = "Qwen3"
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
NORMS = ("Qwen3RMSNorm",)

_BLOCK = BlockLayout(ln1="input_layernorm", attn="self_attn", o_proj="self_attn.o_proj",
                     ln2="post_attention_layernorm", mlp="mlp")
_QKV_PATHS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_QK_NORMS = (ProjectionNorm("self_attn.q_norm", "bphd"), ProjectionNorm("self_attn.k_norm", "bphd"))
_MLP = MLPLayout(pre="mlp.gate_proj", out="mlp.down_proj", pre_linear="mlp.up_proj")


def _base(model: PreTrainedModel) -> str:
    return hf.base_path(model, FAMILY)


def _rope_type(model: PreTrainedModel) -> str:
    return str(getattr(model.get_submodule(hf.join(_base(model), "rotary_emb")), "rope_type", "default"))


def layer_windows(config: Any) -> list[Optional[int]]:
    """Each layer's sliding window (``None`` for full attention), from ``config.layer_types``."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" and window else None for t in types]


@hookimpl
def lensadapters_architectures() -> list[Architecture]:
    return [ARCH]


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    hf.require_transformers_class(model, FAMILY, ("qwen3",))
    base = _base(model)
    layers = hf.require_modules(model, base, FAMILY, ("embed_tokens", "norm", "rotary_emb"),
                                (_BLOCK.ln1, _BLOCK.attn, _BLOCK.o_proj, _BLOCK.ln2, _BLOCK.mlp, *_QKV_PATHS,
                                 *(n.module for n in _QK_NORMS), _MLP.pre, _MLP.pre_linear, _MLP.out))
    hf.require_rope_types([_rope_type(model)], SUPPORTED_ROPE_TYPES, FAMILY)
    config = model.config
    n_heads, n_kv = config.num_attention_heads, hf.n_kv_heads(config)
    if n_heads % n_kv:
        raise UnsupportedModelError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    q_out = getattr(layers[0].get_submodule(_QKV_PATHS[0]), "out_features", None)
    if isinstance(q_out, int) and q_out != n_heads * hf.head_dim(config):
        raise UnsupportedModelError(
            f"q_proj has {q_out} output features, but the config says {n_heads} heads of size {hf.head_dim(config)}")


@hookimpl
def lensadapters_config(arch: Architecture, model: PreTrainedModel) -> HookedConfig:
    c = model.config
    head_dim, windows = hf.head_dim(c), layer_windows(c)
    windowed = any(w is not None for w in windows)
    return HookedConfig(
        n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_heads=c.num_attention_heads, d_head=head_dim,
        d_mlp=c.intermediate_size, d_vocab=c.vocab_size, n_ctx=c.max_position_embeddings, act_fn=c.hidden_act,
        normalization_type="RMS", positional_embedding_type="rotary", model_type="qwen3",
        n_key_value_heads=hf.n_kv_heads(c), rotary_dim=head_dim, gated_mlp=True, eps=c.rms_norm_eps,
        original_architecture=type(model).__name__,
        window_size=next((w for w in windows if w is not None), None),
        attn_types=tuple("local" if w else "global" for w in windows) if windowed else None,
        extra={"rope_theta": hf.rope_theta(c), "rope_type": _rope_type(model), "use_qk_norm": True,
               "attention_bias": bool(getattr(c, "attention_bias", False)),
               "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False))},
    )


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    base = _base(model)
    return ModelLayout(blocks=hf.join(base, "layers"), embed=hf.join(base, "embed_tokens"),
                       ln_final=hf.join(base, "norm"), rotary=hf.join(base, "rotary_emb"),
                       unembed=hf.unembed_path(model))


@hookimpl
def lensadapters_block(arch: Architecture, model: PreTrainedModel, layer: int) -> BlockLayout:
    return _BLOCK


@hookimpl
def lensadapters_attn_qkv(arch: Architecture, model: PreTrainedModel, layer: int) -> SeparateQKV:
    # q_proj -> q_norm (per head) -> k_proj -> k_norm -> v_proj, then RoPE on the normed queries and keys
    return SeparateQKV(*_QKV_PATHS, rotary=rotate_half_spec(hf.head_dim(model.config)), q_norm=_QK_NORMS[0],
                       k_norm=_QK_NORMS[1])


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: PreTrainedModel, layer: int) -> MLPLayout:
    return _MLP


@hookimpl
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    return hf.norm_spec_for(module, NORMS)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """A Qwen3-like toy, width 64, vocabulary 512, head_dim 32 (Qwen3's head_dim differs from width / heads). Seed
    0 is the demo's model: 2 layers, GQA (4 query heads, 2 kv heads), tied embeddings, no window. Other seeds vary
    depth, heads, a sliding window on the layers from ``max_window_layers`` on and the embedding tie."""
    import random

    from transformers import Qwen3Config

    rng = random.Random(seed)
    layers, (heads, kv), window_from, tied = (2, (4, 2), 9, True) if seed == 0 else (
        rng.choice([1, 2, 3]), rng.choice([(4, 2), (4, 4), (4, 1), (8, 2)]), rng.choice([0, 1, 9]), rng.random() < 0.5)
    return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, head_dim=32, vocab_size=512, max_position_embeddings=128,
                       sliding_window=4,
                       use_sliding_window=window_from < layers, max_window_layers=window_from,
                       tie_word_embeddings=tied, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
