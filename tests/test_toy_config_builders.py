"""The core's declarative builders of plugins' toy and test configs (``lensadapters.hf``): the window fields, the
sliding-window toy, the mixture-of-experts decoder config and the tiny test config say what their docstrings say."""

from __future__ import annotations

from transformers import GPT2Config, LlamaConfig, MambaConfig, MistralConfig, MixtralConfig, OPTConfig

from lensadapters import hf


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
