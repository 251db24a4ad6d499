"""The analysis layer against TransformerLens 2.x on the same weights (values within 1e-4, labels identical): the
forward (return types, loss, stop/start, hook values and head-input edits) and text inputs. The cache methods and
``logit_attrs``: ``test_tl_reference_cache.py``; patching, head detection, circuits, ``get_act_name``:
``test_tl_reference_patching.py``.

Each architecture plugin installed here that TransformerLens also converts (gpt2, gpt_neox, opt, llama) gets a
tiny model drawn by hypothesis, and TransformerLens' ``HookedTransformer`` with its weights, no processing
(``lensadapters.testing.tl_reference``). Skipped where TransformerLens is not installed: CI runs these in its
transformers-4.57 environment (``scripts/setup-reference.sh``).

Deliberate differences, checked as such: ``apply_ln_to_stack`` multiplies by the norm's weight (TransformerLens
folds it into the next matrix instead), so its values are TransformerLens' times the weight and
``logit_attrs`` equals TransformerLens' on a ``fold_ln=True`` model; and the loss of right-padded text ignores
the padding (TransformerLens, computing no mask then, counts it), so the loss is compared with an explicit mask.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lensadapters.testing.tl_analysis import (
    MODEL_TYPES,
    SETTINGS,
    check,
    draw_texts,
    draw_tokens,
    each_model_type,
    la_tokens,
    left_mask,
    needs_transformer_lens,
    pair,
    tokenizer,
)
from lensadapters.testing.tl_reference import (
    hooked_transformer,
)

pytestmark = needs_transformer_lens


# --- the forward: return types, loss, stop/start -----------------------------------------------------------


@each_model_type
def test_return_types_and_loss_match(model_type: str, data: st.DataObject) -> None:
    with pair(data, model_type) as (hm, tl), torch.no_grad():
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        padded = data.draw(st.booleans(), label="left padding")
        kw = {"attention_mask": left_mask(data, tokens)} if padded else {}
        real = kw["attention_mask"].bool() if padded else torch.ones_like(tokens, dtype=torch.bool)
        logits = hm(tokens, return_type="logits", **kw)
        check(logits[real], tl(tokens, return_type="logits", **kw)[real], "logits")
        check(hm(tokens, return_type="loss", **kw), tl(tokens, return_type="loss", **kw), "loss")
        per_token = hm(tokens, return_type="loss", loss_per_token=True, **kw)
        assert per_token.shape == (tokens.shape[0], tokens.shape[1] - 1)
        check(per_token, tl(tokens, return_type="loss", loss_per_token=True, **kw), "per-token loss")
        both, tl_both = hm(tokens, return_type="both", **kw), tl(tokens, return_type="both", **kw)
        assert type(both).__name__ == "Output" and both._fields == tl_both._fields == ("logits", "loss")
        check(both.loss, tl_both.loss, "both.loss")
        assert hm(tokens, return_type=None) is None and tl(tokens, return_type=None) is None


@each_model_type
def test_stop_and_start_at_layer_match(model_type: str, data: st.DataObject) -> None:
    with pair(data, model_type, max_layers=3) as (hm, tl), torch.no_grad():
        n = hm.cfg.n_layers
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        stop = data.draw(st.integers(-n, n), label="stop_at_layer")
        check(hm(tokens, stop_at_layer=stop), tl(tokens, stop_at_layer=stop), f"stop_at_layer={stop}")
        start = data.draw(st.integers(0, n), label="start_at_layer")
        residual = torch.randn(tokens.shape + (hm.cfg.d_model,), generator=torch.Generator().manual_seed(start))
        check(hm(residual, start_at_layer=start), tl(residual, start_at_layer=start), f"start_at_layer={start}")
        check(
            hm(residual, start_at_layer=start, tokens=tokens, return_type="loss"),
            tl(residual, start_at_layer=start, tokens=tokens, return_type="loss"),
            "loss from a layer",
        )
        check(
            hm(residual, start_at_layer=start, stop_at_layer=stop),
            tl(residual, start_at_layer=start, stop_at_layer=stop),
            f"start {start} stop {stop}",
        )


@each_model_type
def test_hook_values_match_head_inputs_included(model_type: str, data: st.DataObject) -> None:
    """Every hook point both have, TransformerLens' optional ones switched on (results, mlp_in; head inputs in
    a second model: with split inputs TransformerLens normalizes each head's copy, so its ln1 points change)."""
    with pair(data, model_type, use_attn_result=True, use_hook_mlp_in=True) as (hm, tl):
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        with torch.no_grad():
            _, ours = hm.run_with_cache(tokens, names_filter=lambda n: True)
            _, theirs = tl.run_with_cache(tokens)
            common = [name for name in ours if name in theirs.cache_dict]
            for name in (
                "blocks.0.attn.hook_result",
                "blocks.0.hook_mlp_in",
                "blocks.0.hook_resid_pre",
                "blocks.0.ln1.hook_scale",
                "blocks.0.attn.hook_pattern",
                "ln_final.hook_normalized",
            ):
                assert name in common, name
            for name in common:
                check(ours[name], theirs[name], name)
            split = hooked_transformer(hm.hf_model, use_split_qkv_input=True)
            _, theirs = split.run_with_cache(tokens)
            names = [f"blocks.{i}.hook_{x}_input" for i in range(hm.cfg.n_layers) for x in "qkv"]
            if "blocks.0.hook_attn_in" in hm.hook_names:
                _, attn_in = hooked_transformer(hm.hf_model, use_attn_in=True).run_with_cache(tokens)
                theirs.cache_dict.update({k: v for k, v in attn_in.cache_dict.items() if k.endswith("attn_in")})
                names += [f"blocks.{i}.hook_attn_in" for i in range(hm.cfg.n_layers)]
            for name in names:
                check(ours[name], theirs[name], name)


@each_model_type
def test_head_input_edits_match(model_type: str, data: st.DataObject) -> None:
    """Editing one head's copy of the attention input changes the logits exactly as in TransformerLens."""
    point = data.draw(st.sampled_from(["q_input", "k_input", "v_input", "attn_in"]), label="point")
    fields = {"use_attn_in": True} if point == "attn_in" else {"use_split_qkv_input": True}
    with pair(data, model_type, **fields) as (hm, tl):
        if f"blocks.0.hook_{point}" not in hm.hook_names:
            assert point == "attn_in" and hm.cfg.n_key_value_heads != hm.cfg.n_heads
            return
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        g = torch.Generator().manual_seed(layer)

        def edit(x: torch.Tensor, hook: Any) -> torch.Tensor:
            head = x.shape[2] - 1
            x = x.clone()
            x[:, :, head] = x[:, :, head] * 1.5 + torch.randn(x.shape[-1], generator=g)
            return x

        name = f"blocks.{layer}.hook_{point}"
        with torch.no_grad():
            g.manual_seed(layer)
            ours = hm.run_with_hooks(tokens, fwd_hooks=[(name, edit)], return_type="logits")
            g.manual_seed(layer)
            theirs = tl.run_with_hooks(tokens, fwd_hooks=[(name, edit)])
            assert (ours - hm(tokens, return_type="logits")).abs().max() > 1e-4
        check(ours, theirs, f"logits after editing {name}")


# --- text -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adds_bos", [False, True], ids=["gpt2-style tokenizer", "llama-style tokenizer"])
@SETTINGS
@given(data=st.data())
def test_tokenizer_methods_match(adds_bos: bool, data: st.DataObject) -> None:
    model_type = data.draw(st.sampled_from(MODEL_TYPES), label="model type")
    vocab = 40
    tok = tokenizer(vocab, adds_bos)
    with pair(data, model_type, tokenizer=tok) as (hm, tl):
        if hm.cfg.d_vocab < vocab:
            return
        texts = draw_texts(data, vocab)
        prepend_bos = data.draw(st.sampled_from([None, True, False]), label="prepend_bos")
        padding_side = data.draw(st.sampled_from([None, "left", "right"]), label="padding_side")
        kw = dict(prepend_bos=prepend_bos, padding_side=padding_side)
        tokens = hm.to_tokens(texts, **kw)
        assert torch.equal(tokens, tl.to_tokens(texts, **kw))
        assert torch.equal(hm.to_tokens(texts[0], **kw), tl.to_tokens(texts[0], **kw))
        assert hm.to_str_tokens(texts, **kw) == tl.to_str_tokens(texts, **kw)
        assert hm.to_str_tokens(texts[0], **kw) == tl.to_str_tokens(texts[0], **kw)
        assert hm.to_str_tokens(tokens[0]) == tl.to_str_tokens(tokens[0])
        assert hm.to_string(tokens) == tl.to_string(tokens)
        assert hm.to_string(tokens[0]) == tl.to_string(tokens[0])
        word = texts[0].split()[-1]
        assert hm.to_single_token(word) == tl.to_single_token(word)
        assert hm.to_single_str_token(5) == tl.to_single_str_token(5)
        for mode in ("first", "last"):
            assert hm.get_token_position(word, texts[0], mode=mode, **kw) == tl.get_token_position(
                word, texts[0], mode=mode, **kw
            )


@each_model_type
def test_text_inputs_match(model_type: str, data: st.DataObject) -> None:
    """Text through the forward: left-padded batches (TransformerLens derives positions from the mask, as
    lensadapters does for every architecture), losses, caches."""
    vocab = 40
    tok = tokenizer(vocab, data.draw(st.booleans(), label="tokenizer adds BOS"))
    with pair(data, model_type, tokenizer=tok) as (hm, tl), torch.no_grad():
        if hm.cfg.d_vocab < vocab:
            return
        texts = draw_texts(data, vocab)
        side = data.draw(st.sampled_from(["left", "right"]), label="padding_side")
        _, mask = la_tokens(hm, texts, side)
        real = mask.bool()
        ours, theirs = hm(texts, padding_side=side), tl(texts, padding_side=side)
        check(ours[real], theirs[real], f"logits of {side}-padded text")
        for i, text in enumerate(texts):  # each padded row gives its unpadded values
            check(ours[i][real[i]], hm(text)[0], f"row {i} padded vs alone")
        tokens = hm.to_tokens(texts, padding_side=side)
        check(
            hm(texts, padding_side=side, return_type="loss"),
            tl(tokens, return_type="loss", attention_mask=mask),
            "loss of padded text",
        )
        _, cache = hm.run_with_cache(texts, padding_side=side)
        _, tl_cache = tl.run_with_cache(texts, padding_side=side)
        check(cache["resid_post", -1][real], tl_cache["resid_post", -1][real], "cached resid_post")
