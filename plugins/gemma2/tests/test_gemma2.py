"""Gemma 2: the contract suite over random tiny Gemma 2 configs, plus Gemma 2's own quirks (scaled embeddings and
their edits, softcaps, sandwich norms, alternating windows, refusals)."""

from __future__ import annotations

import pytest
import torch
import transformers
from lensadapters_gemma2.testing import Gemma2Contract, gemma2_config

from lensadapters import UnsupportedModelError
from lensadapters.testing import assert_close
from lensadapters.testing.families import GenerationChecks, RefusalChecks
from lensadapters.testing.families import left_padded_tokens as tokens
from lensadapters.testing.family_checks import assert_window_patterns

TRANSFORMERS_4 = transformers.__version__.startswith("4.")


class TestGemma2(Gemma2Contract, RefusalChecks, GenerationChecks):
    """The plugin's contract suite (``lensadapters_gemma2.testing``, also run by ``lensadapters check gemma2``)."""

    example_config = gemma2_config
    refused_settings = {"use_bidirectional_attention": (True, "use_bidirectional_attention")}
    generation_config = dict(layers=2, window=3)


CONTRACT = TestGemma2()


def test_embeddings_include_the_scale_and_edits_behave():
    """hook_embed == W_E[tokens] == sqrt(d_model) * table[tokens] (TransformerLens), whether transformers scales
    in the embedding module (5.x) or after it (4.x); adding to hook_embed adds to the residual stream."""
    hm = CONTRACT.wrap(CONTRACT.make_model(gemma2_config(hidden=32), 0))
    table = hm.hf_model.model.embed_tokens.weight
    assert_close(hm.W_E, table * 32**0.5, "W_E is the scaled table")
    ids, mask = tokens()
    delta = torch.randn(ids.shape + (32,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, base = hm.run_with_cache(ids, attention_mask=mask, names_filter=["hook_embed", "blocks.0.hook_resid_pre"])
        with hm.hooks([("hook_embed", lambda t, hook: t + delta)]):
            _, edited = hm.run_with_cache(ids, attention_mask=mask, names_filter=["blocks.0.hook_resid_pre"])
        with hm.hooks([("blocks.0.hook_resid_pre", lambda t, hook: t + delta)]):
            at_resid = hm(ids, attention_mask=mask).logits
        at_embed = hm.run_with_hooks(ids, attention_mask=mask, fwd_hooks=[("hook_embed", lambda t, hook: t + delta)])
    assert torch.equal(base["embed"], hm.W_E[ids])
    assert torch.equal(base["resid_pre", 0], base["embed"])
    assert_close(edited["resid_pre", 0], base["embed"] + delta, "a hook_embed edit is what the first block reads")
    assert_close(at_embed, at_resid, "editing hook_embed == editing resid_pre 0", atol=1e-4)
    hm.unwrap()


def test_softcaps_as_transformerlens_has_them():
    """hook_attn_scores is after the attention softcap (|s| <= cap), then masked; the logits are
    cap * tanh(final @ W_U / cap); flattening the capped scores gives a uniform pattern."""
    hm = CONTRACT.wrap(CONTRACT.make_model(gemma2_config(attn_cap=2.0, final_cap=1.5), 0))
    assert hm.cfg.attn_scores_soft_cap == 2.0 and hm.cfg.output_logits_soft_cap == 1.5
    ids, mask = tokens(pads=(0, 0))
    with torch.no_grad():
        out = hm.model(ids, attention_mask=mask, output_hidden_states=True)
        _, cache = hm.run_with_cache(ids, attention_mask=mask)
    scores = cache["attn_scores", 0]
    finite = torch.isfinite(scores)
    assert scores[finite].abs().max() <= 2.0 and (scores[~finite] == float("-inf")).all()
    assert_close(out.logits, 1.5 * torch.tanh(out.hidden_states[-1] @ hm.W_U / 1.5), "final softcap")

    def flatten(t, hook):
        return torch.where(torch.isfinite(t), torch.zeros_like(t), t)

    with torch.no_grad(), hm.hooks([("blocks.0.attn.hook_attn_scores", flatten)]):
        _, edited = hm.run_with_cache(ids, attention_mask=mask, names_filter=["blocks.0.attn.hook_pattern"])
    pattern = edited["pattern", 0]
    assert_close(pattern, finite.float() / finite.float().sum(-1, keepdim=True), "flattened scores: uniform pattern")
    hm.unwrap()


def test_sandwich_norms():
    """hook_attn_out is ln1_post's output (what the residual receives), hook_result sums to its input."""
    hm = CONTRACT.wrap(CONTRACT.make_model(gemma2_config(), 0))
    names = hm.hook_names
    order = [
        n
        for n in names
        if n.startswith("blocks.0.")
        and (
            "ln1_post" in n
            or n.endswith(("hook_result", "hook_attn_out", "ln2_post.hook_scale", "hook_mlp_out", "mlp.hook_post"))
        )
    ]
    assert order == [
        "blocks.0.attn.hook_result",
        "blocks.0.ln1_post.hook_scale",
        "blocks.0.ln1_post.hook_normalized",
        "blocks.0.hook_attn_out",
        "blocks.0.mlp.hook_post",
        "blocks.0.ln2_post.hook_scale",
        "blocks.0.hook_mlp_out",
    ]
    ids, mask = tokens()
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: True)
    before = cache["blocks.0.ln1_post.hook_normalized"] * cache["blocks.0.ln1_post.hook_scale"]
    assert_close(cache["result", 0].sum(-2) + hm.b_O[0], before, "sum of hook_result == ln1_post input")
    assert hm.norm_spec(hm.norm_module("blocks.0.ln1_post")).weight_offset == 1.0
    hm.unwrap()


@pytest.mark.parametrize("pads", [(0, 0), (3, 0)])
def test_alternating_windows_follow_the_config(pads):
    """HF's Gemma 2 makes layer 0 a sliding layer (TransformerLens' configs put the global layer first)."""
    model = CONTRACT.make_model(gemma2_config(layers=2, window=3), 0)
    hm = CONTRACT.wrap(model)
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert hm.cfg.attn_types == ("local", "global")
    assert_window_patterns(hm, *tokens(length=9, pads=pads), [3, None])
    hm.unwrap()


@pytest.mark.skipif(not TRANSFORMERS_4, reason="transformers 5.x offers Gemma 2 no sdpa")
def test_sdpa_without_the_softcap_refuses_patterns_only():
    """transformers 4.x's sdpa ignores Gemma 2's attention softcap: hook points work, patterns refuse naming eager;
    without a softcap, sdpa patterns are served."""
    model = CONTRACT.make_model(gemma2_config(attn_cap=50.0), 0, "sdpa")
    hm = CONTRACT.wrap(model)
    ids, mask = tokens()
    with torch.no_grad():
        hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: not n.endswith(("pattern", "scores")))
        with pytest.raises(UnsupportedModelError, match="softcap.*set_attn_implementation\\('eager'\\)"):
            hm.run_with_cache(ids, attention_mask=mask, names_filter=["blocks.0.attn.hook_pattern"])
    hm.unwrap()
    hm = CONTRACT.wrap(CONTRACT.make_model(gemma2_config(attn_cap=None), 0, "sdpa"))
    assert_window_patterns(hm, *tokens(length=9), [3, None])
    hm.unwrap()
