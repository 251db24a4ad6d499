"""The plugin kit's description of Hugging Face decoder families (lensadapters.hf)."""

from __future__ import annotations

import pytest

from lensadapters import hf
from lensadapters.testing.tiny_models import ARCH_NAMES, tiny


class _LayerNormConfig:
    """A config as a LayerNorm family's: ``layer_norm_eps``, no ``rms_norm_eps`` (the rest from ``config``)."""

    def __init__(self, config: object) -> None:
        self._config = config
        self.layer_norm_eps = 3e-5

    def __getattr__(self, name: str) -> object:
        if name == "rms_norm_eps":
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self._config, name)


@pytest.mark.skipif("llama" not in ARCH_NAMES, reason="no Llama plugin")
def test_hooked_config_reads_no_config_field_that_fields_give() -> None:
    """A family whose config has no ``rms_norm_eps`` (a LayerNorm family, here a Llama-shaped model whose config has
    ``layer_norm_eps`` instead) gives ``eps`` itself: the config's RMS field is not read."""
    model = tiny("llama")
    model.config = config = _LayerNormConfig(model.config)
    assert not hasattr(config, "rms_norm_eps")
    family = hf.DecoderFamily("Llama", model_type="llama", packages=("llama",))
    cfg = family.hooked_config(model, eps=config.layer_norm_eps, normalization_type="LN")
    assert (cfg.eps, cfg.normalization_type) == (config.layer_norm_eps, "LN")
    assert (cfg.d_model, cfg.n_layers, cfg.d_mlp, cfg.d_head) == (
        config.hidden_size,
        config.num_hidden_layers,
        config.intermediate_size,
        config.hidden_size // config.num_attention_heads,
    )
    with pytest.raises(AttributeError, match="rms_norm_eps"):  # without eps= the RMS family's field is read
        family.hooked_config(model)


def test_toy_draw_gives_the_demo_for_seed_0_and_one_draw_per_choice_otherwise() -> None:
    import random

    demo = (2, (4, 2), True)
    assert hf.toy_draw(0, demo, [1, 2, 3], [(4, 2), (4, 4)], 0.5) == demo
    rng = random.Random(7)
    expected = (rng.choice([1, 2, 3]), rng.choice([(4, 2), (4, 4)]), rng.random() < 0.5, rng.randint(1, 3))
    drawn = hf.toy_draw(7, demo + (1,), [1, 2, 3], [(4, 2), (4, 4)], 0.5, lambda rng, *before: rng.randint(1, 3))
    assert drawn == expected


def test_fused_qkv_split_views_each_part_by_heads_and_merges_back() -> None:
    import torch

    split, merge = hf.fused_qkv_split(n_heads=4, n_kv=2, d_head=3)
    fused = torch.randn(2, 5, (4 + 2 * 2) * 3)
    q, k, v = split(fused)
    assert q.shape == (2, 5, 4, 3) and k.shape == v.shape == (2, 5, 2, 3)
    assert torch.equal(q.flatten(-2), fused[..., :12]) and torch.equal(v.flatten(-2), fused[..., 18:])
    assert torch.equal(merge(q, k, v), fused)
