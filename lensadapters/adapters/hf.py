"""Helpers for plugins of transformers' decoder-only models (``<Family>ForCausalLM`` → ``<Family>Model`` with
``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``): finding the pieces, reading rope parameters in
transformers 4.x and 5.x spellings, and the checks that refuse a model a plugin cannot describe
(:mod:`lensadapters.adapters.hf_helpers`).

:class:`DecoderFamily` puts these together for the common shape (pre-norm blocks with ``self_attn.{q,k,v,o}_proj``,
a SwiGLU ``mlp`` and rotate-half RoPE from ``rotary_emb``): a plugin of such a family declares what differs, and
:class:`DecoderPlugin` derives its adapter hooks from that declaration
(:mod:`lensadapters.adapters.decoder_plugin`).

Nothing here names an architecture: plugins pass their own class names, paths and supported values.
"""

from lensadapters.adapters.decoder_plugin import DecoderFamily, DecoderPlugin, toy_config
from lensadapters.adapters.hf_helpers import (
    DECODER_BLOCK,
    DECODER_QKV,
    ROTATE_HALF_ROPE_TYPES,
    SWIGLU_MLP,
    attention_implementation,
    base_path,
    head_dim,
    join,
    layer_windows,
    missing_expert_paths,
    missing_paths,
    n_kv_heads,
    norm_spec_for,
    require_attention_implementation,
    require_head_shapes,
    require_modules,
    require_rope_types,
    require_transformers_class,
    rope_parameters,
    rope_theta,
    rope_type,
    unembed_path,
    window_fields,
)

__all__ = [
    "base_path",
    "join",
    "unembed_path",
    "rope_parameters",
    "rope_theta",
    "rope_type",
    "head_dim",
    "n_kv_heads",
    "layer_windows",
    "window_fields",
    "missing_paths",
    "missing_expert_paths",
    "require_transformers_class",
    "require_modules",
    "require_rope_types",
    "require_attention_implementation",
    "require_head_shapes",
    "attention_implementation",
    "norm_spec_for",
    "ROTATE_HALF_ROPE_TYPES",
    "DECODER_BLOCK",
    "DECODER_QKV",
    "SWIGLU_MLP",
    "DecoderFamily",
    "DecoderPlugin",
    "toy_config",
]
