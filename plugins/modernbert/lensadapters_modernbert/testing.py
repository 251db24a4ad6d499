"""Test kit of lensadapters-modernbert: the config strategy and the contract class (needs ``lensadapters[testing]``).

``ModernBertContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check
modernbert`` runs it): the generic adapter properties in an encoder's form (generation and the next-token loss are
refused with ``NotCausalError``). ``modernbert_configs(**overrides)`` draws tiny ``ModernBertConfig``s.

Importing ``lensadapters_modernbert`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from hypothesis import strategies as st
from transformers import ModernBertConfig, ModernBertForMaskedLM

import lensadapters_modernbert
from lensadapters import HookedModel
from lensadapters.testing import AdapterContract
from lensadapters.testing.models import reinit
from lensadapters.testing.strategies import as_strategy

__all__ = ["ModernBertContract", "modernbert_configs"]


@st.composite
def modernbert_configs(
    draw: st.DrawFn,
    *,
    n_heads: Any = st.integers(1, 4),
    d_head: Any = st.sampled_from([4, 8]),
    n_layers: Any = st.integers(1, 3),
    window: Any = st.sampled_from([2, 4]),
    every: Any = st.integers(1, 3),
    act: Any = st.sampled_from(["gelu", "silu"]),
    bias: Any = st.booleans(),
) -> Any:
    """Tiny ModernBERT configs: 1-3 layers of 1-4 heads, a window of 2 or 4, a global layer every 1-3 layers,
    GeGLU or SwiGLU, with or without biases; no dropout. Each keyword is a value or a strategy."""
    with_bias = draw(as_strategy(bias), label="bias")
    return lensadapters_modernbert.tiny_config(
        ModernBertConfig,
        layers=draw(as_strategy(n_layers), label="n_layers"),
        window=draw(as_strategy(window), label="window"),
        heads=draw(as_strategy(n_heads), label="n_heads"),
        d_head=draw(as_strategy(d_head), label="d_head"),
        global_attn_every_n_layers=draw(as_strategy(every), label="every"),
        hidden_activation=draw(as_strategy(act), label="act"),
        attention_bias=with_bias,
        mlp_bias=with_bias,
        norm_bias=with_bias,
    )


class ModernBertContract(AdapterContract):
    """Every generic adapter property on tiny ModernBERT encoders (pre-LN, rotary, global and local bidirectional
    attention, gated MLP; layer 0 without an attention norm)."""

    plugin = lensadapters_modernbert
    config_strategy = modernbert_configs
    matrix_overrides = dict(n_heads=st.integers(2, 4), d_head=8, n_layers=st.integers(1, 2))
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False
    final_hidden_is_ln_final = False  # HF's last hidden state is the last layer's output, before final_norm

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> torch.nn.Module:
        """``ModernBertForMaskedLM`` (ModernBERT has no causal LM for ``AutoModelForCausalLM``), seeded weights."""
        torch.manual_seed(seed)
        model = ModernBertForMaskedLM._from_config(config, attn_implementation=attn_implementation or "sdpa")
        reinit(model, seed)
        return model.eval()

    def layers_without_ln1(self, model: torch.nn.Module) -> set[int]:
        """Layer 0's ``attn_norm`` is ``nn.Identity``: it has no ``ln1.*`` points."""
        return {0}

    def config_label(self, config: Any) -> Optional[str]:
        return f"every {config.global_attn_every_n_layers}"

    def unembedding_input(self, hm: HookedModel, cache: Any) -> torch.Tensor:
        """``W_U`` reads the prediction head's norm output (after its dense layer and activation)."""
        return cache["mlm_head.ln.hook_normalized"]
