"""Test kit of lensadapters-gpt-neox: configs and the contract class (needs ``lensadapters[testing]``).

``GPTNeoXContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check
gpt_neox`` runs it); the plugin's tests subclass it, and the cross-cutting plugins' matrices put their
variants in front of it. ``gpt_neox_configs(**overrides)`` draws tiny ``GPTNeoXConfig``s (every keyword a
fixed value or a strategy); ``gpt_neox_config(...)`` builds one.

Importing ``lensadapters_gpt_neox`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from hypothesis import strategies as st
from transformers import GPTNeoXConfig

import lensadapters_gpt_neox
from lensadapters import hf
from lensadapters.testing import AdapterContract, Capabilities
from lensadapters.testing.families import keyword_strategy

__all__ = ["GPTNeoXContract", "gpt_neox_config", "gpt_neox_configs", "rotary_pct"]

VOCAB = 128


def gpt_neox_config(
    n_heads: int = 4,
    d_head: int = 8,
    rotary_pct: float = 0.25,
    parallel: bool = True,
    bias: bool = True,
    n_layers: int = 2,
    d_mlp: int = 48,
    vocab: int = VOCAB,
    d_model: Optional[int] = None,
) -> GPTNeoXConfig:
    """A tiny GPT-NeoX config (no dropout, padding token 0, no bos/eos); ``d_model`` fixes the width (``d_head`` is
    then ``d_model // n_heads``)."""
    if d_model is not None:
        d_head = d_model // n_heads
    sizes = hf.size_fields(hidden=n_heads * d_head, d_mlp=d_mlp, layers=n_layers, heads=n_heads, vocab=vocab)
    return hf.without_dropout(
        GPTNeoXConfig,
        **sizes,
        max_position_embeddings=64,
        rotary_pct=rotary_pct,
        rotary_emb_base=10000,
        use_parallel_residual=parallel,
        attention_bias=bias,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )


def rotary_pct(config: Any) -> float:
    """``rotary_pct`` of a config (transformers 5 keeps it in ``rope_parameters["partial_rotary_factor"]``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("partial_rotary_factor", getattr(config, "rotary_pct", None))


gpt_neox_configs = keyword_strategy(
    gpt_neox_config,
    """Tiny GPT-NeoX configs: parallel and sequential residual, ``rotary_pct`` 0.25 / 0.5 / 1, 1-4 heads,
    attention bias on and off, 1-2 layers. Each keyword is a value or a strategy; ``d_model`` fixes the width.""",
    n_heads=st.sampled_from([1, 2, 4]),
    d_head=st.sampled_from([8, 16]),
    d_model=None,
    rotary_pct=st.sampled_from([0.25, 0.5, 1.0]),
    parallel=st.booleans(),
    bias=st.booleans(),
    n_layers=st.integers(1, 2),
    d_mlp=48,
    vocab=VOCAB,
)


class GPTNeoXContract(AdapterContract):
    """Every generic adapter property on tiny GPT-NeoX models (partial rotary, parallel or sequential blocks)."""

    plugin = lensadapters_gpt_neox
    config_strategy = gpt_neox_configs
    # the LoRA and 8-bit matrices build two models per example: smaller ones, at least two heads
    matrix_overrides = dict(
        n_heads=st.integers(2, 4),
        d_head=8,
        d_mlp=st.sampled_from([24, 64]),
        vocab=64,
        rotary_pct=st.sampled_from([0.25, 1.0]),
    )
    aligned_overrides = dict(d_model=64, d_mlp=128, n_heads=st.sampled_from([1, 2, 4]))
    learned_positions, rotary, gated_mlp = False, True, False

    def capabilities(self, model: torch.nn.Module) -> Capabilities:
        return dataclasses.replace(
            super().capabilities(model), parallel_blocks=bool(model.config.use_parallel_residual)
        )

    def config_label(self, config: Any) -> Optional[str]:
        return f"{'parallel' if config.use_parallel_residual else 'sequential'}, rotary_pct {rotary_pct(config)}"
