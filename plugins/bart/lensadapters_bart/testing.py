"""Test kit of lensadapters-bart: the config strategy and the contract classes (needs ``lensadapters[testing]``).

``BartContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check bart`` runs it):
the encoder-decoder properties of :class:`lensadapters.testing.encoder_decoder.EncoderDecoderContract` on tiny models
of every family the plugin serves (``FAMILIES``: drawn, and each non-BART family a stratum of its own).
``BartCausalContract``: the generic adapter properties on their ``*ForCausalLM`` (the decoder alone).
``bart_configs(**overrides)`` draws tiny configs.

Importing ``lensadapters_bart`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

from hypothesis import strategies as st

import lensadapters_bart
from lensadapters.testing.contract import AdapterContract
from lensadapters.testing.encoder_decoder import EncoderDecoderContract, draw_sizes
from lensadapters.testing.models import seeded_model
from lensadapters.testing.strategies import as_strategy

__all__ = ["BartCausalContract", "BartContract", "bart_configs"]

#: the families served as encoder-decoders (every one)
ENCODER_DECODERS = tuple(lensadapters_bart.FAMILIES)
#: the families beside BART, each a stratum of the encoder-decoder contract
OTHERS = tuple(t for t in ENCODER_DECODERS if t != "bart")
PRE_LN = tuple(t for t, f in lensadapters_bart.FAMILIES.items() if f.pre_ln)
#: each family beside BART: every point fires once in order; the pre-LN ones: generation with hooks too
STRATA = {
    t: ("test_encoder_decoder_every_point_fires_once_in_order",)
    + (("test_encoder_decoder_generation_with_hooks",) if t in PRE_LN else ())
    for t in OTHERS
}


@st.composite
def bart_configs(
    draw: st.DrawFn,
    *,
    scale_embedding: Any = st.booleans(),
    act: Any = st.sampled_from(["gelu", "relu"]),
    model_type: Any = st.sampled_from(list(lensadapters_bart.FAMILIES)),
    causal: bool = False,
    **sizes: Any,
) -> Any:
    """Tiny configs of the families (``model_type``): 1-2 layers of each stack with 1-3 heads (``sizes``: the kit's
    ``SIZES``), the embeddings scaled by ``sqrt(d_model)`` or not, GELU or ReLU; no dropout; ``causal``: for the
    ``*ForCausalLM``. Each keyword is a value or a strategy."""
    z = draw_sizes(draw, sizes)
    config = lensadapters_bart.bart_config(
        layers=z["n_layers"],
        heads=z["n_heads"],
        d_model=z["d_model"],
        ffn=z["d_mlp"],
        vocab=z["vocab"],
        scale_embedding=draw(as_strategy(scale_embedding), label="scale_embedding"),
        act=draw(as_strategy(act), label="act"),
        model_type=draw(as_strategy(model_type), label="model_type"),
    )
    if causal:  # what *ForCausalLM sets (AutoModelForCausalLM builds one from such a config)
        config.is_encoder_decoder, config.is_decoder = False, True
    return config


def _label(config: Any) -> str:
    return f"{config.model_type}, {config.activation_function}, scale_embedding={config.scale_embedding}"


class _Families:
    """What the contracts over several families share: the label, and eager attention for a family without sdpa
    (MVP's own attention code)."""

    def config_label(self, config: Any) -> Optional[str]:
        return _label(config)

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> Any:
        try:
            return seeded_model(config, seed, attn_implementation)
        except ValueError:  # "... does not support an attention implementation through sdpa yet"
            return seeded_model(config, seed, "eager")


class BartContract(_Families, EncoderDecoderContract):
    """The encoder-decoder properties on tiny models of every family (``final_norms``: per model, from the
    family)."""

    plugin: ClassVar[Any] = lensadapters_bart
    config_strategy = bart_configs
    config_overrides: ClassVar[Any] = {"model_type": st.sampled_from(ENCODER_DECODERS)}
    config_strata: ClassVar[Any] = STRATA
    stratum_overrides: ClassVar[Any] = {t: {"model_type": t} for t in OTHERS}
    # capabilities (`lensadapters check bart`): a learned position table (hook_pos_embed, W_pos), a plain fc1/fc2 MLP
    learned_positions = True
    gated_mlp: ClassVar[Optional[bool]] = False
    # sdpa (the default); eager's forward without hooks is checked bitwise in tests/test_bart.py
    attn_implementations: ClassVar[Sequence[str]] = ("sdpa",)

    def has_final_norms(self, model: Any) -> bool:
        return lensadapters_bart.family(model).final_norms


class BartCausalContract(_Families, AdapterContract):
    """The generic adapter properties on the families' ``*ForCausalLM`` (post-LN: TransformerLens' ``BertBlock``
    points, no final norm; pre-LN: ``ln_final``)."""

    plugin: ClassVar[Any] = lensadapters_bart
    config_strategy = bart_configs
    config_overrides: ClassVar[Any] = {"causal": True}
    learned_positions, rotary, gated_mlp, parallel_blocks = True, False, False, False

    def final_hidden_is_ln_final_of(self, model: Any) -> bool:
        return lensadapters_bart.family(model).final_norms

    def pre_ln_residual(self, model: Any) -> bool:
        """Pre-LN blocks whose first block reads the embeddings' sum itself (no embedding norm between)."""
        family = lensadapters_bart.family(model)
        return family.pre_ln and not family.embed_ln
