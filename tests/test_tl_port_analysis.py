"""TransformerLens code ported by changing the model-construction line (issue #35): ``generate`` and the ``utils``
helpers on lensadapters' side, then analysis code written in TransformerLens' idiom
(``lensadapters.testing.tl_port.analysis``) run on a lensadapters model and on TransformerLens 2.18's
``HookedTransformer`` with the same tiny weights, every value compared; TransformerLens' parameter names, hook
lifetimes, ``set_use_*`` switches and model aliases. Skipped where TransformerLens is not installed."""

from __future__ import annotations

import contextlib
import inspect
import io
from typing import Any

import pytest
import torch

from lensadapters import ActivationCache, HookedModel
from lensadapters import utils as la_utils
from lensadapters.api.tl_models import MODEL_ALIASES
from lensadapters.testing.tl_port import (
    TOKENS,
    TOL,
    analysis,
    compare,
    needs_tl,
    port_tokenizer,
    ported,
    tiny_model,
)
from lensadapters.testing.tl_reference import hooked_transformer

# --- generate -----------------------------------------------------------------------------------------------


def test_generate_has_transformer_lens_signature_and_runs_hooks() -> None:
    with ported() as hm:
        prompt = "w5 w6 w7"
        text = hm.generate(prompt, max_new_tokens=4, do_sample=False, verbose=False, stop_at_eos=False)
        assert isinstance(text, str) and text.startswith(prompt) and len(text.split()) == 7
        tokens = hm.to_tokens(prompt)
        out = hm.generate(tokens, max_new_tokens=4, do_sample=False, stop_at_eos=False)
        assert torch.equal(out[:, : tokens.shape[1]], tokens) and out.shape == (1, tokens.shape[1] + 4)
        no_cache = hm.generate(tokens, max_new_tokens=4, do_sample=False, stop_at_eos=False, use_past_kv_cache=False)
        assert torch.equal(out, no_cache)
        with torch.no_grad():  # greedy: each new token is the argmax of the full forward
            for i in range(4):
                assert out[0, tokens.shape[1] + i] == hm(out[:, : tokens.shape[1] + i])[0, -1].argmax()
        hf = hm.hf_model.generate(tokens, max_new_tokens=4, do_sample=False, pad_token_id=2)
        assert torch.equal(hf, out)  # Hugging Face's generate stays on hm.hf_model

        def force(logits: torch.Tensor, hook: Any) -> None:  # hooks run at every step
            resid = logits
            resid[:, -1] += 100 * hm.W_U[:, 9]

        with hm.hooks([("ln_final.hook_normalized", force)]):
            steered = hm.generate(tokens, max_new_tokens=3, do_sample=False, stop_at_eos=False)
        assert steered[0, -3:].tolist() == [9, 9, 9]
        both = hm.generate(["w5 w6", "w7"], max_new_tokens=2, do_sample=False, stop_at_eos=False)
        assert isinstance(both, list) and len(both) == 2
        torch.manual_seed(0)
        sampled = hm.generate(tokens, max_new_tokens=3, top_k=1, stop_at_eos=False)
        assert torch.equal(sampled, out[:, :-1])  # top_k=1 sampling is greedy
        with pytest.raises(ValueError, match="return_type must be one of"):
            hm.generate(tokens, return_type="logits")
    hm2 = HookedModel.wrap(tiny_model())  # Hugging Face semantics: Hugging Face's generate
    try:
        assert hm2.generate(TOKENS, max_new_tokens=2, do_sample=False, pad_token_id=2).shape == (1, 10)
    finally:
        hm2.unwrap()


def test_generate_hands_the_cache_back_under_the_name_the_forward_takes() -> None:
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name works, deprecated, until
    5.40): each decoding step after the first gets the previous step's cache under the forward's own name."""
    with ported("llama") as hm:
        parameters = inspect.signature(type(hm.hf_model).forward).parameters
        passed: list[dict[str, Any]] = []
        handle = hm.hf_model.register_forward_pre_hook(lambda m, a, kw: passed.append(dict(kw)), with_kwargs=True)
        try:
            out = hm.generate(TOKENS, max_new_tokens=3, do_sample=False, stop_at_eos=False, use_past_kv_cache=True)
        finally:
            handle.remove()
        names = [[k for k, v in kw.items() if k in ("cache", "past_key_values") and v is not None] for kw in passed]
        assert names[0] == [] and all(len(n) == 1 and n[0] in parameters for n in names[1:]), names
        assert [kw["input_ids"].shape[1] for kw in passed] == [TOKENS.shape[1], 1, 1]
        assert torch.equal(out, hm.generate(TOKENS, max_new_tokens=3, do_sample=False, use_past_kv_cache=False))


# --- utils --------------------------------------------------------------------------------------------------


def test_utils_helpers() -> None:
    assert isinstance(la_utils.get_device(), torch.device)
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert la_utils.sample_logits(logits, temperature=0.0).tolist() == [1, 0]
    assert la_utils.sample_logits(logits, top_k=1).tolist() == [1, 0]
    assert la_utils.sample_logits(logits, top_p=0.01).tolist() == [1, 0]
    tokens = torch.tensor([[1, 1, 1]])
    assert la_utils.sample_logits(torch.tensor([[0.0, 1.0, 0.5]]), top_k=1, freq_penalty=10.0, tokens=tokens) == 2
    x = torch.arange(6.0).reshape(1, 2, 3)
    assert la_utils.repeat_along_head_dimension(x, 4).shape == (1, 2, 4, 3)
    assert torch.equal(la_utils.get_cumsum_along_dim(x, -1, reverse=True)[0, 0], torch.tensor([3.0, 3.0, 2.0]))
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert la_utils.get_offset_position_ids(1, mask).tolist() == [[0, 0, 1], [1, 2, 3]]
    assert la_utils.override_or_use_default_value(3, None) == 3 and la_utils.override_or_use_default_value(3, 4) == 4
    obj = type("O", (), {})()
    la_utils.set_nested_attr(obj, "a", type("P", (), {})())
    la_utils.set_nested_attr(obj, "a.b", 7)
    assert la_utils.get_nested_attr(obj, "a.b") == 7
    with ported() as hm:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            la_utils.test_prompt("w5 w6 w7", "w8", hm, top_k=2)
        lines = out.getvalue().splitlines()
        assert lines[0] == "Tokenized prompt: ['<s>', 'w5', 'w6', 'w7']" and lines[1] == "Tokenized answer: ['w8']"
        assert lines[2] == "Performance on answer token:" and lines[-1].startswith("Ranks of the answer tokens: [(")


@needs_tl
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_transformer_lens_idiom_analysis_gives_transformer_lens_values(model_type: str) -> None:
    import transformer_lens.utils as tl_utils
    from transformer_lens import ActivationCache as TLActivationCache
    from transformer_lens.head_detector import detect_head as tl_detect_head

    from lensadapters.head_detector import detect_head as la_detect_head

    with ported(model_type) as hm:
        tl = hooked_transformer(hm.hf_model, tokenizer=port_tokenizer())
        ours = analysis(hm, la_utils, ActivationCache, la_detect_head)
        theirs = analysis(tl, tl_utils, TLActivationCache, tl_detect_head)
    compare(ours, theirs)


@needs_tl
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_tl_named_parameters_match_transformer_lens_state_dict(model_type: str) -> None:
    with ported(model_type) as hm:
        tl = hooked_transformer(hm.hf_model, tokenizer=port_tokenizer())
        ours = hm.tl_state_dict()
        theirs = {k: v for k, v in tl.state_dict().items() if not k.endswith(("mask", "IGNORE", "sin", "cos"))}
        assert ours.keys() == theirs.keys()
        compare(ours, theirs)
        assert [n for n, _ in hm.tl_named_parameters()] == [n for n, _ in tl.named_parameters()]


@needs_tl
def test_add_hook_lifetime_matches_transformer_lens() -> None:
    with ported() as hm:
        tl = hooked_transformer(hm.hf_model, tokenizer=port_tokenizer())
        logs: dict[str, list[str]] = {}
        for name, model in (("ours", hm), ("theirs", tl)):
            calls = logs[name] = []
            model.add_hook("blocks.0.hook_resid_post", lambda x, hook, c=calls: c.append("added"))
            model.add_hook("blocks.0.hook_resid_pre", lambda x, hook, c=calls: c.append("perma"), is_permanent=True)
            with torch.no_grad():
                model.run_with_cache(TOKENS)
                model.run_with_hooks(TOKENS, fwd_hooks=[("hook_embed", lambda x, hook, c=calls: c.append("temp"))])
                model(TOKENS)
                model.reset_hooks()
                model(TOKENS)
        assert logs["ours"] == logs["theirs"]


@needs_tl
def test_set_use_switches_add_their_points_to_the_default_cache_as_transformer_lens() -> None:
    # Attribution_Patching_Demo: set_use_attn_result(True), then run_with_cache() holds hook_result there
    with ported() as hm:
        tl = hooked_transformer(hm.hf_model, tokenizer=port_tokenizer())
        for switch in ("set_use_attn_result", "set_use_split_qkv_input", "set_use_attn_in"):
            for model in (hm, tl):
                getattr(model, switch)(True)
            with torch.no_grad():
                _, ours = hm.run_with_cache(TOKENS)
                _, theirs = tl.run_with_cache(TOKENS)
            # hook_mlp_in: always in the default cache here (TransformerLens: after set_use_hook_mlp_in)
            assert {n for n in ours.keys() if not n.endswith("hook_mlp_in")} == set(theirs.keys()), switch
            for name in theirs.keys():
                if not name.endswith(("ln1.hook_scale", "ln1.hook_normalized")):  # per head there (split inputs)
                    torch.testing.assert_close(ours[name], theirs[name], atol=TOL, rtol=TOL, msg=name)
            for model in (hm, tl):
                getattr(model, switch)(False)
        with torch.no_grad():
            _, ours = hm.run_with_cache(TOKENS)
        assert not any(n.endswith(("hook_result", "_input", "hook_attn_in")) for n in ours.keys())


@needs_tl
def test_alias_table_matches_transformer_lens() -> None:
    from transformer_lens import loading_from_pretrained as loading

    theirs = {alias: name for alias, name in loading.make_model_alias_map().items() if alias != name.lower()}
    assert MODEL_ALIASES == theirs
