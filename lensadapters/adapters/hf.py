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

from lensadapters.adapters import hf_helpers
from lensadapters.adapters.decoder_plugin import DecoderFamily, DecoderPlugin, qk_norms
from lensadapters.adapters.hf_helpers import *  # noqa: F403  (the helpers: hf_helpers.__all__)
from lensadapters.adapters.plugin_hooks import PointChain, claims, layer_hooks, opaque_blocks
from lensadapters.adapters.toy_configs import (
    decoder_config,
    sliding_layers,
    sliding_toy,
    toy_config,
    toy_draw,
    window_from_fields,
)

__all__ = ["DecoderFamily", "DecoderPlugin", "claims", "decoder_config", "layer_hooks", "qk_norms", "toy_config"]
__all__ += ["PointChain", "opaque_blocks", "sliding_layers", "sliding_toy", "toy_draw", "window_from_fields"]
__all__ += hf_helpers.__all__
