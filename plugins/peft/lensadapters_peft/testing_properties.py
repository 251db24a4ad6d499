"""LoRA's own properties of the contract (:class:`~lensadapters_peft.testing.LoraContract` mixes them in): each
``*_lora`` point reads exactly what PEFT adds and edits do what they say, disabled adapters give the base model,
effective weights are base + factors, merged adapters give the same hooks, switching adapters follows PEFT."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import lensadapters_peft as lp
from lensadapters import LensAdaptersError
from lensadapters.testing import assert_close, served_weights

from .testing_support import (
    ADAPTED_OUTPUT,
    HEAD_DELTAS,
    NO_PATTERN,
    SETTINGS,
    WEIGHTS,
    declared_parts,
    factor_kind,
    float_tol,
    init_lora,
    lora_layers,
    split_like,
)


class LoraProperties:
    """The properties; the contract class supplies ``draw_twins``, ``adapt``, ``wrap`` and the drawn models."""

    # --- LoRA's own properties -----------------------------------------------------------------------

    @SETTINGS
    @given(data=st.data())
    def test_lora_points_read_the_exact_delta(self, data: st.DataObject) -> None:
        """Each ``*_lora`` point reads exactly what PEFT adds (sum of B·A·x·scaling over the active adapters),
        and with one adapter the projection's output is the base layer's output plus that delta."""
        _, pm, inputs = self.draw_twins(data)
        hm = self.wrap(pm)
        layers = lora_layers(hm)
        assert layers, "no *_lora hook point on an adapted model"
        assert set(layers) == set(lp.lora_hook_names(hm))
        seen_in: dict[int, torch.Tensor] = {}
        outs: dict[Any, torch.Tensor] = {}

        def record(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen_in[id(m)] = args[0]
            outs[id(m)] = out

        handles = []
        for module in set(layers.values()):
            handles.append(module.register_forward_hook(record))
            handles.append(
                module.base_layer.register_forward_hook(lambda m, a, o: outs.__setitem__(("base", id(m)), o))
            )
        try:
            with torch.no_grad():
                logits, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=NO_PATTERN)
                assert torch.equal(logits, pm(**inputs.kwargs()).logits)
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():
            for name, module in layers.items():
                x = seen_in[id(module)]
                active = [a for a in module.active_adapters if a in module.lora_A]
                expected = None
                for adapter in active:
                    d = module.lora_B[adapter](module.lora_A[adapter](x)) * module.scaling[adapter]
                    expected = d if expected is None else expected + d
                assert expected is not None, f"{name}: no active adapter on an adapted layer"
                # (a block that flattens tokens around its MLP, OPT, shows [b, p, ...]: compare in that shape)
                assert torch.equal(cache[name], split_like(hm, name, expected).reshape(cache[name].shape)), name
                if len(active) == 1:
                    assert torch.equal(outs[id(module)], outs[("base", id(module.base_layer))] + expected), name
                # lora_factors gives the same delta in TransformerLens shapes: x @ A @ B * scaling (+ LoRA bias)
                layer, which = int(name.split(".")[1]), factor_kind(hm, name)
                if which is None:  # a part lora_factors has no factors for (a gated DeltaNet's projections)
                    continue
                total: Any = 0
                for adapter in active:
                    f = lp.lora_factors(hm, layer, which, adapter=adapter)
                    bias = f.b if f.b is not None else 0
                    if which in ("q", "k", "v"):
                        total = total + torch.einsum("...m,mr,hrd->...hd", x, f.A, f.B) * f.scaling + bias
                    elif which == "o":
                        heads = x.unflatten(-1, (hm.cfg.n_heads, -1))
                        total = total + torch.einsum("...hd,hdr,rm->...m", heads, f.A, f.B) * f.scaling + bias
                    else:
                        total = total + x @ f.A @ f.B * f.scaling + bias
                assert_close(
                    cache[name], total.reshape(cache[name].shape), f"{name} == x @ A @ B * scaling (lora_factors)"
                )
        assert hm.unwrap() is pm

    @SETTINGS
    @given(data=st.data())
    def test_disabled_adapters_match_the_base_model(self, data: st.DataObject) -> None:
        """With adapters disabled every hook point shared with the bare base model is bitwise its value, the
        ``*_lora`` points read zero, and the weights are the base weights."""
        base, pm, inputs = self.draw_twins(data)
        hm, hb = self.wrap(pm), self.wrap(base)
        flags = {n: p.requires_grad for n, p in pm.named_parameters()}
        with torch.no_grad():
            both = lp.run_with_cache_base_and_adapted(hm, **inputs.kwargs(), names_filter=NO_PATTERN)
            base_logits, base_cache = hb.run_with_cache(**inputs.kwargs(), names_filter=NO_PATTERN)
            assert torch.equal(both.logits, pm(**inputs.kwargs()).logits)
        assert {n: p.requires_grad for n, p in pm.named_parameters()} == flags, "requires_grad flags changed"
        assert torch.equal(both.base_logits, base_logits), "disabled adapters: logits differ from the base model"
        assert [n for n in hm.hook_names if not n.endswith("_lora")] == hb.hook_names
        assert set(both.base_cache.keys()) - set(base_cache.keys()) == set(lp.lora_hook_names(hm))
        for key in base_cache.keys():
            assert torch.equal(both.base_cache[key], base_cache[key]), f"{key}: disabled adapters != base model"
        for key in lp.lora_hook_names(hm):
            assert not both.base_cache[key].any(), f"{key} is not zero with adapters disabled"
            assert both.cache[key].abs().max() > 0, f"{key} reads zero with adapters active"
        with lp.adapters_disabled(hm), torch.no_grad():
            names = ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "b_Q", "b_O", "b_in", "b_out")
            adapted, bare = served_weights(hm, names), served_weights(hb, names)
            assert adapted.keys() == bare.keys()
            for w, value in adapted.items():
                assert torch.equal(value, bare[w]), f"{w} with adapters disabled != base {w}"
        hm.unwrap()
        hb.unwrap()

    @SETTINGS
    @given(data=st.data())
    def test_effective_weights_are_base_plus_factors(self, data: st.DataObject) -> None:
        """``hm.W_Q``... of an adapted projection are the base weights plus ``lora_factors(...).W`` summed over
        the active adapters; unadapted projections keep the base weights."""
        base, pm, _ = self.draw_twins(data)
        hm, hb = self.wrap(pm), self.wrap(base)
        with torch.no_grad():
            weights = WEIGHTS + ((("gate", "W_gate"),) if hm.cfg.gated_mlp else ())
            adapted, base_weights = (
                served_weights(hm, [w for _, w in weights]),
                served_weights(hb, [w for _, w in weights]),
            )
            assert adapted.keys() == base_weights.keys()
            for which, w in weights:
                if w not in adapted:  # refused by both (a hybrid's stacked attention weights)
                    continue
                full, bare = adapted[w], base_weights[w]
                for layer in range(hm.cfg.n_layers):
                    factors = []
                    for adapter in pm.peft_config:
                        try:
                            factors.append(lp.lora_factors(hm, layer, which, adapter=adapter))
                        except LensAdaptersError:  # this adapter does not adapt that projection
                            continue
                    if not factors:
                        assert torch.equal(full[layer], bare[layer]), f"unadapted {w}[{layer}] != base"
                        continue
                    delta = sum(f.W for f in factors)
                    assert delta.shape == full[layer].shape
                    assert_close(full[layer], bare[layer] + delta, f"{w}[{layer}] == base + A @ B * scaling", atol=1e-6)
        hm.unwrap()
        hb.unwrap()

    @SETTINGS
    @given(data=st.data())
    def test_zero_ablating_a_head_delta_gives_the_base_head(self, data: st.DataObject) -> None:
        """Zeroing one head's q/k/v delta gives that head the base projection exactly (the base layer's output
        in the same pass, and in the first layer the adapters-disabled value); the other heads keep theirs."""
        _, pm, inputs = self.draw_twins(data, left_padding=False, second=None)
        hm = self.wrap(pm)
        heads = [n for n in lp.lora_hook_names(hm) if n.endswith(HEAD_DELTAS)]
        if not heads:  # no q/k/v projection was adapted
            hm.unwrap()
            return
        name = data.draw(st.sampled_from(heads), label="point")
        target = name.replace("_lora", "")
        layer = int(name.split(".")[1])
        n = hm.cfg.n_heads if name.endswith("q_lora") else hm.cfg.n_key_value_heads
        head = data.draw(st.integers(0, n - 1), label="head")

        def zero(t: torch.Tensor, hook: Any) -> torch.Tensor:
            t = t.clone()
            t[:, :, head] = 0
            return t

        module = lora_layers(hm)[name]
        base_out: list[torch.Tensor] = []
        handle = module.base_layer.register_forward_hook(lambda m, a, o: base_out.append(o))
        try:
            with torch.no_grad():
                _, adapted = hm.run_with_cache(**inputs.kwargs(), names_filter=[target])
                with hm.hooks([(name, zero)]):
                    _, edited = hm.run_with_cache(**inputs.kwargs(), names_filter=[target])
        finally:
            handle.remove()
        base_heads = split_like(hm, name, base_out[-1])
        a, e = adapted[target], edited[target]
        others = [h for h in range(n) if h != head]
        assert torch.equal(e[:, :, others], a[:, :, others]), "zeroing one head's delta changed other heads"
        assert torch.equal(e[:, :, head], base_heads[:, :, head]), "the head without its delta != base projection"
        if layer == 0:  # the same input with the adapters disabled: the same function of it
            with lp.adapters_disabled(hm), torch.no_grad():
                _, disabled = hm.run_with_cache(**inputs.kwargs(), names_filter=[target])
            assert torch.equal(e[:, :, head], disabled[target][:, :, head])
        hm.unwrap()

    @SETTINGS
    @given(data=st.data())
    def test_delta_edit_sets_output_to_base_plus_edit(self, data: st.DataObject) -> None:
        """An edit of a ``*_lora`` point makes the projection output exactly ``base_out + edited delta``, and the
        core's hook points on the same module, attached *before* the edit, see the edited output."""
        _, pm, inputs = self.draw_twins(data, left_padding=False)
        hm = self.wrap(pm)
        layers = lora_layers(hm)
        # adapters only on modules the architecture gives no hook point (Gemma 4's per-layer input projection)
        # have no *_lora point to edit: such a draw says nothing here
        if not layers:
            hm.unwrap()
        assume(bool(layers))
        name = data.draw(st.sampled_from(sorted(layers)), label="point")
        module = layers[name]
        layer = int(name.split(".")[1])
        siblings = [n for n in hm.hook_names if layers.get(n) is module]  # in the projection's order (q, k, v)
        seen: dict[str, torch.Tensor] = {}

        def read(t: torch.Tensor, hook: Any) -> None:
            seen[hook.name] = t.clone()

        def edit(t: torch.Tensor, hook: Any) -> torch.Tensor:
            seen["edited"] = t * -0.5 + torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(t.dtype)
            return seen["edited"]

        core = [
            n
            for n in hm.hook_names
            if n.startswith(f"blocks.{layer}.") and not n.endswith("_lora") and "pattern" not in n and "scores" not in n
        ]
        records: dict[str, torch.Tensor] = {}
        with torch.no_grad(), hm.hooks([(n, read) for n in core]):  # core sites installed first
            with hm.hooks([(n, read) for n in siblings] + [(name, edit)]):
                ha = module.base_layer.register_forward_hook(lambda m, a, o: records.__setitem__("base", o))
                hb = module.register_forward_hook(lambda m, a, o: records.__setitem__("out", o))
                try:
                    edited_logits = hm(**inputs.kwargs()).logits
                finally:
                    ha.remove()
                    hb.remove()
        with torch.no_grad():  # (outside the reading hooks: they would record this pass)
            assert not torch.equal(edited_logits, pm(**inputs.kwargs()).logits), f"editing {name} changed nothing"
        parts = [seen[n] for n in siblings]
        parts[siblings.index(name)] = seen["edited"]
        short = name.rsplit(".", 1)[1]
        qkv = hm.qkv_layouts[layer]
        mlp = hm.mlp_layouts[layer]
        declared = declared_parts(hm, name)
        if declared is not None:  # the parts the architecture's points show (all of them: the siblings)
            delta = declared.merge(*parts)
        elif short in HEAD_DELTAS:
            delta = qkv.merge(*parts) if hasattr(qkv, "split") else parts[0].flatten(-2)
        elif short in ("hook_pre_lora", "hook_pre_linear_lora") and hasattr(mlp, "split"):
            delta = mlp.merge(*parts)  # a fused gate/up projection: both halves' points, in its order
        else:
            delta = parts[0].reshape(records["base"].shape)  # OPT's MLP sees tokens flattened to [b*p, d]
        out = records["out"]
        assert torch.equal(out, (records["base"] + delta).to(out.dtype)), "output != base output + edited delta"
        if declared is not None:  # the part's own point saw the edited output's part
            target = name[: -len("_lora")]
            assert torch.equal(seen[target], split_like(hm, name, out)), target
        target = ADAPTED_OUTPUT.get(short)
        shown = seen[f"blocks.{layer}.{target}"] if target is not None and declared is None else None
        # the core's point on this module saw the edited output
        if shown is not None and shown.numel() == out.numel():
            assert torch.equal(shown, split_like(hm, name, out).reshape(shown.shape)), target
        hm.unwrap()

    @SETTINGS
    @given(data=st.data())
    def test_merged_adapters_give_the_same_hooks(self, data: st.DataObject) -> None:
        """After ``merge_adapter()`` every hook point, weight and the logits agree with the unmerged model within
        float rounding, and zeroing a delta point removes the adapter's contribution there either way."""
        _, pm, inputs = self.draw_twins(data, left_padding=False, lora_bias=False)
        hm = self.wrap(pm)
        with torch.no_grad():
            logits, cache = hm.run_with_cache(**inputs.kwargs())
            weights = served_weights(hm, ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "b_Q", "b_in"))
            pm.merge_adapter()
            merged_logits, merged = hm.run_with_cache(**inputs.kwargs())
            for w, value in weights.items():
                assert_close(getattr(hm, w), value, f"merged {w}", atol=1e-5)
            name = data.draw(st.sampled_from(lp.lora_hook_names(hm)), label="point")
            zero = [(name, lambda t, hook: torch.zeros_like(t))]
            merged_zeroed = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=zero)
            pm.unmerge_adapter()
            unmerged_zeroed = hm.run_with_hooks(**inputs.kwargs(), fwd_hooks=zero)
        assert set(merged.keys()) == set(cache.keys())
        for key in cache.keys():
            assert_close(merged[key], cache[key], f"merged {key}", atol=float_tol(cache[key]))
        assert_close(merged_logits, logits, "merged logits", atol=float_tol(logits))
        assert_close(
            merged_zeroed, unmerged_zeroed, "zeroed delta, merged vs unmerged", atol=float_tol(unmerged_zeroed)
        )
        hm.unwrap()

    @SETTINGS
    @given(data=st.data())
    def test_adapted_hooks_equal_the_merged_and_unloaded_model(self, data: st.DataObject) -> None:
        """Adapted hooks equal the hooks of the same model with the adapters merged into plain weights: a deep
        copy under ``merge_and_unload()`` (no PEFT layer left), wrapped as a bare model, within float rounding."""
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer

        base, pm, inputs = self.draw_twins(data, left_padding=False, lora_bias=False)
        plain = copy.deepcopy(pm).merge_and_unload()
        assert not isinstance(plain, PeftModel) and not any(isinstance(m, BaseTunerLayer) for m in plain.modules())
        hm, hp = self.wrap(pm), self.wrap(plain)
        assert [n for n in hm.hook_names if not n.endswith("_lora")] == hp.hook_names
        weights = ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "W_U", "b_Q", "b_K", "b_V", "b_O", "b_in", "b_out")
        with torch.no_grad():
            logits, cache = hm.run_with_cache(**inputs.kwargs())
            plain_logits, plain_cache = hp.run_with_cache(**inputs.kwargs())
            effective, merged = served_weights(hm, weights), served_weights(hp, weights)
            assert effective.keys() == merged.keys()
            for w, value in effective.items():
                assert_close(value, merged[w], f"effective {w} == merged-and-unloaded {w}", atol=1e-5)
            assert not torch.allclose(pm(**inputs.kwargs()).logits, base(**inputs.kwargs()).logits), (
                "the adapters do not change the model"
            )
        for key in plain_cache.keys():
            assert_close(
                cache[key], plain_cache[key], f"adapted {key} == merged-and-unloaded", atol=float_tol(cache[key])
            )
        assert_close(logits, plain_logits, "logits", atol=float_tol(logits))
        assert hm.unwrap() is pm
        hp.unwrap()

    @SETTINGS
    @given(data=st.data())
    def test_switching_adapters(self, data: st.DataObject) -> None:
        """Hook points follow the active adapter; ``using_adapter`` restores the previous one and the
        ``requires_grad`` flags; two active adapters' deltas add up; ``set_adapter`` outside a helper works."""
        _, pm, inputs = self.draw_twins(data, left_padding=False, second=None)
        blocks = self._blocks(pm)
        adapted = sorted(n for n, m in blocks[0][1].named_modules() if "default" in getattr(m, "lora_A", ()))
        other = sorted(data.draw(st.lists(st.sampled_from(adapted), min_size=1, unique=True), label="other"))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            pm.add_adapter("other", self.lora_config(pm, other, blocks, r=3, lora_alpha=5))
        init_lora(pm, 1)
        pm.eval()
        hm = self.wrap(pm)
        flags = {n: p.requires_grad for n, p in pm.named_parameters()}
        with torch.no_grad():
            logits_default, cache_default = hm.run_with_cache(**inputs.kwargs(), names_filter=NO_PATTERN)
            with lp.using_adapter(hm, "other"):
                assert pm.active_adapters == ["other"]
                logits_other, cache_other = hm.run_with_cache(**inputs.kwargs(), names_filter=NO_PATTERN)
                assert torch.equal(logits_other, pm(**inputs.kwargs()).logits)
                for name, module in lora_layers(hm).items():
                    layer, which = int(name.split(".")[1]), factor_kind(hm, name)
                    if "other" in module.lora_A:
                        if which is not None:
                            assert lp.lora_factors(hm, layer, which).adapter == "other"
                    else:  # not adapted by "other": no delta
                        assert not cache_other[name].any(), name
                        if which is None:
                            continue
                        try:
                            lp.lora_factors(hm, layer, which)
                        except LensAdaptersError as exc:
                            assert "0 active LoRA adapters" in str(exc), str(exc)
                        else:
                            raise AssertionError(f"lora_factors({layer}, {which!r}) without an active adapter")
            assert pm.active_adapters == ["default"]
            assert torch.equal(hm(**inputs.kwargs()).logits, logits_default)
            with lp.using_adapter(hm, ["default", "other"]):
                _, cache_both = hm.run_with_cache(**inputs.kwargs(), names_filter=lp.lora_hook_names(hm))
        assert {n: p.requires_grad for n, p in pm.named_parameters()} == flags, "requires_grad flags changed"
        assert not torch.equal(logits_default, logits_other)
        # the first layer's q/k/v projections see the same input in every run: their deltas add up
        for name in lp.lora_hook_names(hm):
            if name.startswith("blocks.0.attn.") and name.endswith(HEAD_DELTAS):
                assert_close(cache_both[name], cache_default[name] + cache_other[name], f"{name}: two adapters add up")
        pm.set_adapter("other")  # PEFT's own switch, outside a helper
        with torch.no_grad():
            assert torch.equal(hm.run_with_cache(**inputs.kwargs(), names_filter=NO_PATTERN)[0], logits_other)
        hm.unwrap()
