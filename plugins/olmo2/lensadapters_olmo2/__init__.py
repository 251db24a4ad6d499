"""OLMo 2 (``model_type: "olmo2"``: OLMo-2 1B, 7B, 13B, 32B) for lensadapters.

TransformerLens has no OLMo 2; the hook names follow its names for the same pieces elsewhere:

* No pre-norms: the block is ``x + post_attention_layernorm(attn(x))`` then ``h + post_feedforward_layernorm(mlp(h))``.
  So there are no ``ln1``/``ln2`` points; the norms after attention and MLP are ``blocks.L.ln1_post.hook_scale``/
  ``hook_normalized`` and ``ln2_post.*`` (Gemma 2's names in TransformerLens). ``hook_attn_out``/``hook_mlp_out``
  are what is added to the residual (the post norm's output); ``attn.hook_result`` the per-head outputs before
  it; attention reads ``hook_resid_pre`` and the MLP reads ``hook_mlp_in`` (= ``hook_resid_mid``) directly.
* RMSNorm on queries and keys over the whole projection width (``q_norm`` over ``n_heads * d_head``, ``k_norm``
  over ``n_kv_heads * d_head``), between projection and RoPE: ``attn.q_norm.hook_scale`` is ``[b, p, 1]`` and
  ``attn.q_norm.hook_normalized`` ``[b, p, n_heads * d_head]`` (one scale per position, as the model computes;
  Qwen3's and Gemma 3's per-head norms are ``[b, p, h, 1]``). ``hook_q``/``hook_k`` are the projection output,
  ``hook_rot_q``/``hook_rot_k`` the normed and rotated values attention uses.
* RoPE computed in float32 and cast back to the queries' dtype, as OLMo 2 does.

Refused at wrap time with an explanation: rope types whose rotation is not rotate-half, custom modeling code
registered as ``olmo2``, a model without OLMo 2's layout. Flash and flex attention: every hook point but
``hook_attn_scores``/``hook_pattern`` (which name the fix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lensadapters import (
    Architecture,
    BlockLayout,
    HookedConfig,
    MLPLayout,
    ModelLayout,
    NormSpec,
    ProjectionNorm,
    RotarySpec,
    SeparateQKV,
    UnsupportedModelError,
    hf,
    hookimpl,
)
from lensadapters.rotary import apply_rotate_half, invert_rotate_half

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
LENSADAPTERS_CONTRACT = "lensadapters_olmo2.testing:Olmo2Contract"
ARCH = Architecture(
    name="olmo2",
    model_types=("olmo2",),
    description="OLMo 2 (Olmo2ForCausalLM, Olmo2Model): norms after attention and MLP only, q/k norms over the "
                "projection width",
    transformers=">=4.57,<6",
)
FAMILY = "Olmo2"
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
NORMS = ("Olmo2RMSNorm",)
Tensor = torch.Tensor

_BLOCK = BlockLayout(ln1=None, attn="self_attn", o_proj="self_attn.o_proj", ln2=None, mlp="mlp",
                     ln1_post="post_attention_layernorm", ln2_post="post_feedforward_layernorm")
_QKV_PATHS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_QK_NORMS = (ProjectionNorm("self_attn.q_norm", "bpf"), ProjectionNorm("self_attn.k_norm", "bpf"))
_MLP = MLPLayout(pre="mlp.gate_proj", out="mlp.down_proj", pre_linear="mlp.up_proj")


def _base(model: PreTrainedModel) -> str:
    return hf.base_path(model, FAMILY)


def _rope_type(model: PreTrainedModel) -> str:
    return str(getattr(model.get_submodule(hf.join(_base(model), "rotary_emb")), "rope_type", "default"))


def rotary_spec(rotary_dim: int) -> RotarySpec:
    """Rotate-half RoPE with OLMo 2's float32 ``(cos, sin)``, cast back to the input's dtype as the model does."""

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rotate_half(x, cos, sin, rotary_dim).to(x.dtype)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return invert_rotate_half(y, cos, sin, rotary_dim)

    return RotarySpec(rotary_dim, apply, invert)


@hookimpl
def lensadapters_architectures() -> list[Architecture]:
    return [ARCH]


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    hf.require_transformers_class(model, FAMILY, ("olmo2",))
    base = _base(model)
    layers = hf.require_modules(model, base, FAMILY, ("embed_tokens", "norm", "rotary_emb"),
                                (_BLOCK.attn, _BLOCK.o_proj, _BLOCK.mlp, _BLOCK.ln1_post, _BLOCK.ln2_post,
                                 *_QKV_PATHS, *(n.module for n in _QK_NORMS), _MLP.pre, _MLP.pre_linear, _MLP.out))
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
    head_dim = hf.head_dim(c)
    return HookedConfig(
        n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_heads=c.num_attention_heads, d_head=head_dim,
        d_mlp=c.intermediate_size, d_vocab=c.vocab_size, n_ctx=c.max_position_embeddings, act_fn=c.hidden_act,
        normalization_type="RMS", positional_embedding_type="rotary", model_type="olmo2",
        n_key_value_heads=hf.n_kv_heads(c), rotary_dim=head_dim, gated_mlp=True, eps=c.rms_norm_eps,
        original_architecture=type(model).__name__,
        extra={"rope_theta": hf.rope_theta(c), "rope_type": _rope_type(model), "use_qk_norm": True,
               "qk_norm_over_heads": True, "pre_norms": False,
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
    # q_proj -> q_norm (whole width) -> k_proj -> k_norm -> v_proj, then RoPE on the normed queries and keys
    return SeparateQKV(*_QKV_PATHS, rotary=rotary_spec(hf.head_dim(model.config)), q_norm=_QK_NORMS[0],
                       k_norm=_QK_NORMS[1])


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: PreTrainedModel, layer: int) -> MLPLayout:
    return _MLP


@hookimpl
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    return hf.norm_spec_for(module, NORMS)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """An OLMo-2-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, 4 heads (OLMo 2 1B-13B
    use full multi-head attention). Other seeds vary depth and heads (GQA as OLMo-2 32B)."""
    import random

    from transformers import Olmo2Config

    rng = random.Random(seed)
    layers, (heads, kv) = (2, (4, 4)) if seed == 0 else (rng.choice([1, 2, 3]), rng.choice([(4, 2), (4, 4), (8, 2)]))
    return Olmo2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, vocab_size=512, max_position_embeddings=128, rope_theta=500000.0,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
