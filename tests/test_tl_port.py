"""TransformerLens code ported by changing the model-construction line (issue #35), lensadapters' side (any
environment): TransformerLens' call semantics for a model built with ``HookedModel.from_pretrained``,
``ActivationCache(cache_dict, model)``, 1-D tokens, TransformerLens-named weights and components, ``loss_fn``,
construction keywords, model aliases.

``test_tl_port_analysis.py``: ``generate``, the ``utils`` helpers, and analysis code written in TransformerLens'
idiom (one function, unchanged) run on a lensadapters model and on TransformerLens 2.18's ``HookedTransformer`` with
the same tiny weights (no weight processing), every value compared.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

from lensadapters import ActivationCache, HookedModel
from lensadapters.api.tl_api import ProcessingWarning
from lensadapters.api.tl_models import resolve_model_name
from lensadapters.errors import LensAdaptersError, WeightUnavailableError
from lensadapters.testing import attention_layers
from lensadapters.testing.tiny_models import ARCH_NAMES, tiny
from lensadapters.testing.tl_port import (
    TOKENS,
    port_tokenizer,
    ported,
    tiny_model,
)
from lensadapters.wiring import non_attention_blocks

# --- call semantics -----------------------------------------------------------------------------------------


def test_from_pretrained_follows_transformer_lens_call_semantics_and_wrap_keeps_hugging_face(tmp_path) -> None:
    model = tiny_model()
    model.save_pretrained(tmp_path)
    port_tokenizer().save_pretrained(tmp_path)
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
                if hm.hook_names[-1] == "ln_final.hook_normalized":  # no prediction head between the two
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
    port_tokenizer().save_pretrained(tmp_path)
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
