"""What the tests of SAELens-based clients share: one small SAELens activation store (SAELens is imported when
called)."""

from __future__ import annotations

from typing import Any

import torch


def small_activations_store(model: Any, dataset: Any, hook_name: str, d_in: int) -> Any:
    """SAELens' ``ActivationsStore`` over ``dataset`` (a ``datasets.Dataset`` with a ``text`` column) reading
    ``hook_name`` of ``model``: contexts of 12 tokens with BOS prepended, 4 prompts a batch, 48 tokens a training
    batch, a buffer of 2 batches, no normalization, float32 on the CPU."""
    from sae_lens.training.activations_store import ActivationsStore

    return ActivationsStore(
        model=model,
        dataset=dataset,
        streaming=False,
        hook_name=hook_name,
        hook_head_index=None,
        context_size=12,
        d_in=d_in,
        n_batches_in_buffer=2,
        total_training_tokens=10_000,
        store_batch_size_prompts=4,
        train_batch_size_tokens=48,
        prepend_bos=True,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
    )
