"""Activation and attribution patching of one head's keys on multi-head latent attention, whose rope key columns are
one key the model shares over the heads (the hooks make a per-head edit, and the per-head gradient, on the keys the
attention function gets): every sweep of ``"k"``/``"rot_k"`` equals the same patch made by hand with
``run_with_hooks``, and every attribution score of the keys equals (clean - corrupted) . gradient read by a backward
hook, and the derivative of the metric along that patch; on the DeepSeek-V3 plugin's tiny V3 and V2 and on the generic
adapter's automatic description of a DeepSeek-V3."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from lensadapters import HookedModel, attribution, patching
from lensadapters.hf import tiny_config_of
from lensadapters.testing.tiny_models import installed, patching_pair

Tensor = torch.Tensor
KEYS = ("k", "rot_k")


def _generic_pair() -> tuple[Any, Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """A dense two-layer DeepSeek-V3 (query latent, interleaved rope) described by the generic adapter (no plugin
    asked for), in float64, with :func:`_prompts`."""
    config = tiny_config_of(
        DeepseekV3Config,
        kv_heads=4,
        q_lora_rank=16,
        rope_interleave=True,
        first_k_dense_replace=2,
        initializer_range=0.3,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        head_dim=4,
        v_head_dim=6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model, adapter="generic")
    return (hm, *_prompts(hm))


def _prompts(hm: Any) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """Two prompts of 5 tokens whose second token differs, and a logit difference at the last position."""
    clean = torch.randint(3, hm.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(1))
    corrupted = clean.clone()
    corrupted[:, 1] = (clean[:, 1] + 7) % hm.cfg.d_vocab

    def metric(logits: Tensor) -> Tensor:
        return (logits[:, -1, 5] - logits[:, -1, 7]).sum()

    return clean, corrupted, metric


def _v2_pair() -> tuple[Any, Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """The plugin's DeepSeek-V2 (complex rotary of the interleaved rope pairs; a dense layer, then a softmax-routed
    MoE), in float32 (the grouped experts run in no other), with :func:`_prompts`."""
    testing = pytest.importorskip("lensadapters_deepseek_v3.testing")
    config = testing.deepseek_v3_config(v2=True, n_heads=4, hidden=32, layers=2, dense_layers=1, experts=4)
    hm = HookedModel.wrap(testing.DeepseekV3Contract().make_model(config, 0))
    return (hm, *_prompts(hm))


def pair(which: str) -> tuple[Any, Tensor, Tensor, Callable[[Tensor], Tensor]]:
    if which == "generic":
        return _generic_pair()
    if not installed("deepseek_v3"):
        pytest.skip("no plugin for 'deepseek_v3' is installed")
    return patching_pair("deepseek_v3") if which == "plugin" else _v2_pair()


WHICH = ["plugin", "plugin V2", "generic"]


def _shared_key_layers(hm: Any) -> list[int]:
    layers = [i for i in range(hm.cfg.n_layers) if f"blocks.{i}.attn.hook_k_rope" in hm.hook_dict]
    assert layers, "no multi-head latent attention"
    return layers


def _by_hand(hm: Any, corrupted: Tensor, cache: Any, metric: Any, name: str, pos: Any, head: int) -> float:
    """The metric of the corrupted run with the clean run's value of ``name`` written in at ``pos`` of ``head``."""

    def write(x: Tensor, hook: Any) -> Tensor:
        x[:, pos, head] = cache[hook.name][:, pos, head]
        return x

    with torch.no_grad():
        return float(metric(hm.run_with_hooks(corrupted, fwd_hooks=[(name, write)], return_type="logits")))


@pytest.mark.parametrize("which", WHICH)
def test_patching_one_heads_keys_equals_the_patch_made_by_hand(which: str) -> None:
    """TransformerLens' key sweeps and the generic sweep of ``"rot_k"`` run on the blocks whose heads share their rope
    key: each entry is the corrupted run's metric with that head's clean keys written in by a hook (the rope columns
    too, for that head alone); where the two runs' keys are the same (every position of block 0 but the corrupted
    one, position 0 of every block) the entry is the corrupted run's metric, bit for bit."""
    hm, clean, corrupted, metric = pair(which)
    layers = _shared_key_layers(hm)
    n, h, p = hm.cfg.n_layers, hm.cfg.n_heads, clean.shape[1]
    with torch.no_grad():
        _, cache = hm.run_with_cache(clean)
        _, dirty = hm.run_with_cache(corrupted)
        baseline = float(metric(hm(corrupted, return_type="logits")))
        clean_metric = float(metric(hm(clean, return_type="logits")))
    assert abs(clean_metric - baseline) > 1e-3
    by_pos = patching.get_act_patch_attn_head_k_by_pos(hm, corrupted, cache, metric, batch_size=1)
    all_pos = patching.get_act_patch_attn_head_k_all_pos(hm, corrupted, cache, metric, batch_size=1)
    assert by_pos.shape == (n, p, h) and all_pos.shape == (n, h)
    rows = [[layer, pos, head] for layer in layers for pos in range(p) for head in range(h)]
    rot = patching.generic_activation_patch(
        hm, corrupted, cache, metric, patching.layer_pos_head_vector_patch_setter, "rot_k", index_df=rows, batch_size=1
    )
    for (layer, pos, head), rot_value in zip(rows, rot.tolist()):
        pre = f"blocks.{layer}.attn."
        same = torch.equal(cache[pre + "hook_k"][:, pos, head], dirty[pre + "hook_k"][:, pos, head])
        for name, got in ((pre + "hook_k", float(by_pos[layer, pos, head])), (pre + "hook_rot_k", rot_value)):
            expected = baseline if same else _by_hand(hm, corrupted, cache, metric, name, pos, head)
            assert got == pytest.approx(expected, abs=1e-6), (name, pos, head)
    for layer in layers:
        for head in range(h):
            expected = _by_hand(hm, corrupted, cache, metric, f"blocks.{layer}.attn.hook_k", slice(None), head)
            assert float(all_pos[layer, head]) == pytest.approx(expected, abs=1e-6), (layer, head)
    first = layers[0]
    assert torch.equal(by_pos[first, [q for q in range(p) if q != 1]], torch.full((p - 1, h), baseline).to(by_pos))
    assert torch.equal(by_pos[:, 0], torch.full((n, h), baseline).to(by_pos))
    moved = (by_pos[first, 1] - baseline).abs()
    assert moved.min() > 1e-5, moved  # each head's patch at the corrupted position changes the metric ...
    assert (moved - moved[0]).abs().max() > 1e-5, moved  # ... each by its own amount (not every head's at once)
    hm.unwrap()


def _key_gradients(hm: Any, tokens: Tensor, metric: Any, names: list[str]) -> dict[str, Tensor]:
    """The gradient of ``metric`` at each of ``names`` on a run of ``tokens``, read by backward hooks."""
    grads: dict[str, Tensor] = {}
    with torch.enable_grad(), hm.hooks(bwd_hooks=[(n, lambda g, hook: grads.setdefault(hook.name, g)) for n in names]):
        metric(hm(tokens, return_type="logits")).backward()
    hm.model.zero_grad(set_to_none=True)
    return grads


def _along_the_patch(hm: Any, tokens: Tensor, metric: Any, name: str, delta: Tensor, head: int) -> float:
    """d/da metric(run on tokens with ``a * delta`` added to ``head``'s ``name``), at a = 0."""
    a = torch.zeros((), dtype=torch.float64, requires_grad=True)

    def add(x: Tensor, hook: Any) -> Tensor:
        x = x.clone()
        x[:, :, head] = x[:, :, head] + (a * delta).to(x.dtype)
        return x

    with torch.enable_grad():
        value = metric(hm.run_with_hooks(tokens, fwd_hooks=[(name, add)], return_type="logits"))
        return float(torch.autograd.grad(value, a)[0])


@pytest.mark.parametrize("which", WHICH)
def test_attribution_of_one_heads_keys_is_the_gradient_along_the_patch(which: str) -> None:
    """Attribution patching of ``"k"`` and ``"rot_k"`` per head and position on the blocks whose heads share their
    rope key: each score is (clean - corrupted) . the gradient a backward hook on the corrupted run reads there, and
    each head's score over every position the derivative of the metric along its patch."""
    hm, clean, corrupted, metric = pair(which)
    layers = _shared_key_layers(hm)
    tol = 1e-9 if hm.cfg.dtype == torch.float64 else 1e-4
    result = attribution.attribute(hm, clean, corrupted, metric, list(KEYS), progress=False)
    names = [f"blocks.{i}.attn.hook_{w}" for i in layers for w in KEYS]
    with torch.no_grad():
        values = {
            t: hm.run_with_cache(x, names_filter=names)[1] for t, x in (("clean", clean), ("corrupted", corrupted))
        }
    grads = _key_gradients(hm, corrupted, metric, names)
    for which_key in KEYS:
        by_pos = result.scores(which_key, ("layer", "pos", "head"))
        by_head = result.scores(which_key, ("layer", "head"))
        assert by_pos.shape == (hm.cfg.n_layers, clean.shape[1], hm.cfg.n_heads)
        for layer in layers:
            name = f"blocks.{layer}.attn.hook_{which_key}"
            delta = (values["clean"][name] - values["corrupted"][name]).double()
            expected = (delta * grads[name].double()).sum((0, -1))  # [pos, head]
            assert expected.abs().max() > 1e-6, name
            torch.testing.assert_close(by_pos[layer].double(), expected, rtol=tol, atol=tol)
            for head in (0, hm.cfg.n_heads - 1):
                along = _along_the_patch(hm, corrupted, metric, name, delta[:, :, head], head)
                assert abs(float(by_head[layer, head]) - along) <= tol * max(1.0, abs(along)), (name, head)
    hm.unwrap()
