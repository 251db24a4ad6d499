"""The toy-config declarations plugins share: ``hf.without_dropout``, ``hf.router_fields``, ``hf.sliding_layers``."""

from __future__ import annotations

import pytest
from transformers import BertConfig, GPT2Config, LlamaConfig, MixtralConfig, OlmoeConfig

from lensadapters import hf


def test_without_dropout_zeroes_the_body_dropouts_of_any_naming_and_keeps_head_and_given_ones() -> None:
    gpt2 = hf.without_dropout(GPT2Config, n_layer=1, resid_pdrop=0.25)
    assert (gpt2.n_layer, gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop) == (1, 0.25, 0.0, 0.0)
    assert gpt2.summary_first_dropout == GPT2Config().summary_first_dropout  # a task head's, left as it is
    bert = hf.without_dropout(BertConfig)
    assert (bert.hidden_dropout_prob, bert.attention_probs_dropout_prob) == (0.0, 0.0)
    assert BertConfig().hidden_dropout_prob > 0  # the default it replaced


EXPERT_COUNTS = [(MixtralConfig, "num_local_experts"), (OlmoeConfig, "num_experts")]


@pytest.mark.parametrize(("config_class", "count"), EXPERT_COUNTS)
def test_router_fields_name_the_expert_count_as_the_class_does(config_class: type, count: str) -> None:
    fields = hf.router_fields(config_class, 6, 3)
    assert fields == {count: 6, "num_experts_per_tok": 3, "output_router_logits": False}
    config = config_class(**fields)
    assert (getattr(config, count), config.num_experts_per_tok) == (6, 3)


def test_router_fields_refuse_a_config_without_experts() -> None:
    with pytest.raises(TypeError, match="LlamaConfig has no number of experts"):
        hf.router_fields(LlamaConfig, 4, 2)


def test_sliding_layers_mark_every_kth_and_optionally_the_last_layer_full() -> None:
    assert hf.sliding_layers(5, 3) == ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
    assert hf.sliding_layers(4, 3, last_full=True)[2:] == ["full_attention", "full_attention"]
    assert hf.sliding_layers(2, 2) == ["sliding_attention", "full_attention"]
