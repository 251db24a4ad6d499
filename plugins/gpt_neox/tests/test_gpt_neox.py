"""GPT-NeoX-specific tests (the generic adapter properties live in the contract suite).

Architecture-specific properties checked here:
* ``query_key_value`` is per-head interleaved: W_Q/W_K/W_V/b_* are the right rows of the fused weight.
* ``hook_rot_q``/``hook_rot_k`` equal an independent partial rotate-half RoPE reference (complex
  multiplication in float64) applied to ``hook_q``/``hook_k``, with positions from a left-padded mask.
* Attention uses ``scaling = d_head ** -0.5`` on the rotated queries/keys, also after a ``hook_rot_k`` edit.
* Parallel residual: no ``hook_resid_mid``, ``hook_mlp_in`` is the block input, attention edits do not
  reach the same block's MLP (but do reach the residual); sequential blocks do feed it.
* Generation with the KV cache: cached steps continue the positions (``hook_rot_k`` of each step
  equals the full-sequence run), and a ``hook_rot_k`` edit made on the prompt is stored in the cache
  and seen by later steps.
* Bad input is refused at wrap time (untested attention implementations, changed layouts).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import lensadapters_gpt_neox
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lensadapters_gpt_neox.testing import VOCAB, GPTNeoXContract, gpt_neox_config, gpt_neox_configs, rotary_pct
from torch import nn
from transformers import AutoModelForCausalLM

from lensadapters import HookedModel, Registry, UnsupportedModelError
from lensadapters.testing import reference_rope, rope_inv_freq, seeded_model
from lensadapters.testing.contract_support import greedy_kwargs
from lensadapters.testing.strategies import Inputs, token_inputs

make_config = gpt_neox_config
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- tiny models ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def tiny_model(*fields: Any, seed: int = 0, **named: Any) -> nn.Module:
    """The seeded model of ``make_config(*fields, **named)`` (cached); reinit: weights large enough that every path
    matters."""
    return seeded_model(make_config(*fields, **named), seed)


@st.composite
def neox_models(draw: st.DrawFn) -> tuple[tuple, nn.Module]:
    """A config of the contract's strategy, as a cached model: ``((n_heads, d_head, rotary_pct, parallel, bias,
    n_layers), model)``."""
    config = draw(gpt_neox_configs())
    heads = config.num_attention_heads
    key = (
        heads,
        config.hidden_size // heads,
        rotary_pct(config),
        config.use_parallel_residual,
        config.attention_bias,
        config.num_hidden_layers,
    )
    return key, tiny_model(*key)


def registry() -> Registry:
    reg = Registry()
    reg.register(lensadapters_gpt_neox, "gpt_neox")
    return reg


def wrap(model: nn.Module) -> HookedModel:
    return HookedModel.wrap(model, registry=registry())


@contextlib.contextmanager
def wrapped(model: nn.Module):
    hm = wrap(model)
    try:
        yield hm
    finally:
        hm.unwrap()


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """What ``generate`` passes: positions counted from the first real token of each row."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


# --- the generic contract --------------------------------------------------------------------------------


class TestGPTNeoX(GPTNeoXContract):
    """The plugin's contract suite (``lensadapters_gpt_neox.testing``, also run by ``lensadapters check
    gpt_neox``): parallel and sequential blocks, rotary_pct 0.25 / 0.5 / 1, attention bias on and off."""


# --- weights: the per-head interleaved layout ---------------------------------------------------------------


@SETTINGS
@given(neox_models())
def test_qkv_weights_are_deinterleaved_per_head(model_key):
    (n_heads, d_head, *_), model = model_key
    with wrapped(model) as hm:
        W_Q, W_K, W_V, b_Q, b_K, b_V = hm.W_Q, hm.W_K, hm.W_V, hm.b_Q, hm.b_K, hm.b_V
        assert W_Q.shape == (hm.cfg.n_layers, n_heads, hm.cfg.d_model, d_head)
        for layer, block in enumerate(model.gpt_neox.layers):
            fused = block.attention.query_key_value
            for h in range(n_heads):
                rows = slice(3 * d_head * h, 3 * d_head * (h + 1))  # head h owns 3*d_head consecutive rows
                w, b = fused.weight[rows], fused.bias[rows] if fused.bias is not None else torch.zeros(3 * d_head)
                for i, (W, B) in enumerate(((W_Q, b_Q), (W_K, b_K), (W_V, b_V))):
                    assert torch.equal(W[layer, h], w[i * d_head : (i + 1) * d_head].T)
                    assert torch.equal(B[layer, h], b[i * d_head : (i + 1) * d_head])
        assert torch.equal(hm.W_U, model.get_output_embeddings().weight.T)
        assert torch.equal(hm.W_E, model.gpt_neox.embed_in.weight)
        assert torch.equal(hm.W_in, torch.stack([b.mlp.dense_h_to_4h.weight.T for b in model.gpt_neox.layers]))
        assert torch.equal(hm.W_out, torch.stack([b.mlp.dense_4h_to_h.weight.T for b in model.gpt_neox.layers]))


def test_cfg():
    model = tiny_model(n_heads=2, d_head=16, rotary_pct=0.25, parallel=False)
    with wrapped(model) as hm:
        cfg = hm.cfg
        assert (cfg.positional_embedding_type, cfg.rotary_dim, cfg.parallel_attn_mlp) == ("rotary", 4, False)
        assert (cfg.d_model, cfg.n_heads, cfg.d_head, cfg.n_key_value_heads, cfg.d_mlp) == (32, 2, 16, 2, 48)
        assert cfg.normalization_type == "LN" and cfg.model_type == "gpt_neox" and not cfg.gated_mlp
        assert "hook_pos_embed" not in hm.hook_names
        assert "blocks.0.hook_resid_mid" in hm.hook_names
    with wrapped(tiny_model(parallel=True)) as hm:
        assert hm.cfg.parallel_attn_mlp
        assert not any("resid_mid" in n for n in hm.hook_names)


# --- rotary ------------------------------------------------------------------------------------------------


@SETTINGS
@given(neox_models(), token_inputs(VOCAB, max_len=10))
def test_rot_q_k_equal_reference_rope(model_key, inputs: Inputs):
    (_, d_head, pct, *_), model = model_key
    pos = position_ids(inputs.attention_mask)
    with wrapped(model) as hm:
        names = lambda n: n.endswith(("attn.hook_q", "attn.hook_k", "hook_rot_q", "hook_rot_k"))  # noqa: E731
        _, cache = hm.run_with_cache(**inputs.kwargs(), position_ids=pos, names_filter=names)
        rotary_dim = int(d_head * pct)
        assert hm.cfg.rotary_dim == rotary_dim
        for layer in range(hm.cfg.n_layers):
            for x in ("q", "k"):
                expected = reference_rope(cache[x, layer], pos, rope_inv_freq(rotary_dim))
                got = cache[f"rot_{x}", layer]
                torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)
                # the pass-through dims are untouched
                assert torch.equal(got[..., rotary_dim:], cache[x, layer][..., rotary_dim:])


@SETTINGS
@given(neox_models(), token_inputs(VOCAB, max_len=8), st.integers(0, 2**16))
def test_rot_k_edit_is_what_attention_uses(model_key, inputs: Inputs, seed):
    """Scores are ``rot_q . rot_k * d_head**-0.5`` even after ``hook_rot_k`` was replaced."""
    (_, d_head, *_), model = model_key
    gen = torch.Generator().manual_seed(seed)
    edits = {}

    def edit(rot_k, hook):
        new = torch.randn(rot_k.shape, generator=gen, dtype=rot_k.dtype)
        edits[hook.layer()] = new
        return new

    with wrapped(model) as hm:
        with hm.hooks(fwd_hooks=[(lambda n: n.endswith("hook_rot_k"), edit)]):
            _, cache = hm.run_with_cache(
                **inputs.kwargs(), names_filter=lambda n: n.endswith(("hook_rot_q", "hook_attn_scores"))
            )
        for layer in range(hm.cfg.n_layers):
            expected = torch.einsum("bqhd,bkhd->bhqk", cache["rot_q", layer], edits[layer]) * d_head**-0.5
            scores = cache["attn_scores", layer]
            finite = scores.isfinite()
            allowed = torch.ones(scores.shape[-2:], dtype=torch.bool).tril() & inputs.valid[:, None, None, :]
            assert torch.equal(finite, allowed.expand_as(finite))
            torch.testing.assert_close(scores[finite], expected[finite], atol=1e-4, rtol=1e-4)


# --- parallel residual ------------------------------------------------------------------------------------


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_residual_isolation(parallel):
    model = tiny_model(parallel=parallel, rotary_pct=0.5)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    watched = [
        "blocks.0.hook_resid_pre",
        "blocks.0.hook_attn_out",
        "blocks.0.hook_mlp_in",
        "blocks.0.ln2.hook_normalized",
        "blocks.0.mlp.hook_pre",
        "blocks.0.hook_mlp_out",
        "blocks.0.hook_resid_post",
    ]
    with wrapped(model) as hm:
        _, clean = hm.run_with_cache(ids, names_filter=watched)
        delta = torch.randn(clean["blocks.0.hook_attn_out"].shape, generator=torch.Generator().manual_seed(2))
        with hm.hooks(fwd_hooks=[("blocks.0.hook_attn_out", lambda t, hook: t + delta)]):
            _, edited = hm.run_with_cache(ids, names_filter=watched)
        mlp_side = [
            "blocks.0.hook_mlp_in",
            "blocks.0.ln2.hook_normalized",
            "blocks.0.mlp.hook_pre",
            "blocks.0.hook_mlp_out",
        ]
        if parallel:
            assert "blocks.0.hook_resid_mid" not in hm.hook_names
            # the MLP reads the block input (ln2's input), not the attention output
            assert torch.equal(clean["blocks.0.hook_mlp_in"], clean["blocks.0.hook_resid_pre"])
            for name in mlp_side:
                assert torch.equal(clean[name], edited[name]), name
        else:
            assert "blocks.0.hook_resid_mid" in hm.hook_names
            torch.testing.assert_close(
                clean["blocks.0.hook_mlp_in"], clean["blocks.0.hook_resid_pre"] + clean["blocks.0.hook_attn_out"]
            )
            for name in mlp_side:
                assert not torch.allclose(clean[name], edited[name]), name
        # the residual stream gets the edit either way
        change = edited["blocks.0.hook_resid_post"] - clean["blocks.0.hook_resid_post"]
        mlp_change = edited["blocks.0.hook_mlp_out"] - clean["blocks.0.hook_mlp_out"]
        torch.testing.assert_close(change, delta + mlp_change, atol=1e-5, rtol=1e-5)


def test_parallel_mlp_in_edit_reaches_only_the_mlp():
    model = tiny_model(parallel=True)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    watched = ["blocks.0.hook_attn_out", "blocks.0.hook_mlp_out", "blocks.0.hook_resid_post"]
    with wrapped(model) as hm:
        _, clean = hm.run_with_cache(ids, names_filter=watched)
        with hm.hooks(fwd_hooks=[("blocks.0.hook_mlp_in", lambda t, hook: t * 2)]):
            _, edited = hm.run_with_cache(ids, names_filter=watched)
        assert torch.equal(clean["blocks.0.hook_attn_out"], edited["blocks.0.hook_attn_out"])
        assert not torch.allclose(clean["blocks.0.hook_mlp_out"], edited["blocks.0.hook_mlp_out"])
        # the residual itself keeps the unedited block input: resid_post = x + attn + mlp(edited)
        change = edited["blocks.0.hook_resid_post"] - clean["blocks.0.hook_resid_post"]
        torch.testing.assert_close(
            change, edited["blocks.0.hook_mlp_out"] - clean["blocks.0.hook_mlp_out"], atol=1e-5, rtol=1e-5
        )


# --- generation with the KV cache -----------------------------------------------------------------------------


def _prompt(batch: int = 2, length: int = 6, pad: int = 2, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :pad] = 0
    ids[0, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("parallel,pct", [(True, 0.25), (False, 1.0)])
def test_generation_positions_continue_in_rot_k(parallel, pct):
    model = tiny_model(parallel=parallel, rotary_pct=pct)
    ids, mask = _prompt()
    new_tokens = 4
    steps: dict[str, list[torch.Tensor]] = {}

    def record(t, hook):
        steps.setdefault(hook.name, []).append(t.detach().clone())

    names = lambda n: n.endswith(("hook_rot_k", "hook_rot_q"))  # noqa: E731
    with wrapped(model) as hm:
        with hm.hooks(fwd_hooks=[(names, record)]):
            out = hm.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0
            )
        assert out.shape[1] == ids.shape[1] + new_tokens
        full_mask = torch.cat([mask, torch.ones(2, new_tokens, dtype=torch.long)], dim=1)
        _, full = hm.run_with_cache(
            out, attention_mask=full_mask, position_ids=position_ids(full_mask), names_filter=names
        )
    fed = out.shape[1] - 1  # the last generated token is never fed back
    valid = full_mask[:, :fed].bool()
    for name in [n for n in full if names(n)]:
        per_step = steps[name]
        assert len(per_step) == new_tokens
        assert per_step[0].shape[1] == ids.shape[1] and all(s.shape[1] == 1 for s in per_step[1:])
        cached = torch.cat(per_step, dim=1)
        torch.testing.assert_close(cached[valid], full[name][:, :fed][valid], atol=1e-5, rtol=1e-5)


def test_rot_k_edit_is_stored_in_kv_cache():
    """Editing ``hook_rot_k`` on the prompt changes the cached keys that later steps attend to."""
    model = tiny_model(parallel=False, rotary_pct=0.5, n_layers=2)
    ids, mask = _prompt(pad=1)
    layer, position, new_tokens = 1, 3, 3
    gen = torch.Generator().manual_seed(5)
    replacement = torch.randn(2, model.config.num_attention_heads, 8, generator=gen) * 3

    def edit_prompt(rot_k, hook):
        if rot_k.shape[1] == 1:  # a cached step: leave the new key alone
            return None
        rot_k = rot_k.clone()
        rot_k[:, position] = replacement
        return rot_k

    seen: dict[str, list[torch.Tensor]] = {}

    def record(t, hook):
        seen.setdefault(hook.name.rsplit(".", 1)[-1], []).append(t.detach().clone())

    with wrapped(model) as hm:
        name = f"blocks.{layer}.attn.hook_rot_k"
        with hm.hooks(
            fwd_hooks=[
                (name, edit_prompt),
                (f"blocks.{layer}.attn.hook_rot_q", record),
                (f"blocks.{layer}.attn.hook_attn_scores", record),
            ]
        ):
            kwargs = greedy_kwargs(new_tokens, attention_mask=mask, use_cache=True, output_scores=True)
            gen_out = hm.generate(ids, **kwargs)
        # 1. the cache holds the edited key, up to the inverse-then-reapply rotation's rounding
        keys = (
            gen_out.past_key_values.layers[layer].keys
            if hasattr(gen_out.past_key_values, "layers")
            else gen_out.past_key_values.key_cache[layer]
        )
        torch.testing.assert_close(keys[:, :, position], replacement, atol=1e-5, rtol=1e-5)
        # 2. every later step's scores against that position use the edited key
        assert len(seen["hook_attn_scores"]) == new_tokens
        for rot_q, step_scores in list(zip(seen["hook_rot_q"], seen["hook_attn_scores"]))[1:]:
            assert step_scores.shape[-2] == 1
            expected = torch.einsum("bqhd,bhd->bhq", rot_q, replacement) * 8**-0.5
            torch.testing.assert_close(step_scores[..., position], expected, atol=1e-4, rtol=1e-4)
        # 3. the cached run equals a cache-free run of the whole sequence with the same edit
        seq = gen_out.sequences
        full_mask = torch.cat([mask, torch.ones(2, new_tokens, dtype=torch.long)], dim=1)

        def edit_full(rot_k, hook):
            rot_k = rot_k.clone()
            rot_k[:, position] = replacement
            return rot_k

        logits = hm.run_with_hooks(
            seq[:, :-1],
            attention_mask=full_mask[:, :-1],
            position_ids=position_ids(full_mask[:, :-1]),
            fwd_hooks=[(name, edit_full)],
        )
        unedited = hm(
            seq[:, :-1], attention_mask=full_mask[:, :-1], position_ids=position_ids(full_mask[:, :-1])
        ).logits
    P = ids.shape[1]
    for step, step_scores in enumerate(gen_out.scores):
        torch.testing.assert_close(step_scores, logits[:, P - 1 + step], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(unedited[:, P:], logits[:, P:], atol=1e-3)


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention", "paged_attention"])
def test_untested_attention_implementation_is_refused(impl):
    model = AutoModelForCausalLM.from_config(make_config(n_layers=1))
    model.config._attn_implementation = impl
    with pytest.raises(UnsupportedModelError, match="attention implementation"):
        wrap(model)


def test_changed_layout_is_refused():
    model = AutoModelForCausalLM.from_config(make_config(n_layers=1))
    model.gpt_neox.layers[0].mlp = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXMLP"):
        wrap(model)
    model = AutoModelForCausalLM.from_config(make_config(n_layers=1))
    model.gpt_neox.layers[0].attention.query_key_value = nn.Linear(32, 64)
    with pytest.raises(UnsupportedModelError, match="query_key_value"):
        wrap(model)
    model = AutoModelForCausalLM.from_config(make_config(n_layers=1))
    model.gpt_neox.layers[0].input_layernorm = nn.Identity()
    with pytest.raises(UnsupportedModelError, match="LayerNorm"):
        wrap(model)


def test_overridden_forward_warns():
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP

    class MyMLP(GPTNeoXMLP):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    model = AutoModelForCausalLM.from_config(make_config(n_layers=1))
    old = model.gpt_neox.layers[0].mlp
    new = MyMLP(model.config)
    new.load_state_dict(old.state_dict())
    model.gpt_neox.layers[0].mlp = new
    with pytest.warns(UserWarning, match="overrides GPTNeoXMLP.forward"):
        hm = wrap(model)
    hm.unwrap()


def test_tiny_config_wraps():
    import lensadapters_gpt_neox as plugin

    cfg = plugin.lensadapters_tiny_config(arch=plugin.ARCH, seed=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    ref = model(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with wrapped(model) as hm:
            assert hm.arch.name == "gpt_neox"
            assert torch.equal(hm(ids).logits, ref)
