"""The generic contract's edit properties: every point's edit is used downstream as if the model had computed it
(activation patching, attention edits, in-place edits, edits during generation). Mixed into
:class:`~lensadapters.testing.generic.GenericContract`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from lensadapters.testing.contract_support import (
    assert_close,
    check_edited_generation,
    close,
    perturb,
    perturbed_logits,
)
from lensadapters.testing.generic_support import _SETTINGS, BRANCHES, QUERY_SIDE, GenericBase, _real


class GenericEdits(GenericBase):
    """The edit properties of :class:`~lensadapters.testing.generic.GenericContract`."""

    @_SETTINGS
    @given(data=st.data())
    def test_every_point_edit_changes_the_logits(self, data: st.DataObject) -> None:
        _, model, inputs, hm = self.draw_wrapped(data)
        v = inputs.valid
        with torch.no_grad():
            reference = hm(**inputs.kwargs()).logits
            for name in hm.hook_names:
                logits = perturbed_logits(hm, inputs, name)
                if name.endswith("attn.hook_attn_scores") and close(logits[v], reference[v], atol=1e-5, rtol=0):
                    # a saturated softmax can absorb a rescaled score: the pattern must still show the edit
                    pattern = name.replace("hook_attn_scores", "hook_pattern")
                    _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=pattern)
                    with hm.hooks([(name, perturb)]):
                        _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=pattern)
                    assert not torch.equal(edited[pattern], base[pattern]), f"editing {name} changed no pattern"
                    continue
                assert not close(logits[v], reference[v], atol=1e-5, rtol=0), f"editing {name} left the logits alone"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_patching_a_point_from_other_tokens_acts_as_computed(self, data: st.DataObject) -> None:
        """Replacing a point's value with its value on other tokens (activation patching) does what the model
        would do with that value: the residual points and the final norm then give the other tokens' logits; an
        attention or MLP output enters the residual stream as is; hook_z determines the attention output and the
        scores the pattern."""
        _, model, inputs, hm = self.draw_wrapped(data)
        name = data.draw(st.sampled_from(hm.hook_names), label="point")
        v = inputs.valid
        other = self.other_inputs(inputs, hm.W_E.shape[0], data.draw(st.integers(0, 2**16), label="other"))
        block, short = (name.split(".", 2)[:2], name.split(".", 2)[2]) if name.startswith("blocks.") else (None, name)
        pre = ".".join(block) + "." if block else ""
        watch = [n for n in hm.hook_names if block and n.startswith(pre)] or [name]
        with torch.no_grad():
            reference, mine = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
            theirs, their_cache = hm.run_with_cache(**other, names_filter=watch)
            patched = their_cache[name]
            with hm.hooks([(name, lambda t, hook: patched)]):
                logits, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
        assert torch.equal(cache[name], patched)
        if short in ("hook_embed", "hook_resid_pre", "hook_resid_post", "ln_final.hook_normalized"):
            assert_close(logits[v], theirs[v], f"patching {name} gives the other tokens' logits")
        elif short in BRANCHES:
            assert_close(
                cache[pre + "hook_resid_post"],
                cache[pre + "hook_resid_pre"] + cache[pre + "hook_attn_out"] + cache[pre + "hook_mlp_out"],
                f"patched {name} enters the residual stream",
            )
        elif short == "attn.hook_z" and pre + "hook_attn_out" in watch:
            assert_close(
                cache[pre + "hook_attn_out"][v],
                their_cache[pre + "hook_attn_out"][v],
                f"patching {name} gives the other tokens' attention output",
            )
        elif short == "attn.hook_attn_scores":
            pattern = pre + "attn.hook_pattern"
            assert_close(
                _real(cache[pattern], pattern, v),
                _real(their_cache[pattern], pattern, v),
                f"patching {name} gives the other tokens' pattern",
            )
        # a row's first real token attends to itself alone: its query changes nothing (the other tokens may share
        # every later token with these, so only the first differs)
        moved = v & ~(v & (v.cumsum(1) == 1)) if short in QUERY_SIDE else v
        if not close(_real(patched, name, moved), _real(mine[name], name, moved), atol=1e-4, rtol=0):
            assert not close(logits[v], reference[v], atol=1e-6, rtol=0), f"patching {name} left the logits alone"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_attention_edits_are_used(self, data: st.DataObject) -> None:
        """Uniform scores give a uniform pattern; a pattern that attends only to the first real token makes every
        position's ``hook_z`` that token's; zeroing ``hook_z`` leaves only the output projection's bias."""
        if self.attention_function is False:
            pytest.skip("this architecture does not call the attention interface")
        _, model, inputs, hm = self.draw_wrapped(data)
        layers = [i for i in range(hm.cfg.n_layers) if f"blocks.{i}.attn.hook_z" in hm.hook_names]
        assume(layers)
        i = data.draw(st.sampled_from(layers), label="layer")
        pre, v = f"blocks.{i}.", inputs.valid
        names = [n for n in hm.hook_names if n.startswith(pre)]
        first = torch.tensor(inputs.pad)  # each row's first real token
        with torch.no_grad():
            reference = hm(**inputs.kwargs()).logits
            if pre + "attn.hook_pattern" in names:

                def uniform(s: torch.Tensor, hook: Any) -> torch.Tensor:
                    return torch.where(torch.isfinite(s), torch.zeros_like(s), s)

                with hm.hooks([(pre + "attn.hook_attn_scores", uniform)]):
                    _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
                pattern = cache[pre + "attn.hook_pattern"]
                allowed = (pattern > 0).sum(-1, keepdim=True)
                assert_close(
                    pattern[v[:, None, :, None].expand_as(pattern)],
                    (pattern > 0).float().div(allowed)[v[:, None, :, None].expand_as(pattern)],
                    "uniform scores give a uniform pattern",
                )

                def one_hot(p: torch.Tensor, hook: Any) -> torch.Tensor:
                    out = torch.zeros_like(p)
                    out[torch.arange(p.shape[0]), ..., first] = 1.0
                    return out

                with hm.hooks([(pre + "attn.hook_pattern", one_hot)]):
                    _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
                z = cache[pre + "attn.hook_z"]
                for b in range(z.shape[0]):
                    rows = z[b, inputs.valid[b]]
                    assert_close(rows, rows[:1].expand_as(rows), "every position mixes the first token's value")
            with hm.hooks([(pre + "attn.hook_z", lambda z, hook: torch.zeros_like(z))]):
                logits, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
            if pre + "hook_attn_out" in names:
                out = cache[pre + "hook_attn_out"][v]
                assert_close(out, out[:1].expand_as(out), "attn_out with zero z is the same at every position")
            assert not close(logits[v], reference[v], atol=1e-6, rtol=0), "zeroing hook_z left the logits alone"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_in_place_edits_equal_returned_edits(self, data: st.DataObject) -> None:
        _, model, inputs, hm = self.draw_wrapped(data)
        name = data.draw(st.sampled_from(hm.hook_names), label="point")

        def in_place(t: torch.Tensor, hook: Any) -> None:
            t.mul_(1.5)

        with torch.no_grad():
            returned = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(name, lambda t, hook: t * 1.5)])
            edited = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(name, in_place)])
        assert_close(edited[inputs.valid], returned[inputs.valid], f"{name}: an in-place edit is the returned edit")
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_edits_during_generation_match_one_pass(self, data: st.DataObject) -> None:
        config, model, inputs, hm = self.draw_wrapped(data, left_padding=False)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        options = [
            n
            for n in hm.hook_names
            if n.startswith(f"blocks.{layer}.")
            and n.endswith(("hook_resid_post", "attn.hook_z", "attn.hook_pattern", "hook_mlp_out"))
        ]
        point = data.draw(st.sampled_from(options), label="point")
        check_edited_generation(hm, inputs, point, lambda t, hook: t * 1.5, lambda logits: 1e-3)
        hm.unwrap()
