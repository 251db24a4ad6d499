"""``ModernBertForSequenceClassification``'s head: ``cls_head.hook_pooled`` (the pooled final hidden state, the first
token's or the mean over the real tokens), ``cls_head.hook_pre``/``hook_post`` (the head's dense layer and
activation), ``cls_head.ln.*`` (its norm) and ``cls_head.hook_out`` (the classifier's input). Each read against the
reference written from the HF parameters, each edit against the same edit made with a plain PyTorch hook on the HF
module (the norm's scale against the reference's edit), no hook against HF's logits bitwise; the other models have
no head point. Tiny models (width 32, 3 layers); nothing is built at import."""

from __future__ import annotations

import pytest
import torch
from lensadapters_modernbert.reference import IMPLEMENTATIONS, inputs, make_model, max_error, reference
from lensadapters_modernbert.reference import registry as plugin_registry

from lensadapters import HookedModel
from lensadapters.testing import assert_close, assert_wraps_transparently

HEAD = (
    "cls_head.hook_pooled",
    "cls_head.hook_pre",
    "cls_head.hook_post",
    "cls_head.ln.hook_scale",
    "cls_head.ln.hook_normalized",
    "cls_head.hook_out",
)
POOLINGS = ("cls", "mean")


def _classifier(implementation: str, pooling: str, seed: int = 0):
    from transformers import ModernBertForSequenceClassification

    return make_model(
        implementation, seed, cls=ModernBertForSequenceClassification, classifier_pooling=pooling, num_labels=3
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_every_point_of_the_classifier_matches_the_reference(implementation, pooling):
    model, batch = _classifier(implementation, pooling), inputs()
    with torch.no_grad():
        expected = model(**batch).logits
        hm = HookedModel.wrap(model, registry=plugin_registry())
        assert torch.equal(hm(**batch).logits, expected), "no hooks: HF's logits bitwise"
        logits, cache = hm.run_with_cache(**batch, names_filter=hm.hook_names)
        ref = reference(model, batch)
    assert_close(logits, expected, "a cached forward computes HF's logits (patterns computed explicitly)")
    assert set(ref) - {"logits"} == set(hm.hook_names), "the reference computes every point"
    assert hm.hook_names[-len(HEAD) :] == list(HEAD), "the head's points come last, in firing order"
    assert cache["cls_head.hook_pooled"].shape == (2, 32) and cache["cls_head.ln.hook_scale"].shape == (2, 1)
    error = max_error(cache, ref)
    print(f"largest difference from the reference ({implementation}, {pooling}): {error:.3g}")
    assert error < 1e-5, f"largest difference from the reference {error:.3g}"
    assert (ref["logits"] - expected).abs().max() < 1e-5, "the reference's logits are HF's"
    if pooling == "mean":  # the second row's padding is left out of the mean: its first token is not the pool
        assert not torch.allclose(cache["cls_head.hook_pooled"], cache["ln_final.hook_normalized"][:, 0])
    hm.unwrap()


@pytest.mark.parametrize("pooling", POOLINGS)
def test_no_hooks_is_hf_forward_and_order_is_firing_order(pooling):
    assert_wraps_transparently(_classifier("sdpa", pooling), inputs(), plugin_registry())


def _edit(t, hook=None):
    return t * -2.0 + 0.5


# each head point and the HF module (relative to the model) whose input ("pre") or output ("post") a plain hook edits
PLAIN = {
    "cls_head.hook_pooled": ("head", "pre"),
    "cls_head.hook_pre": ("head.dense", "post"),
    "cls_head.hook_post": ("head.act", "post"),
    "cls_head.ln.hook_normalized": ("head.norm", "post"),
    "cls_head.hook_out": ("classifier", "pre"),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_an_edit_of_a_head_point_is_the_same_edit_made_with_a_torch_hook(
    implementation, pooling, edits_match_torch_hooks
):
    model, batch = _classifier(implementation, pooling), inputs()
    hm, base = edits_match_torch_hooks(model, batch, PLAIN, _edit)
    with torch.no_grad():
        # the norm's scale has no module of its own: the reference's edit, where the norm divides by it
        halve = {"cls_head.ln.hook_scale": lambda t, hook: t * 0.5}
        edited = hm.run_with_hooks(**batch, fwd_hooks=list(halve.items()))
        expected = reference(model, batch, edits=halve)["logits"]
    assert not torch.allclose(expected, base, atol=1e-4)
    assert (edited - expected).abs().max() < 1e-5, "an edit of cls_head.ln.hook_scale is used by the norm"
    hm.unwrap()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, base), "unwrapped: HF's logits as they were"


def test_an_edit_of_the_final_norm_reaches_the_pool_only_through_the_pooled_tokens():
    """``cls`` pooling reads the first token only: an edit of ``ln_final.hook_normalized`` at the other positions
    leaves the logits as they were, one at the first token does not."""
    model, batch = _classifier("eager", "cls"), inputs()
    hm = HookedModel.wrap(model, registry=plugin_registry())

    def at(positions):
        def edit(t, hook):
            t = t.clone()
            t[:, positions] = _edit(t[:, positions])
            return t

        return [("ln_final.hook_normalized", edit)]

    with torch.no_grad():
        base = hm(**batch).logits
        assert torch.equal(hm.run_with_hooks(**batch, fwd_hooks=at(slice(1, None))), base)
        assert not torch.allclose(hm.run_with_hooks(**batch, fwd_hooks=at(slice(0, 1))), base, atol=1e-4)
    hm.unwrap()


def test_the_other_models_have_no_classifier_points():
    """The masked-LM and base models have no ``cls_head`` points; token classification's head has no pool."""
    from transformers import ModernBertForMaskedLM, ModernBertForTokenClassification, ModernBertModel

    for cls in (ModernBertForMaskedLM, ModernBertModel):
        hm = HookedModel.wrap(make_model("eager", cls=cls), registry=plugin_registry())
        assert not any(n.startswith("cls_head.") for n in hm.hook_names), cls.__name__
        assert hm.cfg.extra["cls_head"] is False
        hm.unwrap()
    hm = HookedModel.wrap(make_model("eager", cls=ModernBertForTokenClassification), registry=plugin_registry())
    assert "cls_head.hook_pooled" not in hm.hook_names and "cls_head.hook_pre" in hm.hook_names
    hm.unwrap()
