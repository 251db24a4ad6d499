"""ModernBERT: every point against a reference written from the Hugging Face modules' parameters, edits against the
same edits made with plain PyTorch hooks, no hooks against HF's forward bitwise, the padding and window masks, and
the weights from the live fused parameters. Tiny models (width 32, 3 layers: global, local, global); nothing is
built at import."""

from __future__ import annotations

import lensadapters_modernbert
import pytest
import torch
from lensadapters_modernbert.reference import IMPLEMENTATIONS, WINDOW, inputs, make_model, max_error, reference, wrapped
from lensadapters_modernbert.reference import registry as plugin_registry

from lensadapters import HookedModel
from lensadapters.testing import assert_close, assert_wraps_transparently
from lensadapters.testing.plugins import assert_entry_point


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_point_matches_the_reference(implementation):
    model, batch, hm = wrapped(implementation)
    with torch.no_grad():
        expected = model(**batch).logits
        logits, cache = hm.run_with_cache(**batch, names_filter=hm.hook_names)
        ref = reference(model, batch)
    assert_close(logits, expected, "a cached forward computes HF's logits")
    assert set(ref) - {"logits"} == set(hm.hook_names), "the reference computes every point"
    assert not any(n.startswith("blocks.0.ln1.") for n in hm.hook_names), "layer 0 has no attention norm"
    error = max_error(cache, ref)
    print(f"largest difference from the reference ({implementation}): {error:.3g}")
    assert error < 1e-5, f"largest difference from the reference {error:.3g}"
    assert_close(ref["logits"], expected, "the reference's logits are HF's")
    hm.unwrap()


def test_patterns_show_padding_and_the_local_window():
    model, batch, hm = wrapped("eager")
    real = batch["attention_mask"].bool()
    _, cache = hm.run_with_cache(**batch)
    position = torch.arange(9)
    near = (position[:, None] - position[None, :]).abs() <= WINDOW
    assert hm.cfg.attn_types == ("global", "local", "global")
    for i in range(3):
        pattern = cache[f"blocks.{i}.attn.hook_pattern"]
        allowed = real[:, None, None, :] & (near if i == 1 else torch.ones_like(near))
        queries = real[:, None, :].expand(-1, pattern.shape[1], -1)
        assert ((pattern > 0) == allowed.expand_as(pattern)).all(-1)[queries].all()
        assert torch.all(pattern[1, :, :, 7:] == 0), "padding keys get no attention"
    hm.unwrap()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_no_hooks_is_hf_forward_and_order_is_firing_order(implementation):
    assert_wraps_transparently(make_model(implementation), inputs(), plugin_registry())


def _zero_head(t, hook):
    t = t.clone()
    t[:, :, 1] = 0
    return t


def _drop_head_input(module, args):  # Wo's input with head 1's share zeroed
    z = args[0].clone()
    d = z.shape[-1] // 4
    z[..., d : 2 * d] = 0
    return (z,)


def _double(module, args, output):
    return output * 2


def _halve_features(module, args):
    x = args[0].clone()
    x[..., :5] = 0.5 * x[..., :5]
    return (x,)


def _halve_point(t, hook):
    t = t.clone()
    t[..., :5] = 0.5 * t[..., :5]
    return t


# point, its edit, (module path, kind, torch hook) making the same change in the HF model
EDITS = [
    ("blocks.1.attn.hook_z", _zero_head, ("model.layers.1.attn.Wo", "pre", _drop_head_input)),
    ("blocks.2.mlp.hook_post", _halve_point, ("model.layers.2.mlp.Wo", "pre", _halve_features)),
    ("embed.ln.hook_normalized", lambda t, hook: t * 2, ("model.embeddings.norm", "fwd", _double)),
    ("blocks.0.hook_mlp_out", lambda t, hook: t * 2, ("model.layers.0.mlp", "fwd", _double)),
    ("ln_final.hook_normalized", _halve_point, ("decoder", "pre", None)),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("point,edit,torch_hook", EDITS, ids=[e[0] for e in EDITS])
def test_an_edit_is_the_same_edit_made_with_a_torch_hook(implementation, point, edit, torch_hook):
    model, batch, hm = wrapped(implementation)
    with torch.no_grad():
        edited = hm.run_with_hooks(**batch, fwd_hooks=[(point, edit)])
    hm.unwrap()
    path, kind, fn = torch_hook
    module = model.get_submodule(path)
    if point == "ln_final.hook_normalized":  # the head's input: halve it before the head's dense layer
        module, fn = model.head.dense, _halve_features
    handle = module.register_forward_pre_hook(fn) if kind == "pre" else module.register_forward_hook(fn)
    try:
        with torch.no_grad():
            expected = model(**batch).logits
    finally:
        handle.remove()
    assert not torch.allclose(expected, model(**batch).logits), "the edit changes the output"
    assert_close(edited, expected, f"an edit of {point} is the torch hook's edit")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_pattern_edit_is_the_heads_value_mix_edited(implementation):
    """Zeroing a head's pattern on the local layer equals zeroing that head's share of Wo's input."""
    model, batch, hm = wrapped(implementation)

    def zero(pattern, hook):
        pattern = pattern.clone()
        pattern[:, 1] = 0
        return pattern

    with torch.no_grad():
        edited = hm.run_with_hooks(**batch, fwd_hooks=[("blocks.1.attn.hook_pattern", zero)])
    hm.unwrap()
    handle = model.model.layers[1].attn.Wo.register_forward_pre_hook(_drop_head_input)
    try:
        with torch.no_grad():
            expected = model(**batch).logits
    finally:
        handle.remove()
    assert_close(edited, expected, "a pattern edit is the value mix edited")


def test_weights_are_the_live_fused_parameters():
    model, _, hm = wrapped("eager")
    h, d = 4, 8
    for i, layer in enumerate(model.model.layers):
        w = layer.attn.Wqkv.weight.view(3, h, d, -1)  # [3, h, d, m]
        for j, name in enumerate(("W_Q", "W_K", "W_V")):
            assert torch.equal(getattr(hm, name)[i], w[j].transpose(1, 2)), f"{name}[{i}]"
        assert torch.equal(hm.W_O[i], layer.attn.Wo.weight.view(-1, h, d).permute(1, 2, 0))
        first, second = layer.mlp.Wi.weight.chunk(2, dim=0)
        assert torch.equal(hm.W_gate[i], first.T) and torch.equal(hm.W_in[i], second.T)
        assert torch.equal(hm.W_out[i], layer.mlp.Wo.weight.T)
    assert torch.equal(hm.W_E, model.model.embeddings.tok_embeddings.weight)
    assert torch.equal(hm.W_U, model.decoder.weight.T)
    hm.unwrap()


def test_the_base_model_has_no_head_points():
    from transformers import ModernBertModel

    model = make_model("eager", cls=ModernBertModel)
    batch = inputs()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
    hm = HookedModel.wrap(model, registry=plugin_registry())
    assert "mlm_head.ln.hook_normalized" not in hm.hook_names
    _, cache = hm.run_with_cache(**batch)
    assert torch.equal(cache["ln_final.hook_normalized"], expected)
    hm.unwrap()


def test_entry_point():
    assert_entry_point("modernbert", lensadapters_modernbert, skip_uninstalled=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sequence_classification_serves_the_body(implementation):
    from transformers import ModernBertForSequenceClassification

    model = make_model(implementation, cls=ModernBertForSequenceClassification)
    batch = inputs()
    with torch.no_grad():
        expected = model(**batch).logits
        hm = HookedModel.wrap(model, registry=plugin_registry())
        assert torch.equal(hm(**batch).logits, expected), "no hooks: HF's logits bitwise"
        logits, cache = hm.run_with_cache(**batch, names_filter=hm.hook_names)
    assert_close(logits, expected, "a cached forward computes HF's logits")
    assert "ln_final.hook_normalized" in cache and "mlm_head.ln.hook_normalized" not in hm.hook_names
    hm.unwrap()
