"""Test kit of lensadapters-t5: the config strategy and the contract class (needs ``lensadapters[testing]``).

``T5Contract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check t5`` runs it): the
encoder-decoder properties of :class:`lensadapters.testing.encoder_decoder.EncoderDecoderContract` on tiny T5 models
with ReLU and gated-GELU MLPs. ``t5_configs(**overrides)`` draws tiny ``T5Config``s.

Importing ``lensadapters_t5`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

from hypothesis import strategies as st
from transformers import T5Config

import lensadapters_t5
from lensadapters.testing.encoder_decoder import EncoderDecoderContract, draw_sizes
from lensadapters.testing.strategies import as_strategy

__all__ = ["T5Contract", "t5_configs"]


@st.composite
def t5_configs(
    draw: st.DrawFn,
    *,
    buckets: Any = st.sampled_from([4, 8]),
    mlp: Any = st.sampled_from(["relu", "gated-gelu"]),
    tied: Any = st.booleans(),
    **sizes: Any,
) -> Any:
    """Tiny T5 configs: 1-2 layers of each stack with 1-3 heads (``sizes``: the kit's ``SIZES``), ReLU or
    gated-GELU MLPs, tied embeddings or not (the decoder output rescaled or not); no dropout. Each keyword is a value
    or a strategy."""
    z = draw_sizes(draw, sizes)
    return T5Config(  # type: ignore[call-arg]  # T5Config takes the generation ids as keywords
        vocab_size=z["vocab"],
        d_model=z["d_model"] + 4,  # d_model need not be heads * d_kv in T5
        d_kv=z["d_head"],
        d_ff=z["d_mlp"],
        num_layers=z["n_layers"],
        num_heads=z["n_heads"],
        relative_attention_num_buckets=draw(as_strategy(buckets), label="buckets"),
        relative_attention_max_distance=16,
        feed_forward_proj=draw(as_strategy(mlp), label="mlp"),
        tie_word_embeddings=draw(as_strategy(tied), label="tied"),
        **lensadapters_t5.TINY_FIELDS,
    )


class T5Contract(EncoderDecoderContract):
    """The encoder-decoder properties on tiny T5 models (relative position bias, RMS norms, ReLU or gated MLPs)."""

    plugin: ClassVar[Any] = lensadapters_t5
    config_strategy = t5_configs
    gated_mlp: ClassVar[Optional[bool]] = True  # drawn configs include T5 v1.1's gated MLP (``mlp.hook_pre_linear``)
    attn_implementations: ClassVar[Sequence[str]] = ("eager",) if lensadapters_t5.TRANSFORMERS_4 else ("sdpa", "eager")

    def config_label(self, config: Any) -> Optional[str]:
        return str(config.feed_forward_proj)
