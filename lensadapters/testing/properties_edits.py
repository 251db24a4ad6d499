"""The contract's properties of edits: every edit reaches exactly what it should (section 5 of
:class:`~lensadapters.testing.AdapterContract`)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from hypothesis import given
from hypothesis import strategies as st

from lensadapters.adapters.moe import ROUTING_POINTS, FusedExperts, is_expert_point, is_moe
from lensadapters.api.hooked_model import HookedModel
from lensadapters.testing.contract_support import (
    _SETTINGS,
    RTOL,
    _attention_witness,
    _flatten_scores,
    assert_close,
    attention_layers,
    close,
    perturb,
    perturbed_logits,
    uncap,
)


def is_moe_point(name: str) -> bool:
    """Whether a hook name is a mixture-of-experts point (routing or per-expert, :mod:`lensadapters.moe`)."""
    return is_expert_point(name) or name.split(".", 2)[-1] in ROUTING_POINTS


class EditProperties:
    """Property 5: an edit changes everything downstream as the model would (mixed into ``AdapterContract``).

    Blocks whose MLP is a mixture of experts (any model: a MoE family, a hybrid one with MoE layers, experts beside
    a dense MLP) are edited in their MoE form: ``mlp.hook_expert_indices`` holds integers, edited by moving every
    token to the next expert (:meth:`_edit_for`); an expert that no real token chose has no rows whose edit could
    show; the per-expert points of one drawn expert per MoE layer stand for the others (:meth:`points_to_edit`).
    """

    # --- MoE blocks: what each edit property edits there ---------------------------------------------------

    @staticmethod
    def moe_layers(hm: Any) -> list[int]:
        return [i for i, layout in enumerate(hm.mlp_layouts) if is_moe(layout)]

    def _edit_for(self, name: str, hm: Any) -> Any:
        """The generic perturbation, or for expert indices a permutation of the experts (still valid indices)."""
        if name.endswith("mlp.hook_expert_indices"):
            n = hm.cfg.num_experts
            return lambda t, hook: (t + 1) % n
        if name.endswith(("mlp.hook_router_logits", "mlp.hook_expert_weights")):
            # rolled over the experts: every token's selection moves to other experts (under top-1 a rescaled,
            # noisy ranking may keep the same expert, whose renormalized weight is always 1)
            return lambda t, hook: perturb(t.roll(1, -1), hook)
        return perturb

    def _absorbed_by_activation(self, hm: Any, name: str, inputs: Any) -> bool:
        """Whether the generic edit of an expert's gate or up projection (``experts.{e}.hook_gate``/``hook_pre``)
        leaves what the expert's declared activation (``FusedExperts.glu``, read from the live module) computes
        from them unchanged, bitwise: a clamped GLU (GPT-OSS's ``min(g, limit)``, ``clamp(u, -limit, limit)``)
        saturated on every row the expert computes absorbs the edit, as it would absorb the model's own values."""
        if not name.endswith((".hook_gate", ".hook_pre")) or ".mlp.experts." not in name:
            return False
        layer = int(name.split(".")[1])
        experts = hm.mlp_layouts[layer].experts
        if not isinstance(experts, FusedExperts) or experts.glu is None:
            return False
        prefix = name.rsplit(".", 1)[0]
        _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=[prefix + ".hook_gate", prefix + ".hook_pre"])
        gate, up = cache[prefix + ".hook_gate"], cache[prefix + ".hook_pre"]
        edit = self._edit_for(name, hm)
        edited_gate = edit(gate, hm.hook_dict[name]) if name.endswith("hook_gate") else gate
        edited_up = edit(up, hm.hook_dict[name]) if name.endswith("hook_pre") else up
        module = hm.wiring.block_modules[layer].get_submodule(experts.module)
        return torch.equal(experts.glu(module, edited_gate, edited_up), experts.glu(module, gate, up))

    def points_to_edit(self, data: st.DataObject, hm: Any) -> list[str]:
        """Every hook point, with the per-expert points of one drawn expert per MoE layer (the experts' points are
        alike; editing all of them, one forward each, would dominate the suite's time). Nothing is drawn for a model
        without MoE layers."""
        keep = {}
        for layer in self.moe_layers(hm):
            n = hm.mlp_layouts[layer].routing.n_experts
            keep[layer] = data.draw(st.integers(0, n - 1), label=f"edited expert of layer {layer}")
        names = []
        for name in hm.hook_names:
            parts = name.split(".")
            if ".mlp.experts." in name and keep.get(int(parts[1])) != int(parts[4]):
                continue
            names.append(name)
        return names

    def _expert_indices(self, hm: HookedModel, inputs: Any) -> dict[int, torch.Tensor]:
        """Each MoE layer's ``mlp.hook_expert_indices`` on ``inputs`` (computed once per model and inputs)."""
        memo = getattr(self, "_indices_memo", None)
        if memo is None or memo[0] is not hm or memo[1] is not inputs:
            names = [f"blocks.{i}.mlp.hook_expert_indices" for i in self.moe_layers(hm)]
            _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
            memo = (hm, inputs, {i: cache[f"blocks.{i}.mlp.hook_expert_indices"] for i in self.moe_layers(hm)})
            self._indices_memo = memo
        return memo[2]

    def assert_moe_edit_shows(self, hm: HookedModel, inputs: Any, name: str, reference: torch.Tensor) -> None:
        """An edit of MoE point ``name`` (:meth:`_edit_for`) changes the logits by more than 1e-5, where it can:
        the point fires (a per-expert point with the expert's rows: the tokens that chose it); an expert no real
        token chose, an edit a clamped GLU absorbs (as it absorbs the model's own values), and new indices when
        there is a single expert change nothing."""
        rows: list[int] = []

        def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
            rows.append(t.shape[0])
            return self._edit_for(hook.name, hm)(t, hook)

        logits = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(name, edit)])
        assert rows, f"{name} never fired"
        if is_expert_point(name):
            layer, expert = int(name.split(".")[1]), int(name.split(".")[4])
            chosen = self._expert_indices(hm, inputs)[layer] == expert
            used = int(chosen.sum())
            assert rows == [used], f"{name} fired with {rows} rows; the expert computes {used}"
            if not chosen[inputs.valid].any() or self._absorbed_by_activation(hm, name, inputs):
                return  # no rows (or only padding's), or a saturated clamped GLU: nothing the logits can show
        if name.endswith("hook_expert_indices") and hm.cfg.num_experts < 2:
            return
        diff = (logits - reference)[inputs.valid].abs().max().item()
        assert diff > 1e-5, f"editing {name} did not change the logits (max change {diff:.2g})"

    # --- 5. edits ------------------------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_every_hook_point_edit_changes_logits(self, data: st.DataObject) -> None:
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        with torch.no_grad():
            reference = hm(**inputs.kwargs()).logits
            for name in self.points_to_edit(data, hm):
                self.assert_edit_shows(hm, model, inputs, name, reference)
        hm.unwrap()

    def assert_edit_shows(
        self, hm: HookedModel, model: torch.nn.Module, inputs: Any, name: str, reference: torch.Tensor
    ) -> None:
        """An edit of ``name`` (:func:`perturb`) changes the logits of ``inputs`` (``reference``: without it) by more
        than 1e-5; where it does not, it must change its witness: the scores or the pattern for a query/key/score
        point a saturated softmax hides, the next hook point for a declared ``absorbed_points`` edit (norms further
        on undo it up to their eps). A MoE point is checked in its MoE form (:meth:`assert_moe_edit_shows`). Every
        variant of the edit property (float, 8-bit...) checks its points with it."""
        if is_moe_point(name):
            return self.assert_moe_edit_shows(hm, inputs, name, reference)
        logits = perturbed_logits(hm, inputs, name)
        diff = (logits - reference)[inputs.valid].abs().max().item()
        witness = _attention_witness(hm, name)
        if name.split(".", 2)[-1] in self.capabilities(model).absorbed_points and name.startswith("blocks."):
            # scale-invariant norms further on undo this edit (up to their eps): it must show on the next point
            witness = hm.hook_names[hm.hook_names.index(name) + 1]
        if diff <= 1e-5 and witness is not None:
            # a saturated softmax (tiny random models, two tokens) can hide a query/key edit from the
            # logits; the edit must then still reach what attention computes from it. (A saturated
            # pattern stays saturated under a rescaled, noisy score: the scores are flattened instead.)
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=[witness])
            with hm.hooks([(name, _flatten_scores if name.endswith("hook_attn_scores") else perturb)]):
                _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=[witness])
            a, b = edited[witness], base[witness]
            finite = torch.isfinite(a) & torch.isfinite(b)
            changed = (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
            assert changed > 1e-5 or bool((torch.isfinite(a) != torch.isfinite(b)).any()), (
                f"editing {name} changed neither the logits (max change {diff:.2g}) nor {witness}"
            )
            return
        assert diff > 1e-5, f"editing {name} did not change the logits (max change {diff:.2g})"

    @_SETTINGS
    @given(data=st.data())
    def test_in_place_edits_equal_returned_edits(self, data: st.DataObject) -> None:
        """Editing the given tensor in place (TransformerLens allows it) is the same edit as returning a new one.

        Whether the hook then returns ``None`` or its argument, and under ``no_grad`` or ``inference_mode``
        (whose tensors have no version counter), at every hook point: an in-place edit is never silently
        ignored and never leaks into a tensor the model uses elsewhere.
        """
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        returns = data.draw(st.booleans(), label="the hook returns its argument")
        mode = data.draw(st.sampled_from([torch.no_grad, torch.inference_mode]), label="grad mode")
        v = inputs.valid

        with mode():
            for name in self.points_to_edit(data, hm):  # MoE blocks: expert indices edited as indices
                fn = self._edit_for(name, hm)

                def in_place(t: torch.Tensor, hook: Any, fn: Any = fn) -> Optional[torch.Tensor]:
                    t.copy_(fn(t, hook))
                    return t if returns else None

                expected = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(name, fn)])
                got = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(name, in_place)])
                assert_close(got[v], expected[v], f"in-place edit of {name} vs the same edit returned")
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_zero_ablating_a_head_removes_its_output(self, data: st.DataObject) -> None:
        """Zeroing a head's ``hook_z`` is removing ``z_h @ W_O[h]`` from ``hook_attn_out``, and dropping the head at
        ``hook_result`` is the same edit. Where a norm follows the output projection (declared ``post_norms``),
        both edits remove the contribution from that norm's input (``hook_normalized * hook_scale``; centred for
        a LayerNorm) instead: ``hook_attn_out`` is no sum of head contributions there, and the logits after a
        norm of an almost zero attention output (one head out of one) would turn rounding into differences."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        post_norm = self.capabilities(model).post_norms.get("hook_attn_out")
        layer = data.draw(st.sampled_from(attention_layers(hm)), label="layer")
        head = data.draw(st.integers(0, hm.cfg.n_heads - 1), label="head")
        pre = f"blocks.{layer}."
        norm = f"{pre}{post_norm}" if post_norm else None
        watch = [pre + "attn.hook_z"] + ([norm + ".hook_normalized", norm + ".hook_scale"] if norm else [])

        def ablate(t: torch.Tensor, hook: Any) -> torch.Tensor:
            t = t.clone()
            t[:, :, head] = 0
            return t

        with torch.no_grad():
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
            contribution = torch.einsum("bpd,dm->bpm", base["z", layer][:, :, head], hm.W_O[layer, head])
            v = inputs.valid
            if norm is not None:
                for point in ("attn.hook_z", "attn.hook_result"):
                    with hm.hooks([(pre + point, ablate)]):
                        _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
                    expected = self._norm_input(hm, base, norm) - contribution
                    if hm.norm_spec(hm.norm_module(norm)).kind == "LN":
                        expected = expected - expected.mean(-1, keepdim=True)
                    assert_close(
                        self._norm_input(hm, edited, norm)[v],
                        expected[v],
                        f"{point} ablation removes the head's W_O contribution before {post_norm}",
                    )
                hm.unwrap()
                return

            def subtract(out: torch.Tensor, hook: Any) -> torch.Tensor:
                return out - contribution

            ablated = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(pre + "attn.hook_z", ablate)])
            subtracted = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(pre + "hook_attn_out", subtract)])
            # hook_result agrees: dropping one head's result is the same edit
            dropped = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(pre + "attn.hook_result", ablate)])
        assert_close(ablated[v], subtracted[v], "z ablation == removing the head's W_O contribution")
        assert_close(dropped[v], subtracted[v], "hook_result ablation == removing the head's contribution")
        hm.unwrap()

    @staticmethod
    def _norm_input(hm: HookedModel, cache: Any, prefix: str) -> torch.Tensor:
        """A norm's input as its hook points give it: ``hook_normalized * hook_scale`` (a LayerNorm's, centred
        and before its weight and bias)."""
        normalized = cache[f"{prefix}.hook_normalized"]
        spec = hm.norm_spec(hm.norm_module(prefix))
        if spec.kind == "LN":
            normalized = normalized - (spec.bias if spec.bias is not None else 0)
            normalized = normalized / spec.weight if spec.weight is not None else normalized
        return normalized * cache[f"{prefix}.hook_scale"]

    @_SETTINGS
    @given(data=st.data())
    def test_residual_edits_reach_what_they_should(self, data: st.DataObject) -> None:
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        pre = f"blocks.{layer}."
        names = set(hm.hook_names)
        watch = [
            pre + n
            for n in (
                "hook_resid_pre",
                "hook_attn_out",
                "hook_resid_mid",
                "hook_mlp_in",
                "hook_mlp_out",
                "hook_resid_post",
            )
            if pre + n in names
        ]
        delta = torch.randn(inputs.input_ids.shape + (hm.cfg.d_model,), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)

            def add(t: torch.Tensor, hook: Any) -> torch.Tensor:
                return t + delta.to(t.dtype)

            if pre + "hook_resid_mid" in names and self.pre_ln_residual(model):
                with hm.hooks([(pre + "hook_resid_mid", add)]):
                    _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
                mid = base["resid_mid", layer] + delta
                assert_close(edited["resid_mid", layer], mid, "edited resid_mid is seen")
                assert_close(edited["mlp_in", layer], mid, "resid_mid edit reaches the MLP input")
                assert_close(
                    edited["resid_post", layer], mid + edited["mlp_out", layer], "resid_mid edit reaches the residual"
                )
            if pre + "hook_mlp_in" in names and self.pre_ln_residual(model):
                with hm.hooks([(pre + "hook_mlp_in", add)]):
                    _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
                assert not close(edited["mlp_out", layer], base["mlp_out", layer]), "mlp_in edit ignored"
                resid = (
                    base["resid_mid", layer]
                    if pre + "hook_resid_mid" in names
                    else base["resid_pre", layer] + base["attn_out", layer]
                )
                assert_close(
                    edited["resid_post", layer],
                    resid + edited["mlp_out", layer],
                    "mlp_in edit changes only the MLP branch",
                )
            if pre + "hook_resid_mid" not in names and hm.block_layouts[layer].parallel:
                # parallel block: an attention edit does not reach the MLP of the same block
                with hm.hooks([(pre + "hook_attn_out", add)]):
                    _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
                if pre + "hook_mlp_in" in names:
                    assert torch.equal(edited["mlp_in", layer], base["mlp_in", layer])
                assert_close(edited["mlp_out", layer], base["mlp_out", layer], "parallel MLP untouched")
                assert_close(edited["resid_post", layer], base["resid_post", layer] + delta, "parallel residual")
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_norm_scale_edit_is_used(self, data: st.DataObject) -> None:
        """Doubling any norm's ``hook_scale`` halves its ``hook_normalized`` (a LayerNorm's before the bias) and
        changes the logits; where the contract declares ``post_norms`` or query norms (``score_invariant_points``),
        which a later norm or a saturated softmax may make absorb it, at least the first hook point after the
        norm's own."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        norm = data.draw(
            st.sampled_from([n[: -len(".hook_scale")] for n in hm.hook_names if n.endswith("hook_scale")]), label="norm"
        )
        spec = hm.norm_spec(hm.norm_module(norm))  # any norm with hook points, a plugin's own included
        names = [norm + ".hook_normalized"]
        declared = self.capabilities(model)
        if declared.post_norms or declared.score_invariant_points:
            after = hm.hook_names[hm.hook_names.index(names[0]) + 1 :]
            skipped: tuple[str, ...] = ("hook_scale", "hook_normalized")
            if names[0].endswith(declared.mixed_values):  # the values never reach the scores: hook_z shows them
                skipped += ("hook_attn_scores", "hook_pattern")
            names += [n for n in after if not n.endswith(skipped)][:1]
        with torch.no_grad():
            reference = hm(**inputs.kwargs()).logits
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
            with hm.hooks([(norm + ".hook_scale", lambda s, hook: s * 2)]):
                logits, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
        before, after = base[names[0]], edited[names[0]]
        if spec.kind == "LN":
            bias = spec.bias if spec.bias is not None else 0
            expected = (before - bias) / 2 + bias
        else:
            expected = before / 2
        assert_close(after, expected, f"{norm}: normalized with the doubled scale")
        if close(logits[inputs.valid], reference[inputs.valid]):
            assert len(names) > 1, f"scale edit of {norm} ignored"
            change = (base[names[1]] - edited[names[1]]).abs().max().item()
            assert change > 1e-5, f"scale edit of {norm} reached neither the logits nor {names[1]}"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_pattern_and_query_edits_are_used(self, data: st.DataObject) -> None:
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = data.draw(st.sampled_from(attention_layers(hm)), label="layer")
        pre = f"blocks.{layer}.attn."
        v = inputs.valid
        with torch.no_grad():
            mixed = f"blocks.{layer}.{self.capabilities(model).mixed_values}"
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=[mixed, pre + "hook_attn_scores"])

            def uniform(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
                allowed = (pattern > 0).to(pattern.dtype)
                return allowed / allowed.sum(-1, keepdim=True).clamp(min=1)

            with hm.hooks([(pre + "hook_pattern", uniform)]):
                _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=[pre + "hook_pattern", pre + "hook_z"])
            values = base[mixed].repeat_interleave(hm.cfg.n_heads // hm.cfg.n_key_value_heads, dim=2)
            expected_z = torch.einsum("bhqk,bkhd->bqhd", edited["pattern", layer], values)
            assert_close(edited["z", layer][v], expected_z[v], "hook_z mixes values with the edited pattern")
            # doubling the queries (or rotated queries) doubles every unmasked score (before a softcap), where
            # nothing between the point and the scores is nonlinear in the queries (declared: score_linear_points);
            # ahead of a scale-invariant query norm it changes nothing (declared: score_invariant_points)
            declared = self.capabilities(model)
            cap = getattr(model.config, declared.score_softcap, None) if declared.score_softcap else None
            scores = base["attn_scores", layer]
            finite = torch.isfinite(scores) & v[:, None, :, None]
            for points, factor in ((declared.score_linear_points, 2), (declared.score_invariant_points, 1)):
                for point in [f"blocks.{layer}.{p}" for p in points if f"blocks.{layer}.{p}" in hm.hook_names]:
                    with hm.hooks([(point, lambda q, hook: q * 2)]):
                        _, doubled = hm.run_with_cache(**inputs.kwargs(), names_filter=[pre + "hook_attn_scores"])
                    twice = doubled["attn_scores", layer]
                    assert torch.equal(torch.isfinite(twice), torch.isfinite(scores))
                    if cap:  # atanh is ill-conditioned near the cap: those scores are left out
                        keep = finite & (scores.abs() <= 0.99 * cap) & (twice.abs() <= 0.99 * cap)
                        assert_close(
                            uncap(twice, cap)[keep],
                            factor * uncap(scores, cap)[keep],
                            f"doubling {point} multiplies the scores before the softcap by {factor}",
                            atol=1e-3,
                            rtol=1e-3,
                        )
                    else:
                        assert_close(
                            twice[finite],
                            factor * scores[finite],
                            f"doubling {point} multiplies the scores by {factor}",
                            atol=1e-3,
                            rtol=1e-3 if factor == 1 else RTOL,
                        )
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_query_and_key_edits_reach_their_side_of_the_scores(self, data: st.DataObject) -> None:
        """Editing the keys of the first position changes only the first column of the layer's scores, editing the
        queries of the last position only the last row (rotated points too): queries and keys are not swapped,
        and an edit at one position stays at that position."""
        model, inputs = self.draw(data, left_padding=False)
        hm = self.wrap(model)
        layer = data.draw(st.sampled_from(attention_layers(hm)), label="layer")
        pre = f"blocks.{layer}.attn."
        scores = pre + "hook_attn_scores"
        last = inputs.input_ids.shape[1] - 1
        sides = [(pre + "hook_q", last, -2), (pre + "hook_k", 0, -1)]
        if pre + "hook_rot_q" in hm.hook_names:
            sides += [(pre + "hook_rot_q", last, -2), (pre + "hook_rot_k", 0, -1)]
        with torch.no_grad():
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=[scores])
            for point, position, axis in sides:

                def edit(t: torch.Tensor, hook: Any, position: int = position) -> torch.Tensor:
                    t = t.clone()
                    t[:, position] = perturb(t[:, position], hook)
                    return t

                with hm.hooks([(point, edit)]):
                    _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=[scores])
                a, b = base[scores], edited[scores]
                assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{point} edit changed the mask"
                changed = torch.zeros_like(a, dtype=torch.bool)
                finite = torch.isfinite(a)
                changed[finite] = (a[finite] - b[finite]).abs() > 1e-5 * (1 + a[finite].abs())
                line = changed.select(axis, position)
                assert not changed.index_fill(axis, torch.tensor([position]), False).any(), (
                    f"editing {point} at position {position} changed scores outside that "
                    f"{'row' if axis == -2 else 'column'}"
                )
                # every score of that line the mask lets through (all earlier keys, unless a window hides some)
                assert int(line.sum(-1).max()) == int(finite.select(axis, position).sum(-1).max()), (
                    f"editing {point} at position {position} did not change its whole "
                    f"{'row' if axis == -2 else 'column'} of scores"
                )
        hm.unwrap()
