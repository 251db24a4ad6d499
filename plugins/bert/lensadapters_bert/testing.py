"""Test kit of lensadapters-bert: the config strategy and the contract class (needs ``lensadapters[testing]``).

``BertContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check bert`` runs it):
the generic adapter properties in an encoder's form. The generation properties check, as for every model that is
not a causal LM, that ``generate`` and the next-token loss are refused with ``NotCausalError``.
``bert_configs(**overrides)`` draws tiny ``BertConfig``/``RobertaConfig``s.

Importing ``lensadapters_bert`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from hypothesis import strategies as st
from transformers import BertConfig, RobertaConfig

import lensadapters_bert
from lensadapters import HookedModel
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["BertContract", "bert_configs"]


@st.composite
def bert_configs(
    draw: st.DrawFn,
    roberta: Any = None,
    *,
    n_heads: Any = st.integers(1, 4),
    d_head: Any = st.sampled_from([4, 8]),
    n_layers: Any = st.integers(1, 3),
    d_mlp: Any = st.sampled_from([16, 32]),
    vocab: Any = st.integers(16, 100),
    types: Any = st.integers(1, 3),
    act: Any = st.sampled_from(["gelu", "relu", "gelu_new"]),
) -> Any:
    """Tiny BERT and RoBERTa configs (``roberta`` ``None`` draws the family): 1-3 layers of 1-4 heads, 1-3 token
    types, GELU/ReLU; no dropout. Each keyword is a value or a strategy."""
    heads = draw(as_strategy(n_heads), label="n_heads")
    is_roberta = draw(st.booleans() if roberta is None else as_strategy(roberta), label="roberta")
    fields: dict[str, Any] = dict(
        vocab_size=draw(as_strategy(vocab), label="vocab"),
        hidden_size=heads * draw(as_strategy(d_head), label="d_head"),
        num_hidden_layers=draw(as_strategy(n_layers), label="n_layers"),
        num_attention_heads=heads,
        intermediate_size=draw(as_strategy(d_mlp), label="d_mlp"),
        type_vocab_size=draw(as_strategy(types), label="types"),
        hidden_act=draw(as_strategy(act), label="act"),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if is_roberta:  # positions start after the padding row: padding_idx + 1 more rows
        return RobertaConfig(max_position_embeddings=34, pad_token_id=1, bos_token_id=0, eos_token_id=2, **fields)
    return BertConfig(max_position_embeddings=32, pad_token_id=0, **fields)


class BertContract(AdapterContract):
    """Every generic adapter property on tiny BERT and RoBERTa encoders (post-LN blocks, learned positions, token
    types); the generation properties check the named refusal instead (the core contract's form for models that
    are not causal LMs)."""

    plugin = lensadapters_bert
    config_strategy = bert_configs
    matrix_overrides = dict(n_heads=st.integers(2, 4), d_head=8, n_layers=st.integers(1, 2), vocab=st.integers(16, 64))
    learned_positions, rotary, gated_mlp, parallel_blocks = True, False, False, False
    final_hidden_is_ln_final = False  # no final norm: the last hidden state is the last block's output

    def config_label(self, config: Any) -> Optional[str]:
        return str(config.model_type)

    def pre_ln_residual(self, model: torch.nn.Module) -> bool:
        return False

    def unembedding_input(self, hm: HookedModel, cache: Any) -> torch.Tensor:
        """``W_U`` reads the masked-LM head's norm output (after its dense layer and activation)."""
        return cache["mlm_head.ln.hook_normalized"]

    def test_weight_and_residual_identities(self) -> None:  # type: ignore[override]
        pytest.skip(
            "not yet in the encoder's form (its residual identities assume pre-LN sums); tests/test_bert.py checks "
            "every point against a reference from the HF modules and every weight against the live parameters"
        )
