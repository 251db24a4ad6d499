"""OPT: the contract suite over random tiny configs, plus OPT's own quirks.

Architecture-specific properties checked here:
* Positions come from the attention mask with an offset of 2 rows: with left padding,
  ``hook_pos_embed[b, p] == W_pos[cumsum(mask) - 1]`` for real tokens (pad tokens read row 1).
* ``hook_q`` is ``q_proj``'s unscaled output (``== normalized @ W_Q + b_Q``) and
  ``hook_attn_scores == (q * scaling) @ k^T`` (masked entries ``-inf``).
* Post-LN (``do_layer_norm_before=False``) residual semantics, and edits of ``hook_resid_mid``,
  ``hook_mlp_in`` and ``hook_resid_post`` against a by-hand recomputation of the layer.
* ``project_in``/``project_out``: ``W_E``/``W_U`` include the projections; logits == resid @ W_U.
* Generation with the KV cache and left padding, with edits, equals a cache-free forward with the same edits.
"""

from __future__ import annotations

from typing import Any

import lensadapters_opt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lensadapters_opt.testing import OPTContract, opt_configs
from transformers import OPTConfig

from lensadapters import UnsupportedModelError, hf
from lensadapters.testing import assert_close, token_inputs
from lensadapters.testing.contract_support import greedy_kwargs
from lensadapters.testing.plugins import assert_entry_point


class TestOPT(OPTContract):
    """The plugin's contract suite (``lensadapters_opt.testing``, also run by ``lensadapters check opt``): pre- and
    post-LN, projected embeddings, biases and LayerNorm affine on and off; the generation properties also run
    on OPT-350m's shape (post-LN with project_in/project_out) on every run."""


C = TestOPT()


def _draw(data, pre_ln=None, project=None, max_batch=3, max_len=9):
    config = data.draw(opt_configs(pre_ln, project), label="config")
    model = C.make_model(config, data.draw(st.integers(0, 2**16), label="seed"))
    inputs = data.draw(token_inputs(config.vocab_size, max_batch, 2, max_len), label="inputs")
    return model, inputs, C.wrap(model)


def _draw_layer(data, model, hm):
    """A drawn layer of ``model``: its index, its decoder layer and the prefix of its points."""
    layer_idx = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
    return layer_idx, _decoder(model).layers[layer_idx], f"blocks.{layer_idx}."


def NO_PATTERNS(name):
    return not name.endswith(("hook_pattern", "hook_attn_scores", "hook_result"))


def _decoder(model):
    return model.model.decoder


# --- positions -----------------------------------------------------------------------------------


def small_config(**fields: Any) -> OPTConfig:
    """A two-layer OPT config of width 16 (2 heads, MLP 32, vocabulary 40, 16 positions), then ``fields``."""
    shared = hf.size_fields(hidden=16, layers=2, heads=2, vocab=40, positions=16)
    return OPTConfig(**{**shared, "ffn_dim": 32, **fields})


@settings(deadline=None)
@given(data=st.data())
def test_pos_embed_follows_mask_with_offset(data):
    model, inputs, hm = _draw(data)
    with torch.no_grad():
        _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=["hook_pos_embed", "hook_embed"])
    mask = inputs.attention_mask
    positions = mask.cumsum(1) - 1
    table = _decoder(model).embed_positions.weight
    assert hm.W_pos.shape == (model.config.max_position_embeddings, hm.cfg.d_model)
    assert torch.equal(hm.W_pos, table[2:])
    pos = cache["pos_embed"]
    v = inputs.valid
    assert pos.shape == inputs.input_ids.shape + (hm.cfg.d_model,)
    assert torch.equal(pos[v], hm.W_pos[positions[v]])
    # pad tokens are at position -1, i.e. row 1 of the table (an offset row, not part of W_pos)
    assert torch.equal(pos[~v], table[1].expand(int((~v).sum()), -1))
    # every row starts at position 0 after its padding, so a left-padded row equals its unpadded self
    for row, pad in enumerate(inputs.pad):
        assert torch.equal(pos[row, pad], hm.W_pos[0])
    emb = cache["embed"]
    if _decoder(model).project_in is None:
        assert torch.equal(emb, hm.W_E[inputs.input_ids])
    else:
        assert_close(emb, hm.W_E[inputs.input_ids], "hook_embed (after project_in) == W_E[ids]")
    hm.unwrap()


def test_pos_embed_with_broadcast_position_ids_is_per_row():
    """User position_ids of batch 1 are broadcast by OPT; hook_pos_embed is still [b, p, d] and editable per row."""
    config = small_config(vocab_size=50, num_hidden_layers=1, word_embed_proj_dim=8, dropout=0.0)
    model = C.make_model(config, 0)
    hm = C.wrap(model)
    ids = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(5)[None]
    with torch.no_grad():
        reference = model(ids, position_ids=position_ids).logits
        _, cache = hm.run_with_cache(ids, position_ids=position_ids, names_filter="hook_pos_embed")
        assert cache["pos_embed"].shape == (3, 5, 16)
        assert torch.equal(cache["pos_embed"][2], hm.W_pos[:5])

        def zero_row_1(t, hook):
            t = t.clone()
            t[1] = 0
            return t

        edited = hm.run_with_hooks(ids, position_ids=position_ids, fwd_hooks=[("hook_pos_embed", zero_row_1)])
    assert torch.equal(edited[[0, 2]], reference[[0, 2]])
    assert not torch.allclose(edited[1], reference[1])
    hm.unwrap()


# --- queries and scores ------------------------------------------------------------------------------


@settings(deadline=None)
@given(data=st.data())
def test_hook_q_is_unscaled_and_scores_are_scaled(data):
    model, inputs, hm = _draw(data)
    layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
    attn = _decoder(model).layers[layer].self_attn
    seen = {}
    handle = attn.q_proj.register_forward_hook(lambda m, a, o: seen.setdefault("q", o))
    pre = f"blocks.{layer}."
    with torch.no_grad():
        _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=lambda n: n.startswith(pre))
    handle.remove()
    q, k = cache["q", layer], cache["k", layer]
    assert torch.equal(q, seen["q"].unflatten(-1, (hm.cfg.n_heads, -1)))
    attn_in = cache[pre + "ln1.hook_normalized"] if model.config.do_layer_norm_before else cache["resid_pre", layer]
    v = inputs.valid
    expected_q = torch.einsum("bpm,hmd->bphd", attn_in, hm.W_Q[layer]) + hm.b_Q[layer]
    assert_close(q[v], expected_q[v], "hook_q == normalized input @ W_Q + b_Q (no scaling)")
    assert attn.scaling == hm.cfg.d_head**-0.5
    scores = cache["attn_scores", layer]
    expected = torch.einsum("bqhd,bkhd->bhqk", q * attn.scaling, k)
    finite = torch.isfinite(scores)
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    allowed = (causal[None, None] & v[:, None, None, :]).expand_as(scores)
    rows = v[:, None, :, None].expand_as(scores)  # real query tokens
    assert torch.equal(finite[rows], allowed[rows]), "masked scores are exactly the future and padding"
    assert (scores[~finite] == float("-inf")).all()
    allowed = allowed & rows
    assert_close(scores[allowed], expected[allowed], "hook_attn_scores == (q * scaling) @ k^T", atol=1e-4)
    hm.unwrap()


# --- post-LN blocks ----------------------------------------------------------------------------------


def _mlp(layer, x):
    return layer.fc2(layer.activation_fn(layer.fc1(x)))


@settings(deadline=None)
@given(data=st.data())
def test_post_ln_residual_semantics(data):
    model, inputs, hm = _draw(data, pre_ln=False)
    decoder = _decoder(model)
    assert decoder.final_layer_norm is None and not any(n.startswith("ln_final") for n in hm.hook_names)
    with torch.no_grad():
        out = model(**inputs.kwargs(), output_hidden_states=True)
        # without pattern hooks the model keeps its own attention, so everything compares bit for bit
        _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=NO_PATTERNS)
    v = inputs.valid
    assert torch.equal(cache["resid_pre", 0], cache["embed"] + cache["pos_embed"])
    for i, layer in enumerate(decoder.layers):
        mid = cache["resid_mid", i]
        assert torch.equal(mid, cache["resid_pre", i] + cache["attn_out", i])
        assert torch.equal(cache["mlp_in", i], cache[f"blocks.{i}.ln1.hook_normalized"])
        assert torch.equal(cache["mlp_in", i], layer.self_attn_layer_norm(mid))
        assert_close(cache["mlp_out", i], _mlp(layer, cache["mlp_in", i]), "mlp_out == fc2(act(fc1(mlp_in)))")
        with torch.no_grad():
            post = layer.final_layer_norm(cache["mlp_in", i] + cache["mlp_out", i])
        assert torch.equal(cache["resid_post", i], post)
        assert torch.equal(cache["resid_post", i], cache[f"blocks.{i}.ln2.hook_normalized"])
        if i + 1 < hm.cfg.n_layers:
            assert torch.equal(cache["resid_post", i], out.hidden_states[i + 1])
    last = cache["resid_post", hm.cfg.n_layers - 1]
    with torch.no_grad():
        projected = decoder.project_out(last) if decoder.project_out is not None else last
    assert torch.equal(projected, out.hidden_states[-1])
    assert_close((last @ hm.W_U + hm.b_U)[v], out.logits[v], "logits == resid_post[-1] @ W_U (project_out in W_U)")
    hm.unwrap()


@settings(deadline=None)
@given(data=st.data())
def test_post_ln_edits_propagate_exactly(data):
    model, inputs, hm = _draw(data, pre_ln=False)
    layer_idx, layer, pre = _draw_layer(data, model, hm)
    watch = [pre + n for n in ("hook_resid_mid", "hook_mlp_in", "hook_mlp_out", "hook_resid_post")]
    delta = torch.randn(inputs.input_ids.shape + (hm.cfg.d_model,), generator=torch.Generator().manual_seed(3))

    def add(t, hook):
        return t + delta

    with torch.no_grad():
        _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
        # resid_mid: both the MLP input and the residual follow (through self_attn_layer_norm)
        with hm.hooks([(pre + "hook_resid_mid", add)]):
            _, ed = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
        h = layer.self_attn_layer_norm(base["resid_mid", layer_idx] + delta)
        assert_close(ed["mlp_in", layer_idx], h, "resid_mid edit reaches the MLP input")
        assert_close(
            ed["resid_post", layer_idx],
            layer.final_layer_norm(h + _mlp(layer, h)),
            "resid_mid edit reaches the residual",
        )
        # mlp_in: only the MLP branch
        with hm.hooks([(pre + "hook_mlp_in", add)]):
            _, ed = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
        h = base["mlp_in", layer_idx]
        assert_close(ed["mlp_out", layer_idx], _mlp(layer, h + delta), "mlp_in edit feeds fc1")
        assert_close(
            ed["resid_post", layer_idx],
            layer.final_layer_norm(h + _mlp(layer, h + delta)),
            "mlp_in edit changes only the MLP branch",
        )
        # resid_post: the next block's input, and the logits of the last block
        last = layer_idx + 1 == hm.cfg.n_layers
        with hm.hooks([(pre + "hook_resid_post", add)]):
            logits, ed = hm.run_with_cache(
                **inputs.kwargs(),
                names_filter=[pre + "hook_resid_post"] + ([] if last else [f"blocks.{layer_idx + 1}.hook_resid_pre"]),
            )
        edited_post = base["resid_post", layer_idx] + delta
        if not last:
            assert torch.equal(ed["resid_pre", layer_idx + 1], edited_post)
        else:
            assert_close(logits, edited_post @ hm.W_U, "last resid_post edit reaches the logits")
    hm.unwrap()


@settings(deadline=None)
@given(data=st.data())
def test_pre_ln_flattened_mlp_points_are_per_token(data):
    """OPT flattens tokens to [b*p, d] around the MLP; the hook points are [b, p, ...] and edits land per token."""
    model, inputs, hm = _draw(data, pre_ln=True)
    layer_idx, layer, pre = _draw_layer(data, model, hm)
    b, p = inputs.input_ids.shape
    watch = [
        pre + n
        for n in (
            "hook_resid_mid",
            "hook_mlp_in",
            "ln2.hook_scale",
            "ln2.hook_normalized",
            "mlp.hook_pre",
            "mlp.hook_post",
            "hook_mlp_out",
            "hook_resid_post",
        )
    ]
    with torch.no_grad():
        _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
        for name in watch:
            assert base[name].shape[:2] == (b, p), name

        # zero the MLP output of the last token of row 0 only
        def zero_last(t, hook):
            t = t.clone()
            t[0, -1] = 0
            return t

        with hm.hooks([(pre + "hook_mlp_out", zero_last)]):
            _, ed = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
    expected = base["resid_post", layer_idx].clone()
    expected[0, -1] = base["resid_mid", layer_idx][0, -1]
    assert torch.equal(ed["resid_post", layer_idx], expected)
    assert_close(base[pre + "ln2.hook_normalized"], layer.final_layer_norm(base["resid_mid", layer_idx]), "ln2 output")
    hm.unwrap()


# --- projections, weights --------------------------------------------------------------------------


@settings(deadline=None)
@given(data=st.data())
def test_projection_weights(data):
    model, inputs, hm = _draw(data, project=True)
    decoder = _decoder(model)
    assert decoder.project_in is not None and decoder.project_out is not None
    assert hm.cfg.d_model == model.config.hidden_size
    assert hm.cfg.extra["word_embed_proj_dim"] == model.config.word_embed_proj_dim
    assert_close(hm.W_E, decoder.embed_tokens.weight @ decoder.project_in.weight.T, "W_E includes project_in")
    assert_close(hm.W_U, decoder.project_out.weight.T @ model.lm_head.weight.T, "W_U includes project_out")
    assert hm.W_E.shape == (hm.cfg.d_vocab, hm.cfg.d_model) and hm.W_U.shape == (hm.cfg.d_model, hm.cfg.d_vocab)
    with torch.no_grad():
        out = model(**inputs.kwargs(), output_hidden_states=True)
        _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=NO_PATTERNS)
        final = (
            cache["ln_final.hook_normalized"]
            if "ln_final.hook_normalized" in cache
            else cache["resid_post", hm.cfg.n_layers - 1]
        )
        assert torch.equal(decoder.project_out(final), out.hidden_states[-1])
    v = inputs.valid
    assert_close((final @ hm.W_U + hm.b_U)[v], out.logits[v], "logits == final @ (project_out @ lm_head)")
    assert_close(cache["embed"], hm.W_E[inputs.input_ids], "hook_embed == W_E[ids]")
    if not model.config.enable_bias:
        for name in ("b_Q", "b_K", "b_V", "b_O", "b_in", "b_out"):
            assert not getattr(hm, name).any(), name
    hm.unwrap()


def test_opt_model_without_final_norm_or_head():
    """OPTModel (no lm_head) and _remove_final_layer_norm=True (no decoder.final_layer_norm) wrap cleanly."""
    from transformers import OPTModel

    config = small_config(dropout=0.0, _remove_final_layer_norm=True)
    torch.manual_seed(0)
    model = OPTModel(config).eval()
    hm = C.wrap(model)
    assert not any(n.startswith("ln_final") for n in hm.hook_names)
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).last_hidden_state
        assert torch.equal(hm(ids).last_hidden_state, reference)
        _, cache = hm.run_with_cache(ids)
    assert_close(cache["resid_post", 1], reference, "resid_post[-1] == last hidden state (no final norm)")
    with pytest.raises(AttributeError, match="lm_head"):
        _ = hm.W_U
    hm.unwrap()


# --- generation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("pre_ln,project", [(None, None), (False, True)], ids=["drawn", "opt-350m"])
@settings(deadline=None, max_examples=4)
@given(data=st.data())
def test_generation_with_cache_and_edits_matches_full_forward(pre_ln, project, data):
    """Left-padded greedy generation with the KV cache and edits == a cache-free forward with the same edits
    (any drawn shape, and OPT-350m's post-LN with project_in/project_out on every run)."""
    model, inputs, hm = _draw(data, pre_ln=pre_ln, project=project, max_batch=3, max_len=6)
    layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
    head = data.draw(st.integers(0, hm.cfg.n_heads - 1), label="head")
    positions: list[torch.Tensor] = []

    def double_k(t, hook):
        return t * 2  # edits the keys stored in the KV cache

    def ablate(z, hook):
        z = z.clone()
        z[:, :, head] = 0
        return z

    def record_pos(t, hook):
        positions.append(t)

    hooks = [
        (f"blocks.{layer}.attn.hook_k", double_k),
        (f"blocks.{layer}.attn.hook_z", ablate),
        ("hook_pos_embed", record_pos),
    ]
    n_new = 3
    with torch.no_grad(), hm.hooks(hooks):
        gen = hm.generate(**inputs.kwargs(), **greedy_kwargs(n_new, pad_token_id=1))
    seq = gen.sequences
    length = inputs.input_ids.shape[1]
    mask = torch.cat([inputs.attention_mask, torch.ones(seq.shape[0], seq.shape[1] - length, dtype=torch.long)], 1)
    # positions at the decode steps continue each row's own count (left padding shifts them)
    expected_pos = mask.cumsum(1) - 1
    for step, pos in enumerate(positions[1:], start=1):
        assert torch.equal(pos[:, 0], hm.W_pos[expected_pos[:, length + step - 1]])
    with torch.no_grad():
        full = hm.run_with_hooks(seq, attention_mask=mask, fwd_hooks=hooks[:2])
    for step in range(n_new):
        assert_close(
            gen.logits[step], full[:, length - 1 + step], f"step {step}: cached generation with edits", atol=1e-3
        )
    hm.unwrap()


# --- validation, demo config, packaging -----------------------------------------------------------------


def test_mixed_layer_norm_placement_is_refused():
    config = small_config()
    model = C.make_model(config, 0)
    model.model.decoder.layers[1].do_layer_norm_before = False
    with pytest.raises(UnsupportedModelError, match="mix pre-LN and post-LN"):
        C.wrap(model)


def test_layerdrop_warns():
    config = small_config(layerdrop=0.1)
    model = C.make_model(config, 0)
    with pytest.warns(UserWarning, match="layerdrop"):
        hm = C.wrap(model)
    hm.unwrap()


def test_tiny_config_builds_and_wraps():
    config = lensadapters_opt.lensadapters_tiny_config(lensadapters_opt.ARCH, 0)
    model = C.make_model(config, 0)
    hm = C.wrap(model)
    assert hm.cfg.n_layers == config.num_hidden_layers and hm.cfg.d_model == config.hidden_size
    assert hm.cfg.d_model <= 64 and hm.cfg.d_vocab <= 512
    hm.unwrap()


def test_entry_point():
    assert_entry_point("opt", lensadapters_opt, skip_uninstalled=True)
