"""OLMo 2: the contract suite over random tiny OLMo 2 configs, plus OLMo 2's own quirks (no pre-norms, norms after
attention and MLP, q/k norms over the projection width, refusals)."""

from __future__ import annotations

import torch
from lensadapters_olmo2.testing import Olmo2Contract, olmo2_config

from lensadapters.testing import assert_close
from lensadapters.testing.families import GenerationChecks, RefusalChecks, padded_cache
from lensadapters.testing.families import left_padded_tokens as tokens
from lensadapters.testing.family_checks import QK_NORMED_ATTENTION


class TestOlmo2(Olmo2Contract, RefusalChecks, GenerationChecks):
    """The plugin's contract suite (``lensadapters_olmo2.testing``, also run by ``lensadapters check olmo2``)."""

    example_config = olmo2_config
    generation_config = dict(layers=2)


CONTRACT = TestOlmo2()


def test_block_points_without_pre_norms():
    hm = CONTRACT.wrap(CONTRACT.make_model(olmo2_config(n_heads=4, n_kv=2, hidden=32), 0))
    block = [n[len("blocks.0.") :] for n in hm.hook_names if n.startswith("blocks.0.")]
    assert block == [
        "hook_resid_pre",
        "hook_q_input",
        "hook_k_input",
        "hook_v_input",
        *QK_NORMED_ATTENTION,
        "attn.hook_z",
        "attn.hook_result",
        "ln1_post.hook_scale",
        "ln1_post.hook_normalized",
        "hook_attn_out",
        "hook_resid_mid",
        "hook_mlp_in",
        "mlp.hook_pre",
        "mlp.hook_pre_linear",
        "mlp.hook_post",
        "ln2_post.hook_scale",
        "ln2_post.hook_normalized",
        "hook_mlp_out",
        "hook_resid_post",
    ]
    cache = padded_cache(hm)
    # the query norm is over the whole projection width: one scale per position
    q = cache["q", 0].flatten(-2)
    assert_close(
        cache["blocks.0.attn.q_norm.hook_scale"],
        (q.pow(2).mean(-1, keepdim=True) + hm.cfg.eps).sqrt(),
        "q_norm scale over n_heads * d_head",
    )
    # attention reads the block input itself: hook_q == resid_pre @ W_Q + b_Q
    assert_close(cache["q", 0], torch.einsum("bpm,hmd->bphd", cache["resid_pre", 0], hm.W_Q[0]) + hm.b_Q[0], "hook_q")
    hm.unwrap()


def test_mlp_input_edit_reaches_only_the_mlp():
    hm = CONTRACT.wrap(CONTRACT.make_model(olmo2_config(), 0))
    ids, mask = tokens()
    delta = torch.randn(ids.shape + (hm.cfg.d_model,), generator=torch.Generator().manual_seed(1))
    watch = ["blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out", "blocks.0.hook_resid_post", "blocks.0.mlp.hook_pre"]
    with torch.no_grad():
        _, base = hm.run_with_cache(ids, attention_mask=mask, names_filter=watch)
        with hm.hooks([("blocks.0.hook_mlp_in", lambda t, hook: t + delta)]):
            _, edited = hm.run_with_cache(ids, attention_mask=mask, names_filter=watch)
    assert_close(edited["pre", 0], (base["resid_mid", 0] + delta) @ hm.W_gate[0], "the MLP reads the edited input")
    assert_close(edited["resid_post", 0], base["resid_mid", 0] + edited["mlp_out", 0], "the residual does not")
    hm.unwrap()


def test_bfloat16_rotary_is_bitwise():
    """OLMo 2 computes RoPE in float32 and casts back: hook_rot_q in bfloat16 is bitwise what attention uses."""
    model = CONTRACT.make_model(olmo2_config(layers=1), 0).to(torch.bfloat16)
    hm = CONTRACT.wrap(model)
    ids, mask = tokens(pads=(0, 0))
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        logits, cache = hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: "rot" in n)
        # an identity edit rotates back and forth through the float32 (cos, sin): bitwise when nothing changed
        identity = hm.run_with_hooks(
            ids, attention_mask=mask, fwd_hooks=[(lambda n: "rot" in n, lambda t, hook: t.clone())]
        )
    assert cache["rot_q", 0].dtype == torch.bfloat16 and cache["rot_k", 0].dtype == torch.bfloat16
    assert torch.equal(logits, reference) and torch.equal(identity, reference)
    hm.unwrap()


def test_head_input_edits_of_a_float64_model_are_exact_to_float64():
    """No norm sits between the block input and the projections here, so editing every head's query/key/value input
    by a vector is, at the projections, the same edit of ``hook_resid_pre``: equal to float64 rounding (an edit's change
    is computed in the model's dtype where that is wider than float32; it was float32, 2e-7 off)."""
    hm = CONTRACT.wrap(CONTRACT.make_model(olmo2_config(n_heads=4, n_kv=2, hidden=32), 0).double())
    ids, mask = tokens()
    noise = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    projections = [f"blocks.0.attn.hook_{side}" for side in "qkv"]
    inputs = [f"blocks.0.hook_{side}_input" for side in "qkv"]
    with torch.no_grad():
        with hm.hooks([(name, lambda t, hook: t + noise) for name in inputs]):
            _, by_heads = hm.run_with_cache(ids, attention_mask=mask, names_filter=projections)
        with hm.hooks([("blocks.0.hook_resid_pre", lambda t, hook: t + noise)]):
            _, by_stream = hm.run_with_cache(ids, attention_mask=mask, names_filter=projections)
    for name in projections:
        assert by_heads[name].dtype == torch.float64
        torch.testing.assert_close(by_heads[name], by_stream[name], rtol=1e-12, atol=1e-12)
    hm.unwrap()
