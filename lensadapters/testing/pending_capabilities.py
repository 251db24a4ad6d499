"""Properties of the contract that some architectures have in another form, until the contract declares them.

The contract suite (``contract.py``) states a few properties in their Llama form: an edited query row changes
the score of *every* earlier key; doubling ``hook_q`` doubles the scores; ``hook_attn_out == z @ W_O + b_O``;
``hook_mlp_out == post @ W_out + b_out``; ``logits == final @ W_U + b_U``; a head is ablated by subtracting its
contribution from ``hook_attn_out``; norms are found through ``BlockLayout`` only. For architectures where one of
these is false (sliding windows, query/key norms, attention-logit softcaps, post norms, final-logit softcaps) the
mixins here override that single property with the property that is true, each method's docstring starting
``PENDING-CAPABILITY:``. Put a mixin before ``AdapterContract`` among a contract class' bases. When the contract
declares the capability, the override goes.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..hooked_model import HookedModel
from .contract import AdapterContract, assert_close, perturb

__all__ = ["PROPERTY_SETTINGS", "WindowedAttentionProperties", "NormedAttentionProperties", "PostNormProperties", "module_norms",
           "block_input_of_attention", "uncap"]

PROPERTY_SETTINGS = _SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.differing_executors])


def uncap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """The scores before an attention-logit softcap ``cap * tanh(s / cap)`` (``-inf`` stays ``-inf``)."""
    if cap <= 0:
        return scores
    return cap * torch.atanh((scores.double() / cap).clamp(-1 + 1e-15, 1 - 1e-15))


def module_norms(hm: HookedModel) -> dict[str, torch.nn.Module]:
    """Every norm's hook-point prefix (``blocks.0.ln1``, ``blocks.0.attn.q_norm``, ``ln_final``...) and its module."""
    return {name[: -len(".hook_scale")]: hm.norm_module(name[: -len(".hook_scale")])
            for name in hm.hook_names if name.endswith(".hook_scale")}


def block_input_of_attention(hm: HookedModel, cache: Any, layer: int) -> torch.Tensor:
    """What the attention of ``layer`` reads: ``ln1``'s output, or the block input without a pre-norm."""
    layout = hm.block_layouts[layer]
    if layout.ln1 is None:
        return cache["resid_pre", layer]
    spec = hm.norm_spec(hm.norm_module(f"blocks.{layer}.ln1"))
    normalized = cache[f"blocks.{layer}.ln1.hook_normalized"]
    return normalized if spec.weight is None else normalized * (spec.weight + spec.weight_offset)


class WindowedAttentionProperties(AdapterContract):
    """Sliding-window layers: a query attends only to the last ``window`` keys."""

    @_SETTINGS
    @given(data=st.data())
    def test_query_and_key_edits_reach_their_side_of_the_scores(self, data: st.DataObject) -> None:
        """PENDING-CAPABILITY: (sliding windows) editing the keys of the first position changes exactly the first
        column's scores that the layer's mask allows (the queries within the window of that key), editing the
        queries of the last position exactly the allowed entries of the last row (rotated points too), and
        nothing else: queries and keys are not swapped, an edit stays at its position, and the mask is
        unchanged. The contract's form requires the whole row (every earlier key), which a window shorter than
        the input masks."""
        model, inputs = self.draw(data, left_padding=False)
        hm = self.wrap(model)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
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
                finite = torch.isfinite(a)
                assert torch.equal(finite, torch.isfinite(b)), f"{point} edit changed the mask"
                changed = torch.zeros_like(a, dtype=torch.bool)
                changed[finite] = (a[finite] - b[finite]).abs() > 1e-5 * (1 + a[finite].abs())
                side = "row" if axis == -2 else "column"
                assert not changed.index_fill(axis, torch.tensor([position]), False).any(), (
                    f"editing {point} at position {position} changed scores outside that {side}")
                line, allowed = changed.select(axis, position), finite.select(axis, position)
                assert not (line & ~allowed).any()
                assert int(line.sum(-1).max()) == int(allowed.sum(-1).max()), (
                    f"editing {point} at position {position} did not change every allowed score of its {side}")
        hm.unwrap()


class NormedAttentionProperties(AdapterContract):
    """Query/key norms between projection and rotary (``q_norm``/``k_norm``) and attention-logit softcaps."""

    def _pre_cap(self, hm: HookedModel, scores: torch.Tensor) -> torch.Tensor:
        return uncap(scores, hm.cfg.attn_scores_soft_cap)

    @_SETTINGS
    @given(data=st.data())
    def test_pattern_and_query_edits_are_used(self, data: st.DataObject) -> None:
        """PENDING-CAPABILITY: (query norms, softcaps) a pattern edit is what ``hook_z`` mixes the values with;
        doubling the queries that attention multiplies with the keys (``hook_rot_q``, or ``hook_q`` without a
        query norm; with a query norm also its ``hook_normalized``) doubles every unmasked score *before* the
        attention-logit softcap (``cap * atanh(score / cap)``), and doubling ``hook_q`` ahead of a query norm
        leaves the scores as they were up to the norm's eps (an RMS norm is scale-invariant). The contract's form
        (doubling ``hook_q`` doubles the scores) holds only without a norm or softcap."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        pre = f"blocks.{layer}.attn."
        names = hm.hook_names
        v = inputs.valid
        normed = pre + "q_norm.hook_scale" in names
        with torch.no_grad():
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=[pre + "hook_v", pre + "hook_attn_scores"])

            def uniform(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
                allowed = (pattern > 0).to(pattern.dtype)
                return allowed / allowed.sum(-1, keepdim=True).clamp(min=1)

            with hm.hooks([(pre + "hook_pattern", uniform)]):
                _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=[pre + "hook_pattern", pre + "hook_z"])
            values = base["v", layer].repeat_interleave(hm.cfg.n_heads // hm.cfg.n_key_value_heads, dim=2)
            expected_z = torch.einsum("bhqk,bkhd->bqhd", edited["pattern", layer], values)
            assert_close(edited["z", layer][v], expected_z[v], "hook_z mixes values with the edited pattern")
            doubling = [p for p in (pre + "hook_rot_q", pre + "q_norm.hook_normalized") if p in names]
            if not normed:
                doubling.append(pre + "hook_q")
            scores = base["attn_scores", layer]
            finite = torch.isfinite(scores) & v[:, None, :, None]
            for point in doubling:
                with hm.hooks([(point, lambda q, hook: q * 2)]):
                    _, doubled = hm.run_with_cache(**inputs.kwargs(), names_filter=[pre + "hook_attn_scores"])
                twice = doubled["attn_scores", layer]
                assert torch.equal(torch.isfinite(twice), torch.isfinite(scores))
                cap = hm.cfg.attn_scores_soft_cap
                saturated = (scores.abs() > 0.99 * cap) | (twice.abs() > 0.99 * cap) if cap > 0 else None
                keep = finite if saturated is None else finite & ~saturated  # atanh is ill-conditioned near the cap
                assert_close(self._pre_cap(hm, twice)[keep], 2 * self._pre_cap(hm, scores)[keep],
                             f"{point} edit doubles the scores before the softcap", atol=1e-3, rtol=1e-3)
            if normed:
                with hm.hooks([(pre + "hook_q", lambda q, hook: q * 2)]):
                    _, doubled = hm.run_with_cache(**inputs.kwargs(), names_filter=[pre + "hook_attn_scores"])
                assert_close(doubled["attn_scores", layer][finite], scores[finite],
                             "doubling hook_q ahead of an RMS query norm", atol=1e-3, rtol=1e-3)
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_norm_scale_edit_is_used(self, data: st.DataObject) -> None:
        """PENDING-CAPABILITY: (norms outside BlockLayout: ``attn.q_norm``/``k_norm``; post norms) for every norm
        with hook points (found with ``hm.norm_module``), doubling ``hook_scale`` halves ``hook_normalized`` (RMS;
        LayerNorm: the part before the bias) and changes the logits — or, where a scale-invariant norm further on
        absorbs the change (a post norm after attention: halving ``ln1``'s output halves the values, which
        ``ln1_post`` scales back), the first hook point after the norm's own. The contract's form finds norms
        through ``BlockLayout`` only and requires the logits to change."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        norms = module_norms(hm)
        norm = data.draw(st.sampled_from(sorted(norms)), label="norm")
        spec = hm.norm_spec(norms[norm])
        names = hm.hook_names
        after_norm = names.index(norm + ".hook_normalized") + 1
        consumer = next((n for n in names[after_norm:] if not n.endswith(("hook_scale", "hook_normalized"))), None)
        watch = [norm + ".hook_normalized"] + ([consumer] if consumer else [])
        with torch.no_grad():
            reference = hm(**inputs.kwargs()).logits
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
            with hm.hooks([(norm + ".hook_scale", lambda s, hook: s * 2)]):
                logits, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
        before, after = base[watch[0]], edited[watch[0]]
        if spec.kind == "LN":
            bias = spec.bias if spec.bias is not None else 0
            expected = (before - bias) / 2 + bias
        else:
            expected = before / 2
        assert_close(after, expected, f"{norm}: normalized with the doubled scale")
        v = inputs.valid
        if torch.allclose(logits[v], reference[v], atol=1e-4, rtol=1e-4):
            assert consumer is not None, "scale edit ignored"
            a, b = base[consumer], edited[consumer]
            assert (a - b).abs().max().item() > 1e-5, f"scale edit of {norm} reached neither the logits nor {consumer}"
        hm.unwrap()


class PostNormProperties(NormedAttentionProperties):
    """Norms after the attention and MLP outputs (``ln1_post``/``ln2_post``), blocks without pre-norms, final-logit
    softcaps (and, from :class:`NormedAttentionProperties`, query/key norms and attention-logit softcaps)."""

    @staticmethod
    def _norm_input(cache: Any, prefix: str) -> torch.Tensor:
        """A norm's input from its hook points: ``hook_normalized * hook_scale`` (RMS)."""
        return cache[f"{prefix}.hook_normalized"] * cache[f"{prefix}.hook_scale"]

    def _norm_output(self, hm: HookedModel, cache: Any, prefix: str) -> torch.Tensor:
        spec = hm.norm_spec(hm.norm_module(prefix))
        normalized = cache[f"{prefix}.hook_normalized"]
        return normalized if spec.weight is None else normalized * (spec.weight + spec.weight_offset)

    @_SETTINGS
    @given(data=st.data())
    def test_weight_and_residual_identities(self, data: st.DataObject) -> None:
        """PENDING-CAPABILITY: (post norms, no pre-norms, final-logit softcap) TransformerLens' identities in the
        form that holds here: ``hook_q/k/v == attention input @ W + b`` (the attention input is ``ln1``'s output,
        or ``hook_resid_pre`` without ``ln1``); ``z @ W_O + b_O`` is the *input* of ``ln1_post``
        (``hook_normalized * hook_scale``) and ``ln1_post``'s output is ``hook_attn_out``; likewise ``post @ W_out +
        b_out`` is ``ln2_post``'s input and its output ``hook_mlp_out``; the MLP reads ``ln2``'s output (or
        ``hook_mlp_in``); ``hook_resid_mid == resid_pre + attn_out``, ``resid_post == resid_mid + mlp_out``;
        ``hook_embed == W_E[tokens] == resid_pre[0]``; the final norm's output is HF's last hidden state and the
        logits are ``softcap(final @ W_U + b_U)`` with ``cap = cfg.output_logits_soft_cap``. The contract's form puts
        ``hook_attn_out``/``hook_mlp_out`` right after the projections and the logits right after ``W_U``."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        cfg = hm.cfg
        with torch.no_grad():
            out = hm.model(**inputs.kwargs(), output_hidden_states=True)
            _, cache = hm.run_with_cache(**inputs.kwargs())
            W = {"q": (hm.W_Q, hm.b_Q), "k": (hm._W_K, hm._b_K), "v": (hm._W_V, hm._b_V)}
            W_O, b_O, W_out, b_out, W_in, b_in = hm.W_O, hm.b_O, hm.W_out, hm.b_out, hm.W_in, hm.b_in
            v = inputs.valid
            for i in range(cfg.n_layers):
                layout = hm.block_layouts[i]
                attn_in = block_input_of_attention(hm, cache, i)
                for name, (Wt, bt) in W.items():
                    expected = torch.einsum("bpm,hmd->bphd", attn_in, Wt[i]) + bt[i]
                    assert_close(cache[name, i][v], expected[v], f"layer {i} hook_{name} == attention input @ W")
                projected = torch.einsum("bphd,hdm->bpm", cache["z", i], W_O[i]) + b_O[i]
                if layout.ln1_post is not None:
                    prefix = f"blocks.{i}.ln1_post"
                    assert_close(self._norm_input(cache, prefix)[v], projected[v], f"layer {i} ln1_post input == z @ W_O")
                    assert_close(self._norm_output(hm, cache, prefix)[v], cache["attn_out", i][v],
                                 f"layer {i} ln1_post output == hook_attn_out")
                else:
                    assert_close(cache["attn_out", i][v], projected[v], f"layer {i} hook_attn_out == z @ W_O + b_O")
                mlp_in = (self._norm_output(hm, cache, f"blocks.{i}.ln2") if layout.ln2 is not None
                          else cache["mlp_in", i])
                if cfg.gated_mlp:
                    assert_close(cache["pre", i][v], (mlp_in @ hm.W_gate[i] + hm.b_gate[i])[v], f"layer {i} hook_pre")
                    assert_close(cache["pre_linear", i][v], (mlp_in @ W_in[i] + b_in[i])[v], f"layer {i} pre_linear")
                else:
                    assert_close(cache["pre", i][v], (mlp_in @ W_in[i] + b_in[i])[v], f"layer {i} hook_pre")
                down = cache["post", i] @ W_out[i] + b_out[i]
                if layout.ln2_post is not None:
                    prefix = f"blocks.{i}.ln2_post"
                    assert_close(self._norm_input(cache, prefix)[v], down[v], f"layer {i} ln2_post input == post @ W_out")
                    assert_close(self._norm_output(hm, cache, prefix)[v], cache["mlp_out", i][v],
                                 f"layer {i} ln2_post output == hook_mlp_out")
                else:
                    assert_close(cache["mlp_out", i][v], down[v], f"layer {i} hook_mlp_out == post @ W_out + b_out")
                assert_close(cache["resid_mid", i], cache["resid_pre", i] + cache["attn_out", i], "resid_mid")
                assert_close(cache["resid_post", i], cache["resid_mid", i] + cache["mlp_out", i], "resid_post")
                if i + 1 < cfg.n_layers:
                    assert torch.equal(cache["resid_post", i], cache["resid_pre", i + 1])
            assert_close(cache["embed"][v], hm.W_E[inputs.input_ids][v], "hook_embed == W_E[tokens]")
            assert_close(cache["resid_pre", 0], cache["embed"], "resid_pre[0] == embed")
            final = self._norm_output(hm, cache, "ln_final")
            assert_close(final[v], out.hidden_states[-1][v], "final norm output == HF last hidden state")
            if hm.layout.unembed is not None:
                logits = final @ hm.W_U + hm.b_U
                cap = cfg.output_logits_soft_cap
                if cap > 0:
                    logits = cap * torch.tanh(logits / cap)
                assert_close(logits[v], out.logits[v], "logits == softcap(final @ W_U + b_U)")
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_zero_ablating_a_head_removes_its_output(self, data: st.DataObject) -> None:
        """PENDING-CAPABILITY: (post norms) zeroing a head's ``hook_z`` removes ``z_h @ W_O[h]`` from the attention
        output *before* ``ln1_post`` (its input, ``hook_normalized * hook_scale``), and dropping the head at
        ``hook_result`` does the same there. The contract's form subtracts the contribution from ``hook_attn_out``,
        which is after the post norm here (and compares logits, which a post norm of an almost zero attention
        output — one head ablated out of one — turns rounding into visible differences)."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        head = data.draw(st.integers(0, hm.cfg.n_heads - 1), label="head")
        pre = f"blocks.{layer}."
        post = pre + "ln1_post" if hm.block_layouts[layer].ln1_post is not None else None
        watch = [pre + "attn.hook_z", pre + "hook_attn_out"]
        if post:
            watch += [post + ".hook_normalized", post + ".hook_scale"]

        def ablate(t: torch.Tensor, hook: Any) -> torch.Tensor:
            t = t.clone()
            t[:, :, head] = 0
            return t

        with torch.no_grad():
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
            contribution = torch.einsum("bpd,dm->bpm", base["z", layer][:, :, head], hm.W_O[layer, head])
            with hm.hooks([(pre + "attn.hook_z", ablate)]):
                _, ablated = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
            with hm.hooks([(pre + "attn.hook_result", ablate)]):
                _, dropped = hm.run_with_cache(**inputs.kwargs(), names_filter=watch)
        v = inputs.valid
        before = (lambda c: self._norm_input(c, post)) if post else (lambda c: c["attn_out", layer])
        expected = (before(base) - contribution)[v]
        assert_close(before(ablated)[v], expected, "z ablation removes the head's W_O contribution before the post norm")
        assert_close(before(dropped)[v], expected, "hook_result ablation removes the same contribution")
        hm.unwrap()
