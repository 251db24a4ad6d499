"""The core's declarative builders of plugins' toy and test configs (``lensadapters.hf``): the window fields, the
sliding-window toy and the mixture-of-experts decoder config say what their docstrings say."""

from __future__ import annotations

from transformers import MistralConfig, MixtralConfig

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
