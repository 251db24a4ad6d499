"""Llama (Llama 2, Llama 3.x, Code Llama, ...) for lensadapters.

Quirks handled:

* Grouped-query attention: ``hook_q`` has ``num_attention_heads`` heads, ``hook_k``/``hook_v`` (and
  ``hook_rot_k``) keep ``num_key_value_heads`` heads, not repeated. Patterns and scores have one
  row per query head (query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``).
  ``W_K``/``W_V`` are repeated to the query heads; ``_W_K``/``_W_V`` keep the key/value heads.
* ``head_dim`` may differ from ``hidden_size / num_attention_heads`` (read from the model's config).
* Rotary embeddings (rotate-half RoPE on the whole head) with the ``(cos, sin)`` that
  ``model.rotary_emb`` returned in this forward pass, so every rope type of transformers' Llama
  (default, linear, dynamic, llama3, yarn, longrope) is exact, including the ``attention_scaling``
  that YaRN / LongRoPE fold into ``cos``/``sin``. ``hook_rot_q``/``hook_rot_k`` edits are
  inverted back into the projection output, so the KV cache stores the edited keys.
* RMSNorm (``input_layernorm``, ``post_attention_layernorm``, ``norm``): ``hook_scale`` is
  ``sqrt(mean(x^2) + eps)`` and editable, ``hook_normalized`` is ``x / scale`` before the weight
  (TransformerLens semantics); the attention input is ``hook_normalized * ln1.weight``.
* SwiGLU MLP ``down_proj(act(gate_proj x) * up_proj x)``: ``mlp.hook_pre`` is the gate before the
  activation, ``mlp.hook_pre_linear`` the up projection, ``mlp.hook_post`` the input of
  ``down_proj``; ``W_gate`` is ``gate_proj``, ``W_in`` is ``up_proj``, ``W_out`` is ``down_proj``.
* Optional biases (``attention_bias`` on q/k/v/o, ``mlp_bias``) and tied or untied embeddings.

Refused at wrap time with an explanation: rope types outside the list above (their rotation is not
known to be rotate-half), attention implementations other than ``eager`` and ``sdpa`` (flash and
flex attention are untested; switch with ``model.set_attn_implementation("sdpa")``), and models
whose modules do not have Llama's layout (custom code registered as ``llama``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from lensadapters import (
    Architecture,
    BlockLayout,
    HookedConfig,
    MLPLayout,
    ModelLayout,
    SeparateQKV,
    UnsupportedModelError,
    hookimpl,
)
from lensadapters.rotary import rotate_half_spec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
# the contract suite `lensadapters check llama` runs (imported only then: it needs lensadapters[testing])
LENSADAPTERS_CONTRACT = "lensadapters_llama.testing:LlamaContract"
ARCH = Architecture(
    name="llama",
    model_types=("llama",),
    description="Llama 2 / 3.x (LlamaForCausalLM, LlamaModel): GQA, RoPE scaling, RMSNorm, SwiGLU",
    transformers=">=4.57,<6",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
SUPPORTED_ATTENTION = ("eager", "sdpa")
_ATTN_PREFIX = "lensadapters:"

_BLOCK = BlockLayout(
    ln1="input_layernorm", attn="self_attn", o_proj="self_attn.o_proj", ln2="post_attention_layernorm", mlp="mlp"
)
_QKV_PATHS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = MLPLayout(pre="mlp.gate_proj", out="mlp.down_proj", pre_linear="mlp.up_proj")


# --- locating the pieces ------------------------------------------------------------------------


def _base_path(model: PreTrainedModel) -> str:
    """Dotted path of the ``LlamaModel`` inside ``model`` ("" when ``model`` is one)."""
    for name, module in model.named_modules():
        if hasattr(module, "embed_tokens") and hasattr(module, "layers"):
            return name
    raise UnsupportedModelError(
        f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r}) has no submodule with "
        f"`embed_tokens` and `layers`; "
        f"lensadapters-llama supports transformers' Llama classes (LlamaForCausalLM, LlamaModel, ...)"
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unembed_path(model: PreTrainedModel) -> Optional[str]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None
    for name, module in model.named_modules():
        if module is head:
            return name
    return None


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _n_kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _rope_theta(config: Any) -> Optional[float]:
    params = getattr(config, "rope_parameters", None)  # transformers 5.x
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)  # transformers 4.x
    return float(theta) if theta is not None else None


def _rope_type(model: PreTrainedModel) -> str:
    rotary = model.get_submodule(_join(_base_path(model), "rotary_emb"))
    return str(getattr(rotary, "rope_type", "default"))


# --- adapter hooks ------------------------------------------------------------------------------


@hookimpl
def lensadapters_architectures() -> list[Architecture]:
    return [ARCH]


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    config = model.config
    base = _base_path(model)
    missing = []
    try:
        layers = list(model.get_submodule(_join(base, "layers")))
    except AttributeError:
        layers = []
    for path in ("embed_tokens", "norm", "rotary_emb"):
        try:
            model.get_submodule(_join(base, path))
        except AttributeError:
            missing.append(_join(base, path))
    for i, layer in enumerate(layers):
        for path in (
            _BLOCK.ln1,
            _BLOCK.attn,
            _BLOCK.o_proj,
            _BLOCK.ln2,
            _BLOCK.mlp,
            *_QKV_PATHS,
            _MLP.pre,
            _MLP.pre_linear,
            _MLP.out,
        ):
            try:
                layer.get_submodule(path)
            except AttributeError:
                missing.append(f"{_join(base, 'layers')}.{i}.{path}")
    if missing or not layers:
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {config.model_type!r}) does not have transformers' Llama layout "
            f"(missing: "
            f"{', '.join(missing[:6]) or 'decoder layers'}); lensadapters-llama supports transformers' Llama classes"
        )
    rope_type = _rope_type(model)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"Llama rope type {rope_type!r} is not supported by lensadapters-llama (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}): hook_rot_q/hook_rot_k need a rotation known to be "
            f"rotate-half RoPE on the (cos, sin) of model.rotary_emb"
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl.startswith(_ATTN_PREFIX):
        impl = impl[len(_ATTN_PREFIX) :]
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported by lensadapters-llama (supported: "
            f"{', '.join(SUPPORTED_ATTENTION)}; flash and flex attention are untested and pass masks that "
            f"hook_pattern cannot read). Call model.set_attn_implementation('sdpa') before wrapping"
        )
    n_heads, n_kv = config.num_attention_heads, _n_kv_heads(config)
    if n_heads % n_kv:
        raise UnsupportedModelError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    head_dim = _head_dim(config)
    q_out = getattr(layers[0].get_submodule(_QKV_PATHS[0]), "out_features", None)
    if isinstance(q_out, int) and q_out != n_heads * head_dim:
        raise UnsupportedModelError(
            f"q_proj has {q_out} output features, but the config says {n_heads} heads of size {head_dim}"
        )


@hookimpl
def lensadapters_config(arch: Architecture, model: PreTrainedModel) -> HookedConfig:
    c = model.config
    head_dim = _head_dim(c)
    return HookedConfig(
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        n_heads=c.num_attention_heads,
        d_head=head_dim,
        d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size,
        n_ctx=c.max_position_embeddings,
        act_fn=c.hidden_act,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        model_type="llama",
        n_key_value_heads=_n_kv_heads(c),
        rotary_dim=head_dim,
        gated_mlp=True,
        eps=c.rms_norm_eps,
        original_architecture=type(model).__name__,
        extra={
            "rope_theta": _rope_theta(c),
            "rope_type": _rope_type(model),
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
            "attention_bias": bool(getattr(c, "attention_bias", False)),
            "mlp_bias": bool(getattr(c, "mlp_bias", False)),
        },
    )


@hookimpl
def lensadapters_embed(arch: Architecture, model: PreTrainedModel) -> ModelLayout:
    base = _base_path(model)
    return ModelLayout(
        blocks=_join(base, "layers"),
        embed=_join(base, "embed_tokens"),
        ln_final=_join(base, "norm"),
        rotary=_join(base, "rotary_emb"),
        unembed=_unembed_path(model),
    )


@hookimpl
def lensadapters_block(arch: Architecture, model: PreTrainedModel, layer: int) -> BlockLayout:
    return _BLOCK


@hookimpl
def lensadapters_attn_qkv(arch: Architecture, model: PreTrainedModel, layer: int) -> SeparateQKV:
    # Llama rotates the whole head; cos/sin come from model.rotary_emb (attention_scaling folded in).
    return SeparateQKV(*_QKV_PATHS, rotary=rotate_half_spec(_head_dim(model.config)))


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: PreTrainedModel, layer: int) -> MLPLayout:
    return _MLP


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """A Llama-3-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 2 layers, GQA (4 query heads,
    2 kv heads), llama3 rope scaling, tied embeddings. Other seeds vary the depth (1-3), the heads (MHA, GQA,
    MQA), llama3 scaling or plain RoPE (Llama 2) and tied or untied embeddings, deterministically."""
    import random

    from transformers import LlamaConfig

    rng = random.Random(seed)
    layers, (heads, kv_heads), llama3, tied = (
        (2, (4, 2), True, True)
        if seed == 0
        else (
            rng.choice([1, 2, 3]),
            rng.choice([(4, 2), (4, 4), (4, 1), (8, 2)]),
            rng.random() < 0.5,
            rng.random() < 0.5,
        )
    )
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=512,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_theta=500000.0 if llama3 else 10000.0,
        rope_scaling=scaling if llama3 else None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
