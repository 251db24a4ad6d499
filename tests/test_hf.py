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

    def get_text_config(self) -> "_LayerNormConfig":  # a text model's config is its own text config
        return self

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


def test_layer_config_and_rope_types_read_heterogeneous_models() -> None:
    """A config whose attributes vary by layer (``per_layer_config``) answers per layer; a rotary module with a rope
    type per layer type lists them all (one module called once per layer type)."""
    from types import SimpleNamespace

    from torch import nn

    wide = SimpleNamespace(head_dim=16, num_key_value_heads=1)
    narrow = SimpleNamespace(head_dim=8, num_key_value_heads=2)
    config = SimpleNamespace(per_layer_config=[narrow, wide], hidden_size=32, num_attention_heads=4)
    assert hf.layer_config(config, 1) is wide
    assert (hf.head_dim(config), hf.head_dim(config, 1)) == (8, 16)
    assert (hf.n_kv_heads(config), hf.n_kv_heads(config, 1)) == (2, 1)
    plain = SimpleNamespace(hidden_size=32, num_attention_heads=4)
    assert hf.layer_config(plain, 1) is plain and hf.head_dim(plain) == 8
    rotary = nn.Module()
    rotary.rope_type = {"sliding_attention": "default", "full_attention": "proportional"}
    assert hf.rope_types(rotary) == ["default", "proportional"]
    rotary.rope_type = "llama3"
    assert hf.rope_types(rotary) == ["llama3"]


def test_a_value_norm_fires_after_the_key_norm() -> None:
    """``SeparateQKV.v_norm``: q projected, normed, rotated; k and v projected; k normed and rotated; v normed."""
    from lensadapters import ProjectionNorm, SeparateQKV
    from lensadapters.rotary import rotate_half_spec
    from lensadapters.wiring.names import qkv_point_names

    norm = ProjectionNorm("n")
    qkv = SeparateQKV("q", "k", "v", rotary=rotate_half_spec(4), q_norm=norm, k_norm=norm, v_norm=norm)
    assert qkv_point_names(qkv) == [
        "attn.hook_q",
        "attn.q_norm.hook_scale",
        "attn.q_norm.hook_normalized",
        "attn.hook_rot_q",
        "attn.hook_k",
        "attn.hook_v",
        "attn.k_norm.hook_scale",
        "attn.k_norm.hook_normalized",
        "attn.hook_rot_k",
        "attn.v_norm.hook_scale",
        "attn.v_norm.hook_normalized",
    ]


def test_a_layer_reading_another_layers_keys_and_values_has_only_query_points() -> None:
    """``SeparateQKV.kv_from``: no key/value points of its own (another layer's keys and values)."""
    from lensadapters import ProjectionNorm, SeparateQKV
    from lensadapters.rotary import rotate_half_spec
    from lensadapters.wiring.names import qkv_point_names

    qkv = SeparateQKV("q", "", "", rotary=rotate_half_spec(4), q_norm=ProjectionNorm("n"), kv_from=0)
    assert qkv_point_names(qkv) == [
        "attn.hook_q",
        "attn.q_norm.hook_scale",
        "attn.q_norm.hook_normalized",
        "attn.hook_rot_q",
    ]


def test_values_from_the_key_projection_fire_after_the_keys() -> None:
    """``SeparateQKV.values_from_keys``: hook_k and hook_v at the inputs of k_norm and v_norm, keys first."""
    from lensadapters import ProjectionNorm, SeparateQKV
    from lensadapters.rotary import rotate_half_spec
    from lensadapters.wiring.names import qkv_point_names

    norm = ProjectionNorm("n")
    qkv = SeparateQKV(
        "q", "k", "k", rotary=rotate_half_spec(4), q_norm=norm, k_norm=norm, v_norm=norm, values_from_keys=True
    )
    assert qkv_point_names(qkv)[4:] == [
        "attn.hook_k",
        "attn.k_norm.hook_scale",
        "attn.k_norm.hook_normalized",
        "attn.hook_rot_k",
        "attn.hook_v",
        "attn.v_norm.hook_scale",
        "attn.v_norm.hook_normalized",
    ]


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
