"""TransformerLens code ported by changing the model-construction line (issue #35).

The first part checks lensadapters' side (any environment): TransformerLens' call semantics for a model built
with ``HookedModel.from_pretrained``, ``ActivationCache(cache_dict, model)``, 1-D tokens, TransformerLens-named
weights and components, ``loss_fn``, ``generate``, construction keywords, model aliases, the ``utils`` helpers.

The second part runs analysis code written in TransformerLens' idiom (one function, unchanged) on a lensadapters
model and on TransformerLens 2.18's ``HookedTransformer`` with the same tiny weights (no weight processing) and
compares every value: IOI-style logit differences, direct logit attribution, activation patching, attribution
patching, head detection, generation with hooks, the ``utils`` helpers. Skipped where TransformerLens is not
installed (CI's transformers-4.57 environment has it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import re
import warnings
from typing import Any, Iterator

import pytest
import torch

from lensadapters import ActivationCache, HookedModel
from lensadapters import utils as la_utils
from lensadapters.api.tl_api import ProcessingWarning
from lensadapters.api.tl_models import MODEL_ALIASES, resolve_model_name
from lensadapters.demo import reinit
from lensadapters.errors import LensAdaptersError, WeightUnavailableError
from lensadapters.testing import attention_layers
from lensadapters.testing.tiny_models import ARCH_NAMES, tiny
from lensadapters.testing.tl_reference import hooked_transformer, transformer_lens_available, word_tokenizer
from lensadapters.wiring import non_attention_blocks

VOCAB = 32
TOL = 1e-4
needs_tl = pytest.mark.skipif(
    not transformer_lens_available(),
    reason="TransformerLens 2.x is not installed (CI's transformers-4.57 environment has it)",
)


def _config(model_type: str) -> Any:
    from transformers import GPT2Config, LlamaConfig

    if model_type == "gpt2":
        return GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=VOCAB, n_positions=32)
    return LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=16,
        intermediate_size=24,
        vocab_size=VOCAB,
        max_position_embeddings=32,
    )


@functools.lru_cache(maxsize=None)
def _tokenizer() -> Any:
    return word_tokenizer(VOCAB)


def tiny_model(model_type: str = "gpt2", seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(model_type), attn_implementation="eager").eval()
    reinit(model, seed)
    return model


@contextlib.contextmanager
def ported(model_type: str = "gpt2", seed: int = 0) -> Iterator[HookedModel]:
    """The model a port builds: ``HookedModel.from_pretrained`` (here with TransformerLens' ``hf_model=``)."""
    hm = HookedModel.from_pretrained(
        model_type, hf_model=tiny_model(model_type, seed), tokenizer=_tokenizer(), device="cpu"
    )
    try:
        yield hm
    finally:
        hm.unwrap()


TOKENS = torch.tensor([[1, 5, 6, 7, 8, 9, 5, 6]])


# --- call semantics -----------------------------------------------------------------------------------------


def test_from_pretrained_follows_transformer_lens_call_semantics_and_wrap_keeps_hugging_face(tmp_path) -> None:
    model = tiny_model()
    model.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    with torch.no_grad():
        reference = model(TOKENS).logits
    hm = HookedModel.from_pretrained(str(tmp_path), local_files_only=True, attn_implementation="eager", device="cpu")
    try:
        assert hm.call_semantics == "transformer_lens"
        with torch.no_grad():
            logits = hm(TOKENS)
            assert isinstance(logits, torch.Tensor) and torch.equal(logits, reference)
            assert torch.equal(hm(TOKENS)[0, -1], reference[0, -1])
            assert torch.equal(hm.run_with_hooks(TOKENS, fwd_hooks=[]), reference)
            hm.call_semantics = "hf"  # switchable on an existing object
            assert torch.equal(hm(TOKENS).logits, reference)
            hm.call_semantics = "transformer_lens"
            assert torch.equal(hm(TOKENS), reference)
        with pytest.raises(ValueError, match="call_semantics must be one of"):
            hm.call_semantics = "tl"
        with pytest.raises(TypeError, match="not a keyword of a TransformerLens-style call"):
            hm(TOKENS, output_attentions=True)  # Hugging Face keywords: set call_semantics = "hf"
    finally:
        hm.unwrap()
    wrapped = HookedModel.wrap(tiny_model())
    try:
        assert wrapped.call_semantics == "hf"
        with torch.no_grad():
            assert torch.equal(wrapped(TOKENS).logits, reference)
            wrapped.call_semantics = "transformer_lens"
            assert torch.equal(wrapped(TOKENS), reference)
    finally:
        wrapped.unwrap()


def test_one_dimensional_tokens_get_a_batch_dimension() -> None:
    model = tiny_model()
    hm = HookedModel.wrap(model)
    try:
        with torch.no_grad():
            reference = model(TOKENS).logits
            assert torch.equal(hm(TOKENS[0]).logits, reference)
            assert torch.equal(hm(input_ids=TOKENS[0]).logits, reference)
            assert torch.equal(hm(TOKENS[0], return_type="logits"), reference)
            assert torch.equal(hm.run_with_cache(TOKENS[0])[0], reference)
    finally:
        hm.unwrap()


def test_add_hook_hooks_survive_run_with_cache_and_run_with_hooks_as_in_transformer_lens() -> None:
    """TransformerLens 2.x removes only the hooks of the call's own context at the end of ``run_with_cache`` /
    ``run_with_hooks``: a hook added with ``add_hook`` stays (see the comparison below)."""
    with ported() as hm:
        calls: list[str] = []
        hm.add_hook("blocks.0.hook_resid_post", lambda x, hook: calls.append("added"))
        hm.add_hook("blocks.0.hook_resid_pre", lambda x, hook: calls.append("perma"), is_permanent=True)
        with torch.no_grad():
            hm.run_with_cache(TOKENS)
            hm.run_with_hooks(TOKENS, fwd_hooks=[("hook_embed", lambda x, hook: calls.append("temp"))])
            hm(TOKENS)
        assert calls == ["perma", "added", "temp", "perma", "added", "perma", "added"]
        hm.reset_hooks()
        with torch.no_grad():
            hm(TOKENS)
        assert calls[-1] == "perma" and calls.count("added") == 3


def test_run_with_cache_keeps_its_hooks_with_reset_hooks_end_false() -> None:
    with ported() as hm:
        other = torch.tensor([[1, 9, 8, 7, 6, 5, 4, 3]])
        with torch.no_grad():
            _, cache = hm.run_with_cache(TOKENS, names_filter="hook_embed", reset_hooks_end=False)
            first = cache["hook_embed"].clone()
            hm(other)  # the caching hook is still attached: it records this forward
            assert not torch.equal(cache["hook_embed"], first)
            assert torch.equal(cache["hook_embed"], hm.embed(other))
            hm.reset_hooks()
            hm(TOKENS)
            assert torch.equal(cache["hook_embed"], hm.embed(other))
        assert not hm.has_hooks


# --- ActivationCache ----------------------------------------------------------------------------------------


def test_activation_cache_takes_transformer_lens_argument_order() -> None:
    with ported() as hm:
        with torch.no_grad():
            _, cache = hm.run_with_cache(TOKENS)
        ours = ActivationCache(dict(cache), hm)
        assert ours.model is hm and ours.n_layers == 2 and ours.has_batch_dim
        assert torch.equal(ours["pattern", 0], cache["pattern", 0])
        assert torch.equal(ours.accumulated_resid(), cache.accumulated_resid())
        assert ActivationCache(dict(cache), hm, False).has_batch_dim is False
        assert ActivationCache(dict(cache), 2, model=hm).model is hm  # lensadapters' own order still works
        with pytest.raises(TypeError, match="second argument must be the model"):
            ActivationCache(dict(cache), "gpt2")
        with pytest.raises(TypeError, match="second argument must be the model"):
            ActivationCache(dict(cache))
        with pytest.raises(TypeError, match="has_batch_dim must be a bool"):
            ActivationCache(dict(cache), hm, hm)


# --- weights and components ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_block_weights_and_tl_named_parameters_are_the_live_weights(model_type: str) -> None:
    with ported(model_type) as hm:
        hf_names = [n for n, _ in hm.named_parameters()]
        for layer in range(2):
            for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_O", "W_in", "W_out", "b_out"):
                assert torch.equal(getattr(hm.blocks[layer].attn if name[2] in "QKVO" else hm.blocks[layer].mlp, name),
                                   getattr(hm, name)[layer]), name  # fmt: skip
        named = dict(hm.tl_named_parameters())
        assert torch.equal(named["blocks.1.attn.W_Q"], hm.W_Q[1]) and torch.equal(named["unembed.W_U"], hm.W_U)
        assert torch.equal(named["embed.W_E"], hm.W_E) and "blocks.0.ln1.w" in named and "ln_final.w" in named
        assert torch.equal(hm.blocks[0].ln1.w, hm.norm_spec(hm.norm_module("blocks.0.ln1")).weight)
        with torch.no_grad():  # live: an in-place change of the model's parameter shows
            for p in hm.norm_module("blocks.0.ln1").parameters():
                p.add_(1.0)
        assert torch.equal(hm.tl_state_dict()["blocks.0.ln1.w"], hm.blocks[0].ln1.w)
        named["blocks.0.attn.W_Q"].sum().backward()  # gradients reach the Hugging Face parameters
        assert any(p.grad is not None for p in hm.parameters())
        assert [n for n, _ in hm.named_parameters()] == hf_names  # nothing renamed in the model
        with pytest.raises(AttributeError, match="no hook point or namespace 'W_X'"):
            _ = hm.blocks[0].attn.W_X


def test_components_compute_with_the_model_modules_and_fire_hook_points() -> None:
    with ported() as hm:
        with torch.no_grad():
            _, cache = hm.run_with_cache(TOKENS)
            assert torch.equal(hm.embed(TOKENS), cache["hook_embed"])
            assert torch.equal(hm.pos_embed(TOKENS), cache["hook_pos_embed"])
            resid = cache["blocks.1.hook_resid_post"]
            assert torch.allclose(hm.ln_final(resid), cache["ln_final.hook_normalized"])
            assert torch.allclose(hm.unembed(hm.ln_final(resid)), hm(TOKENS))
            seen: list[str] = []

            def double(x: torch.Tensor, hook: Any) -> torch.Tensor:
                seen.append(hook.name)
                return 2 * x

            with hm.hooks([("hook_embed", double), ("hook_pos_embed", double), ("ln_final.hook_scale", double)]):
                assert torch.equal(hm.embed(TOKENS), 2 * cache["hook_embed"])
                assert torch.equal(hm.pos_embed(TOKENS), 2 * cache["hook_pos_embed"])
                hm.ln_final(resid)
            assert seen == ["hook_embed", "hook_pos_embed", "ln_final.hook_scale"]
            with pytest.raises(TypeError, match="not a callable component"):
                hm.blocks[0].attn(resid)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_components_equal_the_forward_values_on_every_architecture(arch: str) -> None:
    """Scaled embeddings (Gemma), position offsets (OPT), final-logit softcaps, parallel blocks, experts."""
    hm = HookedModel.wrap(tiny(arch))
    try:
        tokens = torch.randint(3, 30, (2, 5), generator=torch.Generator().manual_seed(0))
        # the unembedding computes the logits from what the model's head gives it (the final norm's output; an
        # encoder's masked-LM head transforms the stream before its decoder), and ln_final is the final norm
        head_input: list[torch.Tensor] = []
        unembed = hm.hf_model.get_submodule(hm.layout.unembed)
        handle = unembed.register_forward_pre_hook(lambda module, args: head_input.append(args[0]))
        with torch.no_grad():
            try:
                logits, cache = hm.run_with_cache(tokens)
            finally:
                handle.remove()
            assert torch.equal(hm.embed(tokens), cache["hook_embed"])
            if "hook_pos_embed" in cache:
                assert torch.equal(hm.pos_embed(tokens), cache["hook_pos_embed"])
            assert torch.allclose(hm.unembed(head_input[0]), logits, atol=1e-5)
            if "ln_final.hook_normalized" in cache:
                last = cache.accumulated_resid()[-1]  # the last block's output
                assert torch.allclose(hm.unembed(hm.ln_final(last)), logits, atol=1e-5)
            else:  # no final norm: no ln_final component either
                with pytest.raises(AttributeError, match="ln_final"):
                    _ = hm.ln_final
        try:
            names = [n for n, _ in hm.tl_named_parameters()]
        except WeightUnavailableError as refusal:  # a plugin whose queries are not TransformerLens' W_Q says so
            with pytest.raises(WeightUnavailableError, match=re.escape(str(refusal))):
                _ = hm.W_Q
            return
        first = attention_layers(hm)[0]
        assert names[0] == "embed.W_E" and f"blocks.{first}.attn.W_Q" in names and names[-1] == "unembed.b_U"
        assert not [n for n in names for i in non_attention_blocks(hm) if n.startswith(f"blocks.{i}.attn.")]
    finally:
        hm.unwrap()


def test_loss_fn_is_the_forward_loss() -> None:
    with ported() as hm:
        with torch.no_grad():
            logits = hm(TOKENS)
            assert torch.equal(hm.loss_fn(logits, TOKENS), hm(TOKENS, return_type="loss"))
            per_token = hm.loss_fn(logits, TOKENS, per_token=True)
            assert per_token.shape == (1, TOKENS.shape[1] - 1)
            mask = torch.ones_like(TOKENS)
            mask[0, :3] = 0
            assert torch.allclose(hm.loss_fn(logits, TOKENS, mask), per_token[0, 3:].mean())


# --- construction -------------------------------------------------------------------------------------------


def test_from_pretrained_takes_transformer_lens_construction_keywords(tmp_path) -> None:
    tiny_model().save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.from_pretrained(
            str(tmp_path),
            local_files_only=True,
            device="cpu",
            dtype="float64",
            n_devices=1,
            default_prepend_bos=False,
            default_padding_side="left",
            fold_ln=True,
            center_writing_weights=True,
            center_unembed=True,
            fold_value_biases=True,
            refactor_factored_attn_matrices=False,
        )
    try:
        processing = [w for w in caught if issubclass(w.category, ProcessingWarning)]
        assert len(processing) == 1
        text = str(processing[0].message)
        assert "fold_ln=True" in text and "center_unembed=True" in text and "never processes weights" in text
        assert "refactor_factored_attn_matrices" not in text
        assert hm.dtype == torch.float64 and hm.device.type == "cpu"
        assert hm.default_prepend_bos is False and hm.default_padding_side == "left"
        assert hm.to_tokens("w5 w6").tolist() == [[5, 6]]
    finally:
        hm.unwrap()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProcessingWarning)  # the flags left at their defaults: no warning
        HookedModel.from_pretrained(str(tmp_path), local_files_only=True, device="cpu").unwrap()
    with pytest.raises(TypeError, match="checkpoint_index.*revision="):
        HookedModel.from_pretrained(str(tmp_path), checkpoint_index=3)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        HookedModel.from_pretrained(str(tmp_path), dtype="float33")


def test_transformer_lens_aliases_resolve_to_hugging_face_names(tmp_path) -> None:
    assert resolve_model_name("gpt2-small") == "gpt2"
    assert resolve_model_name("GPT2-Small") == "gpt2"
    assert resolve_model_name("pythia-70m") == "EleutherAI/pythia-70m"
    assert resolve_model_name("gpt2") == "gpt2"
    assert resolve_model_name("my-org/my-model") == "my-org/my-model"
    assert resolve_model_name(str(tmp_path)) == str(tmp_path)
    with pytest.raises(LensAdaptersError, match="'NeelNanda/SoLU_1L512W_C4_Code'.*'solu-1l'.*own weight format"):
        resolve_model_name("solu-1l")
    with pytest.raises(LensAdaptersError, match="attn-only-2l|NeelNanda/Attn_Only_2L512W_C4_Code"):
        resolve_model_name("attn-only-2l")


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


# --- the same TransformerLens-idiom analysis code on both libraries -----------------------------------------


def analysis(model: Any, utils: Any, ActivationCache: Any, detect_head: Any) -> dict[str, Any]:
    """Analysis code as written for TransformerLens 2.x (only the objects passed in differ)."""
    results: dict[str, Any] = {}
    clean = model.to_tokens(["w5 w6 w7 w8 w9 w5 w6 w7", "w10 w11 w12 w13 w14 w10 w11 w12"])
    corrupted = model.to_tokens(["w5 w6 w7 w8 w9 w5 w6 w9", "w10 w11 w12 w13 w14 w10 w11 w14"])
    answers = torch.tensor([[model.to_single_token("w8"), model.to_single_token("w9")], [13, 14]])

    def logit_diff(logits: torch.Tensor) -> torch.Tensor:
        final = logits[:, -1, :]
        return (final.gather(-1, answers[:, :1]) - final.gather(-1, answers[:, 1:])).mean()

    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
        corrupted_logits = model(corrupted)
    results["clean logit diff"] = logit_diff(clean_logits)
    results["corrupted logit diff"] = logit_diff(corrupted_logits)
    results["logits of one sequence"] = model(clean[0])
    # direct logit attribution of each head (no norm folding on either side: the raw head outputs)
    directions = model.tokens_to_residual_directions(answers[:, 0]) - model.tokens_to_residual_directions(answers[:, 1])
    per_head, labels = clean_cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    results["head labels"] = labels
    results["head DLA"] = (per_head * directions).sum(-1).mean(-1)
    accumulated = clean_cache.accumulated_resid(layer=-1, pos_slice=-1)
    results["accumulated resid"] = accumulated
    results["embed component"] = model.embed(clean)
    results["final norm"] = model.ln_final(clean_cache["resid_post", 1])
    results["unembed of final norm"] = model.unembed(clean_cache["ln_final.hook_normalized"])
    results["loss_fn"] = model.loss_fn(clean_logits, clean)
    results["W_Q of block 1"] = model.blocks[1].attn.W_Q
    results["W_out of block 0"] = model.blocks[0].mlp.W_out

    # activation patching of the residual stream, position by position
    def patch_resid(resid: torch.Tensor, hook: Any, position: int) -> torch.Tensor:
        resid[:, position] = clean_cache[hook.name][:, position]
        return resid

    patched = torch.zeros(model.cfg.n_layers, clean.shape[1])
    for layer in range(model.cfg.n_layers):
        for position in range(clean.shape[1]):
            hook_fn = functools.partial(patch_resid, position=position)
            with torch.no_grad():
                logits = model.run_with_hooks(corrupted, fwd_hooks=[(utils.get_act_name("resid_pre", layer), hook_fn)])
            patched[layer, position] = logit_diff(logits)
    results["activation patching"] = patched

    # attribution patching (forward and backward caches via add_hook)
    def resid_filter(name: str) -> bool:
        return name.endswith("resid_pre")

    def get_cache_fwd_and_bwd(tokens: torch.Tensor) -> tuple:
        model.reset_hooks()
        cache, grad_cache = {}, {}

        def forward_cache_hook(act: torch.Tensor, hook: Any) -> None:
            cache[hook.name] = act.detach()

        def backward_cache_hook(act: torch.Tensor, hook: Any) -> None:
            grad_cache[hook.name] = act.detach()

        model.add_hook(resid_filter, forward_cache_hook, "fwd")
        model.add_hook(resid_filter, backward_cache_hook, "bwd")
        value = logit_diff(model(tokens))
        value.backward()
        model.reset_hooks()
        return value.item(), ActivationCache(cache, model), ActivationCache(grad_cache, model)

    _, clean_fwd, _ = get_cache_fwd_and_bwd(clean)
    _, corrupted_fwd, corrupted_grad = get_cache_fwd_and_bwd(corrupted)
    results["attribution patching"] = torch.stack(
        [
            ((clean_fwd["resid_pre", layer] - corrupted_fwd["resid_pre", layer]) * corrupted_grad["resid_pre", layer])
            .sum(-1)
            .mean(0)
            for layer in range(model.cfg.n_layers)
        ]
    )

    # head detection
    results["previous token heads"] = detect_head(model, "w5 w6 w7 w8 w5 w6 w7 w8", "previous_token_head")
    results["induction heads"] = detect_head(model, "w5 w6 w7 w8 w5 w6 w7 w8", "induction_head")

    # generation with a hook
    def steer(resid: torch.Tensor, hook: Any) -> torch.Tensor:
        return resid + 0.5 * model.W_U[:, 7]

    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", steer)]):
        results["steered generation"] = model.generate(
            "w5 w6 w7", max_new_tokens=5, do_sample=False, stop_at_eos=False, verbose=False
        )
    results["generated tokens"] = model.generate(
        clean[:1], max_new_tokens=4, do_sample=False, stop_at_eos=False, verbose=False, use_past_kv_cache=False
    )

    # utils
    results["lm_cross_entropy_loss"] = utils.lm_cross_entropy_loss(clean_logits, clean, per_token=True)
    results["sample_logits greedy"] = utils.sample_logits(clean_logits[:, -1], temperature=0.0)
    results["get_act_name"] = [utils.get_act_name("pattern", 1), utils.get_act_name("scale", 0, "ln2")]
    results["gelu_new"] = utils.gelu_new(accumulated)
    results["solu"] = utils.solu(accumulated)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        utils.test_prompt("w5 w6 w7 w8 w9 w5 w6 w7", "w8", model, top_k=3)
        utils.test_prompt("w5 w6 w7", ["w8", "w9"], model, top_k=2)
    results["test_prompt output"] = out.getvalue()
    return results


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours.keys() == theirs.keys()
    for key, a in ours.items():
        b = theirs[key]
        if isinstance(a, torch.Tensor):
            a, b = a.detach().float(), b.detach().float()
            assert a.shape == b.shape, (key, a.shape, b.shape)
            worst = (a - b).abs().max().item() if a.numel() else 0.0
            assert torch.allclose(a, b, atol=TOL, rtol=TOL), f"{key}: max abs difference {worst:.3g}"
        else:
            assert a == b, (key, a, b)


@needs_tl
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_transformer_lens_idiom_analysis_gives_transformer_lens_values(model_type: str) -> None:
    import transformer_lens.utils as tl_utils
    from transformer_lens import ActivationCache as TLActivationCache
    from transformer_lens.head_detector import detect_head as tl_detect_head

    from lensadapters.head_detector import detect_head as la_detect_head

    with ported(model_type) as hm:
        tl = hooked_transformer(hm.hf_model, tokenizer=_tokenizer())
        ours = analysis(hm, la_utils, ActivationCache, la_detect_head)
        theirs = analysis(tl, tl_utils, TLActivationCache, tl_detect_head)
    compare(ours, theirs)


@needs_tl
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_tl_named_parameters_match_transformer_lens_state_dict(model_type: str) -> None:
    with ported(model_type) as hm:
        tl = hooked_transformer(hm.hf_model, tokenizer=_tokenizer())
        ours = hm.tl_state_dict()
        theirs = {k: v for k, v in tl.state_dict().items() if not k.endswith(("mask", "IGNORE", "sin", "cos"))}
        assert ours.keys() == theirs.keys()
        compare(ours, theirs)
        assert [n for n, _ in hm.tl_named_parameters()] == [n for n, _ in tl.named_parameters()]


@needs_tl
def test_add_hook_lifetime_matches_transformer_lens() -> None:
    with ported() as hm:
        tl = hooked_transformer(hm.hf_model, tokenizer=_tokenizer())
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
        tl = hooked_transformer(hm.hf_model, tokenizer=_tokenizer())
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
