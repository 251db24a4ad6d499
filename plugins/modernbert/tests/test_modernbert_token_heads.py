"""The per-token heads: ``ModernBertForMaskedLM``'s prediction head (``mlm_head.hook_pre``, its dense output;
``mlm_head.hook_post``, its activation's output; ``mlm_head.ln.*``, its norm) and
``ModernBertForTokenClassification``'s head (``cls_head.hook_pre``/``hook_post``/``ln.*``/``hook_out`` on every
token, no pooling). Each read against the reference written from the HF parameters and against a plain PyTorch hook
on the HF module, each edit against the same edit made with a plain hook (the norm's scale against the norm written
out with its scale edited), no hook against HF's logits bitwise. Tiny models (width 32, 3 layers); nothing is built
at import."""

from __future__ import annotations

import pytest
import torch
from lensadapters_modernbert.reference import (
    IMPLEMENTATIONS,
    inputs,
    logits_with_head_norm_scale_halved,
    make_model,
    max_error,
    reference,
)
from lensadapters_modernbert.reference import registry as plugin_registry

from lensadapters import HookedModel
from lensadapters.testing import assert_close, assert_wraps_transparently

# each head's points in firing order, and the HF module (relative to the model) whose input ("pre") or output
# ("post") a plain hook reads and edits for it
HEADS = {
    "mlm": {
        "mlm_head.hook_pre": ("head.dense", "post"),
        "mlm_head.hook_post": ("head.act", "post"),
        "mlm_head.ln.hook_scale": None,
        "mlm_head.ln.hook_normalized": ("head.norm", "post"),
    },
    "token": {
        "cls_head.hook_pre": ("head.dense", "post"),
        "cls_head.hook_post": ("head.act", "post"),
        "cls_head.ln.hook_scale": None,
        "cls_head.ln.hook_normalized": ("head.norm", "post"),
        "cls_head.hook_out": ("classifier", "pre"),
    },
}


def _model(head: str, implementation: str, seed: int = 0):
    from transformers import ModernBertForMaskedLM, ModernBertForTokenClassification

    if head == "mlm":
        return make_model(implementation, seed, cls=ModernBertForMaskedLM)
    return make_model(implementation, seed, cls=ModernBertForTokenClassification, num_labels=5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("head", sorted(HEADS))
def test_every_point_of_the_head_matches_the_reference(head, implementation):
    model, batch = _model(head, implementation), inputs()
    points = list(HEADS[head])
    with torch.no_grad():
        expected = model(**batch).logits
        hm = HookedModel.wrap(model, registry=plugin_registry())
        assert torch.equal(hm(**batch).logits, expected), "no hooks: HF's logits bitwise"
        logits, cache = hm.run_with_cache(**batch, names_filter=hm.hook_names)
        ref = reference(model, batch)
    assert_close(logits, expected, "a cached forward computes HF's logits (patterns computed explicitly)")
    assert set(ref) - {"logits"} == set(hm.hook_names), "the reference computes every point"
    assert hm.hook_names[-len(points) - 2 :] == ["ln_final.hook_scale", "ln_final.hook_normalized", *points]
    assert cache[points[0]].shape == (2, 9, 32) and cache[points[2]].shape == (2, 9, 1), "per token"
    assert hm.cfg.extra["mlm_head"] is (head == "mlm") and hm.cfg.extra["cls_head"] is (head == "token")
    assert "cls_head.hook_pooled" not in hm.hook_names, "no pooling"
    error = max_error(cache, ref)
    print(f"largest difference from the reference ({head}, {implementation}): {error:.3g}")
    assert error < 1e-5, f"largest difference from the reference {error:.3g}"
    assert (ref["logits"] - expected).abs().max() < 1e-5, "the reference's logits are HF's"
    hm.unwrap()


@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_read_is_what_a_torch_hook_on_the_module_sees(head):
    model, batch = _model(head, "sdpa"), inputs()
    seen, handles = {}, []
    for point, where in HEADS[head].items():
        if where is None:
            continue
        module = model.get_submodule(where[0])

        def record(module, args, output=None, point=point, kind=where[1]):
            seen[point] = (args[0] if kind == "pre" else output).detach().clone()

        hook = module.register_forward_pre_hook if where[1] == "pre" else module.register_forward_hook
        handles.append(hook(record))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    hm = HookedModel.wrap(model, registry=plugin_registry())
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=list(seen))
    for point, value in seen.items():
        assert torch.equal(cache[point], value), f"{point}: the torch hook's value bitwise"
    hm.unwrap()


@pytest.mark.parametrize("head", sorted(HEADS))
def test_no_hooks_is_hf_forward_and_order_is_firing_order(head):
    assert_wraps_transparently(_model(head, "sdpa"), inputs(), plugin_registry())


def _edit(t, hook=None):
    return t * -2.0 + 0.5


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("head", sorted(HEADS))
def test_an_edit_of_a_head_point_is_the_same_edit_made_with_a_torch_hook(head, implementation, edits_match_torch_hooks):
    model, batch = _model(head, implementation), inputs()
    plain = {point: where for point, where in HEADS[head].items() if where is not None}
    hm, base = edits_match_torch_hooks(model, batch, plain, _edit)
    with torch.no_grad():
        # the norm's scale has no module of its own: the norm written out with its scale halved, in a torch hook
        # replacing the norm's output (written out, so equal to rounding, not bitwise)
        (scale,) = [p for p, where in HEADS[head].items() if where is None]
        edited = hm.run_with_hooks(**batch, fwd_hooks=[(scale, lambda t, hook: t * 0.5)])
    hm.unwrap()
    expected = logits_with_head_norm_scale_halved(model, batch)
    assert not torch.allclose(expected, base, atol=1e-4)
    error = (edited - expected).abs().max().item()
    print(f"{scale} halved: largest difference from the norm written out ({head}, {implementation}): {error:.3g}")
    assert error < 1e-5, f"an edit of {scale} is used by the norm"
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, base), "unwrapped: HF's logits as they were"


def test_a_token_head_edit_at_one_position_changes_only_that_positions_logits():
    """No pooling: the token head's points are per token, and an edit at one position reaches that position's
    logits only."""
    model, batch = _model("token", "eager"), inputs()
    hm = HookedModel.wrap(model, registry=plugin_registry())

    def at_three(t, hook):
        t = t.clone()
        t[:, 3] = _edit(t[:, 3])
        return t

    with torch.no_grad():
        base = hm(**batch).logits
        edited = hm.run_with_hooks(**batch, fwd_hooks=[("cls_head.hook_post", at_three)])
    others = torch.ones(9, dtype=torch.bool)
    others[3] = False
    assert torch.equal(edited[:, others], base[:, others]), "the other positions' logits as they were"
    assert not torch.allclose(edited[:, 3], base[:, 3], atol=1e-4)
    hm.unwrap()


def test_the_head_points_are_only_on_their_models():
    from transformers import ModernBertForSequenceClassification, ModernBertModel

    for cls in (ModernBertModel, ModernBertForSequenceClassification):
        hm = HookedModel.wrap(make_model("eager", cls=cls), registry=plugin_registry())
        assert not any(n.startswith("mlm_head.") for n in hm.hook_names), cls.__name__
        hm.unwrap()
    hm = HookedModel.wrap(make_model("eager", cls=ModernBertModel), registry=plugin_registry())
    assert not any(n.startswith("cls_head.") for n in hm.hook_names)
    assert hm.cfg.extra["cls_head"] is False
    hm.unwrap()
