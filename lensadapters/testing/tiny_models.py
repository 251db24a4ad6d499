"""Tiny models for the analysis-layer tests: every installed architecture plugin's own tiny configs (through the
registry, so no plugin is named here) and a few configs built with transformers' config classes."""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch

from lensadapters import HookedModel, get_registry
from lensadapters.adapters.toy_configs import tiny_config_of
from lensadapters.testing.models import seeded_model
from lensadapters.testing.tl_reference import word_tokenizer

Builder = Callable[[int], torch.nn.Module]


def architectures() -> list[tuple[str, Any, Any]]:
    """``(name, plugin info, architecture)`` of every installed architecture plugin with a tiny config."""
    registry = get_registry()
    found = []
    for info in registry.architecture_plugins():
        for arch in info.architectures:
            if (
                not arch.declared_for_installed_transformers() or arch.encoder_decoder
            ):  # newer releases only; two stacks
                continue
            if registry.hooks_for(info).lensadapters_tiny_config(arch=arch, seed=0) is not None:
                found.append((arch.name, info, arch))
    return sorted(found, key=lambda item: item[0])


ARCHITECTURES = architectures()
ARCH_NAMES = [name for name, _, _ in ARCHITECTURES]


@functools.lru_cache(maxsize=None)
def first_causal() -> str:
    """The first installed architecture (by name) whose tiny model is a causal language model: the model of the
    tests that need one (a loss, generation, left padding) and no particular architecture (an encoder refuses
    those, see ``lensadapters.testing.is_causal``). Wraps the tiny models on first use, never at import."""
    for name in ARCH_NAMES:
        hm = HookedModel.wrap(tiny(name))
        causal = hm.cfg.attention_dir == "causal"
        hm.unwrap()
        if causal:
            return name
    pytest.skip("no installed architecture plugin describes a causal language model")


def tiny(arch_name: str, seed: int = 0) -> torch.nn.Module:
    """The plugin's tiny model for ``seed`` (its configs vary with the seed), unit-scale weights, eval mode."""
    registry = get_registry()
    for name, info, arch in ARCHITECTURES:
        if name == arch_name:
            config = registry.hooks_for(info).lensadapters_tiny_config(arch=arch, seed=seed)
            return from_config(config, seed)
    pytest.skip(f"architecture {arch_name!r} is not installed")


def from_config(config: Any, seed: int = 0) -> torch.nn.Module:
    """:func:`~lensadapters.testing.models.seeded_model` of ``config``: its causal LM (its masked LM where it has
    none: ModernBERT), unit-scale weights from ``seed``, eval mode."""
    return seeded_model(config, seed)


def installed(model_type: str) -> bool:
    return any(model_type in arch.model_types for _, _, arch in ARCHITECTURES)


def needs(model_type: str) -> Any:
    return pytest.mark.skipif(not installed(model_type), reason=f"no plugin for {model_type!r} is installed")


def gqa_llama(**fields: Any) -> Any:
    """A ``LlamaConfig`` with grouped-query attention: 1 layer of width 32, 4 query heads over 2 key/value heads of
    size 8, MLP width 64, vocabulary 50, 32 positions; then ``fields``."""
    from transformers import LlamaConfig

    return tiny_config_of(LlamaConfig, d_mlp=64, layers=1, vocab=50, positions=32, head_dim=8, **fields)


#: :func:`gqa_llama` with 2 layers, MLP width 48, vocabulary 48, 64 positions, bos 1, eos 2 (the SAE clients' model)
CLIENT_LLAMA = dict(
    num_hidden_layers=2, intermediate_size=48, vocab_size=48, max_position_embeddings=64, bos_token_id=1, eos_token_id=2
)


@functools.lru_cache(maxsize=None)
def tokenizer(vocab: int, adds_bos: bool = False) -> Any:
    """A word-level tokenizer over ``w0 .. w{vocab-1}`` (cached per kind; see ``reference.word_tokenizer``)."""
    return word_tokenizer(vocab, adds_bos=adds_bos)


def patching_pair(arch_name: str, seed: int = 0) -> tuple[Any, torch.Tensor, torch.Tensor, Callable[..., Any]]:
    """``(hm, clean, corrupted, metric)`` for the attribution tests: the plugin's tiny model wrapped, in float64 unless
    it is a mixture of experts (grouped-GEMM experts run in float32 only); two prompts of 5 tokens whose second token
    differs; the clean answers' summed log-probability at the last position."""
    model = tiny(arch_name, seed)
    hm = HookedModel.wrap(model)
    if not hm.cfg.num_experts:  # the plugin's count (a config's own field names differ: n_routed_experts...)
        hm.unwrap()
        hm = HookedModel.wrap(model.double())
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, hm.cfg.d_vocab, (2, 5), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 1] = (clean[:, 1] + 7) % hm.cfg.d_vocab
    answers = clean[:, -1]

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1].log_softmax(-1)[torch.arange(2), answers].sum()

    return hm, clean, corrupted, metric
