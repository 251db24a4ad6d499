"""Shared by the tests of SAEs spliced into a HookedModel: a stand-in SAE with SAELens' interface (for the
environments without SAELens), SAELens' own SAE (``make_sae``), the models the tests run on (every installed
architecture; LoRA and 8-bit where plugins declare those variants), token ids, and SAELens' runner config."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from torch import nn

from lensadapters import HookedModel, contract_variants
from lensadapters.saes import SAE_POINTS
from lensadapters.testing.models import int8_copy
from lensadapters.testing.tiny_models import ARCH_NAMES, tiny, tokenizer


def _sae_lens() -> Any:
    try:
        import sae_lens
    except ImportError:  # the transformers-5 environment: SAELens needs transformers 4.x
        return None
    return sae_lens


#: SAELens, or None where it is not installed
sae_lens: Any = _sae_lens()

BOS = 1
ARCH = "gpt2" if "gpt2" in ARCH_NAMES else ARCH_NAMES[0]


class StandInSAE(nn.Module):
    """A ReLU SAE with SAELens' interface (``cfg.metadata.hook_name``, ``encode``/``decode``, ``hook_sae_*``
    points, ``use_error_term``), for the environments without SAELens."""

    hook_sae_input: nn.Module
    hook_sae_acts_pre: nn.Module
    hook_sae_acts_post: nn.Module
    hook_sae_recons: nn.Module

    def __init__(self, hook_name: str, d_in: int, d_sae: int = 24, seed: int = 0, hook_name_out=None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.cfg = SimpleNamespace(metadata=SimpleNamespace(hook_name=hook_name, hook_name_out=hook_name_out))
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) / d_in**0.5)
        self.b_enc = nn.Parameter(0.1 * torch.randn(d_sae, generator=g))
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) / d_sae**0.5)
        self.b_dec = nn.Parameter(0.1 * torch.randn(d_in, generator=g))
        for name in SAE_POINTS:
            setattr(self, name, nn.Identity())
        self.use_error_term = False

    @property
    def hook_dict(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in SAE_POINTS}

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.W_enc.dtype)  # as SAELens' process_sae_in
        pre = self.hook_sae_acts_pre(self.hook_sae_input(x) @ self.W_enc + self.b_enc)
        return self.hook_sae_acts_post(torch.relu(pre))

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        return self.hook_sae_recons(features @ self.W_dec + self.b_dec)


def make_sae(kind: str, hook_name: str, d_in: int, seed: int = 0, **cfg) -> nn.Module:
    if kind == "stand-in":
        return StandInSAE(hook_name, d_in, seed=seed)
    if sae_lens is None:
        pytest.skip("sae-lens is not installed (it needs transformers 4.x)")
    from sae_lens.saes.sae import SAEMetadata

    sae = sae_lens.StandardSAE(
        sae_lens.StandardSAEConfig(d_in=d_in, d_sae=24, metadata=SAEMetadata(hook_name=hook_name), **cfg)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return sae


KINDS = ["stand-in", pytest.param("saelens", marks=pytest.mark.skipif(sae_lens is None, reason="no sae-lens"))]


def models() -> list:
    """The architectures, and a LoRA-adapted and an 8-bit model where installed plugins declare those contract
    variants (plugins are discovered, never named)."""
    variants = contract_variants()
    params: list[Any] = list(ARCH_NAMES)
    params.append(pytest.param("lora", marks=pytest.mark.skipif("lora" not in variants, reason="no LoRA plugin")))
    params.append(pytest.param("int8", marks=pytest.mark.skipif("int8" not in variants, reason="no 8-bit plugin")))
    return params


def build(which: str) -> HookedModel:
    model: Any
    if which == "lora":
        from peft import LoraConfig, get_peft_model

        base = tiny("llama" if "llama" in ARCH_NAMES else ARCH)
        torch.manual_seed(1)
        model = get_peft_model(
            base,
            LoraConfig(
                r=4, target_modules=["q_proj", "v_proj"] if "llama" in ARCH_NAMES else None, init_lora_weights=False
            ),
        )
        model.eval()
    elif which == "int8":
        model = int8_copy(tiny("llama" if "llama" in ARCH_NAMES else ARCH))
    else:
        model = tiny(which)
    hm = HookedModel.wrap(model, tokenizer=tokenizer(48))
    return hm


def ids(batch: int = 2, pos: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 48, (batch, pos), generator=g)
    tokens[:, 0] = BOS
    return tokens


def reconstruct(sae: Any) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    return lambda x, hook: sae.decode(sae.encode(x)).to(x.dtype)


needs_saelens = pytest.mark.skipif(sae_lens is None, reason="sae-lens is not installed (it needs transformers 4.x)")


def runner_config(hm: HookedModel, **overrides):
    cfg = dict(
        sae=sae_lens.StandardTrainingSAEConfig(d_in=hm.cfg.d_model, d_sae=32, l1_coefficient=1.0),
        model_name="lensadapters-tiny",
        hook_name="blocks.0.hook_resid_post",
        dataset_path="",
        context_size=12,
        is_dataset_tokenized=False,
        streaming=False,
        training_tokens=12 * 8 * 6,
        store_batch_size_prompts=8,
        n_batches_in_buffer=4,
        train_batch_size_tokens=48,
        device="cpu",
        n_checkpoints=0,
        checkpoint_path=None,
        output_path=None,
        logger=sae_lens.LoggingConfig(log_to_wandb=False),
        verbose=False,
        lr=1e-2,
        n_batches_for_norm_estimate=2,
        n_eval_batches=2,
        eval_batch_size_prompts=4,
    )
    cfg.update(overrides)
    return sae_lens.LanguageModelSAERunnerConfig(**cfg)


def random_texts(n: int = 120) -> list[str]:
    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(3, 48)}" for _ in range(rng.randrange(4, 40))) for _ in range(n)]
