"""Tools that take a Hugging Face model run on ``hm.hf_model``, and lensadapters hooks compose with them; circuitsvis
renders what a HookedModel caches.

nnterp (on nnsight) and tuned-lens are given the wrapped model itself (``hm.hf_model``: the user's unmodified model,
not a copy). Each test is skipped where its tool is not installed; they pin ``nnsight<0.7`` and transformers 4.57, so
they run in their own environment (README, "Tools that run on lensadapters", gives the recipe:
``scripts/test-clients.sh``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters import HookedModel


def _llama() -> tuple[Any, Any]:
    from transformers import LlamaForCausalLM

    from lensadapters.testing.tiny_models import CLIENT_LLAMA, gqa_llama
    from lensadapters.testing.tl_reference import word_tokenizer

    torch.manual_seed(0)  # transformers' own initialization (small weights: the 1e-6 comparisons below are absolute)
    model = LlamaForCausalLM(gqa_llama(**{**CLIENT_LLAMA, "num_hidden_layers": 3})).eval()
    return model, word_tokenizer(model.config.vocab_size)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(3, 48, (2, 6), generator=torch.Generator().manual_seed(1))


def test_nnterp_reads_what_the_hooked_model_caches_and_steers_as_a_hook_does(tokens: torch.Tensor) -> None:
    nnterp = pytest.importorskip("nnterp")
    model, tok = _llama()
    hm = HookedModel.wrap(model)
    st = nnterp.StandardizedTransformer(hm.hf_model, tokenizer=tok)
    assert st._model is hm.hf_model  # the same modules, no copy
    with torch.no_grad():
        logits, cache = hm.run_with_cache(tokens)
        with st.trace(tokens):
            layer0 = st.layers_output[0].save()  # one by one: nnsight traces the statements of this block
            layer1 = st.layers_output[1].save()
            layer2 = st.layers_output[2].save()
            nn_logits = st.logits.save()
    for i, layer in enumerate((layer0, layer1, layer2)):
        torch.testing.assert_close(layer, cache[f"blocks.{i}.hook_resid_post"], rtol=0, atol=1e-6)
    torch.testing.assert_close(nn_logits, _logits(logits), rtol=0, atol=1e-6)

    # nnterp's steering and a lensadapters hook adding the same vector at the same layer's output agree bitwise
    v = torch.randn(32, generator=torch.Generator().manual_seed(2))

    def add(x: torch.Tensor, hook: Any) -> torch.Tensor:
        return x + v

    with torch.no_grad():
        hooked = _logits(hm.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_post", add)]))
        with st.trace(tokens):
            st.steer(layers=1, steering_vector=v)
            steered = st.logits.save()
    assert torch.equal(steered, hooked)
    assert not torch.allclose(hooked, _logits(logits))


def test_a_lensadapters_edit_reaches_a_nnterp_trace_downstream(tokens: torch.Tensor) -> None:
    """An edit made with lensadapters while nnterp traces changes nnterp's logits exactly as the hooked run's; nnsight
    reads a module's output as the module returned it, before an edit at that module's output point."""
    nnterp = pytest.importorskip("nnterp")
    model, tok = _llama()
    hm = HookedModel.wrap(model)
    st = nnterp.StandardizedTransformer(hm.hf_model, tokenizer=tok)
    v = torch.randn(32, generator=torch.Generator().manual_seed(3))

    def add(x: torch.Tensor, hook: Any) -> torch.Tensor:
        return x + v

    with torch.no_grad():
        plain = _logits(hm.hf_model(tokens))
        _, clean_cache = hm.run_with_cache(tokens)
        hooked = _logits(hm.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", add)]))
        with hm.hooks(fwd_hooks=[("blocks.0.hook_resid_post", add)]):
            with st.trace(tokens):
                seen = st.layers_output[0].save()
                after = st.layers_output[1].save()
                traced = st.logits.save()
            _, edited_cache = hm.run_with_cache(tokens)
    assert torch.equal(traced, hooked)
    torch.testing.assert_close(seen, clean_cache["blocks.0.hook_resid_post"], rtol=0, atol=1e-6)
    torch.testing.assert_close(after, edited_cache["blocks.1.hook_resid_post"], rtol=0, atol=1e-6)
    assert not torch.allclose(after, clean_cache["blocks.1.hook_resid_post"])
    with torch.no_grad():  # the edit is gone once its block ends
        assert torch.equal(_logits(hm.hf_model(tokens)), plain)


def test_tuned_lens_on_the_residual_points(tokens: torch.Tensor) -> None:
    """tuned-lens built from ``hm.hf_model``: a fresh lens (identity translators) on the last block's hook_resid_post
    is the model's logits, and on every layer it is ln_final + unembedding of that layer's residual; a trained
    translator applies to the residual lensadapters caches."""
    tuned_lens = pytest.importorskip("tuned_lens")
    model, _ = _llama()
    hm = HookedModel.wrap(model)
    lens = tuned_lens.TunedLens.from_model(hm.hf_model)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(tokens)
        torch.testing.assert_close(lens(cache["blocks.2.hook_resid_post"], 2), _logits(logits), rtol=0, atol=1e-6)
        for i in range(3):
            resid = cache[f"blocks.{i}.hook_resid_post"]
            logit_lens = hm.hf_model.lm_head(hm.hf_model.model.norm(resid))
            torch.testing.assert_close(lens(resid, i), logit_lens, rtol=0, atol=1e-6)
        translator = lens.layer_translators[0]
        torch.nn.init.normal_(translator.weight, std=0.1, generator=torch.Generator().manual_seed(4))
        resid = cache["blocks.0.hook_resid_post"]
        expected = hm.hf_model.lm_head(hm.hf_model.model.norm(resid + translator(resid)))
        torch.testing.assert_close(lens(resid, 0), expected, rtol=0, atol=1e-6)
        assert not torch.allclose(lens(resid, 0), hm.hf_model.lm_head(hm.hf_model.model.norm(resid)))


def test_circuit_tracer_nnsight_backend_on_the_wrapped_model(tmp_path: Any) -> None:
    """circuit-tracer 0.5's nnsight backend given ``hm.hf_model`` (two lines of glue, the README shows them) builds
    the same attribution graph as from a fresh load of the same weights, and the wrapper still works afterwards."""
    pytest.importorskip("circuit_tracer")
    from circuit_tracer import attribute
    from circuit_tracer.replacement_model.replacement_model_nnsight import NNSightReplacementModel
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, TranscoderSet

    model, tok = _llama()
    model.config.architectures = ["LlamaForCausalLM"]  # what a saved checkpoint's config has
    model.config._attn_implementation = "eager"  # circuit-tracer reads the attention probabilities
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    def transcoders() -> Any:
        g = torch.Generator().manual_seed(5)
        layers = {}
        for i in range(3):
            layers[i] = SingleLayerTranscoder(32, 16, torch.nn.ReLU(), i, device=torch.device("cpu"), dtype=torch.float)
            with torch.no_grad():
                for p in layers[i].parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return TranscoderSet(layers, feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")

    hm = HookedModel.wrap(model)
    ids = torch.tensor([1, 5, 9, 13, 7, 22])
    with torch.no_grad():
        before, cache_before = hm.run_with_cache(ids[None])
    replacement = NNSightReplacementModel(hm.hf_model, tokenizer=tok, dispatch=True)
    replacement._hf_config = hm.hf_model.config
    replacement._configure_replacement_model(transcoders())
    graph = attribute(ids, replacement, max_n_logits=3, batch_size=64)
    reference = NNSightReplacementModel.from_pretrained_and_transcoders(str(tmp_path), transcoders(), device="cpu")
    expected = attribute(ids, reference, max_n_logits=3, batch_size=64)
    assert graph.adjacency_matrix.abs().max() > 0
    torch.testing.assert_close(graph.adjacency_matrix, expected.adjacency_matrix, rtol=0, atol=1e-6)
    # what the README's table says circuit-tracer does to the model it is given (its doing, not lensadapters')
    assert isinstance(hm.hf_model.get_submodule("transcoders"), TranscoderSet)
    assert not any(p.requires_grad for p in hm.hf_model.parameters())
    with torch.no_grad():
        after, cache_after = hm.run_with_cache(ids[None])
    assert torch.equal(_logits(after), _logits(before))
    assert torch.equal(cache_after["blocks.1.mlp.hook_post"], cache_before["blocks.1.mlp.hook_post"])


def test_circuitsvis_renders_the_cached_patterns(tokens: torch.Tensor) -> None:
    """circuitsvis takes tensors: the attention patterns it renders from ``cache["pattern", layer]`` are that
    layer's patterns, every head (the numbers in its HTML, as float32 prints them)."""
    cv = pytest.importorskip("circuitsvis")
    import json
    import re

    model, _ = _llama()
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        _, cache = hm.run_with_cache(tokens)
    pattern = cache["pattern", 1][0]
    html = str(cv.attention.attention_patterns(tokens=[f"t{i}" for i in range(6)], attention=pattern))
    props = json.loads(re.search(r"AttentionPatterns,\s*(\{.*\})\s*\)", html, re.S).group(1))
    assert torch.equal(torch.tensor(props["attention"], dtype=torch.float32), pattern)
