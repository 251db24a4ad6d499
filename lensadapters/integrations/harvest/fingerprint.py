"""Cheap identities of a model and a tokenizer, so a harvest is never resumed with different ones."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

_VOLATILE_CONFIG_KEYS = (
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_commit_hash",
    "_attn_implementation_autoset",
    "_attn_implementation_internal",
)
_SAMPLE = 64


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the model's class, configuration and every parameter's and buffer's name, shape, dtype and
    first values: a different checkpoint, fine-tune, adapter or dtype gives a different fingerprint."""
    digest = hashlib.sha256(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        settings = config.to_dict()
        for key in _VOLATILE_CONFIG_KEYS:
            settings.pop(key, None)
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in tensors:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if tensor.device.type != "meta" and tensor.numel():
            sample = tensor.detach().reshape(-1)[:_SAMPLE]
            if not sample.is_floating_point() or sample.dtype == torch.float32:
                digest.update(sample.cpu().numpy().tobytes())
            else:
                digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's full definition (its vocabulary and special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # without the padding/truncation settings, which calls change
        definition = json.loads(backend.to_str())
        definition.pop("padding", None)
        definition.pop("truncation", None)
        text = json.dumps(definition, sort_keys=True)
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
    return hashlib.sha256((text + special).encode()).hexdigest()[:32]
