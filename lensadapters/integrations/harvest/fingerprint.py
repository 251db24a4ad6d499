"""Identities of a model, its adapters and a tokenizer, so a harvest is never resumed with different ones.

The model's identity covers its class, its configuration and every byte of every parameter and buffer (each
checksummed on its own device, see :mod:`.checksum`), so a resume can name the tensors that differ. The adapters'
identity is the state of every adapter layer (PEFT's, or transformers' own PEFT integration): which adapters are
active, disabled, merged, and their scaling; their weights are parameters of the model.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import torch

from lensadapters.hooks.offload import live_parameters
from lensadapters.integrations.harvest.checksum import tensor_checksum

_VOLATILE_CONFIG_KEYS = (
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_commit_hash",
    "_attn_implementation_autoset",
    "_attn_implementation_internal",
)


def model_fingerprint(model: torch.nn.Module, hf_model: Optional[torch.nn.Module] = None) -> dict[str, Any]:
    """``{"class", "config", "tensors"}``: the classes of ``model`` (the object wrapped: a ``PeftModel`` stays
    one) and ``hf_model``, the configuration, and per parameter and buffer ``"DTYPE[SHAPE] CHECKSUM"`` of all its
    bytes. Offloaded modules are loaded one at a time for their checksums."""
    hf_model = model if hf_model is None else hf_model
    classes = type(model).__name__ if hf_model is model else f"{type(model).__name__}/{type(hf_model).__name__}"
    config = getattr(hf_model, "config", None)
    settings: dict[str, Any] = {}
    if config is not None:
        settings = config.to_dict()
        for key in _VOLATILE_CONFIG_KEYS:
            settings.pop(key, None)
        settings = json.loads(json.dumps(settings, sort_keys=True, default=str))
    tensors: dict[str, str] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if not own:
            continue
        with live_parameters(module):
            own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            for name, tensor in own:
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                described = f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"
                value = "meta" if tensor.device.type == "meta" else tensor_checksum(tensor)
                tensors[f"{prefix}.{name}" if prefix else name] = f"{described} {value}"
    return {"class": classes, "config": settings, "tensors": tensors}


def adapter_state(model: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The state of the model's adapter layers (``None`` without any): ``{"STATE": [layers]}``, the layers grouped
    by their state (active adapters, whether adapters are disabled, the merged adapters, the scaling)."""
    groups: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "adapter_layer_names") and hasattr(module, "active_adapters")):
            continue
        active = module.active_adapters
        state = {
            "active": [active] if isinstance(active, str) else list(active),
            "disabled": bool(getattr(module, "disable_adapters", False)),
            "merged": list(getattr(module, "merged_adapters", []) or []),
            "scaling": {str(k): v for k, v in sorted(dict(getattr(module, "scaling", {}) or {}).items())},
        }
        groups.setdefault(json.dumps(state, sort_keys=True, default=str), []).append(name)
    return groups or None


def explain_model(stored: Any, wanted: Any) -> str:
    """What differs between two model identities, in words."""
    if not (isinstance(stored, dict) and isinstance(wanted, dict)):
        return "another model identity"
    parts = []
    if stored.get("class") != wanted.get("class"):
        parts.append(f"class {stored.get('class')} there, {wanted.get('class')} now")
    old_config, new_config = stored.get("config") or {}, wanted.get("config") or {}
    keys = sorted(k for k in set(old_config) | set(new_config) if old_config.get(k) != new_config.get(k))
    if keys:
        parts.append(f"configuration ({_listed(keys)})")
    old, new = stored.get("tensors") or {}, wanted.get("tensors") or {}
    changed = [n for n in old if n in new and old[n] != new[n]]
    if changed:
        what = "values" if all(old[n].split(" ")[0] == new[n].split(" ")[0] for n in changed) else "dtype/shape"
        parts.append(f"{len(changed)} tensor(s) with other {what}: {_listed(changed)}")
    missing, added = [n for n in old if n not in new], [n for n in new if n not in old]
    if missing:
        parts.append(f"{len(missing)} tensor(s) no longer there: {_listed(missing)}")
    if added:
        parts.append(f"{len(added)} new tensor(s): {_listed(added)}")
    return "; ".join(parts) or "another model identity"


def explain_adapters(stored: Any, wanted: Any) -> str:
    """What differs between two adapter states, in words."""
    if not stored or not wanted:
        there = "adapter layers" if stored else "no adapter layers"
        return f"{there} there, {'adapter layers' if wanted else 'none'} now"
    if len(stored) == 1 and len(wanted) == 1:
        old, new = json.loads(next(iter(stored))), json.loads(next(iter(wanted)))
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        if keys:
            return "; ".join(
                f"{k} adapters {old.get(k)} there, {new.get(k)} now"
                if k in ("active", "merged")
                else f"{k} {old.get(k)} there, {new.get(k)} now"
                for k in keys
            )
    layers_old = {layer: state for state, layers in stored.items() for layer in layers}
    layers_new = {layer: state for state, layers in wanted.items() for layer in layers}
    differing = sorted(n for n in set(layers_old) | set(layers_new) if layers_old.get(n) != layers_new.get(n))
    if differing:
        first = differing[0]
        return (
            f"{len(differing)} adapter layer(s) in another state, e.g. {first}: {layers_old.get(first)} there, "
            f"{layers_new.get(first)} now"
        )
    return "another adapter state"


def _listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


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
