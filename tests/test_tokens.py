"""Tokenizer methods: BOS handling for tokenizers that add it and those that do not, padding sides, the user's
tokenizer never changed, ``HookedModel.from_pretrained`` from a local folder."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensadapters import HookedModel
from lensadapters.testing.tiny_models import first_causal, tiny, tokenizer

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 40
BOS, EOS = 1, 2


def words(draw: st.DrawFn, n: int) -> str:
    return " ".join(f"w{i}" for i in draw(st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n)))


@st.composite
def texts(draw: st.DrawFn) -> list[str]:
    return [words(draw, draw(st.integers(1, 5))) for _ in range(draw(st.integers(1, 3)))]


@pytest.fixture
def hm():
    model = tiny(first_causal())
    wrapped = HookedModel.wrap(model)
    yield wrapped
    wrapped.unwrap()


@pytest.mark.parametrize("adds_bos", [False, True])
@SETTINGS
@given(batch=texts(), prepend_bos=st.sampled_from([None, True, False]), side=st.sampled_from([None, "left", "right"]))
def test_one_bos_when_asked_none_otherwise_padding_on_the_asked_side(adds_bos, batch, prepend_bos, side) -> None:
    tok = tokenizer(VOCAB, adds_bos)
    model = tiny(first_causal())
    hm = HookedModel.wrap(model, tokenizer=tok)
    try:
        tokens = hm.to_tokens(batch, prepend_bos=prepend_bos, padding_side=side)
        bos = prepend_bos is not False  # the default is True, as in TransformerLens
        for row, text in enumerate(batch):
            ids = [int(w[1:]) for w in text.split()]
            expected = ([BOS] if bos else []) + ids
            got = tokens[row].tolist()
            pad = len(got) - len(expected)
            assert got == ([EOS] * pad + expected if side == "left" else expected + [EOS] * pad)
        assert hm.to_str_tokens(batch[0], prepend_bos=prepend_bos) == (["<s>"] if bos else []) + batch[0].split()
        assert hm.to_string(hm.to_tokens(batch[0], prepend_bos=False)[0]) == batch[0]
        assert tok.padding_side == "right" and tok.pad_token == "</s>"  # the user's tokenizer is as it was
    finally:
        hm.unwrap()


def test_single_tokens_and_positions(hm) -> None:
    hm.tokenizer = tokenizer(VOCAB)
    assert hm.to_single_token("w7") == 7
    with pytest.raises(ValueError, match="not a single token"):
        hm.to_single_token("w7 w8")
    assert hm.to_single_str_token(9) == "w9"
    assert hm.get_token_position("w7", "w5 w7 w9 w7") == 2  # BOS first
    assert hm.get_token_position("w7", "w5 w7 w9 w7", mode="last") == 4
    assert hm.get_token_position(7, torch.tensor([5, 7, 7])) == 1
    with pytest.raises(ValueError, match="does not occur"):
        hm.get_token_position("w8", "w5 w7")
    assert hm.to_str_tokens(torch.tensor([[3, 4]])) == ["w3", "w4"]
    assert hm.to_str_tokens([torch.tensor([3]), "w4"]) == [["w3"], ["<s>", "w4"]]


def test_a_tokenizer_without_pad_token_pads_with_eos_and_is_left_unchanged(hm) -> None:
    tok = tokenizer(VOCAB)
    hm.tokenizer = tok
    tok.pad_token = None
    try:
        tokens = hm.to_tokens(["w5", "w6 w7 w8"])
        assert tokens[0].tolist() == [BOS, 5, EOS, EOS]
        assert tok.pad_token is None
    finally:
        tok.pad_token = "</s>"


def test_hooked_model_defaults_follow_transformer_lens(hm) -> None:
    hm.tokenizer = tokenizer(VOCAB)
    assert hm.default_prepend_bos is True and hm.default_padding_side == "right"
    hm.default_prepend_bos, hm.default_padding_side = False, "left"
    assert hm.to_tokens(["w5", "w6 w7"]).tolist() == [[EOS, 5], [6, 7]]


def test_wrap_takes_a_tokenizer_even_when_already_wrapped() -> None:
    model = tiny(first_causal())
    hm = HookedModel.wrap(model)
    tok = tokenizer(VOCAB)
    assert HookedModel.wrap(model, tokenizer=tok) is hm and hm.tokenizer is tok
    hm.unwrap()


def test_from_pretrained_loads_model_and_tokenizer_from_a_folder(tmp_path) -> None:
    model = tiny(first_causal())
    model.save_pretrained(tmp_path)
    tokenizer(VOCAB).save_pretrained(tmp_path)
    hm = HookedModel.from_pretrained(
        str(tmp_path), local_files_only=True, attn_implementation=model.config._attn_implementation, device="cpu"
    )
    try:
        assert hm.tokenizer is not None and hm.to_single_token("w5") == 5
        ids = hm.to_tokens("w5 w6 w7")
        loaded = hm.hf_model.state_dict()
        assert loaded.keys() == model.state_dict().keys()
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())  # the saved weights, exactly
        with torch.no_grad():
            # TransformerLens' call semantics: the logits, those of the loaded model's own forward (bitwise; the
            # saved model's may differ in the last bit where a reload lays a tensor out anew: DeepSeek-V3 on 4.57)
            own = hm.hf_model(ids).logits
            assert torch.equal(hm(ids), own) and torch.equal(hm("w5 w6 w7"), own)
            torch.testing.assert_close(own, model(ids).logits, rtol=1e-5, atol=1e-5)
    finally:
        hm.unwrap()


def test_from_pretrained_without_a_saved_tokenizer_warns(tmp_path) -> None:
    tiny(first_causal()).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="no tokenizer"):
        hm = HookedModel.from_pretrained(str(tmp_path), local_files_only=True)
    assert hm.tokenizer is None
    hm.unwrap()
