"""Seeded tiny models: what every suite builds its models with (no downloads, no test-kit dependencies)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from lensadapters.adapters.registry import PluginInfo, Registry
from lensadapters.hooks.specs import Architecture

__all__ = ["EmbedAndHead", "int8_copy", "reinit", "seeded_model"]


class EmbedAndHead:
    """Hugging Face's embedding getters for a test's model of someone's own (mixed in before its base class),
    whose input embedding is ``self.embed`` and output embedding ``self.head``."""

    embed: torch.nn.Module
    head: torch.nn.Module

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def reinit(model: torch.nn.Module, seed: int) -> None:
    """Give a tiny model weights of unit-ish scale (HF's 0.02 init makes tiny models nearly trivial)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1:
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(min(param.shape)))


def seeded_model(config: Any, seed: int = 0, attn_implementation: Optional[str] = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` (``AutoModelForSeq2SeqLM`` for an encoder-decoder config,
    ``AutoModelForMaskedLM`` for an encoder without a causal LM) with
    :func:`reinit` weights from ``seed``, in eval mode.

    ``attn_implementation=None`` keeps transformers' default for the config.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    try:
        model = auto.from_config(config, **kwargs)
    except ValueError:  # an encoder with no causal LM (ModernBERT): its masked LM
        from transformers import AutoModelForMaskedLM

        model = AutoModelForMaskedLM.from_config(config, **kwargs)
    reinit(model, seed)
    return model.eval()


def int8_copy(model: Any) -> Any:
    """``model`` saved and loaded back with its own class in 8 bits (bitsandbytes LLM.int8) on the CPU, float32
    elsewhere, its attention implementation kept; in eval mode."""
    import tempfile

    from transformers import BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        quantized = type(model).from_pretrained(
            directory,
            quantization_config=BitsAndBytesConfig(load_in_8bit=True),
            device_map="cpu",
            dtype=torch.float32,
            attn_implementation=model.config._attn_implementation,
        )
    return quantized.eval()


def tiny_model(
    registry: Registry, info: PluginInfo, arch: Architecture, seed: int = 0, encoder_decoder: bool = False
) -> torch.nn.Module:
    """A seeded tiny model of ``arch`` built from the plugin's tiny config (its causal LM, or its masked LM where it has
    none). An encoder-decoder architecture's (its ``*ForConditionalGeneration``) only with ``encoder_decoder``: the
    demo and the cross-plugin matrices build single-stack models."""

    if not arch.declared_for_installed_transformers():
        import transformers

        raise LookupError(
            f"{arch.name!r} is declared for transformers {arch.transformers}, not the installed "
            f"{transformers.__version__}"
        )
    if arch.encoder_decoder and not encoder_decoder:
        raise LookupError(
            f"{arch.name!r} is an encoder-decoder: the demo builds single-stack models (its plugin's contract tests it)"
        )
    config = registry.hooks_for(info).lensadapters_tiny_config(arch=arch, seed=seed)
    if config is None:
        raise LookupError(f"plugin {info.name!r} provides no tiny config for {arch.name!r}")
    return seeded_model(config, seed)
