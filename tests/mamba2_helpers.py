"""The tiny seeded Mamba-2 model the Mamba-2 scan tests share (tests/test_generic_scan_heads.py,
tests/test_generic_scan_conv_gate.py), and its sizes and token ids."""

from __future__ import annotations

import warnings

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

from lensadapters import HookedModel, Registry

IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11], [4, 4, 8, 30, 2, 6, 1]])
HEADS, HEAD_DIM, GROUPS, STATE = 4, 8, 2, 4


def tiny_mamba2(dtype: torch.dtype = torch.float32) -> tuple[Mamba2ForCausalLM, HookedModel]:
    """Two Mamba-2 layers of four heads in two groups, and the model wrapped by the generic adapter (warnings off)."""
    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=64,
        hidden_size=16,
        state_size=STATE,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        n_groups=GROUPS,
        expand=2,
        num_hidden_layers=2,
        chunk_size=4,  # 7 positions: two chunks, the second padded
        conv_kernel=4,
        use_conv_bias=True,
        residual_in_fp32=False,
    )
    model = Mamba2ForCausalLM(config).eval().to(dtype)
    with torch.no_grad():  # each term of the equations away from its initial value
        for layer in model.backbone.layers:
            layer.mixer.D.uniform_(-1.0, 1.0)
            layer.mixer.A_log.add_(torch.randn_like(layer.mixer.A_log) * 0.5)
            layer.mixer.dt_bias.add_(torch.randn_like(layer.mixer.dt_bias))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, HookedModel.wrap(model, registry=Registry())
