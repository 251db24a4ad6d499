"""Test kit of lensadapters-bart: the config strategy and the contract class (needs ``lensadapters[testing]``).

``BartContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check bart`` runs it):
the encoder-decoder properties of :class:`lensadapters.testing.encoder_decoder.EncoderDecoderContract` on tiny BART
models. ``bart_configs(**overrides)`` draws tiny ``BartConfig``s.

Importing ``lensadapters_bart`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

from hypothesis import strategies as st

import lensadapters_bart
from lensadapters.testing.encoder_decoder import EncoderDecoderContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["BartContract", "bart_configs"]


@st.composite
def bart_configs(
    draw: st.DrawFn,
    *,
    n_heads: Any = st.integers(1, 3),
    d_head: Any = st.sampled_from([4, 8]),
    n_layers: Any = st.integers(1, 2),
    d_mlp: Any = st.sampled_from([16, 24]),
    vocab: Any = st.integers(16, 64),
    scale_embedding: Any = st.booleans(),
    act: Any = st.sampled_from(["gelu", "relu"]),
) -> Any:
    """Tiny BART configs: 1-2 layers of each stack with 1-3 heads, the embeddings scaled by ``sqrt(d_model)`` or
    not, GELU or ReLU; no dropout. Each keyword is a value or a strategy."""
    heads = draw(as_strategy(n_heads), label="n_heads")
    return lensadapters_bart.bart_config(
        layers=draw(as_strategy(n_layers), label="n_layers"),
        heads=heads,
        d_model=heads * draw(as_strategy(d_head), label="d_head"),
        ffn=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        scale_embedding=draw(as_strategy(scale_embedding), label="scale_embedding"),
        act=draw(as_strategy(act), label="act"),
    )


class BartContract(EncoderDecoderContract):
    """The encoder-decoder properties on tiny BART models (learned positions, post-LN blocks, no final norms)."""

    plugin: ClassVar[Any] = lensadapters_bart
    config_strategy = bart_configs
    final_norms: ClassVar[bool] = False
    # capabilities (`lensadapters check bart`): a learned position table (hook_pos_embed, W_pos), a plain fc1/fc2 MLP
    learned_positions = True
    gated_mlp: ClassVar[Optional[bool]] = False
    # sdpa (the default); eager's forward without hooks is checked bitwise in tests/test_bart.py
    attn_implementations: ClassVar[Sequence[str]] = ("sdpa",)

    def config_label(self, config: Any) -> Optional[str]:
        return f"{config.activation_function}, scale_embedding={config.scale_embedding}"
