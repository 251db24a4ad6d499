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
from lensadapters.testing.families import declared_config, keyword_strategy
from lensadapters.testing.models import reinit

__all__ = ["ModernBertContract", "modernbert_config", "modernbert_configs"]


modernbert_config = declared_config(
    "modernbert_config",
    ModernBertConfig,
    """A tiny ModernBERT config (``lensadapters_modernbert.tiny_config``'s): ``n_layers`` layers of ``n_heads`` heads
    of ``d_head``, a global layer every ``every`` layers, the others with a ``window``-token window, the MLP's
    activation ``act``, biases (attention, MLP, norms) or none; no dropout.""",
    keywords=dict(bias=False),
    fields={
        **dict(n_layers="layers", n_heads="heads", bias=None),
        **dict(every="global_attn_every_n_layers", act="hidden_activation"),
    },
    derive=lambda given: dict.fromkeys(("attention_bias", "mlp_bias", "norm_bias"), given["bias"]),
    build=lensadapters_modernbert.tiny_config,
)

modernbert_configs = keyword_strategy(
    modernbert_config,
    """Tiny ModernBERT configs: 1-3 layers of 1-4 heads, a window of 2 or 4, a global layer every 1-3 layers,
    GeGLU or SwiGLU, with or without biases; no dropout. Each keyword is a value or a strategy.""",
    bias=st.booleans(),
    n_layers=st.integers(1, 3),
    window=st.sampled_from([2, 4]),
    n_heads=st.integers(1, 4),
    d_head=st.sampled_from([4, 8]),
    every=st.integers(1, 3),
    act=st.sampled_from(["gelu", "silu"]),
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
