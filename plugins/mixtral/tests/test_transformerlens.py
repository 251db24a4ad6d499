"""Agreement with TransformerLens 2.x's Mixtral (``HookedTransformer``, its own weight conversion, no weight
processing) on the same weights: hook values and the effects of edits. Runs where ``transformer_lens`` is importable
(the transformers 4.57 environment; TransformerLens' conversion reads 4.x's expert modules).

Deliberate differences, checked here as such: TransformerLens flattens the routing points to ``[b*p, ...]``
(lensadapters shows ``[b, p, ...]``); it has no router-logits, routing-weights or expert-result point (steering the
router through lensadapters' logits equals editing TransformerLens' probabilities to ``softmax(log p + bias)``;
zeroing an expert's ``hook_result`` equals zeroing its ``hook_post`` there).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lensadapters_mixtral.testing import MixtralContract, mixtral_configs

from lensadapters.testing import assert_close

pytest.importorskip("transformer_lens")
from lensadapters_mixtral.reference import tl_mixtral  # noqa: E402

CONTRACT = MixtralContract()
SETTINGS = settings(deadline=None, max_examples=max(2, settings.default.max_examples // 2))


def build(data: st.DataObject) -> tuple[Any, Any, Any, torch.Tensor]:
    config = data.draw(mixtral_configs(sliding_window=None, tied=False), label="config")
    model = CONTRACT.make_model(config, data.draw(st.integers(0, 2**16), label="seed"), "eager")
    if not hasattr(model.model.layers[0], "block_sparse_moe"):
        pytest.skip("TransformerLens' Mixtral conversion reads transformers 4.x's expert modules")
    ids = torch.randint(
        0,
        config.vocab_size,
        (data.draw(st.integers(1, 2), label="batch"), data.draw(st.integers(2, 8), label="length")),
        generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99), label="ids")),
    )
    return model, CONTRACT.wrap(model), tl_mixtral(model), ids


def tl_names(hm: Any, layer: int) -> list[str]:
    """The points both have in a block, by TransformerLens' name (and lensadapters')."""
    pre = f"blocks.{layer}."
    names = [
        pre + n
        for n in (
            "hook_resid_pre",
            "ln1.hook_scale",
            "ln1.hook_normalized",
            "attn.hook_q",
            "attn.hook_k",
            "attn.hook_v",
            "attn.hook_rot_q",
            "attn.hook_rot_k",
            "attn.hook_z",
            "hook_attn_out",
            "hook_resid_mid",
            "ln2.hook_scale",
            "ln2.hook_normalized",
            "mlp.hook_expert_weights",
            "mlp.hook_expert_indices",
            "hook_mlp_out",
            "hook_resid_post",
        )
    ]
    for e in range(hm.cfg.num_experts):
        names += [f"{pre}mlp.experts.{e}.{p}" for p in ("hook_gate", "hook_pre", "hook_post")]
    return names


@SETTINGS
@given(data=st.data())
def test_hook_values_match_transformerlens(data: st.DataObject) -> None:
    """Every point both have agrees (``[b*p, ...]`` routing points reshaped), and so do the logits."""
    model, hm, tl, ids = build(data)
    names = ["hook_embed", "ln_final.hook_scale", "ln_final.hook_normalized"]
    names += [n for i in range(hm.cfg.n_layers) for n in tl_names(hm, i)]
    with torch.no_grad():
        ours_logits, ours = hm.run_with_cache(ids, names_filter=names)
        tl_logits, theirs = tl.run_with_cache(ids, names_filter=names)
    assert_close(ours_logits, tl_logits, "logits", atol=1e-4)
    for name in names:
        a, b = ours[name], theirs[name]
        if name.endswith(("hook_expert_weights", "hook_expert_indices")):
            a = a.reshape(b.shape)
        assert a.shape == b.shape, (name, tuple(a.shape), tuple(b.shape))
        if a.dtype == torch.int64:
            assert torch.equal(a, b), name
        else:
            assert_close(a, b, name, atol=1e-4)
    hm.unwrap()


@SETTINGS
@given(data=st.data())
def test_edit_effects_match_transformerlens(data: st.DataObject) -> None:
    """The same edit gives the same logits: new probabilities (re-selected and renormalized), permuted indices,
    zeroed expert outputs, and steering the router (lensadapters' logits + bias == TransformerLens' probabilities
    ``softmax(log p + bias)``)."""
    model, hm, tl, ids = build(data)
    cfg = hm.cfg
    layer = data.draw(st.integers(0, cfg.n_layers - 1), label="layer")
    expert = data.draw(st.integers(0, cfg.num_experts - 1), label="expert")
    g = torch.Generator().manual_seed(layer)
    probs = torch.rand(ids.numel(), cfg.num_experts, generator=g)
    bias = torch.randn(cfg.num_experts, generator=g) * 3
    pre = f"blocks.{layer}.mlp."
    pairs = [
        (
            [(pre + "hook_expert_weights", lambda t, hook: probs.reshape(t.shape))],
            [(pre + "hook_expert_weights", lambda t, hook: probs)],
        ),
        (
            [(pre + "hook_expert_indices", lambda t, hook: (t + 1) % cfg.num_experts)],
            [(pre + "hook_expert_indices", lambda t, hook: (t + 1) % cfg.num_experts)],
        ),
        (
            [(f"{pre}experts.{expert}.hook_result", lambda t, hook: torch.zeros_like(t))],
            [(f"{pre}experts.{expert}.hook_post", lambda t, hook: torch.zeros_like(t))],
        ),
        (
            [(f"{pre}experts.{expert}.hook_gate", lambda t, hook: t * 2)],
            [(f"{pre}experts.{expert}.hook_gate", lambda t, hook: t * 2)],
        ),
        (
            [(pre + "hook_router_logits", lambda t, hook: t + bias)],
            [(pre + "hook_expert_weights", lambda t, hook: torch.softmax(t.log() + bias, dim=-1))],
        ),
    ]
    with torch.no_grad():
        reference = hm(ids).logits
        for ours, theirs in pairs:
            a = hm.run_with_hooks(ids, fwd_hooks=ours)
            b = tl.run_with_hooks(ids, fwd_hooks=theirs)
            assert_close(a, b, f"{ours[0][0]} edit vs TransformerLens", atol=1e-4)
        changed = hm.run_with_hooks(ids, fwd_hooks=pairs[0][0])
    assert not torch.allclose(changed, reference), "the probability edit changed nothing"
    hm.unwrap()
