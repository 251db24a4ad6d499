"""The ends of an automatically described stack: embeddings the model scales in place and adds positions to (CTRL),
a final norm the model also runs elsewhere in the forward (NanoChat's norm of the embeddings). Each point's value
is compared with one computed from the HF modules, and an edit with the same edit made by a plain PyTorch hook."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters import HookedModel
from lensadapters.testing.every_model_type import build, input_ids


def _hooked(model_type: str) -> tuple[Any, HookedModel]:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this transformers version")
    model = build(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, HookedModel.wrap(model)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_embeddings_scaled_in_place_before_positions_are_hook_embed() -> None:
    """CTRL: ``e = w(ids); e *= sqrt(d_model); h = e + positions``. ``hook_embed`` is ``w(ids) * sqrt(d_model)``
    exactly, and an edit of it moves the first layer's input by exactly the edit (as a plain pre-hook does)."""
    model, hm = _hooked("ctrl")
    assert "hook_embed" in hm.hook_names
    ids = input_ids()
    factor = float(model.config.n_embd) ** 0.5
    with torch.no_grad():
        expected = model.get_input_embeddings()(ids) * factor
    seen: dict[str, torch.Tensor] = {}
    hm.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda t, hook: seen.setdefault("v", t.clone()))])
    assert torch.equal(seen["v"], expected)

    delta = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
    got = hm.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda t, hook: t + delta)])
    hm.reset_hooks()
    layer0 = model.transformer.h[0]

    def plain(module: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        moved = x + ((expected + delta) - expected)
        return ((moved, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": moved})

    handle = layer0.register_forward_pre_hook(plain, with_kwargs=True)
    try:
        want = _logits(model, ids)
    finally:
        handle.remove()
    assert not torch.equal(want, _logits(model, ids))  # the edit moves the logits
    assert torch.equal(got, want)
