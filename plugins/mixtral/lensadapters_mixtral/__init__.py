"""Mixtral (Mixtral 8x7B, 8x22B and other ``model_type: "mixtral"`` checkpoints) for lensadapters.

Attention, norms and residuals are Mistral's (GQA, rotate-half RoPE with ``model.rotary_emb``'s cos/sin, RMSNorm,
an optional sliding window); the MLP of every block is a sparse mixture of experts, described to the core as a
:class:`lensadapters.moe.MoELayout`:

* transformers 5: ``mlp.gate`` (``MixtralTopKRouter``) returns ``(logits, top_k_weights, top_k_index)`` and
  ``mlp.experts`` (``MixtralExperts``) stores every expert in 3-D parameters ``gate_up_proj``
  ``[n_experts, 2 * d_mlp, d_model]`` and ``down_proj`` ``[n_experts, d_model, d_mlp]``, run by transformers'
  fused / grouped-GEMM implementations. The routing weights stay float32.
* transformers 4.57: ``block_sparse_moe.gate`` is a linear layer (logits only; the MoE block routes itself) and
  ``block_sparse_moe.experts`` a ``ModuleList`` of ``w1`` (gate), ``w3`` (up), ``w2`` (down).

Routing: softmax over all experts (float32), top-``num_experts_per_tok``, the selected probabilities renormalized to
sum to one. Hook points, weights and edit semantics are the core's (``lensadapters.moe``); ``W_in`` is ``w3``/the up
rows, ``W_gate`` ``w1``/the gate rows, ``W_out`` ``w2``/``down_proj``, ``W_router`` the router.

Refused at wrap time: rope types outside the list below, attention implementations other than ``eager`` and
``sdpa``, modules without Mixtral's layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from lensadapters import (
    Architecture,
    BlockLayout,
    HookedConfig,
    ModelLayout,
    SeparateQKV,
    UnsupportedModelError,
    hookimpl,
)
from lensadapters.moe import ExpertModules, FusedExperts, MoELayout, Routing
from lensadapters.rotary import rotate_half_spec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
LENSADAPTERS_CONTRACT = "lensadapters_mixtral.testing:MixtralContract"
ARCH = Architecture(
    name="mixtral",
    model_types=("mixtral",),
    description="Mixtral (MixtralForCausalLM, MixtralModel): sparse mixture of experts, GQA, RoPE, RMSNorm",
    transformers=">=4.57,<6",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
SUPPORTED_ATTENTION = ("eager", "sdpa")
_ATTN_PREFIX = "lensadapters:"
_QKV_PATHS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


# --- locating the pieces ------------------------------------------------------------------------


def _base_path(model: PreTrainedModel) -> str:
    """Dotted path of the ``MixtralModel`` inside ``model`` ("" when ``model`` is one)."""
    for name, module in model.named_modules():
        if hasattr(module, "embed_tokens") and hasattr(module, "layers"):
            return name
    raise UnsupportedModelError(
        f"{type(model).__name__} has model_type 'mixtral' but no submodule with `embed_tokens` and `layers`; "
        f"lensadapters-mixtral supports transformers' Mixtral classes (MixtralForCausalLM, MixtralModel, ...)"
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _layers(model: PreTrainedModel) -> list[nn.Module]:
    try:
        return list(model.get_submodule(_join(_base_path(model), "layers")))
    except AttributeError:
        return []


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


def _rope_theta(config: Any) -> Optional[float]:
    params = getattr(config, "rope_parameters", None)  # transformers 5.x
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else None


def _rope_type(model: PreTrainedModel) -> str:
    rotary = model.get_submodule(_join(_base_path(model), "rotary_emb"))
    return str(getattr(rotary, "rope_type", "default"))


def _moe_path(layer: nn.Module) -> str:
    """transformers 5 names the MoE block ``mlp``, 4.57 ``block_sparse_moe``."""
    return "mlp" if hasattr(layer, "mlp") else "block_sparse_moe"


def moe_layout(layer: nn.Module, config: Any) -> MoELayout:
    """The MoE description of one decoder layer, for the transformers version that built it."""
    moe = _moe_path(layer)
    experts = layer.get_submodule(f"{moe}.experts")
    n, k = config.num_local_experts, config.num_experts_per_tok
    if isinstance(experts, nn.ModuleList):  # transformers 4.x: one module per expert, a linear router
        return MoELayout(
            router=f"{moe}.gate",
            routing=Routing(n, k, normalize=True, weights_dtype="logits"),
            experts=ExpertModules(f"{moe}.experts", gate="w1", up="w3", down="w2"),
            router_output="logits",
        )
    return MoELayout(
        router=f"{moe}.gate",
        routing=Routing(n, k, normalize=True, weights_dtype="float32"),
        experts=FusedExperts(f"{moe}.experts"),
        router_output="routing",
    )


# --- adapter hooks ------------------------------------------------------------------------------


@hookimpl
def lensadapters_architectures() -> list[Architecture]:
    return [ARCH]


def _missing_paths(layer: nn.Module) -> list[str]:
    moe = _moe_path(layer)
    paths = [
        "input_layernorm",
        "self_attn",
        "self_attn.o_proj",
        "post_attention_layernorm",
        *_QKV_PATHS,
        f"{moe}.gate",
        f"{moe}.experts",
    ]
    missing = []
    for path in paths:
        try:
            layer.get_submodule(path)
        except AttributeError:
            missing.append(path)
    if missing:
        return missing
    experts = layer.get_submodule(f"{moe}.experts")
    if isinstance(experts, nn.ModuleList):
        for e, expert in enumerate(experts):
            missing += [f"{moe}.experts.{e}.{p}" for p in ("w1", "w2", "w3", "act_fn") if not hasattr(expert, p)]
    else:
        while isinstance(getattr(experts, "base_layer", None), nn.Module):  # an adapter wrapping the experts (LoRA)
            experts = experts.base_layer
        missing += [f"{moe}.experts.{p}" for p in ("gate_up_proj", "down_proj", "act_fn") if not hasattr(experts, p)]
    return missing


@hookimpl
def lensadapters_validate(arch: Architecture, model: PreTrainedModel) -> None:
    config = model.config
    base = _base_path(model)
    layers = _layers(model)
    missing = [_join(base, p) for p in ("embed_tokens", "norm", "rotary_emb") if not _has(model, _join(base, p))]
    for i, layer in enumerate(layers):
        missing += [f"{_join(base, 'layers')}.{i}.{p}" for p in _missing_paths(layer)]
    if missing or not layers:
        raise UnsupportedModelError(
            f"{type(model).__name__} has model_type 'mixtral' but not transformers' Mixtral layout (missing: "
            f"{', '.join(missing[:6]) or 'decoder layers'}); lensadapters-mixtral supports transformers' Mixtral "
            f"classes"
        )
    rope_type = _rope_type(model)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"Mixtral rope type {rope_type!r} is not supported by lensadapters-mixtral (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}): hook_rot_q/hook_rot_k need rotate-half RoPE on the (cos, sin) of "
            f"model.rotary_emb"
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl.startswith(_ATTN_PREFIX):
        impl = impl[len(_ATTN_PREFIX) :]
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported by lensadapters-mixtral (supported: "
            f"{', '.join(SUPPORTED_ATTENTION)}). Call model.set_attn_implementation('sdpa') before wrapping"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )


def _has(model: PreTrainedModel, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


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
        model_type="mixtral",
        n_key_value_heads=c.num_key_value_heads,
        rotary_dim=head_dim,
        gated_mlp=True,
        eps=c.rms_norm_eps,
        original_architecture=type(model).__name__,
        num_experts=c.num_local_experts,
        experts_per_token=c.num_experts_per_tok,
        extra={
            "rope_theta": _rope_theta(c),
            "rope_type": _rope_type(model),
            "sliding_window": getattr(c, "sliding_window", None),
            "router_jitter_noise": getattr(c, "router_jitter_noise", 0.0),
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
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
    moe = _moe_path(_layers(model)[layer])
    return BlockLayout(
        ln1="input_layernorm", attn="self_attn", o_proj="self_attn.o_proj", ln2="post_attention_layernorm", mlp=moe
    )


@hookimpl
def lensadapters_attn_qkv(arch: Architecture, model: PreTrainedModel, layer: int) -> SeparateQKV:
    return SeparateQKV(*_QKV_PATHS, rotary=rotate_half_spec(_head_dim(model.config)))


@hookimpl
def lensadapters_mlp_act(arch: Architecture, model: PreTrainedModel, layer: int) -> MoELayout:
    return moe_layout(_layers(model)[layer], model.config)


@hookimpl
def lensadapters_tiny_config(arch: Architecture, seed: int) -> Any:
    """A Mixtral-like toy, width 64, vocabulary 512, 4 experts of width 96. Seed 0 is the demo's model: 2 layers,
    GQA (4 query heads, 2 kv heads), top-2 routing. Other seeds vary the depth (1-3), the number of experts (2-8),
    top-k (1 to 3) and the heads, deterministically."""
    import random

    from transformers import MixtralConfig

    rng = random.Random(seed)
    if seed == 0:
        layers, (heads, kv_heads), experts, top_k = 2, (4, 2), 4, 2
    else:
        layers, (heads, kv_heads) = rng.choice([1, 2, 3]), rng.choice([(4, 2), (4, 4), (4, 1)])
        experts = rng.choice([2, 4, 8])
        top_k = rng.randint(1, min(3, experts))
    return MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=512,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        rope_theta=1e6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
