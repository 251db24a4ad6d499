"""Llama: generation with hooks through the key/value cache (dynamic and static, half precision, compiled-style
steps), and a ``hook_rot_k`` edit stored in the cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lensadapters_llama.testing import left_padded, llama32_3b_like, llama_config, make, wrap

from lensadapters.testing import assert_close
from lensadapters.testing.contract_support import greedy_kwargs

# --- generation with the KV cache ------------------------------------------------------------------


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache_implementation: str, steps: int = 4):
    kwargs = dict(
        max_new_tokens=steps, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    if cache_implementation != "dynamic":
        kwargs["cache_implementation"] = cache_implementation
    return model.generate(input_ids=ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_generate_with_pattern_and_cache_hooks_matches_unwrapped(llama32, cache_implementation):
    """``generate(..., cache_implementation="static")`` (and dynamic) with hooks: same greedy tokens."""
    model = llama32
    ids, mask = left_padded(256, length=7, pads=(2, 0))
    with torch.no_grad():
        reference = _generate(model, ids, mask, cache_implementation)
        hm = wrap(model)
        stored: dict[str, list[torch.Tensor]] = {}

        def store(t: torch.Tensor, hook: Any) -> None:
            stored.setdefault(hook.name, []).append(t.detach().clone())

        hooks = [
            (lambda n: n.endswith(("hook_pattern", "hook_attn_scores")), store),
            (lambda n: n.endswith(("hook_rot_k", "hook_resid_post", "hook_z")), store),
        ]
        with hm.hooks(hooks):
            hooked = _generate(hm, ids, mask, cache_implementation)
    assert torch.equal(hooked.sequences, reference.sequences)
    for step, (a, b) in enumerate(zip(reference.logits, hooked.logits)):
        assert_close(a, b, f"step {step} logits", atol=1e-4)
    patterns = stored["blocks.1.attn.hook_pattern"]
    assert len(patterns) == 4  # prefill + 3 decoding steps
    assert patterns[0].shape[:3] == (2, 24, 7) and all(p.shape[:3] == (2, 24, 1) for p in patterns[1:])
    query_valid = [mask.bool()] + [torch.ones(2, 1, dtype=torch.bool)] * 3
    for p, valid in zip(patterns, query_valid):
        sums = p.sum(-1).transpose(1, 2)[valid]  # rows of real query tokens (padding queries attend nowhere)
        assert_close(sums, torch.ones_like(sums), "pattern rows sum to 1")
        assert (p[0][:, valid[0]][..., :2] == 0).all()  # real queries of row 0 never attend its left padding
    # decoding steps see every earlier key, even with a static (preallocated) cache
    assert (patterns[-1][..., : 7 + 2] > 0).sum(-1).min() >= 1
    assert all(k.shape[1] == 1 for k in stored["blocks.0.attn.hook_rot_k"][1:])
    hm.unwrap()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_static_cache_generation(dtype):
    """A Llama loaded in float16/bfloat16 with sdpa and generates with a static cache: hooks that read keep
    the generation bitwise (the model's own sdpa runs), values come in the model's dtype, and a pattern hook
    (explicit attention in that layer) keeps every decoding step's pattern a distribution over the real keys."""
    model = make(llama32_3b_like(), 7).to(dtype)  # a fresh model: no static cache left from earlier generations
    ids, mask = left_padded(256, length=7, pads=(2, 0))
    with torch.no_grad():
        reference = _generate(model, ids, mask, "static")
        hm = wrap(model)
        seen: dict[str, list[torch.Tensor]] = {}

        def store(t: torch.Tensor, hook: Any) -> None:
            seen.setdefault(hook.name, []).append(t.detach().clone())

        with hm.hooks(
            [(lambda n: n.endswith(("hook_resid_post", "hook_z", "hook_rot_k", "ln_final.hook_scale")), store)]
        ):
            hooked = _generate(hm, ids, mask, "static")
        assert torch.equal(hooked.sequences, reference.sequences)
        assert all(torch.equal(a, b) for a, b in zip(reference.logits, hooked.logits)), "reading hooks changed numbers"
        assert {t.dtype for values in seen.values() for t in values} == {dtype}
        assert len(seen["blocks.1.hook_resid_post"]) == 4  # prefill + 3 decoding steps
        with hm.hooks([("blocks.1.attn.hook_pattern", store)]):
            patterned = _generate(hm, ids, mask, "static")
    patterns = seen["blocks.1.attn.hook_pattern"]
    assert len(patterns) == 4 and all(p.dtype == dtype for p in patterns)
    slots = patterns[-1].shape[-1]
    for step, pattern in enumerate(patterns[1:], start=1):  # decoding step i attends 7 prompt + i fed-back tokens
        filled = 7 + step
        keys = torch.cat([mask, torch.ones(2, step, dtype=mask.dtype)], 1).bool()
        assert pattern.shape[-1] == slots >= filled
        assert torch.equal(pattern[..., :filled].float() > 0, keys[:, None, None, :].expand(-1, 24, 1, -1))
        assert (pattern[..., filled:] == 0).all(), "the static cache's empty slots are attended"
    assert slots > 8, "no decoding step left a static cache slot empty"
    last = patterns[-1].float()
    assert_close(last.sum(-1), torch.ones_like(last.sum(-1)), "pattern rows sum to 1", atol=2e-2)
    for a, b in zip(reference.logits, patterned.logits):
        assert_close(a, b, "logits with a pattern hook", atol=0.1, rtol=0.05)
    hm.unwrap()


def test_hooks_run_at_every_step_when_generate_would_compile():
    """A static cache on an accelerator makes ``generate`` compile the decoding forward; a graph traced
    before the hooks existed would run them on the prefill only. Forced here on the CPU (eager backend):
    while hooks are attached the forward is not compiled, and the edit applies at every step."""
    from transformers.generation import CompileConfig

    config = llama_config(n_heads=4, n_kv=2, head_dim=8, hidden=32, layers=2)
    model = make(config, 3)
    ids, mask = left_padded(config.vocab_size, length=5, pads=(0, 0))
    compile_config = CompileConfig(backend="eager", fullgraph=False)
    compile_config._compile_all_devices = True  # what a CUDA device does by itself
    kwargs = greedy_kwargs(3, cache_implementation="static")
    bump = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(2))
    steps: list[int] = []

    def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
        steps.append(t.shape[1])
        return t + bump

    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, compile_config=compile_config, **kwargs)  # compiles
        hm = wrap(model)
        with hm.hooks([("blocks.0.hook_resid_post", edit)]):
            compiled = model.generate(input_ids=ids, attention_mask=mask, compile_config=compile_config, **kwargs)
            assert steps == [5, 1, 1], f"the hook ran on steps of length {steps}"
            eager = model.generate(input_ids=ids, attention_mask=mask, disable_compile=True, **kwargs)
    for step, (a, b) in enumerate(zip(compiled.logits, eager.logits)):
        assert_close(a, b, f"step {step}: edited logits with compilation requested vs without", atol=1e-5)
    assert not getattr(model.generation_config, "disable_compile", False), "the setting is restored"
    hm.unwrap()


def _kv_keys(past: Any, layer: int) -> torch.Tensor:
    layers = getattr(past, "layers", None)
    if layers is not None:
        return layers[layer].keys
    return past.key_cache[layer]  # pragma: no cover - older caches


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_rot_k_edit_is_stored_in_the_kv_cache(cache_implementation):
    """An edit of hook_rot_k during prefill is what the KV cache holds, and decoding uses it."""
    from transformers import DynamicCache, StaticCache

    config = llama_config(n_heads=6, n_kv=2, head_dim=8, hidden=24, layers=2, rope_type="llama3", theta=500000.0)
    model = make(config, 11)
    hm = wrap(model)
    prefix = 6
    ids, mask = left_padded(config.vocab_size, length=prefix + 1, pads=(2, 0))
    layer = 1
    delta = torch.randn(2, prefix, 2, 8, generator=torch.Generator().manual_seed(5))
    seen = {}

    def edit(k: torch.Tensor, hook: Any) -> torch.Tensor:
        if k.shape[1] != prefix + 1 and k.shape[1] != prefix:
            return None
        k = k.clone()
        k[:, :prefix] += delta  # only the prefix positions: the last token's key stays as computed
        seen.setdefault(k.shape[1], k)
        return k

    def new_cache():
        if cache_implementation == "static":
            try:
                return StaticCache(config=config, max_cache_len=16)
            except TypeError:  # transformers 4.57 also wants the batch size
                return StaticCache(config=config, max_batch_size=2, max_cache_len=16)
        return DynamicCache()

    with torch.no_grad():
        with hm.hooks([(f"blocks.{layer}.attn.hook_rot_k", edit)]):
            full = hm(ids, attention_mask=mask).logits[:, -1]  # one pass over all tokens, prefix keys edited
            past = new_cache()
            out = hm(ids[:, :prefix], attention_mask=mask[:, :prefix], past_key_values=past, use_cache=True)
        keys = _kv_keys(out.past_key_values, layer)[:, :, :prefix]  # [b, hkv, p, d]
        assert_close(keys.transpose(1, 2), seen[prefix], "KV cache holds the edited rotated keys", atol=1e-5)
        step = hm(
            ids[:, prefix:],
            attention_mask=mask,
            past_key_values=out.past_key_values,
            use_cache=True,
            position_ids=torch.full((2, 1), prefix),
        ).logits[:, -1]
    assert_close(step, full, "decoding from the edited cache == one pass with the edit", atol=1e-4)
    with torch.no_grad():
        unedited = hm(ids, attention_mask=mask).logits[:, -1]
    assert not torch.allclose(unedited, full, atol=1e-3), "the edit should matter"
    hm.unwrap()
