"""The core's declarative builders of plugins' toy and test configs (``lensadapters.hf``): the window fields, the
sliding-window toy, the mixture-of-experts decoder config and the tiny test config say what their docstrings say; so
do the test kit's declared config builders and keyword strategies (``lensadapters.testing.families``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, LlamaConfig, MambaConfig, MistralConfig, MixtralConfig, OPTConfig

from lensadapters import hf
from lensadapters.testing.families import declared_config, keyword_strategy


def test_window_fields_switch_the_window_on_only_where_a_layer_has_it() -> None:
    assert hf.window_from_fields(3, 1, 2) == {"sliding_window": 3, "use_sliding_window": True, "max_window_layers": 1}
    assert hf.window_from_fields(3, 9, 2)["use_sliding_window"] is False  # no layer from 9 on in 2 layers
    assert hf.window_from_fields(None) == {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 0}
    assert "max_window_layers" not in hf.window_from_fields(3, None)


def test_the_sliding_toy_of_seed_0_is_the_demo_and_others_are_drawn() -> None:
    demo = hf.sliding_toy(MistralConfig, 0, (2, (4, 2)))
    assert (demo.num_hidden_layers, demo.num_attention_heads, demo.num_key_value_heads) == (2, 4, 2)
    assert demo.sliding_window == 4
    drawn = {
        (c.num_hidden_layers, c.num_key_value_heads, c.sliding_window)
        for c in (hf.sliding_toy(MistralConfig, seed, (2, (4, 2))) for seed in range(1, 40))
    }
    assert {layers for layers, _, _ in drawn} <= {1, 2, 3} and {w for _, _, w in drawn} <= {3, 8}
    assert len(drawn) > 1, "every seed drew the same config"
    typed = hf.sliding_toy(MistralConfig, 0, (2, (4, 2)), full_every=2)
    assert typed.layer_types == hf.sliding_layers(2, 2, False)


def test_a_mixture_of_experts_decoder_config_has_its_experts_and_its_defaults() -> None:
    config = hf.moe_decoder_config(MixtralConfig, experts=6, top_k=3, hidden=32, layers=1, n_heads=4, n_kv=2)
    assert (config.num_local_experts, config.num_experts_per_tok) == (6, 3)
    assert (config.intermediate_size, config.max_position_embeddings) == (16, 32)
    assert (
        hf.moe_decoder_config(MixtralConfig, d_mlp=24, hidden=32, layers=1, n_heads=4, n_kv=2).intermediate_size == 24
    )


def test_a_tiny_config_has_the_shared_sizes_under_the_family_s_own_names() -> None:
    llama = hf.tiny_config_of(LlamaConfig, layers=3, head_dim=8)
    sizes = (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers, llama.num_attention_heads)
    assert sizes == (32, 48, 3, 4) and (llama.num_key_value_heads, llama.head_dim) == (2, 8)
    assert (llama.vocab_size, llama.max_position_embeddings) == (64, 64)
    gpt2 = hf.tiny_config_of(GPT2Config, hidden=16)  # n_embd, n_layer, n_head, n_positions: GPT-2's names
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_positions, gpt2.n_inner) == (16, 2, 4, 64, None)
    mamba = hf.tiny_config_of(MambaConfig, hidden=16)  # no heads, no positions, its MLP width its own
    assert not hasattr(mamba, "num_attention_heads") and mamba.intermediate_size == 2 * 16
    assert (
        hf.tiny_config_of(LlamaConfig, positions=None).max_position_embeddings == LlamaConfig().max_position_embeddings
    )
    assert hf.tiny_config_of(LlamaConfig, layers=1, num_hidden_layers=5).num_hidden_layers == 5  # transformers' name
    opt = hf.tiny_config_of(OPTConfig, dropout_free=True, attention_dropout=0.5)  # rates the fields set stay
    assert (opt.dropout, opt.attention_dropout) == (0.0, 0.5) and OPTConfig().dropout > 0


def test_a_declared_config_sets_each_keyword_as_its_field_and_derives_the_others() -> None:
    build = declared_config(
        "sliding_config",
        lambda given: MixtralConfig if given["experts"] else MistralConfig,
        "A tiny sliding-window config.",
        keywords=dict(window=3, layers=2, head_dim=8, span=2, experts=0),
        fields=dict(window="sliding_window", span=None, experts=None),
        derive=lambda given: {"max_position_embeddings": 16 * given["span"]},
    )
    assert (build.__name__, build.__doc__) == ("sliding_config", "A tiny sliding-window config.")
    config = build()
    assert type(config) is MistralConfig and (config.sliding_window, config.num_hidden_layers) == (3, 2)
    assert (config.head_dim, config.max_position_embeddings) == (8, 32)
    assert not hasattr(config, "span") and not hasattr(config, "window")  # read by derive only / set as its field
    given = build(window=5, span=1, hidden=64, attention_dropout=0.25)  # declared, shared and transformers' keywords
    assert (given.sliding_window, given.max_position_embeddings, given.hidden_size) == (5, 16, 64)
    assert given.attention_dropout == 0.25 and given.bos_token_id == 1  # decoder_config's fields, one replaced
    assert type(build(experts=4)) is MixtralConfig  # the class is chosen from the keywords


def test_a_keyword_strategy_draws_in_declaration_order_and_refuses_unknown_keywords() -> None:
    def pair(**drawn: Any) -> dict[str, Any]:
        return drawn

    pairs = keyword_strategy(pair, "pairs", low=st.integers(0, 3), high=lambda drawn: st.integers(drawn["low"], 9))

    @given(pairs(), pairs(low=7))
    @settings(max_examples=20, derandomize=True, database=None)
    def check(drawn: dict[str, Any], fixed: dict[str, Any]) -> None:
        assert set(drawn) == {"low", "high"} and 0 <= drawn["low"] <= drawn["high"] <= 9
        assert fixed["low"] == 7 and 7 <= fixed["high"] <= 9

    check()
    assert pairs.__name__ == "pairs" and pairs.__doc__ == "pairs"
    with pytest.raises(TypeError, match="pair draws no width"):
        find(pairs(width=3), lambda drawn: True)


def test_a_hand_written_plugins_config_and_layout_hooks_read_the_model() -> None:
    """``hf.hooked_config`` fills in the sizes, ``model_type`` and ``original_architecture`` around a plugin's own
    fields; ``hf.model_layout`` puts its paths under the base model and finds the unembedding."""
    from transformers import GPT2LMHeadModel, GPT2Model

    config = GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=16)
    own = dict(act_fn="gelu_new", normalization_type="LN", positional_embedding_type="standard")
    config_hook = hf.hooked_config(lambda model: dict(d_mlp=64, n_ctx=8, **own))
    layout_hook = hf.model_layout(blocks="h", embed="wte", ln_final="ln_f", rotary_from_inputs=None)
    for model, prefix, unembed in ((GPT2LMHeadModel(config), "transformer.", "lm_head"), (GPT2Model(config), "", None)):
        cfg = config_hook(None, model)
        assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_vocab) == (2, 16, 2, 8, 32)
        assert (cfg.d_mlp, cfg.act_fn, cfg.n_ctx) == (64, "gelu_new", 8)  # the plugin's fields replace the sizes
        assert (cfg.model_type, cfg.original_architecture) == ("gpt2", type(model).__name__)
        layout = layout_hook(None, model)
        assert (layout.blocks, layout.embed, layout.ln_final) == (prefix + "h", prefix + "wte", prefix + "ln_f")
        assert layout.unembed == unembed and layout.rotary_from_inputs is None
