"""The contract's properties of whole runs: generation with hooks, and the model staying the user's after
unwrap and exceptions (sections 6 and 7 of :class:`~lensadapters.testing.AdapterContract`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from lensadapters.api.hooked_model import HookedModel
from lensadapters.errors import HookReturnError, UnknownHookError
from lensadapters.testing.contract_support import (
    _SETTINGS,
    _hook_counts,
    _instance_attributes,
    assert_close,
    assert_refuses_causal_operations,
    attention_layers,
    check_edited_generation,
    is_causal,
)


class RunProperties:
    """Properties 6-7: generation, unwrap, errors (mixed into ``AdapterContract``)."""

    # --- 6. generation -------------------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_generation_with_hooks_matches(self, data: st.DataObject) -> None:
        """Generation with hooks gives the logits of generation without; a model that is not a causal LM (an
        encoder) refuses to generate instead, with ``NotCausalError``."""
        model, inputs = self.draw(data)
        if self.refused_as_not_causal(model, inputs):
            return
        pad = getattr(model.config, "pad_token_id", None)
        kwargs = dict(
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad if pad is not None else 0,
        )
        impl = model.config._attn_implementation
        with torch.no_grad():
            reference = model.generate(**inputs.kwargs(), **kwargs)
            hm = self.wrap(model)
            shapes: list[int] = []

            def record(t: torch.Tensor, hook: Any) -> None:
                shapes.append(t.shape[1])

            hooks = [
                (lambda n: n.endswith(("hook_resid_post", "hook_pattern", "hook_q")), lambda t, hook: t.clone()),
                ("blocks.0.hook_resid_pre", record),
            ]
            with hm.hooks(hooks):
                hooked = hm.generate(**inputs.kwargs(), **kwargs)
        assert shapes[0] == inputs.input_ids.shape[1] and all(s == 1 for s in shapes[1:]), shapes
        for step, (a, b) in enumerate(zip(reference.logits, hooked.logits)):
            assert_close(a, b, f"step {step} logits with hooks", atol=1e-3)
            ta, tb = (
                reference.sequences[:, inputs.input_ids.shape[1] + step],
                hooked.sequences[:, inputs.input_ids.shape[1] + step],
            )
            if not torch.equal(ta, tb):  # a near-tie may flip; later steps are no longer comparable
                break
        assert model.config._attn_implementation == impl
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_edits_during_generation_match_one_pass(self, data: st.DataObject) -> None:
        """An edit applied while generating with the KV cache gives the logits of one pass over the generated
        sequence with the same edit: edits of keys and values are what the cache holds, residual and pattern edits
        apply at every step."""
        model, inputs = self.draw_for_generation(data)
        if self.refused_as_not_causal(model, inputs):
            return
        hm = self.wrap(model)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        rotary = f"blocks.{layer}.attn.hook_rot_k" in hm.hook_names
        candidates = [
            "hook_resid_post",
            "attn.hook_v",
            "attn.hook_rot_k" if rotary else "attn.hook_k",
            "attn.hook_pattern",
            "mlp.hook_post",
        ]  # those the layer has (a block with another token mixer has no attn.* point)
        point = f"blocks.{layer}." + data.draw(
            st.sampled_from([n for n in candidates if f"blocks.{layer}.{n}" in hm.hook_names]), label="point"
        )
        bump = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(layer))

        def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:  # the same at every position
            return t + bump.to(t.dtype) if hook.name.endswith("resid_post") else t * 1.5

        pad = getattr(model.config, "pad_token_id", None)
        one_pass, unedited, prompt = check_edited_generation(hm, inputs, point, edit, self.generation_atol, pad)
        atol = self.generation_atol(one_pass)
        hm.unwrap()
        # an edit too weak to tell apart from rounding proves nothing: such examples do not count
        assume((one_pass - unedited)[:, prompt - 1 :].abs().max().item() > 4 * atol)

    def refused_as_not_causal(self, model: Any, inputs: Any) -> bool:
        """For a model that is not a causal LM: check that generation and the next-token loss are refused (see
        :func:`~lensadapters.testing.contract_support.assert_refuses_causal_operations`) and return ``True``; for
        a causal LM return ``False`` (the generation properties then run)."""
        hm = self.wrap(model)
        causal = is_causal(hm)
        if not causal:
            assert_refuses_causal_operations(hm, inputs.input_ids)
        hm.unwrap()
        return not causal

    def draw_for_generation(self, data: st.DataObject) -> Any:
        """The model and (unpadded) inputs of the generation property; a variant whose models round a decoding
        step and a one-pass forward differently by themselves draws models that do not."""
        return self.draw(data, left_padding=False)

    def generation_atol(self, logits: torch.Tensor) -> float:
        """Tolerance between a KV-cache decoding step and a one-pass forward over the same tokens."""
        return 1e-3

    # --- 7. the model stays the user's -----------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_unwrap_and_exceptions_leave_nothing(self, data: st.DataObject) -> None:
        model, inputs = self.draw(data)
        modules = list(model.named_modules())
        state = {k: (v.data_ptr(), v.clone()) for k, v in self.model_state(model).items()}
        baseline_hooks = _hook_counts(model)
        impl = model.config._attn_implementation
        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
            attributes = _instance_attributes(model)  # after a forward: lazily cached attributes exist
            hm = self.wrap(model)
            assert HookedModel.wrap(model) is hm, "wrapping twice must return the same wrapper"

            def boom(t: torch.Tensor, hook: Any) -> None:
                raise RuntimeError("user hook failed")

            layers = attention_layers(hm)  # the first block with an attention pattern (a hybrid's may be later)
            failing = f"blocks.{layers[0]}.attn.hook_pattern" if layers else "blocks.0.hook_resid_pre"
            with pytest.raises(RuntimeError, match="user hook failed"):
                hm.run_with_hooks(
                    **inputs.kwargs(), fwd_hooks=[(failing, boom), (lambda n: True, lambda t, hook: t.clone())]
                )
            assert _hook_counts(model) == baseline_hooks, "a failing hook left PyTorch hooks behind"
            assert _instance_attributes(model) == attributes, "a failing hook left instance attributes behind"
            assert model.config._attn_implementation == impl
            hm.add_hook(lambda n: True, lambda t, hook: t.clone(), is_permanent=True)
            hm(**inputs.kwargs())
            assert _hook_counts(model) > baseline_hooks
            assert [n for n, _ in model.named_modules()] == [n for n, _ in modules]
            assert all(a is b for (_, a), (_, b) in zip(model.named_modules(), modules))
            back = hm.unwrap()
            assert back is model
            assert _hook_counts(model) == baseline_hooks
            assert _instance_attributes(model) == attributes, "unwrap left instance attributes behind"
            assert torch.equal(model(**inputs.kwargs()).logits, reference)
            for k, v in self.model_state(model).items():
                assert v.data_ptr() == state[k][0] and torch.equal(v, state[k][1]), k

    @_SETTINGS
    @given(data=st.data())
    def test_bad_hooks_get_clear_errors(self, data: st.DataObject) -> None:
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        with pytest.raises(UnknownHookError, match="blocks.0.hook_resid_pre"):
            hm.add_hook("blocks.0.hook_resid_pr", lambda t, hook: None)
        with pytest.raises(HookReturnError, match="blocks.0.hook_resid_pre") as info:
            hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[("blocks.0.hook_resid_pre", lambda t, hook: t[:, :1])])
        expected = tuple(inputs.input_ids.shape) + (hm.cfg.d_model,)
        assert str(expected) in str(info.value) and "shape" in str(info.value)
        assert not any(p.active for p in hm.hook_dict.values())
        hm.unwrap()
