"""The generic adapter's contract: its properties on one architecture that no plugin describes.

Subclass :class:`GenericContract` per architecture with a strategy of tiny configs and the points the generic
adapter is expected to find there (declared, so that an identification that silently fails, and leaves a point out,
fails a test instead of shrinking what the other properties check)::

    class TestFalcon(GenericContract):
        branches, attention_function, patterns, final_norm = True, False, False, True

        @classmethod
        def configs(cls):
            return st.builds(FalconConfig, ...)

The models are wrapped through a registry without architecture plugins, so the generic adapter serves them
whatever is installed (``tests/`` check separately that a model type a plugin claims is never handled generically).
Each property runs ``examples`` examples (a quarter of the Hypothesis profile's, at least two): the suite runs on
many architectures and each of them costs one probe forward per wrap.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from lensadapters.adapters.generic import GenericAdapterWarning, findings
from lensadapters.adapters.registry import Registry
from lensadapters.api.hooked_model import HookedModel
from lensadapters.errors import WeightUnavailableError
from lensadapters.testing.contract_support import (
    _hook_counts,
    _instance_attributes,
    assert_close,
    assert_unchanged_by_caching,
    perturb,
)
from lensadapters.testing.generic_edits import GenericEdits
from lensadapters.testing.generic_support import (  # noqa: F401  (re-exported: this module's public names)
    _SETTINGS,
    BRANCHES,
    PATTERNS,
    QUERY_SIDE,
    GenericBase,
    GenericPoints,
    check_described_weights,
)


class GenericContract(GenericEdits):
    """Properties of the generic adapter on one architecture (see the module docstring); the edit properties come
    from :class:`~lensadapters.testing.generic_edits.GenericEdits`, the machinery from
    :class:`~lensadapters.testing.generic_support.GenericBase`."""

    # --- the points, the warning, the weights --------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_points_weights_and_warning_are_as_declared(self, data: st.DataObject) -> None:
        config, model, inputs = self.draw(data)
        expected = self.expected(config)
        with pytest.warns(GenericAdapterWarning) as warned:
            hm = HookedModel.wrap(model, registry=Registry())
        message = str(warned[0].message)
        assert repr(config.model_type) in message and "docs/writing-a-plugin.md" in message, message
        assert hm.arch.name == "generic" and hm.cfg.n_layers == config.num_hidden_layers
        names = hm.hook_names
        assert names[0] == "hook_embed" and len(set(names)) == len(names)
        for i in range(hm.cfg.n_layers):
            block = [n[len(f"blocks.{i}.") :] for n in names if n.startswith(f"blocks.{i}.")]
            assert block[0] == "hook_resid_pre" and block[-1] == "hook_resid_post", block
            for flag, points in (
                (expected.branches, BRANCHES),
                (expected.attention_function, ("attn.hook_z",)),
                (expected.patterns, PATTERNS),
            ):
                if flag is not None:
                    assert all((p in block) == flag for p in points), f"layer {i}: expected {points} {flag}: {block}"
        if expected.final_norm is not None:
            assert ("ln_final.hook_normalized" in names) == expected.final_norm
        described = all(layout is not None for layout in hm.block_layouts)
        if self.described is not None:
            assert described == self.described, f"described: {described}, declared {self.described}: {message}"
        if described:
            check_described_weights(hm, inputs)
            hm.unwrap()
            return
        # undescribed: no queries, keys, values or per-head results; norm scales, hook_resid_mid and MLP activations
        # only on a layer of the mixer form (verified at wrap time, as a scaled-branch layer's: .generic.parallel)
        # (and ln_final.hook_scale only in a model with such a layer)
        mixer_form = {f"blocks.{i}." for i, b in enumerate(findings(model).blocks) if b.mixer is not None}
        verified = tuple(mixer_form) + (("ln_final.",) if mixer_form else ())
        for n in names:
            only_described = ("hook_q", "hook_k", "hook_v", "hook_result")
            if not n.startswith(verified):
                only_described += ("hook_scale", "hook_resid_mid", "mlp.hook_pre", "mlp.hook_post")
            assert not n.endswith(only_described), n
        for absent in ("ln_final.hook_normalized", "attn.hook_z", "hook_attn_out"):
            if not any(n.endswith(absent) for n in names):
                assert absent.split(".")[-1] in message, f"the warning does not say why {absent} is absent"
        head = model.get_output_embeddings()
        final: list[torch.Tensor] = []
        handle = head.register_forward_pre_hook(lambda m, args: final.append(args[0])) if head is not None else None
        try:
            with torch.no_grad():
                logits, cache = hm.run_with_cache(**inputs.kwargs(), names_filter="hook_embed")
        finally:
            if handle is not None:
                handle.remove()
        # W_E's rows are hook_embed (the embeddings as the model uses them: Granite's multiplier included)
        assert torch.equal(hm.W_E[inputs.input_ids], cache["hook_embed"]), "W_E[ids] != hook_embed"
        if head is not None:  # final @ W_U is the logits (logit scaling included), up to the bias b_U (not served)
            h, out = final[0], logits.float()
            assert_close(
                (h[:, 1:] - h[:, :-1]).float() @ hm.W_U.float(), out[:, 1:] - out[:, :-1], "final @ W_U vs logits"
            )
        for name in ("W_Q", "W_K", "W_O", "W_in", "W_out", "W_pos", "b_U"):
            with pytest.raises(WeightUnavailableError, match="writing-a-plugin"):
                getattr(hm, name)
        hm.unwrap()

    # --- the model as it was ----------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_no_hooks_is_bitwise_and_wrapping_leaves_no_trace(self, data: st.DataObject) -> None:
        impl = data.draw(st.sampled_from(list(self.attn_implementations)), label="attn_implementation")
        _, model, inputs = self.draw(data, impl)
        impl = model.config._attn_implementation
        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
        model.train()  # the probe runs in eval mode and puts every module back as it was
        rng, hooks = torch.get_rng_state(), _hook_counts(model)
        hm = self.wrap(model)
        assert torch.equal(torch.get_rng_state(), rng), "wrapping changed the random state"
        assert all(m.training for m in model.modules()) and _hook_counts(model) == hooks
        assert model.config._attn_implementation == impl
        model.eval()
        assert_unchanged_by_caching(hm, inputs, reference)
        assert model.config._attn_implementation == impl
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_identity_hooks_fire_in_order_and_keep_logits(self, data: st.DataObject) -> None:
        _, model, inputs, hm = self.draw_wrapped(data)
        calls: list[str] = []

        def copy(t: torch.Tensor, hook: Any) -> torch.Tensor:
            calls.append(hook.name)
            return t.clone()

        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
            logits = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(lambda n: True, copy)])
        assert calls == hm.hook_names, "hook points must fire once each, in the order of hook_names"
        assert_close(logits[inputs.valid], reference[inputs.valid], "identity hooks")
        hm.unwrap()

    # --- values ------------------------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_residual_points_are_the_hidden_states(self, data: st.DataObject) -> None:
        """``resid_pre``/``resid_post`` are HF's ``output_hidden_states``, the final norm's output is what the
        unembedding reads, and where attention and MLP outputs are served the residual stream is their sum."""
        _, model, inputs, hm = self.draw_wrapped(data)
        v, n = inputs.valid, hm.cfg.n_layers
        unembedded: list[torch.Tensor] = []
        head = model.get_output_embeddings()
        with torch.no_grad():
            hidden = model(**inputs.kwargs(), output_hidden_states=True).hidden_states
            handle = head.register_forward_pre_hook(lambda m, args: unembedded.append(args[0])) if head else None
            try:
                _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=lambda name: not name.endswith(PATTERNS))
            finally:
                if handle is not None:
                    handle.remove()
        for i in range(n):
            assert_close(cache["resid_pre", i][v], hidden[i][v], f"blocks.{i}.hook_resid_pre == hidden_states[{i}]")
            if i + 1 < n:
                assert_close(cache["resid_post", i][v], hidden[i + 1][v], f"blocks.{i}.hook_resid_post")
            if f"blocks.{i}.hook_attn_out" in cache:
                assert_close(
                    cache["resid_post", i],
                    cache["resid_pre", i] + cache["attn_out", i] + cache["mlp_out", i],
                    f"layer {i}: resid_post == resid_pre + attn_out + mlp_out",
                )
        if "ln_final.hook_normalized" in cache and unembedded:
            final = self.final_output(hm, cache["ln_final.hook_normalized"])
            assert_close(final[v], unembedded[0][v], "the final norm's output is what the unembedding reads")
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_patterns_match_hf_eager(self, data: st.DataObject) -> None:
        if self.patterns is False:
            pytest.skip("this architecture gets no attention patterns")
        impl = data.draw(st.sampled_from(list(self.attn_implementations)), label="attn_implementation")
        _, model, inputs, hm = self.draw_wrapped(data, impl)
        assume(any(n.endswith("attn.hook_pattern") for n in hm.hook_names))
        impl = model.config._attn_implementation
        with torch.no_grad():
            model.config._attn_implementation = "eager"
            reference = model(**inputs.kwargs(), output_attentions=True).attentions
            model.config._attn_implementation = impl
            _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=lambda n: n.endswith("hook_pattern"))
        rows = inputs.valid[:, None, :, None]
        for i in range(hm.cfg.n_layers):
            name = f"blocks.{i}.attn.hook_pattern"
            if name in cache:
                pattern = cache[name]
                keep = rows.expand_as(pattern)
                assert_close(pattern[keep], reference[i][keep], f"layer {i} pattern vs HF eager")
                # a padded query's row is what the implementation gives an empty row; a real query's ignores padding
                pad_keys = (rows & (~inputs.valid)[:, None, None, :]).expand_as(pattern)
                assert (pattern[pad_keys] == 0).all(), "pattern attends to padding"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_unwrap_and_exceptions_leave_nothing(self, data: st.DataObject) -> None:
        _, model, inputs = self.draw(data)
        state = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
        hooks, impl = _hook_counts(model), model.config._attn_implementation
        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
            attributes = _instance_attributes(model)
            hm = self.wrap(model)
            last = hm.hook_names[-2]  # inside the last block: every earlier site is installed when it raises

            def boom(t: torch.Tensor, hook: Any) -> None:
                raise RuntimeError("user hook failed")

            with pytest.raises(RuntimeError, match="user hook failed"):
                hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(lambda n: True, perturb), (last, boom)])
            assert _hook_counts(model) == hooks and _instance_attributes(model) == attributes
            assert model.config._attn_implementation == impl
            hm.add_hook(lambda n: True, lambda t, hook: t.clone(), is_permanent=True)
            hm(**inputs.kwargs())
            assert hm.unwrap() is model
            assert _hook_counts(model) == hooks and _instance_attributes(model) == attributes
            assert model.config._attn_implementation == impl
            assert torch.equal(model(**inputs.kwargs()).logits, reference)
        for k, value in model.state_dict().items():
            assert value.data_ptr() == state[k][0] and torch.equal(value, state[k][1]), k
