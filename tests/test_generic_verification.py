"""The generic adapter serves only what its probe verified: ``hook_embed`` as the model uses the embeddings (Granite
multiplies them after the module), residual points only where the layers' outputs are the residual stream (not where
layers return their change for the model to add), and ``W_U`` such that ``final @ W_U`` is the logits (Cohere's
``logit_scale``, Granite's ``logits_scaling``), or not at all (a softcap), each absence explained."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig

from lensadapters import HookedModel, Registry
from lensadapters.errors import WeightUnavailableError
from lensadapters.generic import GenericAdapterWarning
from lensadapters.hf import tiny_config_of
from lensadapters.sites import first_input, replace_first_input
from lensadapters.testing import reinit
from lensadapters.testing.models import EmbedAndHead

#: the special tokens of every model here (the sizes: ``tiny_config_of``'s, vocabulary 96)
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _model(config_class, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    config = tiny_config_of(config_class, **{"vocab": 96, **SPECIAL, **kwargs})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    reinit(model, 0)
    return model.eval().to(dtype)


def _wrap(model):
    with pytest.warns(GenericAdapterWarning) as warned:
        hm = HookedModel.wrap(model, registry=Registry())
    return hm, str(warned[0].message)


def _layers(model):
    return model.get_submodule(next(n for n, m in model.named_modules() if n.endswith("layers")))


def _ids():
    return torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(0))


def _first_layer_input_and_edited_logits(model, ids, edit):
    """The first layer's input, and the logits when a plain PyTorch hook replaces it with ``edit``."""
    seen = []
    first = _layers(model)[0]
    with torch.no_grad():
        handle = first.register_forward_pre_hook(lambda m, a, k: seen.append(first_input(a, k)), with_kwargs=True)
        model(ids)
        handle.remove()
        handle = first.register_forward_pre_hook(lambda m, a, k: replace_first_input(a, k, edit), with_kwargs=True)
        logits = model(ids).logits
        handle.remove()
    return seen[0], logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "family, kwargs",
    [
        ("granite", dict(embedding_multiplier=12.0, logits_scaling=4.0, residual_multiplier=0.5)),
        ("granite", dict(embedding_multiplier=0.3, logits_scaling=0.7, residual_multiplier=1.0)),
        ("cohere", dict(logit_scale=0.25, use_qk_norm=False)),
    ],
)
def test_embeddings_and_unembedding_are_what_the_model_computes(family, kwargs, dtype) -> None:
    model = _model(GraniteConfig if family == "granite" else CohereConfig, dtype, **kwargs)
    hm, _ = _wrap(model)
    ids = _ids()
    edit = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    first, expected = _first_layer_input_and_edited_logits(model, ids, edit)
    final: list = []
    head = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: final.append(a[0]))
    try:
        with torch.no_grad():
            logits, cache = hm.run_with_cache(ids, names_filter=["hook_embed", "blocks.0.hook_resid_pre"])
            assert torch.equal(cache["hook_embed"], first)  # the embeddings as the model uses them
            assert torch.equal(cache["blocks.0.hook_resid_pre"], first)
            assert torch.equal(hm.W_E[ids], first)
            edited = hm.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda x, hook: edit)])
            assert torch.equal(edited, expected)  # an edit is what a plain hook on the first layer's input does
            atol = 1e-4 if dtype == torch.float32 else 0.1
            torch.testing.assert_close((final[0] @ hm.W_U).float(), logits.float(), atol=atol, rtol=0.02)
    finally:
        head.remove()
        hm.unwrap()


def test_a_softcapped_head_gets_no_w_u_and_scaled_embeddings_are_found() -> None:
    """Gemma 2 without its plugin: W_U would not give the (softcapped) logits, so it is refused saying why; the
    embeddings' sqrt(d_model) (inside the module or after it, by transformers version) is hook_embed's."""
    model = _model(Gemma2Config, head_dim=8, final_logit_softcapping=5.0, sliding_window=4)
    hm, _ = _wrap(model)
    ids = _ids()
    first, expected = _first_layer_input_and_edited_logits(model, ids, torch.ones(2, 6, 32))
    try:
        with pytest.raises(WeightUnavailableError, match="logits.*softcap"):
            _ = hm.W_U
        with torch.no_grad():
            _, cache = hm.run_with_cache(ids, names_filter=["hook_embed"])
            assert torch.equal(cache["hook_embed"], first) and torch.equal(hm.W_E[ids], first)
            assert torch.equal(
                hm.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda x, hook: torch.ones_like(x))]), expected
            )
    finally:
        hm.unwrap()


class _DeltaLayers(EmbedAndHead, torch.nn.Module):
    """A model of someone's own whose layers return only their change: ``x = x + layer(x)`` in the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(num_hidden_layers=2, vocab_size=16, model_type="test_delta_layers")
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids, **kwargs):
        from transformers.modeling_outputs import CausalLMOutput

        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return CausalLMOutput(logits=self.head(x))


def test_layers_that_return_their_change_get_no_residual_points() -> None:
    torch.manual_seed(0)
    model = _DeltaLayers().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm, message = _wrap(model)
    try:
        assert not any("resid" in name for name in hm.hook_names), hm.hook_names
        assert "hook_resid_pre and hook_resid_post" in message and "return their change" in message
        assert hm.hook_names == ["hook_embed"]
    finally:
        hm.unwrap()
