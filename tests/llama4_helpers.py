"""The tiny Llama 4 of the generic adapter's Llama 4 MoE tests (test_generic_moe_llama4, test_generic_llama4_experts):
a seeded two-layer model of ``llama4_text`` or ``llama4`` with top-2 routing, its wrap, and one MoE layer's HF
modules."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lensadapters import HookedModel
from lensadapters.adapters.generic import GenericAdapterWarning
from lensadapters.moe import MoELayout
from lensadapters.testing.every_model_type import causal_lm_class, shrink_config

TOP_K = 2


def llama4_model(model_type: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A seeded (0) two-layer ``model_type`` (``llama4_text`` or ``llama4``), ``TOP_K`` experts a token, eval mode."""
    from transformers import AutoConfig

    config = shrink_config(AutoConfig.for_model(model_type), 2, False)
    text = getattr(config, "text_config", config)
    text.num_experts_per_tok = TOP_K
    auto, config = causal_lm_class(config)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto.from_config(config, torch_dtype=dtype)
    return model.eval()


def llama4_wrap(model: nn.Module) -> HookedModel:
    """``HookedModel.wrap(model)``, the generic adapter's warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        return HookedModel.wrap(model)


def llama4_parts(hm: HookedModel, layer: int) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """The HF modules of one MoE layer: the MoE module, its router, experts and shared expert."""
    block, layout = hm.block_modules[layer], hm.mlp_layouts[layer]
    assert isinstance(layout, MoELayout) and layout.shared is not None
    return (
        block.get_submodule(hm.block_layouts[layer].mlp),
        block.get_submodule(layout.router),
        block.get_submodule(layout.experts.module),
        block.get_submodule(layout.shared),
    )
