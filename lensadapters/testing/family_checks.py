"""Checks that architecture plugins' own tests share: refusals at wrap time, window masks, static-cache generation.

Each function takes the plugin's contract instance (for ``make_model``/``wrap``) or a wrapped model and asserts
one behaviour with a message that names what went wrong.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

from lensadapters.api.hooked_model import HookedModel
from lensadapters.errors import UnsupportedModelError
from lensadapters.testing.contract import assert_close
from lensadapters.testing.contract_support import greedy_kwargs

__all__ = [
    "as_custom_code",
    "assert_custom_code_refused",
    "assert_unknown_rope_refused",
    "assert_patterns_refused_under",
    "window_allowed",
    "assert_window_patterns",
    "assert_window_patterns_match_eager",
    "QK_NORMED_ATTENTION",
    "generate_with_hooks",
    "with_examples",
    "int8_model",
]


def as_custom_code(model: nn.Module) -> nn.Module:
    """``model`` with its class replaced by a subclass that lives outside transformers, as custom modeling code
    (``trust_remote_code=True``) registered under the same ``model_type`` would."""
    custom = type(type(model).__name__, (type(model),), {"__module__": "transformers_modules.someone.modeling_custom"})
    model.__class__ = custom
    return model


def assert_custom_code_refused(contract: Any, model: nn.Module) -> None:
    with pytest.raises(UnsupportedModelError, match="trust_remote_code"):
        contract.wrap(as_custom_code(model))


def assert_unknown_rope_refused(contract: Any, model: nn.Module, rotary: nn.Module) -> None:
    rotary.rope_type = "interleaved_future_rope"  # what a rope type unknown to the plugin would look like
    with pytest.raises(UnsupportedModelError, match="rope type 'interleaved_future_rope'.*supported: default"):
        contract.wrap(model)


def assert_patterns_refused_under(contract: Any, model: nn.Module, implementation: str) -> None:
    """Under ``implementation`` (flash, flex: set directly, these kernels need a GPU) the model wraps, every hook
    point but the pattern and score points accepts hooks, and those refuse naming the fix."""
    model.config._attn_implementation = implementation
    with pytest.warns(UserWarning, match=f"{implementation}.*every hook point works"):
        hm = contract.wrap(model)
    hm.add_hook("blocks.0.hook_resid_pre", lambda t, hook: None)
    hm.add_hook("blocks.0.attn.hook_rot_k", lambda t, hook: None)
    for point in ("attn.hook_pattern", "attn.hook_attn_scores"):
        with pytest.raises(UnsupportedModelError, match=f"{implementation}.*set_attn_implementation"):
            hm.add_hook(f"blocks.0.{point}", lambda t, hook: None)
    hm.reset_hooks()
    hm.unwrap()


def int8_model(model: Any) -> nn.Module:
    """``model`` saved and loaded back in 8 bits on the CPU (transformers' bitsandbytes integration, float32 for what
    it leaves unquantized)."""
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return AutoModelForCausalLM.from_pretrained(
            directory,
            quantization_config=BitsAndBytesConfig(load_in_8bit=True),
            device_map="cpu",
            dtype=torch.float32,
            attn_implementation=model.config._attn_implementation,
        ).eval()


def window_allowed(length: int, window: Optional[int], valid: torch.Tensor) -> torch.Tensor:
    """``[b, 1, q, k]``: causal, within ``window`` keys (the query's own included) and not padding."""
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    return allowed[None, None] & valid[:, None, None, :].bool()


def assert_window_patterns(
    hm: HookedModel, ids: torch.Tensor, mask: torch.Tensor, windows: list[Optional[int]]
) -> None:
    """Each layer's pattern is non-zero exactly where its window (``None``: global) allows, rows of real tokens
    summing to 1."""
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: n.endswith("hook_pattern"))
    valid = mask.bool()
    for layer, window in enumerate(windows):
        pattern = cache["pattern", layer]
        allowed = window_allowed(ids.shape[1], window, valid).expand_as(pattern)
        rows = valid[:, None, :, None].expand_as(pattern)
        assert (pattern[~allowed & rows] == 0).all(), f"layer {layer} attends outside its window {window}"
        assert (pattern[allowed & rows] > 0).all(), f"layer {layer} ignores keys inside its window {window}"
        sums = pattern.sum(-1)[valid[:, None, :].expand(-1, pattern.shape[1], -1)]
        assert_close(sums, torch.ones_like(sums), f"layer {layer} pattern rows sum to 1")


def assert_window_patterns_match_eager(contract: Any, config: Any, seed: int, length: int = 8) -> HookedModel:
    """A model of ``config`` (a sliding window on every layer) under sdpa: each layer's pattern is HF eager's, nothing
    beyond ``config.sliding_window`` is attended, and wrapping keeps the logits bitwise. Returns the (still wrapped)
    model's wrapper."""
    model = contract.make_model(config, seed, "sdpa")
    ids = torch.randint(0, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        model.config._attn_implementation = "eager"
        eager = model(ids, output_attentions=True).attentions
        model.config._attn_implementation = "sdpa"
        hm = contract.wrap(model)
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern"))
        assert torch.equal(hm(ids).logits, reference)
    far = torch.ones(length, length, dtype=torch.bool).tril(-config.sliding_window)
    for layer in range(config.num_hidden_layers):
        assert_close(cache["pattern", layer], eager[layer], f"layer {layer} pattern")
        assert (cache["pattern", layer][..., far] == 0).all(), "attends beyond the window"
    return hm


#: the attention points of a block whose queries and keys are normed between projection and RoPE, in firing order
QK_NORMED_ATTENTION = [
    "attn.hook_q",
    "attn.q_norm.hook_scale",
    "attn.q_norm.hook_normalized",
    "attn.hook_rot_q",
    "attn.hook_k",
    "attn.k_norm.hook_scale",
    "attn.k_norm.hook_normalized",
    "attn.hook_rot_k",
    "attn.hook_v",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
]


def generate_with_hooks(
    hm: HookedModel, ids: torch.Tensor, mask: torch.Tensor, cache_implementation: Optional[str], steps: int = 4
) -> None:
    """Greedy generation with reading hooks on every point (patterns included) gives the logits of generation
    without hooks, under ``cache_implementation`` (``None``: dynamic, ``"static"``...)."""
    kwargs = greedy_kwargs(steps, attention_mask=mask)
    if cache_implementation is not None:
        kwargs["cache_implementation"] = cache_implementation
    with torch.no_grad():
        reference = hm.model.generate(ids, **kwargs)
        seen: list[str] = []
        with hm.hooks([(lambda n: True, lambda t, hook: seen.append(hook.name))]):
            hooked = hm.model.generate(ids, **kwargs)
    assert set(seen) == set(hm.hook_names), f"points that never fired: {set(hm.hook_names) - set(seen)}"
    for step, (a, b) in enumerate(zip(reference.logits, hooked.logits)):
        assert_close(a, b, f"step {step} logits with hooks ({cache_implementation or 'dynamic'} cache)", atol=1e-3)
        if not torch.equal(reference.sequences[:, ids.shape[1] + step], hooked.sequences[:, ids.shape[1] + step]):
            break


def with_examples(examples: int) -> Any:
    """A class decorator: every Hypothesis property of a contract test class runs on ``examples`` examples (at most
    the profile's), for variant suites (LoRA, 8-bit) whose every example builds several models, when the float suite
    already explores the configs with the profile's count."""

    def decorate(cls: type) -> type:
        return _with_examples(cls, examples)

    return decorate


def _with_examples(cls: type, examples: int) -> type:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    examples = max(1, min(examples, settings.default.max_examples))
    for name in dir(cls):
        test = getattr(cls, name, None)
        inner = getattr(getattr(test, "hypothesis", None), "inner_test", None)
        if not name.startswith("test_") or inner is None:
            continue
        current = getattr(test, "_hypothesis_internal_use_settings", settings.default)
        if current.max_examples <= examples:
            continue

        body = _calling(inner)
        body.__name__ = body.__qualname__ = name
        body.__doc__ = test.__doc__
        setattr(cls, name, settings(current, max_examples=examples)(given(data=st.data())(body)))
    return cls


def _calling(inner: Any) -> Any:
    def body(self: Any, data: Any) -> None:
        inner(self, data)

    return body
