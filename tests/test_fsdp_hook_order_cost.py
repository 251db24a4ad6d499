"""FSDP2's hooks are kept outermost on ``fully_shard`` modules (``lensadapters.hooks.distributed.FsdpHookOrder``).
Transformers and accelerate import FSDP2 in every process, so the look for sharded modules must not walk an
unsharded model's every module each time hooks are installed (Python work per hooked forward, which a GPU waits
for). The sharded case runs under torchrun in ``test_distributed.py``."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lensadapters import HookedModel
from lensadapters.hf import size_fields
from lensadapters.hooks import distributed


def test_hooks_are_installed_without_walking_the_model_when_nothing_is_sharded(monkeypatch) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    assert "torch.distributed.fsdp" in sys.modules
    looked_at: list[torch.nn.Module] = []
    original = distributed._fsdp_handles

    def counting(module):  # noqa: ANN001, ANN202
        looked_at.append(module)
        return original(module)

    monkeypatch.setattr(distributed, "_fsdp_handles", counting)
    torch.manual_seed(0)
    config = LlamaConfig(**size_fields(hidden=16, d_mlp=24, layers=2, heads=4, kv_heads=2, vocab=32, positions=32))
    hm = HookedModel.wrap(AutoModelForCausalLM.from_config(config).eval())
    ids = torch.randint(0, 32, (1, 5))
    seen: list[str] = []
    with torch.no_grad():
        hm.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_post", lambda t, hook: seen.append(hook.name))])
    assert seen == ["blocks.1.hook_resid_post"], "the hook did not run"
    assert not looked_at, f"{len(looked_at)} modules were looked at for FSDP2's hooks with nothing sharded"
    hm.unwrap()


def test_a_registry_torch_no_longer_has_means_the_model_is_walked(monkeypatch) -> None:
    """Without torch's private registry of composable states nothing can tell a sharded model apart: the walk is
    kept (correct, if slower)."""
    composable = pytest.importorskip("torch.distributed._composable_state")
    monkeypatch.delattr(composable, "_module_state_mapping")
    assert distributed._any_module_sharded()
