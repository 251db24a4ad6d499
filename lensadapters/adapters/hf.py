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

from lensadapters.adapters import hf_helpers, toy_configs
from lensadapters.adapters.decoder_plugin import DecoderFamily, DecoderPlugin, qk_norms
from lensadapters.adapters.hf_helpers import *  # noqa: F403  (the helpers: hf_helpers.__all__)
from lensadapters.adapters.plugin_hooks import (
    PointChain,
    claims,
    hooked_config,
    layer_hooks,
    model_layout,
    opaque_blocks,
    own_attention_patterns,
)
from lensadapters.adapters.plugin_module import plugin_module
from lensadapters.adapters.toy_configs import *  # noqa: F403  (the toy configs: toy_configs.__all__)

__all__ = ["DecoderFamily", "DecoderPlugin", "PointChain", "claims", "layer_hooks", "opaque_blocks", "qk_norms"]
__all__ += ["hooked_config", "model_layout", "own_attention_patterns"]
__all__ += ["plugin_module"]
__all__ += toy_configs.__all__
__all__ += hf_helpers.__all__
