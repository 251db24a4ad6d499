"""``ModernBertForQuestionAnswering`` (the classification head on every token, its classifier's two outputs the start
and end logits: ``cls_head.hook_pre``/``hook_post``/``ln.*``/``hook_out``) and ``ModernBertForMultipleChoice`` (its
``[batch, num_choices, pos]`` input flattened to ``[batch * num_choices, pos]`` as transformers flattens it, then
the sequence classifier's points, ``cls_head.hook_pooled`` on, with a one-logit classifier), with the encoder's
points. Each read against the reference written from the HF parameters, each edit against the same edit made with a
plain PyTorch hook on the HF module (bitwise; the norm's scale against the norm written out with its scale halved),
no hook against HF's output bitwise. Tiny models (width 32, 3 layers), built once per module; nothing is built at
import."""

from __future__ import annotations

import pytest
import torch
from lensadapters_modernbert.reference import (
    IMPLEMENTATIONS,
    choice_inputs,
    inputs,
    logits_of,
    logits_with_head_norm_scale_halved,
    make_model,
    max_error,
    reference,
)
from lensadapters_modernbert.reference import registry as plugin_registry

from lensadapters import HookedModel
from lensadapters.testing import assert_close

CLASSES = {"qa": "ModernBertForQuestionAnswering", "choice": "ModernBertForMultipleChoice"}
# (model, classifier_pooling) cases: the question answerer reads every token, so its pooling does not matter
CASES = [("qa", "cls"), ("choice", "cls"), ("choice", "mean")]
IDS = ["qa", "choice-cls", "choice-mean"]
CHOICES = 3
# each head's points in firing order, and the HF module (relative to the model) whose input ("pre") or output
# ("post") a plain hook edits for it (None: the norm's scale, which has no module of its own)
HEADS = {
    "qa": {
        "cls_head.hook_pre": ("head.dense", "post"),
        "cls_head.hook_post": ("head.act", "post"),
        "cls_head.ln.hook_scale": None,
        "cls_head.ln.hook_normalized": ("head.norm", "post"),
        "cls_head.hook_out": ("classifier", "pre"),
    },
    "choice": {
        "cls_head.hook_pooled": ("head", "pre"),
        "cls_head.hook_pre": ("head.dense", "post"),
        "cls_head.hook_post": ("head.act", "post"),
        "cls_head.ln.hook_scale": None,
        "cls_head.ln.hook_normalized": ("head.norm", "post"),
        "cls_head.hook_out": ("classifier", "pre"),
    },
}
# encoder points (the first and the last; the others' edits are test_modernbert.py's), edited on the rows the encoder
# sees (multiple choice: the flattened ones)
BODY = {
    "hook_embed": ("model.embeddings.tok_embeddings", "post"),
    "ln_final.hook_normalized": ("model.final_norm", "post"),
}


@pytest.fixture(scope="module")
def build():
    """``build(kind, implementation, pooling)``: the tiny model, made once per module (tests leave it unwrapped)."""
    import transformers

    made = {}

    def get(kind: str, implementation: str = "sdpa", pooling: str = "cls"):
        cls = getattr(transformers, CLASSES[kind], None)
        if cls is None:
            pytest.skip(f"transformers {transformers.__version__} has no {CLASSES[kind]}")
        key = (kind, implementation, pooling)
        if key not in made:
            made[key] = make_model(implementation, cls=cls, classifier_pooling=pooling)
        return made[key]

    return get


def _batch(kind: str) -> dict:
    return choice_inputs(choices=CHOICES) if kind == "choice" else inputs()


def _edit(t):
    return t * -2.0 + 0.5


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("kind", "pooling"), CASES, ids=IDS)
def test_every_point_matches_the_reference(build, kind, pooling, implementation):
    model, batch = build(kind, implementation, pooling), _batch(kind)
    points = list(HEADS[kind])
    rows = 2 * CHOICES if kind == "choice" else 2  # multiple choice: [batch * num_choices, ...]
    with torch.no_grad():
        expected = logits_of(model(**batch))
        hm = HookedModel.wrap(model, registry=plugin_registry())
        assert torch.equal(logits_of(hm(**batch)), expected), "no hooks: HF's output bitwise"
        logits, cache = hm.run_with_cache(**batch, names_filter=hm.hook_names)
        ref = reference(model, batch)
    hm.unwrap()
    assert expected.shape == ((2, CHOICES) if kind == "choice" else (2, 9, 2))
    assert_close(logits_of(logits), expected, "a cached forward computes HF's logits (patterns computed explicitly)")
    assert set(ref) - {"logits"} == set(hm.hook_names), "the reference computes every point"
    assert hm.hook_names[-len(points) - 2 :] == ["ln_final.hook_scale", "ln_final.hook_normalized", *points]
    assert hm.cfg.extra["cls_head"] is True and hm.cfg.extra["mlm_head"] is False
    assert cache["hook_embed"].shape == (rows, 9, 32)
    assert cache["blocks.1.attn.hook_pattern"].shape == (rows, 4, 9, 9)
    if kind == "qa":
        assert "cls_head.hook_pooled" not in hm.hook_names, "no pooling"
        assert cache["cls_head.hook_out"].shape == (2, 9, 32) and cache["cls_head.ln.hook_scale"].shape == (2, 9, 1)
    else:
        assert cache["cls_head.hook_pooled"].shape == (rows, 32) and cache["cls_head.hook_out"].shape == (rows, 32)
    error = max_error(cache, ref)
    print(f"largest difference from the reference ({kind}, {pooling}, {implementation}): {error:.3g}")
    assert error < 1e-5, f"largest difference from the reference {error:.3g}"
    assert (ref["logits"] - expected).abs().max() < 1e-5, "the reference's logits are HF's"


@pytest.mark.parametrize(("kind", "pooling"), CASES, ids=IDS)
def test_no_hooks_is_hf_forward_and_order_is_firing_order(build, kind, pooling):
    model, batch = build(kind, "sdpa", pooling), _batch(kind)
    with torch.no_grad():
        expected = logits_of(model(**batch))
        hm = HookedModel.wrap(model, registry=plugin_registry())
        assert torch.equal(logits_of(hm(**batch)), expected), "no hooks: HF's output bitwise"
        fired = []
        hooks = [(n, lambda t, hook: fired.append(hook.name)) for n in hm.hook_names]
        assert_close(logits_of(hm.run_with_hooks(**batch, fwd_hooks=hooks)), expected, "identity hooks everywhere")
    assert fired == hm.hook_names, "every point fires once, in hook_names' order"
    assert hm.unwrap() is model
    with torch.no_grad():
        assert torch.equal(logits_of(model(**batch)), expected), "unwrapped: the model's output as it was"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("kind", "pooling"), CASES, ids=IDS)
def test_an_edit_is_the_same_edit_made_with_a_torch_hook(build, edits_match_torch_hooks, kind, pooling, implementation):
    model, batch = build(kind, implementation, pooling), _batch(kind)
    plain = {**BODY, **{point: where for point, where in HEADS[kind].items() if where is not None}}
    hm, base = edits_match_torch_hooks(model, batch, plain, _edit)
    try:
        with torch.no_grad():
            halve = [("cls_head.ln.hook_scale", lambda t, hook: t * 0.5)]
            edited = logits_of(hm.run_with_hooks(**batch, fwd_hooks=halve))
    finally:
        hm.unwrap()
    # the norm's scale has no module of its own: the norm written out with its scale halved
    expected = logits_with_head_norm_scale_halved(model, batch)
    assert not torch.allclose(expected, base, atol=1e-4)
    error = (edited - expected).abs().max().item()
    print(
        f"cls_head.ln.hook_scale halved: largest difference from the norm written out ({kind}, {pooling}): {error:.3g}"
    )
    assert error < 1e-5, "an edit of cls_head.ln.hook_scale is used by the norm"
    with torch.no_grad():
        assert torch.equal(logits_of(model(**batch)), base), "unwrapped: HF's output as it was"


def test_multiple_choice_rows_are_choices_of_batch_rows(build):
    """The flattened layout: row ``b * num_choices + c`` of every point is choice ``c`` of batch row ``b`` (an edit
    of that row of ``cls_head.hook_pooled`` changes ``logits[b, c]`` only), and ``cls`` pooling reads each row's
    first real token (the left-padded choice's third token)."""
    model, batch = build("choice", "eager", "cls"), choice_inputs(choices=CHOICES)
    b, c = 1, 1  # the left-padded choice
    row = b * CHOICES + c
    hm = HookedModel.wrap(model, registry=plugin_registry())

    def at_row(t, hook):
        t = t.clone()
        t[row] = _edit(t[row])
        return t

    try:
        with torch.no_grad():
            base, cache = hm.run_with_cache(**batch, names_filter=["ln_final.hook_normalized", "cls_head.hook_pooled"])
            edited = hm.run_with_hooks(**batch, fwd_hooks=[("cls_head.hook_pooled", at_row)])
    finally:
        hm.unwrap()
    others = torch.ones(2, CHOICES, dtype=torch.bool)
    others[b, c] = False
    assert torch.equal(edited[others], base[others]), "the other choices' logits as they were"
    assert not torch.allclose(edited[b, c], base[b, c], atol=1e-4)
    final, pooled = cache["ln_final.hook_normalized"], cache["cls_head.hook_pooled"]
    assert torch.equal(pooled[row], final[row, 2]), "the left-padded choice pools its first real token"
    assert torch.equal(pooled[0], final[0, 0])
    assert not torch.allclose(pooled[row], final[row, 0], atol=1e-4)
