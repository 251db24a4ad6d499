"""The contract suite every adapter plugin passes.

Opt in from your plugin's tests by subclassing :class:`AdapterContract`::

    from lensadapters.testing import AdapterContract
    import lensadapters_myarch
    from lensadapters_myarch.testing import myarch_configs   # a Hypothesis strategy of tiny configs

    class TestMyArch(AdapterContract):
        plugin = lensadapters_myarch            # registered by hand: no installation needed
        config_strategy = myarch_configs        # called with config_overrides as keyword arguments
        learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False

The suite draws a config and left-padded inputs, builds a seeded model with
``AutoModelForCausalLM.from_config`` and checks the properties below.

Configs are *declared*: ``config_strategy`` is a function returning a strategy of tiny transformers
configs, whose keyword arguments each take a fixed value or a narrower strategy. ``config_overrides`` are
the keywords it is called with; ``matrix_overrides`` narrow them further for suites that build more than one
model per example (the LoRA and 8-bit matrices: :func:`lensadapters.testing.matrix_class`), and
``aligned_overrides`` (optional) keep every linear layer's input width a multiple of 64 and its output width
a multiple of 32 (blockwise-quantized kernels). A contract whose configs cannot be said that way overrides
``configs()`` instead.

Capabilities (learned positions, rotary, gated MLP, parallel blocks) are *declared*: set the class
attributes, or override ``capabilities(model)`` when one depends on the config (GPT-NeoX's
``use_parallel_residual``). ``test_hook_points_match_declared_capabilities`` then requires the hook
points and ``hm.cfg`` fields each capability implies (a rotary model without ``hook_rot_q`` fails); an
undeclared capability (``None``) is not checked. The other properties follow the hook points the wrapped
model has.

What the properties may assume about the architecture is declared too (see :class:`Capabilities`; the
defaults hold for GPT-2, GPT-NeoX, OPT, Llama and GPT-J): ``score_linear_points``, the query points whose
doubling doubles the attention scores (not through a query norm), and ``score_invariant_points``, those whose
doubling a scale-invariant query norm undoes; ``score_softcap``, the config attribute of an attention-score
softcap; ``post_norms``, block outputs taken after a norm that follows their projection (Gemma 2's sandwich
norms); ``pre_norms``, whether blocks have norms before attention and MLP (OLMo 2 has none);
``logit_softcap``, the config attribute of a final-logit softcap. A sliding attention window needs no
declaration: the properties read which scores are masked from the scores themselves.

Override ``pre_ln_residual(model)`` for blocks whose residual stream is not ``resid_mid = resid_pre +
attn_out`` / ``resid_post = resid_mid + mlp_out`` (post-LN), ``final_hidden_is_ln_final`` when the model's
last hidden state is not the final norm's output, and ``attn_implementations`` when transformers offers the
model no sdpa (the first entry is the default implementation).

Coverage on every run: with few examples per property, a random draw can miss a config family for some
properties on every CI run. ``config_strata`` names such families and the properties that must see them
(``{"llama3": ("test_edits_during_generation_match_one_pass", ...)}``); ``stratum_overrides`` gives each
family as keyword overrides of ``config_strategy`` (``{"llama3": {"rope_types": ("llama3",)}}``; or override
``stratum_configs(name)``). Each pair becomes one more test, ``<property>__<name>``, that draws only from the
stratum (``stratum_examples`` examples, a quarter of the profile's by default): an ``@example`` for a whole
family of configs. ``config_label(config)`` names a drawn config for Hypothesis' statistics (``pytest
--hypothesis-show-statistics`` lists the labels each property drew).

Ship the subclass in the plugin package and name it in the plugin's ``LENSADAPTERS_CONTRACT =
"module:Class"`` so that ``lensadapters check PLUGIN`` runs the same suite, and the cross-cutting plugins'
test matrices find it.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import fields
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lensadapters.adapters.registry import Registry
from lensadapters.api.hooked_model import HookedModel
from lensadapters.testing.contract_support import (
    ATOL,
    RTOL,
    Capabilities,
    assert_close,
    close,
    perturb,
    perturbed_logits,
    property_settings,
    uncap,
)
from lensadapters.testing.gradients import GradientContract
from lensadapters.testing.models import seeded_model
from lensadapters.testing.properties_edits import EditProperties
from lensadapters.testing.properties_reading import ReadingProperties
from lensadapters.testing.properties_runs import RunProperties
from lensadapters.testing.strategies import Inputs, token_inputs

__all__ = [
    "ATOL",
    "RTOL",
    "AdapterContract",
    "Capabilities",
    "assert_close",
    "close",
    "perturb",
    "perturbed_logits",
    "property_settings",
    "uncap",
]

_STRATUM_SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
)


def _stratum_test(name: str, prop: str, stratum: str, examples: int) -> Any:
    """The test ``name``: property ``prop`` (resolved on the instance's class, so variants' overrides run) on
    configs drawn from ``stratum_configs(stratum)``."""

    def body(self: "AdapterContract", data: st.DataObject) -> None:
        inner = _served(getattr(type(self), prop)).hypothesis.inner_test
        self._stratum = stratum
        try:
            inner(self, data)
        finally:
            self._stratum = None

    body.__name__ = body.__qualname__ = name  # (also gives each its own derandomized examples)
    body.__doc__ = (
        f"``{prop}`` on configs of the stratum {stratum!r} only (``config_strata``): covered on every "
        f"run, whatever ``configs()`` happens to draw."
    )
    test = settings(max_examples=examples, **_STRATUM_SETTINGS)(given(data=st.data())(body))
    test._lensadapters_stratum = (prop, stratum, examples)
    return test


def _served(method: Any) -> Any:
    """The property itself, where ``not_served`` replaced it by a skipped test."""
    return getattr(method, "_lensadapters_served", method)


def _skipped_test(prop: str, served: Any, reason: str, mark: str, value: Any) -> Any:
    """A visibly skipped test in place of property ``prop`` (``served``), with ``reason``; ``mark`` names the
    attribute (``value``) saying why, which the class checks when it is subclassed."""

    def test(self: "AdapterContract") -> None:
        pytest.skip(reason)

    test.__name__ = test.__qualname__ = prop
    test.__doc__ = served.__doc__
    test._lensadapters_served = served  # type: ignore[attr-defined]
    setattr(test, mark, value)
    return pytest.mark.skip(reason=reason)(test)


def _not_served_test(prop: str, served: Any, why: str) -> Any:
    """The contract's reason (``not_served``) for not running property ``prop``."""
    reason = f"not served (the contract's not_served): {why}"
    return _skipped_test(prop, served, reason, "_lensadapters_not_served", why)


def _strata_only_test(prop: str, served: Any, strata: list[str]) -> Any:
    """Property ``prop``, which runs on its config strata only (``strata_only``), skipped unstratified."""
    reason = f"runs on its config strata only (the contract's strata_only): {', '.join(strata)}"
    return _skipped_test(prop, served, reason, "_lensadapters_strata_only", tuple(strata))


class AdapterContract(ReadingProperties, EditProperties, RunProperties, GradientContract):
    """Generic properties of an adapter plugin (see the module docstring); the properties themselves are in
    :mod:`~lensadapters.testing.properties_reading`, :mod:`~lensadapters.testing.properties_edits` and
    :mod:`~lensadapters.testing.properties_runs`."""

    plugin: ClassVar[Any] = None
    extra_plugins: ClassVar[Sequence[Any]] = ()
    #: why the LoRA variant of the contract suite (``lensadapters check --lora``) does not run over this contract
    #: (``None``: it does); the architecture's README says the same
    lora_variant_refused: ClassVar[Optional[str]] = None
    attn_implementations: ClassVar[Sequence[str]] = ("sdpa", "eager")
    final_hidden_is_ln_final: ClassVar[bool] = True
    max_batch: ClassVar[int] = 3
    max_len: ClassVar[int] = 9
    # the configs (module docstring): a strategy function and the keyword overrides it is called with
    config_strategy: ClassVar[Optional[Callable[..., st.SearchStrategy]]] = None
    config_overrides: ClassVar[Mapping[str, Any]] = {}
    #: narrower overrides (on top of config_overrides) for suites building several models per example
    matrix_overrides: ClassVar[Mapping[str, Any]] = {}
    #: overrides (on top of matrix_overrides) under which every linear layer's input width is a multiple of 64
    #: and its output width a multiple of 32, for blockwise-quantized kernels; None: none declared
    aligned_overrides: ClassVar[Optional[Mapping[str, Any]]] = None
    #: how far a quantized twin's hook values may drift from the float model's, normwise relative, per block of
    #: quantized projections (an empirical agreement, not a bound: the exact properties use the quantization's own
    #: error bound); None: the quantization plugin's default. A family whose forward normalizes vectors that can be
    #: near zero (an L2 norm of keys) amplifies rounding there and declares more, with its measurement
    quantized_drift_per_block: ClassVar[Optional[float]] = None
    # declared capabilities (see Capabilities); None: not declared. Override capabilities() when the
    # config decides one of them.
    learned_positions: ClassVar[Optional[bool]] = None
    rotary: ClassVar[Optional[bool]] = None
    gated_mlp: ClassVar[Optional[bool]] = None
    parallel_blocks: ClassVar[Optional[bool]] = None
    # what the properties may assume about the architecture (see Capabilities)
    score_linear_points: ClassVar[tuple[str, ...]] = ("attn.hook_q", "attn.hook_rot_q")
    score_invariant_points: ClassVar[tuple[str, ...]] = ()
    score_softcap: ClassVar[Optional[str]] = None
    post_norms: ClassVar[Mapping[str, str]] = {}
    pre_norms: ClassVar[bool] = True
    logit_softcap: ClassVar[Optional[str]] = None
    #: attention with sinks (a learned logit per head joins the softmax): pattern rows sum to less than one
    attention_sinks: ClassVar[bool] = False
    mixed_values: ClassVar[str] = "attn.hook_v"
    absorbed_points: ClassVar[tuple[str, ...]] = ()
    # config families some properties must see on every run: {stratum: property names} (module docstring)
    config_strata: ClassVar[Mapping[str, Sequence[str]]] = {}
    #: each stratum as keyword overrides of config_strategy (on top of config_overrides)
    stratum_overrides: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    stratum_examples: ClassVar[Optional[int]] = None  # None: a quarter of the profile's max_examples (at least 1)
    _stratum: Optional[str] = None
    #: properties that do not hold for the architecture, each with why (a named refusal, documented by the plugin):
    #: skipped with that reason in the contract and in every variant built over it (bnb, PEFT...), where a variant's
    #: override of the property is skipped too; a stratum (``config_strata``) still runs the property on its configs
    not_served: ClassVar[Mapping[str, str]] = {}
    #: properties that hold on every config but cost too much to draw ``max_examples`` times (an edit at every point
    #: of a large toy): they run on their ``config_strata`` only (``stratum_examples`` examples each), the
    #: unstratified test skipped with a note naming the strata
    strata_only: ClassVar[Sequence[str]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        strategy = cls.__dict__.get("config_strategy")
        if inspect.isfunction(strategy):  # a plain function: not a method of the contract
            cls.config_strategy = staticmethod(strategy)
        examples = cls.stratum_examples or max(1, settings.default.max_examples // 4)
        custom_strata = getattr(cls.stratum_configs, "__func__", None) is not AdapterContract.stratum_configs.__func__
        wanted: dict[str, tuple[str, str, int]] = {}
        for stratum, properties in dict(cls.config_strata).items():
            if not custom_strata and stratum not in cls.stratum_overrides:
                raise TypeError(
                    f"{cls.__name__}.config_strata names the stratum {stratum!r}, which neither "
                    f"stratum_overrides nor stratum_configs() defines"
                )
            slug = re.sub(r"\W+", "_", stratum).strip("_")
            for prop in properties:
                if not hasattr(_served(getattr(cls, prop, None)), "hypothesis"):
                    raise TypeError(
                        f"{cls.__name__}.config_strata[{stratum!r}] names {prop!r}, which is not a "
                        f"property of the contract (a Hypothesis test method)"
                    )
                wanted[f"{prop}__{slug}"] = (prop, stratum, examples)
        for name in dir(cls):  # generated for a base class's strata that this class does not declare
            if getattr(getattr(cls, name, None), "_lensadapters_stratum", None) is not None and name not in wanted:
                setattr(cls, name, None)
        for name, spec in wanted.items():
            if getattr(getattr(cls, name, None), "_lensadapters_stratum", None) != spec:
                setattr(cls, name, _stratum_test(name, *spec))
        for prop in cls.strata_only:
            # (a variant built over the contract without its strata, a cross-cutting matrix, skips the property)
            strata = [name for name, spec in wanted.items() if spec[0] == prop] or ["none in this class"]
            method = getattr(cls, prop)
            if getattr(method, "_lensadapters_strata_only", None) != tuple(strata):
                setattr(cls, prop, _strata_only_test(prop, _served(method), strata))
        for prop, why in dict(cls.not_served).items():
            method = getattr(cls, prop, None)
            if "not_served" in cls.__dict__ and not hasattr(_served(method), "hypothesis"):
                raise TypeError(
                    f"{cls.__name__}.not_served names {prop!r}, which is not a property of the contract (a "
                    f"Hypothesis test method)"
                )
            if getattr(method, "_lensadapters_not_served", None) != why:
                setattr(cls, prop, _not_served_test(prop, _served(method), why))

    # --- what a plugin provides ------------------------------------------------------------------

    @classmethod
    def configs(cls) -> st.SearchStrategy:
        """The strategy of tiny configs every property draws from: ``config_strategy(**config_overrides)``."""
        if cls.config_strategy is None:
            raise NotImplementedError(
                f"{cls.__name__} declares no config_strategy (a function returning a strategy of "
                f"tiny configs) and does not override configs()"
            )
        return cls.config_strategy(**cls.config_overrides)

    @classmethod
    def stratum_configs(cls, stratum: str) -> st.SearchStrategy:
        """The configs of one of ``config_strata`` (a part of what ``configs()`` draws):
        ``config_strategy(**{**config_overrides, **stratum_overrides[stratum]})``."""
        if cls.config_strategy is None or stratum not in cls.stratum_overrides:
            raise NotImplementedError(
                f"{cls.__name__} declares no stratum_overrides[{stratum!r}] (nor a config_strategy "
                f"to apply them to) and does not override stratum_configs()"
            )
        return cls.config_strategy(**{**cls.config_overrides, **cls.stratum_overrides[stratum]})

    def config_label(self, config: Any) -> Optional[str]:
        """A short name of a drawn config's family, counted in Hypothesis' statistics (None: not counted)."""
        return None

    def capabilities(self, model: torch.nn.Module) -> Capabilities:
        """What ``model`` has (declared, not read from the plugin): the class attributes by default."""
        return Capabilities(**{f.name: getattr(self, f.name) for f in fields(Capabilities)})

    def final_hidden_is_ln_final_of(self, model: torch.nn.Module) -> bool:
        """``final_hidden_is_ln_final`` for ``model`` (a contract over several families answers per model)."""
        return self.final_hidden_is_ln_final

    def layers_without_ln1(self, model: torch.nn.Module) -> set[int]:
        """Layers of a pre-norm model whose attention reads the residual without a norm (ModernBERT's layer 0):
        they have no ``ln1.*`` points. None by default."""
        return set()

    def pre_ln_residual(self, model: torch.nn.Module) -> bool:
        """Whether resid_mid = resid_pre + attn_out and resid_post = resid_mid + mlp_out hold (pre-LN blocks)."""
        return True

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The tensors wrapping must leave untouched (storage and values): the state dict by default.

        Override to drop entries a library synthesizes anew at every ``state_dict()`` call
        (bitsandbytes' ``weight_format``).
        """
        return model.state_dict()

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> torch.nn.Module:
        return seeded_model(config, seed, attn_implementation or self.attn_implementations[0])

    # --- machinery ---------------------------------------------------------------------------------

    def registry(self) -> Registry:
        registry = Registry()
        registry.register(self.plugin, getattr(self.plugin, "__name__", None))
        for extra in self.extra_plugins:
            registry.register(extra, getattr(extra, "__name__", None))
        return registry

    def wrap(self, model: torch.nn.Module) -> HookedModel:
        return HookedModel.wrap(model, registry=self.registry())

    def draw(
        self, data: st.DataObject, attn_implementation: Optional[str] = None, left_padding: bool = True
    ) -> tuple[torch.nn.Module, Inputs]:
        """A model and inputs; ``attn_implementation`` defaults to the first of ``attn_implementations``."""
        attn_implementation = attn_implementation or self.attn_implementations[0]
        config = self.draw_config(data)
        seed = data.draw(st.integers(0, 2**16), label="seed")
        model = self.make_model(config, seed, attn_implementation)
        vocab = model.get_input_embeddings().weight.shape[0]
        inputs = data.draw(token_inputs(vocab, self.max_batch, 2, self.max_len, left_padding), label="inputs")
        return model, inputs

    def draw_config(self, data: st.DataObject) -> Any:
        """A config from ``configs()``, or from the stratum a generated ``<property>__<stratum>`` test runs."""
        strategy = self.configs() if self._stratum is None else self.stratum_configs(self._stratum)
        config = data.draw(strategy, label="config" if self._stratum is None else f"config ({self._stratum})")
        label = self.config_label(config)
        if label is not None:
            event(f"config: {label}")
        return config

    @staticmethod
    def valid_logits(logits: torch.Tensor, inputs: Inputs) -> torch.Tensor:
        return logits[inputs.valid]
