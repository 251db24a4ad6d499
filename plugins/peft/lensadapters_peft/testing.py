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
adds (and ``lora_factors`` gives the same delta), the projection output is the base output plus it, and
an edited delta point makes it base + the edited delta; zeroing one head's delta gives that head the base
projection; with adapters disabled every hook point and weight is bitwise the base model's; effective
weights are base + ``lora_factors(...).W``; merged adapters (``merge_adapter``, and a ``merge_and_unload``
copy wrapped as a bare model) give the same hooks, weights and logits within float rounding; switching
adapters (``using_adapter``, ``set_adapter``) follows PEFT exactly. ``lensadapters check PLUGIN --lora``
runs the same class.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from typing import Any, Optional

from hypothesis import note
from hypothesis import strategies as st
from torch import nn

import lensadapters_peft as lp
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import Inputs, token_inputs

from .testing_properties import LoraProperties
from .testing_support import (
    LoraSpec,
    base_layer,
    factor_kind,
    float_tol,
    has_module,
    init_lora,
    linear_targets,
    lora_layers,
    peft_renamed_targets,
    split_like,
)

__all__ = [
    "LoraContract",
    "LoraSpec",
    "factor_kind",
    "float_tol",
    "init_lora",
    "linear_targets",
    "lora_layers",
    "peft_renamed_targets",
    "split_like",
]


class LoraContract(LoraProperties, AdapterContract):
    """The contract suite with every model a ``PeftModel`` (LoRA) over the plugin's drawn config.

    Put it first among the bases (``class T(LoraContract, MyArchContract)``): the plugin's contract
    supplies ``plugin``, ``configs()`` and its overrides. Override :meth:`lora_targets` to restrict
    which modules may be adapted.
    """

    @classmethod
    def supports(cls, contract: type) -> Optional[str]:
        """Why this variant does not run over ``contract`` (``None``: it does): LoRA on a mixture of experts (fused
        expert parameters or expert modules, per transformers version) is checked by the architecture's own tests;
        a contract may declare its own reason (``lora_variant_refused``)."""
        from lensadapters.testing.moe import MoEContract

        if issubclass(contract, MoEContract):
            return "LoRA on mixture-of-experts models is checked by their architecture's own tests"
        return getattr(contract, "lora_variant_refused", None)  # declared by the architecture's contract

    extra_plugins = (lp,)

    # --- building adapted models -------------------------------------------------------------------

    def base_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> nn.Module:
        """The unadapted model: what the plugin's contract builds."""
        return super().make_model(config, seed, attn_implementation)

    def lora_targets(self, model: nn.Module) -> list[str]:
        """Module names relative to a block that may be adapted (default: every linear-like leaf PEFT adapts as
        that module: not one PEFT renames into a fused experts parameter's target, :func:`peft_renamed_targets`)."""
        return linear_targets(self._blocks(model), peft_renamed_targets(model))

    def _blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(name, block)``, names relative to the Hugging Face model inside ``model`` (PEFT matches
        ``target_modules`` against those)."""
        hm = self.wrap(model)
        try:
            names = {id(m): n for n, m in hm.hf_model.named_modules()}
            return [(names[id(block)], block) for block in hm.block_modules]
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

        spec = LoraSpec(
            subset(),
            r=rng.randint(1, 4),
            alpha=rng.randint(1, 16),
            rslora=rng.random() < 0.5,
            lora_bias=rng.random() < 0.5,
        )
        if rng.random() < 0.5:
            spec.second, spec.second_r, spec.second_alpha = subset(), rng.randint(1, 3), rng.randint(1, 8)
        return spec

    def lora_config(
        self, model: nn.Module, targets: list[str], blocks: Optional[list[tuple[str, nn.Module]]] = None, **kwargs: Any
    ) -> Any:
        """A ``peft.LoraConfig`` (random non-zero initialisation) on ``targets`` (names relative to a block) in
        every block of ``model`` (bare or already adapted); ``fan_in_fan_out`` for transformers ``Conv1D``.
        ``blocks``: ``model``'s blocks when already known."""
        from peft import LoraConfig
        from transformers.pytorch_utils import Conv1D

        blocks = blocks if blocks is not None else self._blocks(model)
        full = [f"{prefix}.{t}" if prefix else t for prefix, block in blocks for t in targets if has_module(block, t)]
        conv = any(
            isinstance(base_layer(block.get_submodule(t)), Conv1D)
            for _, block in blocks
            for t in targets
            if has_module(block, t)
        )
        return LoraConfig(target_modules=full, init_lora_weights=False, fan_in_fan_out=conv, **kwargs)

    def adapt(self, model: nn.Module, seed: int, spec: Optional[LoraSpec] = None) -> nn.Module:
        """``model`` under LoRA adapters (``spec``, by default the one ``seed`` chooses), in eval mode."""
        from peft import get_peft_model

        spec = spec or self.lora_spec(model, seed)
        try:
            note(f"LoRA adapters: {spec}")
        except Exception:  # outside a Hypothesis test
            pass
        blocks = self._blocks(model)
        with warnings.catch_warnings():  # fan_in_fan_out corrections, lora_bias on a layer without bias
            warnings.filterwarnings("ignore", message=".*(fan_in_fan_out|lora_bias).*")
            first = self.lora_config(
                model,
                spec.targets,
                blocks,
                r=spec.r,
                lora_alpha=spec.alpha,
                use_rslora=spec.rslora,
                lora_bias=spec.lora_bias,
            )
            second = (
                self.lora_config(model, spec.second, blocks, r=spec.second_r, lora_alpha=spec.second_alpha)
                if spec.second
                else None
            )
            pm = get_peft_model(model, first)
            if second is not None:
                pm.add_adapter("second", second)
                pm.base_model.set_adapter(["default", "second"])
        init_lora(pm, seed)
        return pm.eval()

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> nn.Module:
        return self.adapt(self.base_model(config, seed, attn_implementation), seed)

    def draw_twins(
        self, data: st.DataObject, left_padding: bool = True, **spec: Any
    ) -> tuple[nn.Module, nn.Module, Inputs]:
        """A base model, the same model (rebuilt from the same seed) under LoRA, and inputs (left-padded unless
        ``left_padding=False``). ``spec`` replaces fields of the drawn :class:`LoraSpec` (``second=None``...)."""
        config = self.draw_config(data)
        seed = data.draw(st.integers(0, 2**16), label="seed")
        impl = self.attn_implementations[0]
        base = self.base_model(config, seed, impl)
        bare = self.base_model(config, seed, impl)
        adapted = self.adapt(bare, seed, dataclasses.replace(self.lora_spec(bare, seed), **spec))
        vocab = base.get_input_embeddings().weight.shape[0]
        inputs = data.draw(token_inputs(vocab, self.max_batch, 2, self.max_len, left_padding), label="inputs")
        return base, adapted, inputs
