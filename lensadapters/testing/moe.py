"""The contract of mixture-of-experts plugins: :class:`MoEContract`, the generic suite adapted to MoE blocks, plus
the MoE properties (routing and per-expert points against an independent reference computed from the weights).

Subclass it as you would ``AdapterContract`` (``plugin``, ``configs()``...). Dense layers of a model that mixes
dense and MoE MLPs are checked as the generic suite checks them.

Two generic properties are structurally different for a MoE block and are overridden here (their docstrings start
with ``MoE form:`` and say what is checked instead): a MoE block has no dense ``mlp.hook_pre`` /
``mlp.hook_post`` and its ``W_in``/``W_gate``/``W_out`` have an experts axis. The generic suite itself checks MoE
blocks in three more properties, on any model that has them (hybrid models too): the declared points, an edit at
every point, in-place edits (``mlp.hook_expert_indices`` holds integers, edited as indices; an expert that no token
chose has no rows to edit; see ``EditProperties``).

The independent reference (the MoE output computed from the read weights, the routing) is
:mod:`lensadapters.testing.moe_reference`; its names are importable from here too.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from lensadapters.adapters.moe import expert_rows, is_moe, router_weight
from lensadapters.adapters.moe.sites import EXPERT_POINTS, ROUTING_POINTS
from lensadapters.testing.contract import AdapterContract
from lensadapters.testing.contract_support import (
    _SETTINGS,
    assert_close,
    check_edited_generation,
    close,
)
from lensadapters.testing.moe_reference import (  # noqa: F401  (mlp_input... importable from here as before
    activation,
    assert_moe_reference,
    expert_glu,
    mlp_input,
    mlp_input_of,
    moe_reference,
    route,
    router_bias_or_zero,
    select,
    selection_bias,
    shared_output,
)
from lensadapters.wiring.weights import mlp_weights

Tensor = torch.Tensor
_DENSE_ONLY = ("mlp.hook_pre", "mlp.hook_post")


class MoEContract(AdapterContract):
    """The generic contract with the MoE overrides and properties (see the module docstring)."""

    #: experts implementations (``config._experts_implementation``, transformers 5) the properties are drawn over
    experts_implementations: ClassVar[Sequence[str]] = ("grouped_mm", "eager", "batched_mm")

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> torch.nn.Module:
        model = super().make_model(config, seed, attn_implementation)
        impl = getattr(config, "_lensadapters_experts_implementation", None)
        if impl is not None and hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(impl)
        return model

    def draw_config(self, data: st.DataObject) -> Any:
        config = super().draw_config(data)
        if hasattr(config, "_experts_implementation"):  # transformers 5: every fused implementation is exercised
            impl = data.draw(st.sampled_from(list(self.experts_implementations)), label="experts_implementation")
            config._lensadapters_experts_implementation = impl
        return config

    def draw_moe_layer(self, data: st.DataObject, hm: Any) -> int:
        layers = self.moe_layers(hm)
        assume(layers)
        return data.draw(st.sampled_from(layers), label="MoE layer")

    # --- generic properties, MoE form (each overridden in its MoE form) -----------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_weight_and_residual_identities(self, data: st.DataObject) -> None:
        """MoE form: a MoE block's ``W_in``/``W_gate``/``W_out`` have an experts axis
        (``[n_layers, n_experts, d_model, d_mlp]``) and it has no dense ``hook_pre``/``hook_post``, so the generic
        ``hook_mlp_out == hook_post @ W_out`` is false by structure. Checked instead, with the generic attention,
        residual, embedding and unembedding identities: ``hook_router_logits == mlp_in @ W_router``; per expert,
        ``hook_gate == x[rows] @ W_gate[e]``, ``hook_pre == x[rows] @ W_in[e]``, ``hook_post == act(gate) * pre``,
        ``hook_result == routing weight * (hook_post @ W_out[e])``; the results summed per token are
        ``hook_mlp_out``; shapes of every weight."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        cfg = hm.cfg
        v = inputs.valid
        with torch.no_grad():
            out = hm.model(**inputs.kwargs(), output_hidden_states=True)
            _, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=lambda n: "pattern" not in n)
            W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, b_O = (
                hm.W_Q,
                hm.b_Q,
                hm._W_K,
                hm._b_K,
                hm._W_V,
                hm._b_V,
                hm.W_O,
                hm.b_O,
            )
            for i in range(cfg.n_layers):
                attn_in = mlp_input_of(hm, cache, i, "ln1")
                for name, W, b in (("q", W_Q, b_Q), ("k", W_K, b_K), ("v", W_V, b_V)):
                    expected = torch.einsum("bpm,hmd->bphd", attn_in, W[i]) + b[i]
                    assert_close(cache[name, i][v], expected[v], f"layer {i} hook_{name}")
                expected = torch.einsum("bphd,hdm->bpm", cache["z", i], W_O[i]) + b_O[i]
                assert_close(cache["attn_out", i][v], expected[v], f"layer {i} hook_attn_out")
                assert_close(cache["resid_mid", i], cache["resid_pre", i] + cache["attn_out", i], "resid_mid")
                assert_close(cache["resid_post", i], cache["resid_mid", i] + cache["mlp_out", i], "resid_post")
                x = mlp_input(hm, cache, i)
                if not is_moe(hm.mlp_layouts[i]):
                    W_out, b_out = mlp_weights(hm.wiring, i, "out")
                    assert_close(cache["mlp_out", i][v], (cache["post", i] @ W_out + b_out)[v], f"layer {i} dense")
                    continue
                moe = hm.mlp_layouts[i]
                n, k = moe.routing.n_experts, moe.routing.top_k
                (W_in, b_in), (W_gate, b_gate), (W_out, b_out) = (
                    mlp_weights(hm.wiring, i, r) for r in ("in", "gate", "out")
                )
                glu = expert_glu(hm, i)
                assert W_in.shape == W_gate.shape == (n, cfg.d_model, cfg.d_mlp)
                assert W_out.shape == (n, cfg.d_mlp, cfg.d_model)
                pre = f"blocks.{i}.mlp."
                assert_close(
                    cache[pre + "hook_router_logits"],
                    x @ router_weight(hm.wiring, i) + router_bias_or_zero(hm, i),
                    f"layer {i} router logits",
                )
                index = cache[pre + "hook_expert_indices"].reshape(-1, k)
                weights = cache[pre + "hook_routing_weights"].reshape(-1, k)
                flat = x.reshape(-1, cfg.d_model)
                total = torch.zeros_like(flat)
                for e in range(n):
                    slot, token = expert_rows(index, e)
                    rows = flat[token]
                    point = {p: cache[f"{pre}experts.{e}.{p}"] for p in EXPERT_POINTS}
                    get = point.__getitem__
                    assert_close(get("hook_gate"), rows @ W_gate[e] + b_gate[e], f"layer {i} expert {e} hook_gate")
                    assert_close(get("hook_pre"), rows @ W_in[e] + b_in[e], f"layer {i} expert {e} hook_pre (up)")
                    assert_close(get("hook_post"), glu(get("hook_gate"), get("hook_pre")), f"expert {e} hook_post")
                    assert_close(
                        get("hook_result"),
                        weights[token, slot, None] * (get("hook_post") @ W_out[e] + b_out[e]),
                        f"layer {i} expert {e} hook_result",
                    )
                    total.index_add_(0, token, get("hook_result"))
                assert_close(
                    total.reshape(cache["mlp_out", i].shape) + shared_output(hm, i, x),
                    cache["mlp_out", i],
                    f"layer {i}: expert results summed == hook_mlp_out",
                )
                if i + 1 < cfg.n_layers:
                    assert torch.equal(cache["resid_post", i], cache["resid_pre", i + 1])
            assert_close(cache["embed"][v], hm.W_E[inputs.input_ids][v], "hook_embed == W_E[tokens]")
            assert_close(cache["resid_pre", 0], cache["embed"], "resid_pre[0] == embed")
            final = mlp_input_of(hm, cache, None, "ln_final")
            assert_close(final[v], out.hidden_states[-1][v], "final norm output == HF last hidden state")
            if hm.layout.unembed is not None:
                assert_close((final @ hm.W_U + hm.b_U)[v], out.logits[v], "logits == final @ W_U + b_U")
            assert W_Q.shape == (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head)
            if len(self.moe_layers(hm)) == cfg.n_layers:
                assert hm.W_router.shape == (cfg.n_layers, cfg.d_model, cfg.num_experts)
                assert hm.W_in.shape == (cfg.n_layers, cfg.num_experts, cfg.d_model, cfg.d_mlp)
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_edits_during_generation_match_one_pass(self, data: st.DataObject) -> None:
        """MoE form: the generic property draws ``mlp.hook_post``, which a MoE block does not have. Checked
        instead, with the same statement (an edit applied while generating with the KV cache gives the logits of
        one pass over the generated sequence with the same edit), on ``hook_resid_post``, ``attn.hook_v``,
        ``attn.hook_rot_k``, ``attn.hook_pattern``, ``mlp.hook_routing_weights`` and ``mlp.hook_router_logits``."""
        model, inputs = self.draw(data, left_padding=False)
        hm = self.wrap(model)
        layer = self.draw_moe_layer(data, hm)
        point = f"blocks.{layer}." + data.draw(
            st.sampled_from(
                [
                    "hook_resid_post",
                    "attn.hook_v",
                    "attn.hook_rot_k",
                    "attn.hook_pattern",
                    "mlp.hook_routing_weights",
                    "mlp.hook_router_logits",
                ]
            ),
            label="point",
        )
        bump = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(layer))

        def edit(t: Tensor, hook: Any) -> Tensor:
            if hook.name.endswith("resid_post"):
                return t + bump.to(t.dtype)
            if hook.name.endswith("router_logits"):
                return t + torch.arange(t.shape[-1], dtype=t.dtype)  # steers towards the last experts
            return t * 1.5

        pad = getattr(model.config, "pad_token_id", None)
        one_pass, unedited, prompt = check_edited_generation(hm, inputs, point, edit, self.generation_atol, pad)
        atol = self.generation_atol(one_pass)
        hm.unwrap()
        assume((one_pass - unedited)[:, prompt - 1 :].abs().max().item() > 4 * atol)

    # --- MoE properties ------------------------------------------------------------------------------------

    def _moe_cache(self, hm: Any, inputs: Any, layer: int, hooks: Sequence = ()) -> Any:
        pre = f"blocks.{layer}."
        names = [pre + "ln2.hook_normalized", pre + "hook_mlp_out"] + [pre + p for p in ROUTING_POINTS]
        with hm.hooks(list(hooks)):
            return hm.run_with_cache(**inputs.kwargs(), names_filter=names)

    @_SETTINGS
    @given(data=st.data())
    def test_reading_experts_keeps_the_model_bitwise(self, data: st.DataObject) -> None:
        """Reading every routing and per-expert point (which computes the experts expert by expert) leaves the
        model's output bitwise as it is without hooks, under every experts implementation; and the per-expert
        results, summed per token, are ``hook_mlp_out``."""
        model, inputs = self.draw(data)
        with torch.no_grad():
            reference = model(**inputs.kwargs()).logits
            hm = self.wrap(model)
            logits, cache = hm.run_with_cache(
                **inputs.kwargs(),
                names_filter=lambda n: ".mlp." in n or n.endswith(("hook_mlp_out", "ln2.hook_normalized")),
            )
            assert torch.equal(logits, reference), "reading MoE points changed the model's output"
            assert torch.equal(hm(**inputs.kwargs()).logits, reference)
        for layer in self.moe_layers(hm):
            k = hm.mlp_layouts[layer].routing.top_k
            index = cache[f"blocks.{layer}.mlp.hook_expert_indices"].reshape(-1, k)
            out = cache["mlp_out", layer]
            total = torch.zeros(index.shape[0], out.shape[-1], dtype=out.dtype)
            for e in range(hm.mlp_layouts[layer].routing.n_experts):
                total.index_add_(0, expert_rows(index, e)[1], cache[f"blocks.{layer}.mlp.experts.{e}.hook_result"])
            shared = shared_output(hm, layer, mlp_input(hm, cache, layer))
            assert_close(
                total.reshape(out.shape) + shared, out, f"layer {layer}: expert results summed == hook_mlp_out"
            )
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_routing_points_are_the_routing(self, data: st.DataObject) -> None:
        """``hook_expert_weights`` is the softmax of ``hook_router_logits`` over all experts, ``hook_expert_indices``
        its top-k, ``hook_routing_weights`` the selected probabilities (renormalized when the family does), and
        ``hook_mlp_out`` the reference MoE computed from the weights with that routing."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = self.draw_moe_layer(data, hm)
        layout = hm.mlp_layouts[layer]
        with torch.no_grad():
            _, cache = self._moe_cache(hm, inputs, layer)
        pre = f"blocks.{layer}.mlp."
        probs, top, index = route(layout, cache[pre + "hook_router_logits"], selection_bias(hm, layer))
        assert_close(cache[pre + "hook_expert_weights"], probs, "expert weights == softmax(router logits)")
        chosen = torch.gather(probs, -1, cache[pre + "hook_expert_indices"])
        assert_close(chosen, torch.gather(probs, -1, index), "the indices select the top-k probabilities")
        assert_close(cache[pre + "hook_routing_weights"], top, "routing weights == the normalized top-k")
        assert_moe_reference(hm, cache, [layer], "hook_mlp_out == reference MoE")
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_routing_edits_equal_running_with_that_routing(self, data: st.DataObject) -> None:
        """An edit of the routing weights, the indices, the probabilities or the logits routes exactly as the
        router's own values would: ``hook_mlp_out`` is the reference MoE with the edited routing (probabilities
        and logits re-selected and renormalized as the family does), and the logits are those of the model with
        that ``hook_mlp_out``."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = self.draw_moe_layer(data, hm)
        layout = hm.mlp_layouts[layer]
        n, k = layout.routing.n_experts, layout.routing.top_k
        which = data.draw(
            st.sampled_from(["routing_weights", "expert_indices", "expert_weights", "router_logits"]),
            label="edited point",
        )
        seed = data.draw(st.integers(0, 2**16), label="edit seed")
        g = torch.Generator().manual_seed(seed)
        pre = f"blocks.{layer}.mlp."
        with torch.no_grad():
            _, base = self._moe_cache(hm, inputs, layer)
            shape = base[pre + "hook_expert_indices"].shape
            if which == "routing_weights":
                new = torch.rand(shape, generator=g) * 2
                edit = lambda t, hook: new.to(t.dtype)  # noqa: E731
            elif which == "expert_indices":
                new = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(shape[0] * shape[1])])
                new = new.reshape(shape)
                edit = lambda t, hook: new  # noqa: E731
            elif which == "expert_weights":
                new = torch.rand(shape[:-1] + (n,), generator=g)
                edit = lambda t, hook: new.to(t.dtype)  # noqa: E731
            else:
                bias = torch.randn(n, generator=g) * 3
                edit = lambda t, hook: t + bias.to(t.dtype)  # noqa: E731
            logits, edited = self._moe_cache(hm, inputs, layer, [(pre + "hook_" + which, edit)])
            weights, index = edited[pre + "hook_routing_weights"], edited[pre + "hook_expert_indices"]
            if which == "routing_weights":
                assert_close(weights, new, "the edited weights are used")
                assert torch.equal(index, base[pre + "hook_expert_indices"])
            elif which == "expert_indices":
                assert torch.equal(index, new)
                assert_close(weights, base[pre + "hook_routing_weights"], "each slot keeps its weight")
            else:
                if which == "expert_weights" and layout.routing.order in ("topk_softmax", "topk_sigmoid"):
                    # routers that select first: the selection stays the logits', the weights are read there
                    probs, sel = new.double(), base[pre + "hook_expert_indices"]
                    top = torch.gather(probs, -1, sel)
                elif which == "expert_weights":
                    probs = new.double()
                    top, sel = select(layout, probs, selection_bias(hm, layer))
                else:
                    assert_close(
                        edited[pre + "hook_router_logits"], base[pre + "hook_router_logits"] + bias, "edited logits"
                    )
                    probs, top, sel = route(layout, edited[pre + "hook_router_logits"], selection_bias(hm, layer))
                    assert_close(edited[pre + "hook_expert_weights"], probs, "probabilities of the edited logits")
                assert_close(torch.gather(probs, -1, index), torch.gather(probs, -1, sel), "re-selected top-k")
                assert_close(weights, top, "renormalized as the family does")
            expected = moe_reference(hm, layer, mlp_input(hm, edited, layer), weights, index)
            assert_close(edited["mlp_out", layer], expected, f"{which} edit: hook_mlp_out == reference", atol=1e-4)
            replaced = hm.run_with_hooks(
                **inputs.kwargs(), fwd_hooks=[(f"blocks.{layer}.hook_mlp_out", lambda t, hook: expected.to(t.dtype))]
            )
        assert_close(logits[inputs.valid], replaced[inputs.valid], "downstream of the edit", atol=1e-4)
        hm.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_removing_an_expert(self, data: st.DataObject) -> None:
        """Zeroing expert ``e``'s ``hook_result`` equals removing the expert for those tokens: the same logits as
        giving it routing weight 0 where chosen, and as subtracting its contributions from ``hook_mlp_out``; zeroing
        its ``hook_post`` leaves only its weighted down bias (the same as removing it, for experts without one)."""
        model, inputs = self.draw(data)
        hm = self.wrap(model)
        layer = self.draw_moe_layer(data, hm)
        layout = hm.mlp_layouts[layer]
        expert = data.draw(st.integers(0, layout.routing.n_experts - 1), label="expert")
        pre = f"blocks.{layer}.mlp."
        v = inputs.valid
        zero = lambda t, hook: torch.zeros_like(t)  # noqa: E731
        with torch.no_grad():
            names = [pre + "hook_expert_indices", f"{pre}experts.{expert}.hook_result", pre + "hook_routing_weights"]
            reference, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=names)
            index = cache[names[0]]
            assume(bool((index == expert)[v].any()))  # chosen by a real token (a pad's logits are not compared)
            flat = index.reshape(-1, index.shape[-1])
            slot, token = expert_rows(flat, expert)
            contribution = torch.zeros(flat.shape[0], hm.cfg.d_model, dtype=cache[names[1]].dtype)
            contribution.index_add_(0, token, cache[names[1]])
            contribution = contribution.reshape(*index.shape[:-1], -1)
            # a zeroed hook_post still adds the expert's down bias, weighted: what is left of its contribution
            b_out = mlp_weights(hm.wiring, layer, "out")[1][expert]
            weight = cache[names[2]].reshape(flat.shape)[token, slot, None]
            left = torch.zeros_like(contribution.reshape(flat.shape[0], -1)).index_add_(0, token, weight * b_out)
            left = left.reshape(contribution.shape)
            ablated = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(names[1], zero)])
            post = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=[(f"{pre}experts.{expert}.hook_post", zero)])
            unweighted = hm.run_with_hooks(
                **inputs.kwargs(),
                fwd_hooks=[(pre + "hook_routing_weights", lambda t, hook: t.masked_fill(index == expert, 0))],
            )
            subtracted = hm.run_with_hooks(
                **inputs.kwargs(),
                fwd_hooks=[(f"blocks.{layer}.hook_mlp_out", lambda t, hook: t - contribution.to(t.dtype))],
            )
            biased = subtracted
            if bool(left.any()):
                biased = hm.run_with_hooks(
                    **inputs.kwargs(),
                    fwd_hooks=[(f"blocks.{layer}.hook_mlp_out", lambda t, hook: t - (contribution - left).to(t.dtype))],
                )
        assert not close(ablated[v], reference[v]), "removing a chosen expert changed nothing"
        assert_close(ablated[v], subtracted[v], "zeroed hook_result == contributions subtracted", atol=1e-4)
        assert_close(post[v], biased[v], "zeroed hook_post == contributions but the down bias subtracted", atol=1e-4)
        assert_close(unweighted[v], subtracted[v], "routing weight 0 == contributions subtracted", atol=1e-4)
        hm.unwrap()
