"""The analysis layer against TransformerLens 2.x on the same weights: ``ActivationCache``'s methods (values within
1e-4, labels identical) and ``logit_attrs`` (equal to TransformerLens' on a ``fold_ln=True`` model:
``apply_ln_to_stack`` multiplies by the norm's weight, which TransformerLens folds into the next matrix instead).
Skipped where TransformerLens is not installed."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from lensadapters.testing.tl_analysis import (
    both_methods,
    check,
    draw_tokens,
    each_model_type,
    needs_transformer_lens,
    norm_weight,
    pair,
)
from lensadapters.testing.tl_reference import (
    hooked_transformer,
)

pytestmark = needs_transformer_lens


# --- ActivationCache methods ----------------------------------------------------------------------------------


@each_model_type
def test_cache_methods_match(model_type: str, data: st.DataObject) -> None:
    with pair(data, model_type) as (hm, tl), torch.no_grad():
        n = hm.cfg.n_layers
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        _, ours = hm.run_with_cache(tokens)
        _, theirs = tl.run_with_cache(tokens)
        parallel = hm.cfg.parallel_attn_mlp
        layer = data.draw(st.integers(0, n), label="layer")
        below = data.draw(st.integers(0, n - 1), label="block")
        pos = data.draw(st.sampled_from([None, -1, (0, 2), [0, tokens.shape[1] - 1]]), label="pos_slice")
        mid = data.draw(st.booleans(), label="incl_mid") and not parallel

        # accumulated_resid: identical; apply_ln at the final layer recomputes the final norm (as TransformerLens)
        a, b = both_methods(ours, theirs, "accumulated_resid", layer=layer, incl_mid=mid, pos_slice=pos)
        check(a, b, "accumulated_resid")
        a, b = both_methods(ours, theirs, "accumulated_resid", apply_ln=True, pos_slice=pos)
        check(a, b, "accumulated_resid(apply_ln) at the unembed")
        if not parallel:
            a, b = both_methods(ours, theirs, "accumulated_resid", layer=below, mlp_input=True, apply_ln=True)
            check(a, b * norm_weight(hm, below, True), "accumulated_resid(mlp_input, apply_ln)")

        # decompose_resid; with apply_ln: TransformerLens' values times the norm's weight
        mode = data.draw(st.sampled_from(["all", "attn", "mlp"]), label="mode")
        a, b = both_methods(ours, theirs, "decompose_resid", layer=layer, mode=mode, pos_slice=pos)
        check(a, b, "decompose_resid")
        a, b = both_methods(ours, theirs, "decompose_resid", layer=layer, apply_ln=True, pos_slice=pos)
        check(a, b * norm_weight(hm, layer, False), "decompose_resid(apply_ln)")
        if not parallel:  # a parallel block's MLP does not read its attention output (TransformerLens adds it)
            a, b = both_methods(ours, theirs, "decompose_resid", layer=below, mlp_input=True)
            check(a, b, "decompose_resid(mlp_input)")

        # heads
        a, b = both_methods(
            ours,
            theirs,
            "stack_head_results",
            layer=layer,
            pos_slice=pos,
            incl_remainder=data.draw(st.booleans(), label="incl_remainder"),
        )
        check(a, b, "stack_head_results")
        a, b = both_methods(ours, theirs, "stack_head_results", layer=layer, apply_ln=True)
        check(a, b * norm_weight(hm, layer, False), "stack_head_results(apply_ln)")
        check(ours.stack_activation("pattern"), theirs.stack_activation("pattern"), "stack_activation")

        # neurons
        one = data.draw(st.sampled_from([None, 1, (0, 3), [0, 2]]), label="neuron_slice of one layer")
        check(
            ours.get_neuron_results(below, neuron_slice=one, pos_slice=pos),
            theirs.get_neuron_results(below, neuron_slice=one, pos_slice=pos),
            "get_neuron_results",
        )
        # (an int neuron_slice breaks TransformerLens' stack_neuron_results: it labels and stacks by iterating it)
        neurons = data.draw(st.sampled_from([None, (0, 3), [0, 2]]), label="neuron_slice")
        a, b = both_methods(
            ours,
            theirs,
            "stack_neuron_results",
            layer=layer,
            neuron_slice=neurons,
            pos_slice=pos,
            incl_remainder=True,
        )
        check(a, b, "stack_neuron_results")

        # full decomposition
        expand = data.draw(st.booleans(), label="expand_neurons")
        a, b = both_methods(
            ours,
            theirs,
            "get_full_resid_decomposition",
            layer=layer,
            expand_neurons=expand,
            pos_slice=pos,
        )
        check(a, b, "get_full_resid_decomposition")
        if not parallel:
            a, b = both_methods(
                ours,
                theirs,
                "get_full_resid_decomposition",
                layer=below,
                mlp_input=True,
                expand_neurons=expand,
                apply_ln=True,
            )
            check(a, b * norm_weight(hm, below, True), "get_full_resid_decomposition(mlp_input, apply_ln)")

        # batch slices
        batch = data.draw(st.sampled_from([0, (0, 1), [0]]), label="batch_slice")
        sliced_ours, sliced_theirs = ours.apply_slice_to_batch_dim(batch), theirs.apply_slice_to_batch_dim(batch)
        assert sliced_ours.has_batch_dim == sliced_theirs.has_batch_dim
        check(sliced_ours["resid_post", n - 1], sliced_theirs["resid_post", n - 1], "batch slice")


@each_model_type
def test_logit_attrs_match_transformer_lens_with_folded_norms(model_type: str, data: st.DataObject) -> None:
    """TransformerLens' own recipe for direct logit attribution is a ``fold_ln=True`` model: lensadapters gives
    its numbers on the unfolded Hugging Face weights."""
    with pair(data, model_type) as (hm, _), torch.no_grad():
        folded = hooked_transformer(hm.hf_model, fold_ln=True)
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        _, ours = hm.run_with_cache(tokens)
        _, theirs = folded.run_with_cache(tokens)
        stack, labels = ours.get_full_resid_decomposition(pos_slice=-1, expand_neurons=False, return_labels=True)
        answer = tokens[:, -1]
        wrong = (answer + 1) % hm.cfg.d_vocab
        check(
            ours.logit_attrs(stack, answer, wrong, pos_slice=-1),
            theirs.logit_attrs(stack, answer, wrong, pos_slice=-1),
            "logit_attrs",
        )
        attrs = ours.logit_attrs(stack, answer, pos_slice=-1)
        # the attributions add up to the logit, less the final norm's and the unembedding's biases
        logits = hm(tokens, return_type="logits")[:, -1]
        spec = hm.norm_spec(hm.norm_module("ln_final")) if "ln_final.hook_scale" in hm.hook_names else None
        bias = hm.b_U[answer]
        if spec is not None and spec.bias is not None:
            bias = bias + spec.bias.float() @ hm.W_U[:, answer]
        check(attrs.sum(0), logits.gather(-1, answer[:, None])[:, 0] - bias, "attributions add up")
