"""Test kit of lensadapters-llama: configs and the contract class (needs ``lensadapters[testing]``).

``LlamaContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check llama``
runs it); the plugin's tests subclass it, and the cross-cutting plugins' matrices put their variants in front
of it. ``llama_configs(**overrides)`` draws tiny ``LlamaConfig``s (every keyword a fixed value or a
strategy); ``llama_config(...)`` builds one and ``rope_scaling(...)`` the rope parameters of each type.

Importing ``lensadapters_llama`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from hypothesis import strategies as st
from transformers import LlamaConfig

import lensadapters_llama
from lensadapters import HookedModel, hf
from lensadapters.testing.families import DecoderContract, config_strategy, decoder_config, rope_type

__all__ = ["LlamaContract", "ROPE_TYPES", "llama_config", "llama_configs", "rope_scaling", "rope_type"]

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_scaling(rope_type: str, head_dim: int, original_max: int = 4, factor: float = 4.0) -> Any:
    """A ``rope_scaling`` dict (accepted by transformers 4.57 and 5.x) for ``rope_type``."""
    if rope_type == "default":
        return None
    if rope_type in ("linear", "dynamic"):
        return {"rope_type": rope_type, "factor": factor}
    if rope_type == "llama3":
        return {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original_max,
        }
    if rope_type == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original_max}
    if rope_type == "longrope":
        half = head_dim // 2
        return {
            "rope_type": "longrope",
            "factor": factor,
            "original_max_position_embeddings": original_max,
            "short_factor": [1.0 + 0.25 * i / half for i in range(half)],
            "long_factor": [1.5 + 2.0 * i / half for i in range(half)],
        }
    raise ValueError(rope_type)


def llama_config(
    *,
    head_dim: int = 8,
    rope_type: str = "default",
    max_pos: int = 32,
    original_max: int = 4,
    factor: float = 4.0,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    **shared: Any,
) -> LlamaConfig:
    """A tiny Llama config (``decoder_config``'s shared fields: ``n_heads``, ``n_kv``, ``hidden``, ``layers``,
    ``d_mlp``, ``vocab``, ``theta``, ``tied``, ``eps``, ``act``); ``rope_type`` one of ``ROPE_TYPES``."""
    if rope_type == "longrope":
        factor = max_pos / original_max  # what LongRoPE means by its factor
    config = decoder_config(
        LlamaConfig,
        max_pos=max_pos,
        head_dim=head_dim,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        rope_scaling=rope_scaling(rope_type, head_dim, original_max, factor),
        **shared,
    )
    if rope_type == "longrope":  # transformers 4.57 reads it from the config, 5.x from the rope parameters
        config.original_max_position_embeddings = original_max
    return config


def _drawn_llama_config(*, rope_types: tuple[str, ...], rope: str, original_max: int, **drawn: Any) -> LlamaConfig:
    # LongRoPE switches from its short to its long factors once a position passes original_max_position_embeddings,
    # in the middle of a generation: a decoding step then no longer equals one pass over the same tokens, with or
    # without hooks. Keep the contract's sequences (at most 9 + 3 tokens) in the short regime; test_llama.py checks
    # the long one. The contract compares generate() before and after wrapping: max_pos keeps dynamic RoPE (whose
    # frequencies depend on the longest sequence seen so far) below its growth threshold.
    original = 16 if rope == "longrope" else original_max
    return llama_config(rope_type=rope, original_max=original, max_pos=32, **drawn)


llama_configs = config_strategy(
    _drawn_llama_config,
    """Tiny Llama configs covering GQA ratios 1, 2, 3 and multi-query attention (one kv head), ``head_dim``
    different from ``hidden_size / num_attention_heads``, every rope type in ``rope_types``, tied and untied
    embeddings, ``attention_bias``, ``mlp_bias``.

    Each keyword is a value or a strategy. Query heads are ``n_kv * ratio`` unless ``n_heads`` is given (``n_kv``
    must divide it); ``hidden_size`` is ``n_heads * hidden_per_head`` unless ``d_model`` is given.""",
    rope_types=ROPE_TYPES,
    rope=lambda drawn: st.sampled_from(drawn["rope_types"]),
    n_kv=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([4, 8, 12]),
    hidden_per_head=st.sampled_from([2, 4, 8]),
    n_layers=st.integers(1, 2),
    d_mlp=st.sampled_from([16, 24, 40]),
    vocab=st.integers(16, 160),
    theta=st.sampled_from([100.0, 10000.0, 500000.0]),
    original_max=st.sampled_from([4, 8]),
    factor=st.sampled_from([2.0, 8.0]),
    tied=st.booleans(),
    attention_bias=st.booleans(),
    mlp_bias=st.booleans(),
    act=st.sampled_from(["silu", "silu", "gelu_new"]),
    eps=st.sampled_from([1e-6, 1e-5]),
)


#: the contract's edit and generation properties: each also runs on llama3-scaled RoPE on every run
EDITS_AND_GENERATION = (
    "test_every_hook_point_edit_changes_logits",
    "test_in_place_edits_equal_returned_edits",
    "test_zero_ablating_a_head_removes_its_output",
    "test_residual_edits_reach_what_they_should",
    "test_norm_scale_edit_is_used",
    "test_pattern_and_query_edits_are_used",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_generation_with_hooks_matches",
    "test_edits_during_generation_match_one_pass",
)


class LlamaContract(DecoderContract):
    """Every generic adapter property on tiny Llama models (GQA, every rope type, RMSNorm, SwiGLU). Llama 3's
    rope scaling (``llama3``) is a stratum of the edit and generation properties: drawn on every run."""

    plugin: ClassVar[Any] = lensadapters_llama
    config_strategy = llama_configs
    config_strata = {"llama3": EDITS_AND_GENERATION}
    stratum_overrides = {"llama3": dict(rope_types=("llama3",))}
    # the LoRA and 8-bit matrices build two models per example: smaller ones, at least two query heads, default
    # rope (the float contract covers the rope types)
    matrix_overrides = dict(
        ratio=2,
        head_dim=st.sampled_from([4, 8]),
        d_model=st.sampled_from([16, 32]),
        d_mlp=24,
        vocab=64,
        rope_types=("default",),
        theta=10000.0,
    )
    aligned_overrides = dict(n_heads=2, head_dim=32, d_model=64, d_mlp=128)

    def config_label(self, config: Any) -> Optional[str]:
        return f"rope {rope_type(config)}"


#: a contract instance whose model builders the family tests use
_CONTRACT = LlamaContract()


def make(config: LlamaConfig, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A seeded Llama of ``config``, as the contract builds it."""
    return _CONTRACT.make_model(config, seed, attn_implementation)


def wrap(model: torch.nn.Module) -> HookedModel:
    """``model`` wrapped as the contract wraps it."""
    return _CONTRACT.wrap(model)


def left_padded(
    vocab: int, batch: int = 2, length: int = 8, pads: tuple[int, ...] = (3, 0), seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask whose rows are left-padded by ``pads``."""
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, pad in enumerate(pads[:batch]):
        mask[row, :pad] = 0
    return ids, mask


def llama32_3b_like(layers: int = 2) -> LlamaConfig:
    """Llama 3.2 3B's ratios at toy width: 24 query heads sharing 8 kv heads of size 128, theta 500000,
    llama3 rope scaling (factor 32, low 1, high 4), tied embeddings; hidden 96 and vocab 256 for the CPU."""
    return LlamaConfig(
        **hf.size_fields(hidden=96, d_mlp=256, layers=layers, heads=24, kv_heads=8, vocab=256, positions=512),
        head_dim=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },  # 8192 in the real model; 8 so scaling matters here
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
