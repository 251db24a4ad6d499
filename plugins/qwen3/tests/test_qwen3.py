"""Qwen3: the contract suite over random tiny Qwen3 configs, plus Qwen3's own quirks (per-head q/k norms between
projection and RoPE, their place in hook_names, edits reaching the KV cache, refusals)."""

from __future__ import annotations

import torch
from lensadapters_qwen3.testing import Qwen3Contract, qwen3_config

from lensadapters.rotary import apply_rotate_half
from lensadapters.testing import assert_close
from lensadapters.testing.families import GenerationChecks, RefusalChecks
from lensadapters.testing.families import left_padded_tokens as tokens
from lensadapters.testing.family_checks import QK_NORMED_ATTENTION


class TestQwen3(Qwen3Contract, RefusalChecks, GenerationChecks):
    """The plugin's contract suite (``lensadapters_qwen3.testing``, also run by ``lensadapters check qwen3``)."""

    example_config = qwen3_config
    generation_config = dict(layers=2, window=3, window_from=1)


CONTRACT = TestQwen3()


def test_query_norm_points_sit_between_projection_and_rotary():
    hm = CONTRACT.wrap(CONTRACT.make_model(qwen3_config(n_heads=4, n_kv=2, head_dim=8), 0))
    names = [
        n[len("blocks.0.") :]
        for n in hm.hook_names
        if n.startswith("blocks.0.attn.hook_") or ".attn.q_norm" in n or ".attn.k_norm" in n
    ]
    assert names[:11] == QK_NORMED_ATTENTION
    ids, mask = tokens()
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, attention_mask=mask)
        cos, sin = hm.hf_model.model.rotary_emb(cache["blocks.0.hook_resid_pre"], torch.arange(ids.shape[1])[None])
    # TransformerLens' q_norm: the RMS of each head's projection; hook_rot_q rotates weight * normalized
    q = cache["q", 0]
    scale = cache["blocks.0.attn.q_norm.hook_scale"]
    assert scale.shape == q.shape[:-1] + (1,)
    assert_close(scale, (q.pow(2).mean(-1, keepdim=True) + hm.cfg.eps).sqrt(), "q_norm scale per head")
    normalized = cache["blocks.0.attn.q_norm.hook_normalized"]
    assert_close(normalized, q / scale, "q_norm normalized")
    weight = hm.block_modules[0].self_attn.q_norm.weight
    expected = apply_rotate_half(normalized * weight, cos, sin)
    valid = mask.bool()
    # left-padded rows use positions shifted by their padding: compare the unpadded row
    assert_close(cache["rot_q", 0][1], expected[1], "hook_rot_q == RoPE(q_norm(hook_q))")
    assert valid.all(-1)[1]
    hm.unwrap()


def test_rotated_key_edit_is_what_the_cache_stores():
    from transformers import DynamicCache

    hm = CONTRACT.wrap(CONTRACT.make_model(qwen3_config(layers=1), 0))
    ids, mask = tokens(pads=(0, 0))
    edited = {}

    def edit(t, hook):
        edited["k"] = t * 0.5 + 1.0
        return edited["k"]

    cache = DynamicCache()
    with torch.no_grad(), hm.hooks([("blocks.0.attn.hook_rot_k", edit)]):
        hm(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    stored = cache.layers[0].keys if hasattr(cache, "layers") else cache.key_cache[0]
    assert_close(stored.transpose(1, 2), edited["k"], "the KV cache holds the edited rotated key", atol=1e-5)
    hm.unwrap()


def test_query_norm_scale_edit_reaches_scores():
    hm = CONTRACT.wrap(CONTRACT.make_model(qwen3_config(), 0))
    ids, mask = tokens(pads=(0, 0))
    with torch.no_grad():
        _, base = hm.run_with_cache(ids, attention_mask=mask, names_filter=["blocks.0.attn.hook_attn_scores"])
        with hm.hooks([("blocks.0.attn.q_norm.hook_scale", lambda s, hook: s * 2)]):
            _, edited = hm.run_with_cache(ids, attention_mask=mask, names_filter=["blocks.0.attn.hook_attn_scores"])
    a, b = base["attn_scores", 0], edited["attn_scores", 0]
    finite = torch.isfinite(a)
    assert_close(b[finite], a[finite] / 2, "halving the normed queries halves the scores", atol=1e-5)
    hm.unwrap()
