"""Test kit of lensadapters-gpt2: the config strategy and the contract class (needs ``lensadapters[testing]``).

``GPT2Contract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check gpt2``
runs it); the plugin's tests subclass it, and the cross-cutting plugins' matrices put their variants in front
of it. ``gpt2_configs(**overrides)`` draws tiny ``GPT2Config``s; every keyword takes a fixed value or a
strategy (defaults: the contract's coverage).

Importing ``lensadapters_gpt2`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import transformers
from hypothesis import strategies as st
from transformers import GPT2Config

import lensadapters_gpt2
from lensadapters import hf
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["GPT2Contract", "gpt2_configs"]

ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu", "tanh")
_TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5


@st.composite
def gpt2_configs(
    draw: st.DrawFn,
    *,
    n_layers: Any = st.integers(1, 3),
    n_heads: Any = st.integers(1, 4),
    d_head: Any = st.sampled_from([4, 8, 16]),
    d_model: Any = None,
    d_mlp: Any = st.sampled_from([None, 32, 48]),
    vocab: Any = st.integers(16, 200),
    act: Any = st.sampled_from(ACTIVATIONS),
    scale_attn_weights: Any = st.booleans(),
    scale_attn_by_inverse_layer_idx: Any = st.booleans(),
    reorder_and_upcast_attn: Any = st.booleans(),
    eps: Any = st.sampled_from([1e-5, 1e-3]),
) -> GPT2Config:
    """Tiny GPT-2 configs: 1-3 layers, 1-4 heads of 4-16 dims, ``n_inner`` default or set, every activation,
    both scaling flags and ``reorder_and_upcast_attn``.

    Each keyword is a value or a strategy. ``d_model`` fixes ``n_embd`` (``d_head`` is then ignored; ``n_heads``
    must divide it); ``d_mlp=None`` is GPT-2's default ``4 * n_embd``.
    """
    heads = draw(as_strategy(n_heads), label="n_heads")
    width = draw(as_strategy(d_model)) if d_model is not None else heads * draw(as_strategy(d_head), label="d_head")
    return hf.without_dropout(
        GPT2Config,
        n_layer=draw(as_strategy(n_layers), label="n_layers"),
        n_head=heads,
        n_embd=width,
        n_inner=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab_size=draw(as_strategy(vocab), label="vocab"),
        n_positions=32,
        activation_function=draw(as_strategy(act), label="act"),
        scale_attn_weights=draw(as_strategy(scale_attn_weights), label="scale_attn_weights"),
        scale_attn_by_inverse_layer_idx=draw(
            as_strategy(scale_attn_by_inverse_layer_idx), label="scale_attn_by_inverse_layer_idx"
        ),
        reorder_and_upcast_attn=draw(as_strategy(reorder_and_upcast_attn), label="reorder_and_upcast_attn"),
        layer_norm_epsilon=draw(as_strategy(eps), label="eps"),
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


class GPT2Contract(AdapterContract):
    """Every generic adapter property on tiny GPT-2 models (learned positions, sequential blocks)."""

    plugin = lensadapters_gpt2
    config_strategy = gpt2_configs
    # the LoRA and 8-bit matrices build two models per example: smaller ones, at least two heads (with one head
    # and two tokens a tiny random model can saturate the softmax)
    matrix_overrides = dict(
        n_layers=st.integers(1, 2),
        n_heads=st.integers(2, 4),
        d_head=st.sampled_from([4, 8]),
        d_mlp=st.sampled_from([None, 24]),
        vocab=st.integers(16, 100),
    )
    aligned_overrides = dict(d_model=64, d_mlp=None, n_heads=st.sampled_from([1, 2, 4]))  # widths 64, 192, 256
    learned_positions, rotary, gated_mlp, parallel_blocks = True, False, False, False

    def config_label(self, config: Any) -> Optional[str]:
        flags = [f for f in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn") if getattr(config, f)]
        return f"{config.n_layer} layer(s), {config.activation_function}" + "".join(f", {f}" for f in flags)

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> torch.nn.Module:
        # transformers 4.57's sdpa GPT-2 ignores both scale flags while its eager path applies them, so HF's
        # own eager patterns (the reference) describe a different model there: use eager for such configs.
        if _TRANSFORMERS_4 and (not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx):
            attn_implementation = "eager"
        return super().make_model(config, seed, attn_implementation)
