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
