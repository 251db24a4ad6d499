"""The Hypothesis profiles of every lensadapters suite, and the single-model kits of lensadapters-peft's tests.

The kits build tiny GPT-2 and Llama models (their Hugging Face module paths are what the tests adapt and
inspect) and wrap them with the installed plugin that supports the model type, found through its entry
point, next to lensadapters-peft; a test whose model type no installed plugin supports is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch

from lensadapters import hf
from lensadapters.testing.profiles import load_profile

load_profile()

import lensadapters_peft as lp  # noqa: E402
from lensadapters_peft.testing import init_lora  # noqa: E402

from lensadapters import HookedModel  # noqa: E402
from lensadapters.testing import architecture_plugin, registry_for, seeded_model  # noqa: E402

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Adapted:
    """A tiny HF config plus the LoRA adapters to put on it."""

    config: Any
    targets: list[str]
    r: int = 4
    alpha: int = 8
    rslora: bool = False
    lora_bias: bool = False
    second: Optional[list[str]] = None  # targets of a second adapter, active together with the first
    fan_in_fan_out: bool = False
    extra: dict = field(default_factory=dict)


def lora_model(base: torch.nn.Module, spec: Adapted, seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=spec.targets,
        init_lora_weights=False,
        use_rslora=spec.rslora,
        lora_bias=spec.lora_bias,
        fan_in_fan_out=spec.fan_in_fan_out,
    )
    pm = get_peft_model(base, cfg)
    if spec.second:
        pm.add_adapter(
            "second",
            LoraConfig(
                r=2,
                lora_alpha=3,
                target_modules=spec.second,
                init_lora_weights=False,
                fan_in_fan_out=spec.fan_in_fan_out,
            ),
        )
        pm.base_model.set_adapter(["default", "second"])
    init_lora(pm, seed)
    return pm.eval()


class Kit:
    """Builds base and adapted twins of one spec and wraps them with a fresh registry: the installed plugin for
    the model type and lensadapters-peft."""

    def __init__(self, spec: Adapted, seed: int) -> None:
        self.spec, self.seed = spec, seed

    def base(self) -> torch.nn.Module:
        return seeded_model(self.spec.config, self.seed, "sdpa")

    def adapted(self, spec: Optional[Adapted] = None) -> Any:
        return lora_model(self.base(), spec or self.spec, self.seed)

    def wrap(self, model: Any) -> HookedModel:
        return HookedModel.wrap(model, registry=registry_for(self.spec.config.model_type, lp))

    def tokens(self, batch: int, length: int, seed: int) -> torch.Tensor:
        """``[batch, length]`` token ids of the model's vocabulary, drawn with ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.spec.config.vocab_size, (batch, length), generator=generator)


def _gpt2(**kw: Any) -> Adapted:
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return Adapted(config, kw.pop("targets", ["c_attn", "c_proj", "c_fc"]), fan_in_fan_out=True, **kw)


def _llama(**kw: Any) -> Adapted:
    from transformers import LlamaConfig

    sizes = dict(hidden=16, d_mlp=24, layers=2, n_heads=4, n_kv=2, vocab=64, max_pos=32)
    config = hf.decoder_config(LlamaConfig, **sizes, head_dim=4)
    return Adapted(config, kw.pop("targets", LLAMA_TARGETS), **kw)


@pytest.fixture
def kit_for() -> Callable[..., Kit]:
    """``kit_for(model_type, **adapter_fields)``: a :class:`Kit` for a tiny ``"gpt2"`` or ``"llama"`` model
    (LoRA on every projection unless ``targets=`` says otherwise), seed 0; skips without a plugin for it."""

    def make(model_type: str, **kw: Any) -> Kit:
        if architecture_plugin(model_type) is None:
            pytest.skip(f"no installed lensadapters plugin supports model_type {model_type!r}")
        return Kit({"gpt2": _gpt2, "llama": _llama}[model_type](**kw), 0)

    return make
