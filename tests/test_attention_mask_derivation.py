"""What explicit attention derives from a missing mask (sdpa's causal fast path) is derived once per shape, not in
every layer of every forward: each derivation asks the device whether anything is blocked, which is a wait on a GPU.
The values stay those of the model, and what was derived in inference mode never reaches a pass that needs grads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lensadapters import HookedModel
from lensadapters.hf import size_fields
from lensadapters.hooks import explicit_attention as attention
from lensadapters.testing import reinit

LAYERS = 3


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(**size_fields(hidden=16, d_mlp=24, layers=LAYERS, heads=4, kv_heads=2, vocab=32, positions=32))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    reinit(model, 0)
    return model.eval()


def _ids(length: int = 6) -> torch.Tensor:
    return torch.randint(0, 32, (2, length), generator=torch.Generator().manual_seed(length))


@pytest.fixture
def derivations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (queries, keys) shapes explicit attention derived a missing mask's blocked positions for, in order."""
    seen: list[tuple[int, int]] = []
    original = attention._allowed_and_bias_info

    def counting(mask, q_len, k_len, *args):  # noqa: ANN001, ANN202
        if mask is None:
            seen.append((q_len, k_len))
        return original(mask, q_len, k_len, *args)

    monkeypatch.setattr(attention, "_allowed_and_bias_info", counting)
    monkeypatch.setattr(attention, "_MASKLESS_INFOS", type(attention._MASKLESS_INFOS)())
    return seen


def test_without_a_mask_what_is_blocked_is_derived_once_per_shape_not_in_every_layer(derivations) -> None:
    model = _llama()
    hm = HookedModel.wrap(model)
    patterns = lambda name: name.endswith("hook_pattern")  # noqa: E731
    with torch.no_grad():
        _, first = hm.run_with_cache(_ids(6), names_filter=patterns)
        _, again = hm.run_with_cache(_ids(6), names_filter=patterns)
        hm.run_with_cache(_ids(5), names_filter=patterns)
    assert len(first) == LAYERS, "explicit attention did not run in every layer"
    assert derivations == [(6, 6), (5, 5)], f"derived {derivations}, expected once per shape"
    for name in first:  # a causal pattern, with nothing above the diagonal, in every layer and every call
        for cache in (first, again):
            upper = torch.ones(6, 6, dtype=torch.bool).triu(1)
            assert bool((cache[name][..., upper] == 0).all()), name
            torch.testing.assert_close(cache[name].sum(-1), torch.ones_like(cache[name].sum(-1)))
    with torch.no_grad():
        expected = model(_ids(6), output_attentions=False).logits
        assert torch.equal(hm(_ids(6)).logits, expected)
    hm.unwrap()


def test_a_maskless_derivation_made_in_inference_mode_is_not_reused_by_a_pass_with_gradients(derivations) -> None:
    hm = HookedModel.wrap(_llama())
    with torch.inference_mode():
        hm.run_with_cache(_ids(6), names_filter=lambda n: n.endswith("hook_pattern"))
    grads: list[torch.Tensor] = []

    def keep_grad(pattern: torch.Tensor, hook) -> None:  # noqa: ANN001
        pattern.register_hook(grads.append)

    logits = hm.run_with_hooks(_ids(6), fwd_hooks=[("blocks.1.attn.hook_pattern", keep_grad)])
    logits.sum().backward()  # an inference tensor saved for backward would raise here
    assert len(grads) == 1 and grads[0].shape[-2:] == (6, 6)
    assert derivations == [(6, 6), (6, 6)], "inference mode and grad mode share a derivation"
    hm.unwrap()
