"""The contract suite on LoRA-adapted models, for any architecture plugin (needs ``lensadapters[testing]``).

A plugin author opts in with one line, next to the plugin's own contract class::

    from lensadapters_peft.testing import LoraContract
    from lensadapters_myarch.contract import MyArchContract

    class TestMyArchLora(LoraContract, MyArchContract):
        '''Every contract property, plus LoRA's own, on PeftModels over the plugin's configs.'''

Each drawn model is the base model :class:`~lensadapters.testing.AdapterContract` builds from the
plugin's ``configs()``, adapted with ``peft.get_peft_model``. The seed chooses which linear layers inside
the blocks get LoRA (a non-empty subset of the ``nn.Linear`` / transformers ``Conv1D`` leaf modules of the
first block, in every block; ``fan_in_fan_out`` for ``Conv1D``), the rank, alpha, rsLoRA, LoRA biases and
sometimes a second adapter active together with the first. A and B are random and non-zero (PEFT's
default B = 0 would make every adapter a no-op). lensadapters-peft is registered next to the plugin.

Besides every inherited property, LoRA's own are checked: each ``*_lora`` point reads exactly what PEFT
adds and the projection output is the base output plus it; with adapters disabled every hook point and
weight is bitwise the base model's; effective weights are base + ``lora_factors(...).W``.
``lensadapters check PLUGIN --lora`` runs the same class.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

import lensadapters_peft as lp
from lensadapters import HookedModel, LensAdaptersError
from lensadapters.testing import AdapterContract, assert_close
from lensadapters.testing.strategies import Inputs, token_inputs

__all__ = ["LoraContract", "LoraSpec", "init_lora", "linear_targets", "lora_layers", "split_like"]

_SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.differing_executors])
# pattern/score hooks run the core's explicit attention (equal to SDPA within rounding, not bitwise)
_NO_PATTERN = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731
_WEIGHTS = (("q", "W_Q"), ("k", "_W_K"), ("v", "_W_V"), ("o", "W_O"), ("in", "W_in"), ("out", "W_out"))


@dataclass
class LoraSpec:
    """The LoRA adapters put on a model: relative module names (inside each block) and hyperparameters."""

    targets: list[str]
    r: int
    alpha: int
    rslora: bool
    lora_bias: bool
    second: Optional[list[str]] = None  # a second adapter's targets, active together with the first
    second_r: int = 2
    second_alpha: int = 3


def _is_linear_like(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D)) and not list(module.children())


def linear_targets(blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """Relative names of the linear-like leaf modules (``nn.Linear``, ``Conv1D``) of the first block."""
    _, first = blocks[0]
    return sorted(name for name, module in first.named_modules() if name and _is_linear_like(module))


def init_lora(model: nn.Module, seed: int) -> None:
    """Random, non-zero LoRA factors (and LoRA biases) for every adapter of ``model``."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=g) / math.sqrt(max(p.shape))).to(p.dtype))


def lora_layers(hm: HookedModel) -> dict[str, nn.Module]:
    """``{*_lora hook name: the LoRA layer it reads}``."""
    out = {}
    for site in hm._sites:
        if isinstance(site, lp.LoraDeltaSite):
            for point in site.points:
                out[point.name] = site.module
    return out


def split_like(hm: HookedModel, name: str, t: torch.Tensor) -> torch.Tensor:
    """Split a projection-output tensor as the ``*_lora`` hook point ``name`` shows it."""
    layer = int(name.split(".")[1])
    short = name.rsplit(".", 1)[1]
    qkv = hm.qkv_layouts[layer]
    if short in ("hook_q_lora", "hook_k_lora", "hook_v_lora"):
        if hasattr(qkv, "split"):
            return qkv.split(t)["qkv".index(short[5])]
        return t.unflatten(-1, (-1, hm.cfg.d_head))
    return t


class LoraContract(AdapterContract):
    """The contract suite with every model a ``PeftModel`` (LoRA) over the plugin's drawn config.

    Put it first among the bases (``class T(LoraContract, MyArchContract)``): the plugin's contract
    supplies ``plugin``, ``configs()`` and its overrides. Override :meth:`lora_targets` to restrict
    which modules may be adapted.
    """

    extra_plugins = (lp,)

    # --- building adapted models -------------------------------------------------------------------

    def base_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> nn.Module:
        """The unadapted model: what the plugin's contract builds."""
        return super().make_model(config, seed, attn_implementation)

    def lora_targets(self, model: nn.Module) -> list[str]:
        """Module names relative to a block that may be adapted (default: every linear-like leaf)."""
        return linear_targets(self._blocks(model))

    def _blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        names = {id(m): n for n, m in model.named_modules()}
        hm = self.wrap(model)
        try:
            return [(names[id(block)], block) for block in hm.blocks]
        finally:
            hm.unwrap()

    def lora_spec(self, model: nn.Module, seed: int) -> LoraSpec:
        """The adapters for ``model``, chosen by ``seed``."""
        options = self.lora_targets(model)
        if not options:
            raise AssertionError("no linear-like module (nn.Linear, Conv1D) inside the blocks to put LoRA on")
        rng = random.Random(seed)

        def subset() -> list[str]:
            return sorted(rng.sample(options, rng.randint(1, len(options))))

        spec = LoraSpec(subset(), r=rng.randint(1, 4), alpha=rng.randint(1, 16), rslora=rng.random() < 0.5,
                        lora_bias=rng.random() < 0.5)
        if rng.random() < 0.5:
            spec.second, spec.second_r, spec.second_alpha = subset(), rng.randint(1, 3), rng.randint(1, 8)
        return spec

    def adapt(self, model: nn.Module, seed: int, spec: Optional[LoraSpec] = None) -> nn.Module:
        """``model`` under LoRA adapters (``spec``, by default the one ``seed`` chooses), in eval mode."""
        from peft import LoraConfig, get_peft_model
        from transformers.pytorch_utils import Conv1D

        spec = spec or self.lora_spec(model, seed)
        try:
            note(f"LoRA adapters: {spec}")
        except Exception:  # outside a Hypothesis test
            pass
        blocks = self._blocks(model)

        def config(targets: list[str], **kw: Any) -> Any:
            full = [f"{prefix}.{t}" if prefix else t for prefix, block in blocks for t in targets
                    if _has(block, t)]
            conv = any(isinstance(model.get_submodule(n), Conv1D) for n in full)
            return LoraConfig(target_modules=full, init_lora_weights=False, fan_in_fan_out=conv, **kw)

        with warnings.catch_warnings():  # fan_in_fan_out corrections, lora_bias on a layer without bias
            warnings.filterwarnings("ignore", message=".*(fan_in_fan_out|lora_bias).*")
            pm = get_peft_model(model, config(spec.targets, r=spec.r, lora_alpha=spec.alpha,
                                              use_rslora=spec.rslora, lora_bias=spec.lora_bias))
            if spec.second:
                pm.add_adapter("second", config(spec.second, r=spec.second_r, lora_alpha=spec.second_alpha))
                pm.base_model.set_adapter(["default", "second"])
        init_lora(pm, seed)
        return pm.eval()

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> nn.Module:
        return self.adapt(self.base_model(config, seed, attn_implementation), seed)

    def draw_twins(self, data: st.DataObject) -> tuple[nn.Module, nn.Module, Inputs]:
        """A base model, the same model (rebuilt from the same seed) under LoRA, and left-padded inputs."""
        config = data.draw(self.configs(), label="config")
        seed = data.draw(st.integers(0, 2**16), label="seed")
        impl = self.attn_implementations[0]
        base = self.base_model(config, seed, impl)
        adapted = self.make_model(config, seed, impl)
        vocab = base.get_input_embeddings().weight.shape[0]
        inputs = data.draw(token_inputs(vocab, self.max_batch, 2, self.max_len), label="inputs")
        return base, adapted, inputs

    # --- LoRA's own properties -----------------------------------------------------------------------

    @_SETTINGS
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
            handles.append(module.base_layer.register_forward_hook(
                lambda m, a, o: outs.__setitem__(("base", id(m)), o)))
        try:
            with torch.no_grad():
                logits, cache = hm.run_with_cache(**inputs.kwargs(), names_filter=_NO_PATTERN)
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
        assert hm.unwrap() is pm

    @_SETTINGS
    @given(data=st.data())
    def test_disabled_adapters_match_the_base_model(self, data: st.DataObject) -> None:
        """With adapters disabled every hook point shared with the bare base model is bitwise its value, the
        ``*_lora`` points read zero, and the weights are the base weights."""
        base, pm, inputs = self.draw_twins(data)
        hm, hb = self.wrap(pm), self.wrap(base)
        flags = {n: p.requires_grad for n, p in pm.named_parameters()}
        with torch.no_grad():
            both = lp.run_with_cache_base_and_adapted(hm, **inputs.kwargs(), names_filter=_NO_PATTERN)
            base_logits, base_cache = hb.run_with_cache(**inputs.kwargs(), names_filter=_NO_PATTERN)
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
            for w in ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "b_Q", "b_O", "b_in", "b_out"):
                assert torch.equal(getattr(hm, w), getattr(hb, w)), f"{w} with adapters disabled != base {w}"
        hm.unwrap()
        hb.unwrap()

    @_SETTINGS
    @given(data=st.data())
    def test_effective_weights_are_base_plus_factors(self, data: st.DataObject) -> None:
        """``hm.W_Q``... of an adapted projection are the base weights plus ``lora_factors(...).W`` summed over
        the active adapters; unadapted projections keep the base weights."""
        base, pm, _ = self.draw_twins(data)
        hm, hb = self.wrap(pm), self.wrap(base)
        with torch.no_grad():
            weights = _WEIGHTS + ((("gate", "W_gate"),) if hm.cfg.gated_mlp else ())
            for which, w in weights:
                full, bare = getattr(hm, w), getattr(hb, w)
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
                    assert_close(full[layer], bare[layer] + delta, f"{w}[{layer}] == base + A @ B * scaling",
                                 atol=1e-6)
        hm.unwrap()
        hb.unwrap()


def _has(block: nn.Module, name: str) -> bool:
    try:
        block.get_submodule(name)
    except AttributeError:
        return False
    return True
