"""Training through the wrapper: gradient checkpointing, gradients through edits, saved adapters."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import PeftModel  # noqa: E402

from lensadapters.testing import assert_close  # noqa: E402

warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")

# pattern/score hooks run the core's explicit attention (equal to SDPA within rounding, not bitwise)
NO_PATTERN = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731


# an edit inside a checkpointed layer (Llama's hook_rot_q also needs the rotary (cos, sin) when recomputed)
TRAIN_EDITS = {"gpt2": "blocks.1.attn.hook_z", "llama": "blocks.1.attn.hook_rot_q"}


def _training_model(kit: Any, checkpointing: Optional[bool]) -> PeftModel:
    """The adapted twin in train mode; ``checkpointing`` is ``use_reentrant`` (``None``: no checkpointing)."""
    pm = kit.adapted()
    pm.train()
    if checkpointing is not None:
        pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    pm.enable_input_require_grads()  # the same in every run: the reentrant variant needs it
    return pm


def _lora_grads(pm: PeftModel) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in pm.named_parameters() if "lora_" in n and p.grad is not None}
    assert grads, "no LoRA parameter received a gradient"
    return grads


def _edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
    return t * 1.5 + 0.25


@pytest.mark.parametrize("edited", ["attention", "resid_mid"])
@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gradient_checkpointing_records_each_point_once(
    arch: str, use_reentrant: bool, edited: str, kit_for: Any
) -> None:
    """The cache and read-only hooks see each forward once; edits are re-applied; gradients are unchanged.

    ``hook_resid_mid`` edits are carried into the block's own residual add (inside the checkpointed forward),
    so even the reentrant variant, which re-runs the forward but not the block's own hooks, recomputes them."""
    import transformers

    transformers.logging.set_verbosity_error()  # "use_cache=True is incompatible with gradient checkpointing"
    kit = kit_for(arch)
    ids = kit.tokens(2, 6, seed=3)
    names = None
    results = []
    for checkpointing in (None, use_reentrant):
        pm = _training_model(kit, checkpointing)
        hm = kit.wrap(pm)
        calls: dict[str, list[bool]] = {}
        edits: list[bool] = []

        def count(t: torch.Tensor, hook: Any, calls: dict[str, list[bool]] = calls) -> None:
            calls.setdefault(hook.name, []).append(hook.recomputing)

        def edit(t: torch.Tensor, hook: Any, edits: list[bool] = edits) -> torch.Tensor:
            edits.append(hook.recomputing)
            return _edit(t, hook)

        point = TRAIN_EDITS[arch] if edited == "attention" else "blocks.1.hook_resid_mid"
        with hm.hooks([(point, edit), (lambda n: True, count)]):
            _, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=names)
        results.append((cache, _lora_grads(pm), calls, edits))
        hm.unwrap()
    (ref_cache, ref_grads, ref_calls, ref_edits), (cache, grads, calls, edits) = results
    assert not any(r for rs in ref_calls.values() for r in rs) and ref_edits == [False]
    # with checkpointing every point runs once in the real forward, at most once more when its layer is recomputed
    assert all(rs.count(False) == 1 and rs.count(True) <= 1 for rs in calls.values()), calls
    assert sum(rs.count(True) for rs in calls.values()) > 0, "no layer was recomputed"
    assert edits == [False, True], "the edit must be applied in the forward and again in the recomputation"
    # the cache: the same names (gradients included), each recorded once, equal to the run without checkpointing
    assert sorted(cache.keys()) == sorted(ref_cache.keys())
    for name in ref_cache.keys():
        assert_close(cache[name], ref_cache[name], name)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert_close(grads[name], grad, name, atol=1e-5)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_cache_keeps_the_value_of_the_real_forward(use_reentrant: bool, kit_for: Any) -> None:
    """A recomputation that differed would not overwrite the cached value (it is never recorded)."""
    import transformers

    transformers.logging.set_verbosity_error()
    kit = kit_for("gpt2")
    pm = _training_model(kit, use_reentrant)
    hm = kit.wrap(pm)
    ids = kit.tokens(2, 5, seed=4)
    seen: list[torch.Tensor] = []

    def differ_when_recomputed(t: torch.Tensor, hook: Any) -> Optional[torch.Tensor]:
        if hook.recomputing:
            return t + 100.0
        seen.append(t.detach().clone())
        return None

    name = "blocks.0.hook_mlp_out"
    hm.add_hook(name, differ_when_recomputed)
    _, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=[name])
    assert len(seen) == 1 and torch.equal(cache[name], seen[0])
    assert cache[name + "_grad"].shape == seen[0].shape
    hm.unwrap()


def _mlp_module(pm: PeftModel, arch: str, layer: int) -> torch.nn.Module:
    inner = pm.base_model.model
    return inner.transformer.h[layer].mlp if arch == "gpt2" else inner.model.layers[layer].mlp


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_training_step_through_an_edit_matches_a_plain_torch_hook(arch: str, kit_for: Any) -> None:
    """An SGD step with ``hook_mlp_out`` edited through the wrapper is the step with a plain PyTorch hook."""
    kit = kit_for(arch)
    ids = kit.tokens(2, 6, seed=5)
    vec = torch.randn(16 if arch == "llama" else 32, generator=torch.Generator().manual_seed(6))
    results = []
    for through_wrapper in (True, False):
        pm = _training_model(kit, None)
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
        if through_wrapper:
            hm = kit.wrap(pm)
            with hm.hooks([("blocks.0.hook_mlp_out", lambda t, hook: t + vec)]):
                hm(ids, labels=ids).loss.backward()
            hm.unwrap()
        else:
            handle = _mlp_module(pm, arch, 0).register_forward_hook(lambda m, a, o: o + vec)
            pm(ids, labels=ids).loss.backward()
            handle.remove()
        grads = _lora_grads(pm)
        opt.step()
        results.append((grads, {n: p.detach().clone() for n, p in pm.named_parameters() if "lora_" in n}))
    (grads, params), (ref_grads, ref_params) = results
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name
        assert torch.equal(params[name], ref_params[name]), name
    # the edit matters: without it the gradients differ
    pm = _training_model(kit, None)
    pm(ids, labels=ids).loss.backward()
    assert any(not torch.allclose(g, ref_grads[n]) for n, g in _lora_grads(pm).items())


# Backward hooks keep the gradients bit for bit here; at norm points (hook_scale, RMS hook_normalized/hook_mlp_in)
# the norm is recomputed from its input to carry the hook, and autograd then sums gradients in another order.
def bitwise_grad_point(name: str) -> bool:
    return name.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "_lora"))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_saved_adapter_is_identical_after_training_through_the_wrapper(arch: str, tmp_path: Any, kit_for: Any) -> None:
    """Two SGD steps through ``HookedModel`` (caching, identity hooks) save the bare model's bytes.

    Pattern and score points are left out: hooking them runs the core's explicit attention, equal to SDPA
    within rounding but not bit for bit.
    """
    kit = kit_for(arch)
    batches = [kit.tokens(2, 6, seed=10 + i) for i in range(2)]
    models = {}
    for wrapped in (True, False):
        pm = _training_model(kit, None)
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
        hm = kit.wrap(pm) if wrapped else None
        if hm is not None:
            hm.add_hook(NO_PATTERN, lambda t, hook: t, is_permanent=True)
        for ids in batches:
            opt.zero_grad()
            if hm is not None:
                # every point read (a forward-only cache), gradients of the residual stream and the LoRA deltas
                _, cache = hm.run_with_cache(ids, names_filter=NO_PATTERN)
                assert "blocks.1.hook_mlp_out" in cache.keys()
                _, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=bitwise_grad_point)
                assert "blocks.1.hook_resid_mid_grad" in cache.keys()
            else:
                pm(ids, labels=ids).loss.backward()
            opt.step()
        models[wrapped] = (pm, hm)
    files = ("adapter_model.safetensors", "adapter_config.json")

    def saved(pm: PeftModel, name: str) -> dict[str, bytes]:
        pm.save_pretrained(tmp_path / name)
        return {f: (tmp_path / name / f).read_bytes() for f in files}

    bare = saved(models[False][0], "bare")
    pm, hm = models[True]
    assert saved(pm, "wrapped") == bare
    assert hm.unwrap() is pm
    assert saved(pm, "unwrapped") == bare
    # training did change the adapter
    assert saved(kit.adapted(), "untrained")["adapter_model.safetensors"] != bare["adapter_model.safetensors"]
