"""Every causal-LM ``model_type`` of the installed transformers, as a tiny model built from its default config:
``HookedModel.wrap`` either refuses it by name (:class:`UnsupportedModelError`) or wraps it, and then
``run_with_cache`` with every point never raises, and a forward with no hooks is the unwrapped model's, bitwise.

The default run takes every model type (about 200, two minutes on one core);
``LENSADAPTERS_EVERY_MODEL_TYPE=0 pytest tests/test_every_model_type.py`` takes :data:`SAMPLE` only (plain decoders and
the hybrids whose linear-attention layers have no attention module).
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters import HookedModel, Registry, UnsupportedModelError
from lensadapters.adapters.generic import GenericAdapterWarning
from lensadapters.adapters.generic.identify import layer_ranges
from lensadapters.adapters.vlm import AUDIO_POINTS, IMAGE_POINTS
from lensadapters.testing.every_model_type import NotBuildable, build, input_ids

#: hybrids (linear-attention or recurrent layers beside attention layers), two plain decoders, an encoder used as a
#: decoder whose embeddings are projected to the model's width (Electra), GPT-J (the example plugin)
SAMPLE = (
    "gpt2",
    "llama",
    "qwen3_next",
    "qwen3_5_text",
    "minimax",
    "recurrent_gemma",
    "nemotron_h",
    "lfm2",
    "electra",
    "gptj",
)
EVERY = os.environ.get("LENSADAPTERS_EVERY_MODEL_TYPE", "1") not in ("", "0")  # =0: the sample only
MODEL_TYPES = (
    sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if EVERY
    else [t for t in SAMPLE if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
)


def _wrap(model: torch.nn.Module, registry: Optional[Registry] = None) -> tuple[HookedModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model, registry=registry)
    return hm, [str(w.message) for w in caught if issubclass(w.category, GenericAdapterWarning)]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_wrap_refuses_by_name_or_serves_every_point(model_type: str) -> None:
    try:
        model = build(model_type)
    except NotBuildable as why:
        pytest.skip(f"{model_type}: not buildable from its config alone: {why}")
    ids = input_ids()
    with torch.no_grad():
        expected = model(ids).logits
    try:
        hm, _ = _wrap(model)
    except UnsupportedModelError as refusal:  # a refusal names the model and the reason
        assert str(refusal), model_type
        return
    with torch.no_grad():
        try:
            _, cache = hm.run_with_cache(ids, names_filter=lambda name: True)
        except UnsupportedModelError as refusal:  # only a refusal that names its fix, and the fix works
            assert "set_attn_implementation" in str(refusal), refusal
            implementation = model.config._attn_implementation
            model.set_attn_implementation("eager")
            _, cache = hm.run_with_cache(ids, names_filter=lambda name: True)
            model.set_attn_implementation(implementation)
        # every point fires, but the projectors' of a vision-language model: no image nor audio in these inputs
        # points that fire only with an input these token ids lack (images, audio) declare it (``fires_when``)
        needs_input = {name for name in hm.hook_names if hm.hook_dict[name].fires_when}
        assert all(n in IMAGE_POINTS or n in AUDIO_POINTS or n.startswith("vision.") for n in needs_input), needs_input
        assert set(cache.keys()) == set(hm.hook_names) - needs_input
        assert torch.equal(model(ids).logits, expected)  # no hooks left, and none costs anything
        assert torch.equal(hm(ids).logits, expected)


@pytest.mark.parametrize(
    "model_type", [t for t in ("qwen3_next", "qwen3_5_text", "minimax") if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
)
def test_hybrid_layers_without_attention_get_no_attention_points_and_the_warning_names_them(model_type: str) -> None:
    """Regression: a hybrid's linear-attention layers (no attention module) crashed every pattern/hook_z hook of
    the model's attention layers (the core's backend was handed ``None`` modules). The generic adapter's, also where
    a plugin claims the model type."""
    model = build(model_type)
    hm, messages = _wrap(model, registry=Registry())  # no plugin: the generic adapter, and its warning
    attention_layers = sorted({int(n.split(".")[1]) for n in hm.hook_names if n.endswith(".attn.hook_z")})
    linear_layers = [i for i in range(hm.cfg.n_layers) if i not in attention_layers]
    assert attention_layers and linear_layers
    named = f"(layers {layer_ranges(linear_layers)})"
    assert any("hook_z: the decoder layers do not call" in m and named in m for m in messages), messages
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda name: True)
    for i in attention_layers:  # the attention layers' pattern and hook_z: served, and an edit changes the logits
        assert cache[f"blocks.{i}.attn.hook_pattern"].shape[-1] == input_ids().shape[1]
        with torch.no_grad():
            plain = model(input_ids()).logits
            with hm.hooks(fwd_hooks=[(f"blocks.{i}.attn.hook_z", lambda z, hook: z * 0)]):
                edited = model(input_ids()).logits
        assert not torch.equal(plain, edited)
