"""Gemma 2 (``model_type: "gemma2"``: Gemma-2 2B, 9B, 27B) for lensadapters.

Quirks handled, with TransformerLens 2.x's hook names and semantics:

* Sandwich norms: ``input_layernorm`` → attention → ``post_attention_layernorm`` → residual add, and
  ``pre_feedforward_layernorm`` → MLP → ``post_feedforward_layernorm`` → residual add. The post norms are
  ``blocks.L.ln1_post.hook_scale``/``hook_normalized`` and ``ln2_post.*``; ``hook_attn_out``/``hook_mlp_out`` are
  what is added to the residual (after the post norm), ``attn.hook_result`` the per-head outputs before it;
  ``ln2`` is ``pre_feedforward_layernorm``.
* ``(1 + weight)`` RMSNorm (``NormSpec.weight_offset = 1``), computed in float32 as Gemma does.
* Embeddings scaled by ``sqrt(d_model)``: ``hook_embed`` and ``W_E`` include the factor (TransformerLens:
  ``hook_embed == W_E[tokens] == resid_pre[0]``), whether the model applies it in its embedding module
  (transformers 5.x) or after it (4.x); an edit of ``hook_embed`` is an edit of the scaled embeddings.
* Attention scale ``query_pre_attn_scalar ** -0.5``; attention-logit softcapping (``attn_logit_softcapping``):
  ``hook_attn_scores`` is after the softcap, then masked with ``-inf`` (TransformerLens), so an edit there is
  an edit of the capped scores the softmax reads. Final-logit softcapping (``final_logit_softcapping``) has no
  hook point (as in TransformerLens): ``logits = cap * tanh(ln_final_out @ W_U / cap)`` with
  ``cap = cfg.output_logits_soft_cap``.
* Alternating sliding-window and global layers from ``config.layer_types`` (layer 0 is a sliding layer in HF's
  Gemma 2; TransformerLens' hard-coded configs put the global layer first, the HF config is the truth).
* GeGLU MLP (``gelu_pytorch_tanh``): ``mlp.hook_pre`` is the gate, ``mlp.hook_pre_linear`` the up projection.

Attention implementations: eager (transformers 5.x offers Gemma 2 no sdpa, because sdpa cannot softcap). Under
transformers 4.x's sdpa, which ignores the softcap, every hook point works and ``hook_attn_scores``/
``hook_pattern`` refuse, naming ``model.set_attn_implementation("eager")``.
Refused at wrap time: rope types other than rotate-half ones, bidirectional attention
(``use_bidirectional_attention``), custom modeling code registered as ``gemma2``, a model without Gemma 2's layout.
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
LENSADAPTERS_CONTRACT = "lensadapters_gemma2.testing:Gemma2Contract"
ARCH = Architecture(
    name="gemma2",
    model_types=("gemma2",),
    description="Gemma 2 (Gemma2ForCausalLM, Gemma2Model): sandwich norms, (1 + w) RMSNorm, scaled embeddings, "
                "logit softcaps, alternating sliding windows",
    transformers=">=4.57,<6",
)
FAMILY = "Gemma2"
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
NORMS = ("Gemma2RMSNorm",)

_BLOCK = BlockLayout(ln1="input_layernorm", attn="self_attn", o_proj="self_attn.o_proj",
                     ln2="pre_feedforward_layernorm", mlp="mlp", ln1_post="post_attention_layernorm",
                     ln2_post="post_feedforward_layernorm")
_QKV_PATHS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = MLPLayout(pre="mlp.gate_proj", out="mlp.down_proj", pre_linear="mlp.up_proj")


def _base(model: PreTrainedModel) -> str:
    return hf.base_path(model, FAMILY)


def _rope_type(model: PreTrainedModel) -> str:
    return str(getattr(model.get_submodule(hf.join(_base(model), "rotary_emb")), "rope_type", "default"))


def layer_windows(config: Any) -> list[Optional[int]]:
    """Each layer's sliding window (``None`` for global attention), from ``config.layer_types``."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" and window else None for t in types]


def _cap(value: Optional[float]) -> float:
    return float(value) if value else -1.0


@hookimpl
def lensadapters_architectures() -> list[Architecture]:
    return [ARCH]


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    hf.require_transformers_class(model, FAMILY, ("gemma2",))
    base = _base(model)
    layers = hf.require_modules(model, base, FAMILY, ("embed_tokens", "norm", "rotary_emb"),
                                (_BLOCK.ln1, _BLOCK.attn, _BLOCK.o_proj, _BLOCK.ln2, _BLOCK.mlp, _BLOCK.ln1_post,
                                 _BLOCK.ln2_post, *_QKV_PATHS, _MLP.pre, _MLP.pre_linear, _MLP.out))
    hf.require_rope_types([_rope_type(model)], SUPPORTED_ROPE_TYPES, FAMILY)
    config = model.config
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "this Gemma 2 config sets use_bidirectional_attention=True (an encoder, not a causal language model); the "
            "gemma2 plugin describes causal Gemma 2 models, whose attention masks it reproduces")
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
        d_mlp=c.intermediate_size, d_vocab=c.vocab_size, n_ctx=c.max_position_embeddings,
        act_fn=c.hidden_activation, normalization_type="RMS", positional_embedding_type="rotary",
        model_type="gemma2", n_key_value_heads=hf.n_kv_heads(c), rotary_dim=head_dim, gated_mlp=True,
        eps=c.rms_norm_eps, original_architecture=type(model).__name__,
        attn_scores_soft_cap=_cap(c.attn_logit_softcapping), output_logits_soft_cap=_cap(c.final_logit_softcapping),
        window_size=next((w for w in windows if w is not None), None),
        attn_types=tuple("local" if w else "global" for w in windows) if windowed else None,
        extra={"rope_theta": hf.rope_theta(c), "rope_type": _rope_type(model),
               "query_pre_attn_scalar": c.query_pre_attn_scalar, "attn_scale": float(c.query_pre_attn_scalar) ** 0.5,
               "embed_scale": float(c.hidden_size) ** 0.5, "use_normalization_before_and_after": True,
               "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", True))},
    )


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    base = _base(model)
    embed = model.get_submodule(hf.join(base, "embed_tokens"))
    return ModelLayout(blocks=hf.join(base, "layers"), embed=hf.join(base, "embed_tokens"),
                       ln_final=hf.join(base, "norm"), rotary=hf.join(base, "rotary_emb"),
                       unembed=hf.unembed_path(model), embed_scale=float(model.config.hidden_size) ** 0.5,
                       # transformers 5.x scales inside the embedding module, 4.x in the model's forward after it
                       embed_scale_after_module=not hasattr(embed, "embed_scale"))


@hookimpl
def lensadapters_block(arch: Architecture, model: PreTrainedModel, layer: int) -> BlockLayout:
    return _BLOCK


@hookimpl
def lensadapters_attn_qkv(arch: Architecture, model: PreTrainedModel, layer: int) -> SeparateQKV:
    return SeparateQKV(*_QKV_PATHS, rotary=rotate_half_spec(hf.head_dim(model.config)))


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: PreTrainedModel, layer: int) -> MLPLayout:
    return _MLP


@hookimpl
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    return hf.norm_spec_for(module, NORMS, weight_offset=1.0)  # Gemma: x / rms * (1 + weight)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """A Gemma-2-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers (sliding, then global,
    as HF's Gemma 2), GQA (4 query heads, 2 kv heads), a 4-token window, softcaps 50 and 30. Other seeds vary
    depth, heads and the window."""
    import random

    from transformers import Gemma2Config

    rng = random.Random(seed)
    layers, (heads, kv), sliding = (2, (4, 2), 4) if seed == 0 else (
        rng.choice([1, 2, 3]), rng.choice([(4, 2), (4, 4), (4, 1)]), rng.choice([3, 8]))
    return Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv, head_dim=16, vocab_size=512, max_position_embeddings=128,
                        sliding_window=sliding, query_pre_attn_scalar=16, rope_theta=10000.0,
                        attn_implementation="eager", bos_token_id=2, eos_token_id=1, pad_token_id=0)
