"""The contract's properties of reading: declared points, bitwise with no hooks, identity hooks,
patterns, weights and residual identities (sections 0 to 4 of :class:`~lensadapters.testing.AdapterContract`)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from hypothesis import given
from hypothesis import strategies as st

from lensadapters.adapters.moe import EXPERT_POINTS, ROUTING_POINTS, is_moe
from lensadapters.api.hooked_model import HookedModel
from lensadapters.testing.contract_support import (
    _BLOCK_POINTS,
    _SETTINGS,
    assert_close,
    assert_unchanged_by_caching,
    attention_layers,
)
from lensadapters.testing.reference import apply_norm, block_inputs, norm_out
from lensadapters.wiring.names import non_attention_blocks
from lensadapters.wiring.weights import mlp_weights

_DENSE_MLP_POINTS = ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")


def check_moe_points(hm: Any, layers: list[int]) -> None:
    """The MoE points of each MoE block in ``layers`` (see ``test_hook_points_match_declared_capabilities``)."""
    names = hm.hook_names
    for i in layers:
        layout, pre = hm.mlp_layouts[i], f"blocks.{i}."
        assert (hm.cfg.num_experts, hm.cfg.experts_per_token) == (layout.routing.n_experts, layout.routing.top_k)
        expected = [pre + p for p in ROUTING_POINTS] + [
            f"{pre}mlp.experts.{e}.{p}" for e in range(layout.routing.n_experts) for p in EXPERT_POINTS
        ]
        start = names.index(expected[0])
        # in this order; a plugin's own points (a shared expert's) may fire between them: where the core computes
        # the experts at the MoE module's output (transformers 4), after a shared expert the module runs last
        ours = [n for n in names[start:] if n in set(expected)]
        assert ours == expected, f"layer {i}: MoE points missing or out of order"
        last = names.index(expected[-1])
        assert all(n.startswith(pre + "mlp.") for n in names[start:last]), f"layer {i}: non-MLP points among the MoE's"
        after = "mlp.hook_moe_out" if layout.beside is not None else "hook_mlp_out"
        assert names.index(pre + after) > last, f"layer {i}: {after} before the experts' points"
        dense = [pre + p for p in _DENSE_MLP_POINTS if pre + p in names]
        if layout.beside is None:
            assert not dense, f"layer {i} is a mixture of experts without a dense MLP, but has {dense}"
        else:
            assert pre + "mlp.hook_dense_out" in names and len(dense) >= 2, f"layer {i}: its dense MLP's points"


class ReadingProperties:
    """Properties 0-4: what a hook reads is what its name says (mixed into ``AdapterContract``)."""

    def _draw_any_implementation(self, data: st.DataObject) -> tuple[Any, Any, str]:
        """A model and inputs with one of ``attn_implementations`` (drawn), and the implementation the model runs
        (its config's: transformers may choose another)."""
        impl = data.draw(st.sampled_from(list(self.attn_implementations)), label="attn_implementation")
        model, inputs = self.draw(data, impl)
        return model, inputs, model.config._attn_implementation

    # --- 0. declared capabilities ------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_hook_points_match_declared_capabilities(self, data: st.DataObject) -> None:
        """Every block has the hook points all architectures have, and each declared capability its own
        (``Capabilities``), with ``hm.cfg`` saying the same: a point the plugin fails to expose fails here
        instead of silently shrinking what the other properties check.

        A block whose MLP is a mixture of experts has the four routing points and ``mlp.experts.{e}.hook_gate/
        hook_pre/hook_post/hook_result`` for every expert, in that order, before ``hook_mlp_out`` (experts beside a
        dense MLP: ``mlp.hook_moe_out``), and ``cfg.num_experts``/``cfg.experts_per_token`` match its description;
        without a dense MLP beside the experts it has no dense ``mlp.hook_pre``/``hook_pre_linear``/``hook_post``
        (TransformerLens' MoE has none either), and ``gated_mlp`` is not checked on a model with such blocks (its
        experts are gated: ``mlp.experts.{e}.hook_gate``)."""
        model, inputs = self.draw(data)
        declared = self.capabilities(model)
        hm = self.wrap(model)
        cfg, names = hm.cfg, set(hm.hook_names)
        blocks = range(cfg.n_layers)
        mixers = non_attention_blocks(hm)  # blocks the plugin describes without softmax attention: no attn.* point
        moe = [i for i, layout in enumerate(hm.mlp_layouts) if is_moe(layout)]
        sparse = [i for i in moe if hm.mlp_layouts[i].beside is None]  # no dense MLP point

        def points(*suffixes: str) -> list[str]:
            return [
                f"blocks.{i}.{s}"
                for i in blocks
                for s in suffixes
                if not (i in mixers and s.startswith("attn.")) and not (i in sparse and s in _DENSE_MLP_POINTS)
            ]

        check_moe_points(hm, moe)

        stray = sorted(n for n in names for i in mixers if n.startswith(f"blocks.{i}.attn."))
        assert not stray, f"blocks {mixers} have no softmax attention (as described), but the model has {stray}"

        pre_norm_points = ("ln1.hook_scale", "ln1.hook_normalized") if declared.pre_norms else ()
        without_ln1 = {f"blocks.{i}.{s}" for i in self.layers_without_ln1(model) for s in pre_norm_points}
        expected = ["hook_embed"] + [n for n in points(*_BLOCK_POINTS, *pre_norm_points) if n not in without_ln1]
        missing = [n for n in expected if n not in names]
        assert not missing, f"hook points every model has are missing: {missing}"
        if not declared.pre_norms:
            found = sorted(n for n in names if n.startswith("blocks.") and n.split(".")[2] in ("ln1", "ln2"))
            assert not found, f"pre_norms=False, but the model has {found}"
            missing = [n for n in points("hook_mlp_in") if n not in names]
            assert not missing, f"pre_norms=False: the MLP reads hook_mlp_in, but the model lacks {missing}"
        shapes: dict[str, tuple[str, ...]] = {}  # capability point -> the point whose shape it has
        if declared.learned_positions is not None:
            assert ("hook_pos_embed" in names) == declared.learned_positions, (
                f"learned_positions={declared.learned_positions}, but hook_pos_embed is "
                f"{'present' if 'hook_pos_embed' in names else 'missing'}"
            )
            if declared.learned_positions:
                assert cfg.positional_embedding_type == "standard", cfg.positional_embedding_type
                assert hm.W_pos.ndim == 2 and hm.W_pos.shape[1] == cfg.d_model, tuple(hm.W_pos.shape)
                shapes["hook_pos_embed"] = ("hook_embed",)
        if declared.rotary is not None:
            rotary_points = points("attn.hook_rot_q", "attn.hook_rot_k")
            present = [n for n in rotary_points if n in names]
            if declared.rotary:
                assert present == rotary_points, (
                    f"rotary=True, but missing: {sorted(set(rotary_points) - set(present))}"
                )
                assert cfg.positional_embedding_type == "rotary", cfg.positional_embedding_type
                assert cfg.rotary_dim is not None and 0 < cfg.rotary_dim <= cfg.d_head, (cfg.rotary_dim, cfg.d_head)
                for i in (i for i in blocks if i not in mixers):
                    for x in "qk":
                        shapes[f"blocks.{i}.attn.hook_rot_{x}"] = (f"blocks.{i}.attn.hook_{x}",)
            else:
                assert not present, f"rotary=False, but the model has {present}"
                assert cfg.positional_embedding_type != "rotary"
        if declared.gated_mlp is not None and not sparse:  # (with sparse blocks it speaks of the experts)
            gated_points = points("mlp.hook_pre_linear")
            present = [n for n in gated_points if n in names]
            assert cfg.gated_mlp == declared.gated_mlp, f"gated_mlp={declared.gated_mlp}, cfg.gated_mlp={cfg.gated_mlp}"
            if declared.gated_mlp:
                assert present == gated_points, (
                    f"gated_mlp=True, but missing: {sorted(set(gated_points) - set(present))}"
                )
                if not moe:  # a MoE block's W_gate has an experts axis
                    assert hm.W_gate.shape == (cfg.n_layers, cfg.d_model, cfg.d_mlp), tuple(hm.W_gate.shape)
                for i in (i for i in blocks if i not in sparse):
                    shapes[f"blocks.{i}.mlp.hook_pre_linear"] = (f"blocks.{i}.mlp.hook_pre",)
            else:
                assert not present, f"gated_mlp=False, but the model has {present}"
        if declared.parallel_blocks is not None:
            mid = [n for n in points("hook_resid_mid") if n in names]
            assert cfg.parallel_attn_mlp == declared.parallel_blocks, (
                f"parallel_blocks={declared.parallel_blocks}, cfg.parallel_attn_mlp={cfg.parallel_attn_mlp}"
            )
            assert [layout.parallel for layout in hm.block_layouts] == [declared.parallel_blocks] * cfg.n_layers
            if declared.parallel_blocks:
                assert not mid, f"parallel blocks have no hook_resid_mid, but the model has {mid}"
            else:
                assert mid == points("hook_resid_mid"), "a sequential block lacks hook_resid_mid"
        for output, norm in declared.post_norms.items():
            missing = [n for n in points(f"{norm}.hook_scale", output) if n not in names]
            assert not missing, f"post_norms declares {output} after {norm}, but the model lacks {missing}"
        if shapes:
            watched = list(shapes) + [like for likes in shapes.values() for like in likes]
            with torch.no_grad():
                _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=watched)
            for name, (like,) in shapes.items():
                assert cache[name].shape == cache[like].shape, (
                    f"{name} has shape {tuple(cache[name].shape)}, {like} {tuple(cache[like].shape)}"
                )
        hm.unwrap()

    # --- 1. no hooks: bitwise ----------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_no_hooks_is_bitwise(self, data: st.DataObject) -> None:
        model, inputs, impl = self._draw_any_implementation(data)
        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
            hm = self.wrap(model)
            assert_unchanged_by_caching(hm, inputs, reference)
            assert model.config._attn_implementation == impl
        hm.unwrap()

    # --- 2. identity hooks everywhere ------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_identity_hooks_keep_logits(self, data: st.DataObject) -> None:
        model, inputs = self.draw(data)
        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
            hm = self.wrap(model)
            calls: dict[str, int] = {}

            def copy(t: torch.Tensor, hook: Any) -> torch.Tensor:
                calls[hook.name] = calls.get(hook.name, 0) + 1
                return t.clone()  # a new tensor: forces every re-fusing/recomputing path

            logits = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(lambda n: True, copy)])
        assert set(calls) == set(hm.hook_names), f"hook points that never fired: {set(hm.hook_names) - set(calls)}"
        assert list(calls) == hm.hook_names, "hook_names is not the order in which hook points fire"
        assert_close(self.valid_logits(logits, inputs), self.valid_logits(reference, inputs), "identity hooks")
        hm.unwrap()

    # --- 3. patterns ---------------------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_pattern_matches_hf_eager(self, data: st.DataObject) -> None:
        model, inputs, impl = self._draw_any_implementation(data)
        with torch.no_grad():
            model.config._attn_implementation = "eager"
            reference = model(**inputs.kwargs(), output_attentions=True).attentions
            model.config._attn_implementation = impl
            hm = self.wrap(model)
            _, cache = hm.run_with_cache(
                **inputs.kwargs(), names_filter=lambda n: n.endswith(("hook_pattern", "hook_attn_scores"))
            )
        valid = inputs.valid
        length = inputs.input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        for layer in attention_layers(hm):
            pattern = cache["pattern", layer]
            assert pattern.shape == (inputs.input_ids.shape[0], hm.cfg.n_heads, length, length)
            rows = valid[:, None, :, None].expand_as(pattern)
            assert_close(
                pattern[rows.expand_as(pattern)],
                reference[layer][rows.expand_as(pattern)],
                f"layer {layer} pattern vs HF eager",
            )
            sums = pattern.sum(-1)[valid[:, None, :].expand(-1, hm.cfg.n_heads, -1)]
            if self.capabilities(model).attention_sinks:  # the sink takes a share of every row
                assert ((sums > 0) & (sums < 1)).all(), "pattern rows with sinks sum to less than 1"
            else:
                assert_close(sums, torch.ones_like(sums), "pattern rows sum to 1")
            # a padding query (no key to attend to) is whatever the implementation makes of an empty row (eager
            # spreads it over every key; compared with HF above only where the query is valid)
            queries = valid[:, None, :, None].expand_as(pattern)
            pad_keys = (~valid)[:, None, None, :].expand_as(pattern)
            if hm.cfg.attention_dir == "causal":
                assert (pattern[queries & ~causal] == 0).all(), "pattern attends to the future"
            else:  # an encoder's queries see every real key its scores leave unmasked (a window), later ones too
                unmasked = torch.isfinite(cache["attn_scores", layer])
                later = queries & ~causal & ~pad_keys & unmasked
                assert (pattern[later] > 0).all(), "bidirectional pattern skips a later key"
                assert (pattern[queries & ~unmasked] == 0).all(), "pattern attends to a masked key"
            assert (pattern[queries & pad_keys] == 0).all(), "pattern attends to padding"
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_pattern_hooks_leave_other_layers_alone(self, data: st.DataObject) -> None:
        """Only hooked layers compute attention explicitly: everything the model computes before the hooked
        layer's attention (earlier layers included) keeps the configured implementation's numbers, bit for bit."""
        model, inputs, _ = self._draw_any_implementation(data)
        hm = self.wrap(model)
        layer = attention_layers(hm)[-1]
        names = hm.hook_names
        scores = names.index(f"blocks.{layer}.attn.hook_attn_scores")
        earlier = [n for n in names[:scores] if not n.endswith(("hook_attn_scores", "hook_pattern"))]
        with torch.no_grad():
            _, base = hm.run_with_cache(**inputs.kwargs(), names_filter=earlier)
            with hm.hooks([(f"blocks.{layer}.attn.hook_pattern", lambda t, hook: None)]):
                _, other = hm.run_with_cache(**inputs.kwargs(), names_filter=earlier)
        for name in earlier:
            assert torch.equal(base[name], other[name]), f"{name} changed when only layer {layer}'s pattern was hooked"
        hm.unwrap()

    # --- 4. weights and residual identities ------------------------------------------------------

    def unembedding_input(self, hm: HookedModel, cache: Any) -> torch.Tensor:
        """What ``W_U`` reads: the final norm's output, or the last block's output without one (post-LN OPT);
        a contract whose model has a head before the unembedding (an encoder's masked-LM head) overrides it."""
        if hm.layout.ln_final is not None:
            return norm_out(hm, cache, "ln_final")
        last = f"blocks.{hm.cfg.n_layers - 1}.hook_normalized_resid_post"  # BertBlock's names: the block output
        return cache[last] if last in hm.hook_names else cache["resid_post", hm.cfg.n_layers - 1]

    def expected_logits(self, model: torch.nn.Module, unembedded: torch.Tensor) -> torch.Tensor:
        """The logits the model gives for ``final @ W_U + b_U``: unchanged, or softcapped where the contract
        declares ``logit_softcap`` and the config sets it."""
        attribute = self.capabilities(model).logit_softcap
        cap = getattr(model.config, attribute, None) if attribute else None
        return unembedded if cap is None else cap * torch.tanh(unembedded / cap)

    def _post_normed(
        self, hm: HookedModel, layer: int, output: str, value: torch.Tensor, post_norms: Mapping[str, str]
    ) -> tuple[torch.Tensor, str]:
        """``value`` (a projection's output) as block output ``output`` shows it: after its declared post norm."""
        norm = post_norms.get(output)
        if norm is None:
            return value, ""
        return apply_norm(hm.norm_spec(hm.norm_module(f"blocks.{layer}.{norm}")), value), f" after {norm}"

    @_SETTINGS
    @given(data=st.data())
    def test_weight_and_residual_identities(self, data: st.DataObject) -> None:
        """The projections' outputs from the weights, the residual stream's sums, the embeddings and the
        unembedding. A block whose MLP is a mixture of experts has its MLP identities in the MoE properties (an
        experts axis on ``W_in``...): here, its dense MLP's inputs when it runs one beside the experts
        (``mlp_weights(..., dense=True)``), and its residual sums."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        post_norms = self.capabilities(model).post_norms
        moe = set(self.moe_layers(hm))  # type: ignore[attr-defined]
        with torch.no_grad():
            out = hm.model(**inputs.kwargs(), output_hidden_states=True)
            _, cache = hm.run_with_cache(**inputs.kwargs())
            W_Q, b_Q, W_K, b_K, W_V, b_V = hm.W_Q, hm.b_Q, hm._W_K, hm._b_K, hm._W_V, hm._b_V
            W_O, b_O = hm.W_O, hm.b_O
            gated = hm.cfg.gated_mlp
            W_in: Any
            b_in: Any
            W_gate: Any
            b_gate: Any
            if not moe:
                W_out, b_out, W_in, b_in = hm.W_out, hm.b_out, hm.W_in, hm.b_in
                if gated:
                    W_gate, b_gate = hm.W_gate, hm.b_gate
            else:  # each dense MLP's, layer by layer (a MoE block's dense MLP beside its experts)
                dense = [i for i in range(hm.cfg.n_layers) if i not in moe or hm.mlp_layouts[i].beside is not None]

                def per_layer(role: str) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
                    read = {i: mlp_weights(hm.wiring, i, role, dense=i in moe) for i in dense}
                    return {i: w for i, (w, _) in read.items()}, {i: b for i, (_, b) in read.items()}

                W_in, b_in = per_layer("in")
                if gated:
                    W_gate, b_gate = per_layer("gate")
            v = inputs.valid
            names = set(hm.hook_names)
            for block in block_inputs(hm, cache):
                i, attn_in, mlp_in = block.layer, block.attn_in, block.mlp_in
                for name, W, b in (("q", W_Q, b_Q), ("k", W_K, b_K), ("v", W_V, b_V)):
                    expected = torch.einsum("bpm,hmd->bphd", attn_in, W[i]) + b[i]
                    assert_close(
                        cache[name, i][v], expected[v], f"layer {i} hook_{name} == normalized @ W_{name.upper()}"
                    )
                expected, after = self._post_normed(
                    hm, i, "hook_attn_out", torch.einsum("bphd,hdm->bpm", cache["z", i], W_O[i]) + b_O[i], post_norms
                )
                assert_close(cache["attn_out", i][v], expected[v], f"layer {i} hook_attn_out == z @ W_O + b_O{after}")
                if mlp_in is not None and (i not in moe or i in W_in):
                    if gated:
                        assert_close(cache["pre", i][v], (mlp_in @ W_gate[i] + b_gate[i])[v], f"layer {i} hook_pre")
                        assert_close(
                            cache["pre_linear", i][v], (mlp_in @ W_in[i] + b_in[i])[v], f"layer {i} hook_pre_linear"
                        )
                    else:
                        assert_close(cache["pre", i][v], (mlp_in @ W_in[i] + b_in[i])[v], f"layer {i} hook_pre")
                if i not in moe:
                    expected, after = self._post_normed(
                        hm, i, "hook_mlp_out", cache["post", i] @ W_out[i] + b_out[i], post_norms
                    )
                    assert_close(
                        cache["mlp_out", i][v], expected[v], f"layer {i} hook_mlp_out == post @ W_out + b_out{after}"
                    )
                if i + 1 < hm.cfg.n_layers:  # the block output (BertBlock's names: hook_normalized_resid_post)
                    block_out = f"blocks.{i}.hook_normalized_resid_post"
                    assert torch.equal(
                        cache[block_out] if block_out in names else cache["resid_post", i], cache["resid_pre", i + 1]
                    )
                if self.pre_ln_residual(model):
                    if f"blocks.{i}.hook_resid_mid" in names:
                        assert_close(cache["resid_mid", i], cache["resid_pre", i] + cache["attn_out", i], "resid_mid")
                        assert_close(cache["resid_post", i], cache["resid_mid", i] + cache["mlp_out", i], "resid_post")
                    else:
                        assert_close(
                            cache["resid_post", i],
                            cache["resid_pre", i] + cache["attn_out", i] + cache["mlp_out", i],
                            "parallel",
                        )
            assert_close(cache["embed"][v], hm.W_E[inputs.input_ids][v], "hook_embed == W_E[tokens]")
            if "hook_pos_embed" in names:
                full = ~(~v).any(-1)  # unpadded rows: positions 0 .. p-1 whatever the model derives them from
                length = inputs.input_ids.shape[1]
                assert_close(
                    cache["pos_embed"][full],
                    hm.W_pos[:length].expand(int(full.sum()), -1, -1),
                    "hook_pos_embed == W_pos[positions]",
                )
            embed = cache["embed"] + (cache["pos_embed"] if "hook_pos_embed" in names else 0)
            if "hook_full_embed" in names:  # what the first block reads (after an embedding norm: BERT, ModernBERT)
                embed = cache["hook_full_embed"]
            if self.pre_ln_residual(model):
                assert_close(cache["resid_pre", 0], embed, "resid_pre[0] == embed (+ pos_embed), or hook_full_embed")
            final = self.unembedding_input(hm, cache)
            if self.final_hidden_is_ln_final_of(model):
                # real tokens only: with patterns cached, a query row with nothing to attend to (a left pad)
                # gets a zero pattern as in TransformerLens, where HF's eager attention spreads it uniformly
                assert_close(final[v], out.hidden_states[-1][v], "final norm output == HF last hidden state")
            if hm.layout.unembed is not None:
                assert_close(
                    self.expected_logits(model, final @ hm.W_U + hm.b_U)[v],
                    out.logits[v],
                    "logits == final @ W_U + b_U (softcapped where declared)",
                )
            assert hm.W_E.shape == (hm.cfg.d_vocab, hm.cfg.d_model)
            assert W_Q.shape == (hm.cfg.n_layers, hm.cfg.n_heads, hm.cfg.d_model, hm.cfg.d_head)
            assert hm.W_K.shape == W_Q.shape
            assert W_O.shape == (hm.cfg.n_layers, hm.cfg.n_heads, hm.cfg.d_head, hm.cfg.d_model)
            if not moe:  # (a MoE block's W_in has an experts axis)
                assert W_in.shape == (hm.cfg.n_layers, hm.cfg.d_model, hm.cfg.d_mlp)
        hm.unwrap()
