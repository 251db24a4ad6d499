"""Mistral (Mistral 7B, Mistral NeMo, Ministral and other ``model_type: "mistral"`` checkpoints) for lensadapters.

Quirks handled (everything else is Llama's layout: GQA, rotate-half RoPE, RMSNorm, SwiGLU):

* Sliding-window attention (``config.sliding_window``, every layer): ``hook_attn_scores``/``hook_pattern``
  show exactly the window mask the model applies (a query at ``i`` sees keys ``i - window < j <= i``), also
  when the window is shorter than the input, during generation and with left padding. ``cfg.window_size``
  and ``cfg.attn_types`` (TransformerLens' names) say which layers are windowed.
* ``head_dim`` may differ from ``hidden_size / num_attention_heads`` (Mistral NeMo).

Refused at wrap time with an explanation: rope types whose rotation is not rotate-half on the rotary module's
``(cos, sin)``, custom modeling code registered as ``mistral``, a model without Mistral's layout.
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
LENSADAPTERS_CONTRACT = "lensadapters_mistral.testing:MistralContract"
ARCH = Architecture(
    name="mistral",
    model_types=("mistral",),
    description="Mistral (MistralForCausalLM, MistralModel): sliding-window attention, GQA, RoPE, RMSNorm, SwiGLU",
    transformers=">=4.57,<6",
)
FAMILY = "Mistral"
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
NORMS = ("MistralRMSNorm",)

_BLOCK = BlockLayout(ln1="input_layernorm", attn="self_attn", o_proj="self_attn.o_proj",
                     ln2="post_attention_layernorm", mlp="mlp")
_QKV_PATHS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = MLPLayout(pre="mlp.gate_proj", out="mlp.down_proj", pre_linear="mlp.up_proj")


def _base(model: PreTrainedModel) -> str:
    return hf.base_path(model, FAMILY)


def _rope_type(model: PreTrainedModel) -> str:
    return str(getattr(model.get_submodule(hf.join(_base(model), "rotary_emb")), "rope_type", "default"))


def window(config: Any) -> Optional[int]:
    """The sliding window of every layer, or ``None``."""
    return getattr(config, "sliding_window", None) or None


@hookimpl
def lensadapters_architectures() -> list[Architecture]:
    return [ARCH]


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    hf.require_transformers_class(model, FAMILY, ("mistral",))
    base = _base(model)
    layers = hf.require_modules(model, base, FAMILY, ("embed_tokens", "norm", "rotary_emb"),
                                (_BLOCK.ln1, _BLOCK.attn, _BLOCK.o_proj, _BLOCK.ln2, _BLOCK.mlp, *_QKV_PATHS,
                                 _MLP.pre, _MLP.pre_linear, _MLP.out))
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
    head_dim, w = hf.head_dim(c), window(c)
    return HookedConfig(
        n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_heads=c.num_attention_heads, d_head=head_dim,
        d_mlp=c.intermediate_size, d_vocab=c.vocab_size, n_ctx=c.max_position_embeddings, act_fn=c.hidden_act,
        normalization_type="RMS", positional_embedding_type="rotary", model_type="mistral",
        n_key_value_heads=hf.n_kv_heads(c), rotary_dim=head_dim, gated_mlp=True, eps=c.rms_norm_eps,
        original_architecture=type(model).__name__, window_size=w,
        attn_types=("local",) * c.num_hidden_layers if w else None,
        extra={"rope_theta": hf.rope_theta(c), "rope_type": _rope_type(model),
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
    return SeparateQKV(*_QKV_PATHS, rotary=rotate_half_spec(hf.head_dim(model.config)))


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: PreTrainedModel, layer: int) -> MLPLayout:
    return _MLP


@hookimpl
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    return hf.norm_spec_for(module, NORMS)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """A Mistral-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, GQA (4 query heads,
    2 kv heads), a 4-token sliding window. Other seeds vary depth, heads and the window (or none)."""
    import random

    from transformers import MistralConfig

    rng = random.Random(seed)
    layers, (heads, kv), sliding = (2, (4, 2), 4) if seed == 0 else (
        rng.choice([1, 2, 3]), rng.choice([(4, 2), (4, 4), (4, 1), (8, 2)]), rng.choice([None, 3, 8]))
    return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=512, max_position_embeddings=128, sliding_window=sliding,
                         rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
