"""Per-call semantics: nested calls (a hook that calls the model again), threads, gradient checkpointing.

Hooks of a ``hooks()`` block (``run_with_hooks``, ``run_with_cache``) apply to the forwards of the thread that
opened the block, at its nesting depth; values sites share within a forward belong to that forward; a
checkpointed layer recomputed during ``backward()`` runs the hooks of its original forward, even after they were
removed.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from lensadapters import HookedModel
from lensadapters.hf import tiny_config_of
from lensadapters.testing import reinit


def _model(config_class: Any, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config_of(config_class))
    reinit(model, seed)
    return model.eval()


MODELS = {"llama": functools.partial(_model, LlamaConfig), "gpt2": functools.partial(_model, GPT2Config)}


def _ids(seed: int, batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", sorted(MODELS))
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), layer=st.integers(0, 1))
def test_a_nested_call_keeps_the_outer_calls_edits_and_cache(arch: str, seed: int, layer: int) -> None:
    """A hook that runs the model again (as patching code does) neither loses the outer forward's edits (a
    ``hook_resid_mid`` edit, rotary values) nor writes into the outer ``run_with_cache`` store; the nested call
    sees no hook of the outer block."""
    hm = HookedModel.wrap(MODELS[arch](seed))
    outer, inner = _ids(seed), _ids(seed + 1)
    point = f"blocks.{layer}.hook_resid_mid"
    bump = torch.randn(32, generator=torch.Generator().manual_seed(seed))

    def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
        return t + bump

    with torch.no_grad():
        with hm.hooks([(point, edit)]):
            expected_logits, expected = hm.run_with_cache(outer)
        clean_inner = hm(inner).logits
        nested: dict[str, torch.Tensor] = {}

        def call_again(t: torch.Tensor, hook: Any) -> None:
            nested["logits"] = hm(inner).logits  # a plain call from inside a hook
            _, nested_cache = hm.run_with_cache(inner, names_filter=lambda n: n.endswith("hook_rot_q"))
            nested["cache"] = nested_cache

        with hm.hooks([(point, edit), ("blocks.0.hook_resid_pre", call_again)]):
            logits, cache = hm.run_with_cache(outer)
    assert torch.equal(logits, expected_logits), "the outer forward lost its edit to a nested call"
    assert torch.equal(nested["logits"], clean_inner), "the nested call ran the outer block's hooks"
    for name in expected:
        assert torch.equal(cache[name], expected[name]), f"{name}: the outer cache was overwritten by a nested call"
    hm.unwrap()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_threads_get_their_own_hooks_and_caches(arch: str) -> None:
    """Two threads calling ``run_with_cache`` (and editing) on one wrapper at the same time each get exactly what a
    lone call on their own input gives."""
    hm = HookedModel.wrap(MODELS[arch](3))
    inputs = [_ids(10 + k, batch=1, length=8 + k) for k in range(2)]
    scales = [1.5, -0.5]

    def edit_for(k: int) -> Any:
        def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
            return t * scales[k]

        return edit

    with torch.no_grad():
        expected = []
        for k, ids in enumerate(inputs):
            with hm.hooks([("blocks.0.attn.hook_z", edit_for(k))]):
                expected.append(hm.run_with_cache(ids))
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with torch.no_grad(), hm.hooks([("blocks.0.attn.hook_z", edit_for(k))]):
                barrier.wait()
                runs = [hm.run_with_cache(inputs[k]) for _ in range(6)]
            results[k] = runs
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        logits, cache = expected[k]
        for run_logits, run_cache in results[k]:
            assert torch.equal(run_logits, logits), f"thread {k}: logits mixed with the other thread's"
            assert set(run_cache) == set(cache)
            for name in cache:
                assert torch.equal(run_cache[name], cache[name]), f"thread {k}: {name} from the other thread"
    assert not hm.has_hooks
    hm.unwrap()


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("reentrant", [True, False])
def test_backward_after_run_with_hooks_under_gradient_checkpointing(arch: str, reentrant: bool) -> None:
    """``loss = run_with_hooks(...)`` then ``loss.backward()`` outside the call recomputes the checkpointed layers
    with the edits of that forward (gradients equal those of a model without checkpointing), and hooks attached
    by then do not leak into the recomputation."""
    ids = _ids(5)
    reference_model = MODELS[arch](7)
    model = MODELS[arch](7)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    reference_model.train()
    for m in (model, reference_model):  # dropout off: the runs must be comparable
        for module in m.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    edits = [("blocks.0.hook_resid_mid", lambda t, hook: t * 1.7), ("blocks.1.mlp.hook_post", lambda t, hook: t * -0.6)]
    ref = HookedModel.wrap(reference_model)
    ref.run_with_hooks(ids, fwd_hooks=edits).float().pow(2).mean().backward()
    expected = {n: p.grad.clone() for n, p in reference_model.named_parameters() if p.grad is not None}
    hm = HookedModel.wrap(model)
    loss = hm.run_with_hooks(ids, fwd_hooks=edits).float().pow(2).mean()
    assert not hm.has_hooks or all(p.pins for p in hm.hook_dict.values() if p.active)
    with hm.hooks([("blocks.0.hook_resid_mid", lambda t, hook: t * 100.0)]):  # attached after that forward
        loss.backward()
    assert expected
    for name, grad in expected.items():
        got = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(got, grad, rtol=1e-4, atol=1e-5, msg=f"{name}: gradient of the unedited forward")
    del loss
    import gc

    gc.collect()
    hm.wiring.sync()
    assert not hm.has_hooks, "the recomputation's snapshot outlived the graph"
    hm.unwrap()
    ref.unwrap()
