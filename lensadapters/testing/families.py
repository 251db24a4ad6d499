"""Test configurations of Llama-shaped families, declared rather than written out per plugin.

A plugin of a family described by :class:`lensadapters.hf.DecoderFamily` declares its tiny configs with two calls:

* :func:`declared_config` declares its builder: the keywords it takes with their defaults, the transformers field
  each sets and the fields derived from them; it builds with :func:`decoder_config`, which fills in the fields every
  such family shares (sizes, heads, rope theta, RMSNorm eps, activation, tied embeddings; bos 1, eos 2, pad 0; no
  dropout);
* :func:`config_strategy` turns that builder into the ``config_strategy`` of its contract: a function of keyword
  overrides (each a value or a strategy) returning a strategy of configs (:func:`keyword_strategy`: the same
  without the decoder's heads and width drawn first).

::

    mistral_config = declared_config(
        "mistral_config", MistralConfig, keywords=dict(head_dim=8, window=3), fields=dict(window="sliding_window")
    )
    mistral_configs = config_strategy(mistral_config, window=st.sampled_from([None, 2, 3, 5, 16]), ...)

:class:`DecoderContract` is the contract of such a family (no learned positions, rotary, gated MLP, sequential
blocks); :data:`WINDOW_PROPERTIES` the properties a short sliding window must reach on every run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Mapping, Optional

import pytest
import torch
from hypothesis import strategies as st
from torch import nn

from lensadapters.adapters.toy_configs import decoder_config
from lensadapters.errors import UnsupportedModelError
from lensadapters.testing.contract import AdapterContract
from lensadapters.testing.family_checks import (
    assert_custom_code_refused,
    assert_patterns_refused_under,
    assert_unknown_rope_refused,
    generate_with_hooks,
)
from lensadapters.testing.moe import MoEContract
from lensadapters.testing.strategies import as_strategy

__all__ = [
    "DENSE_DRAWS",
    "DecoderContract",
    "GenerationChecks",
    "HEAD_DRAWS",
    "MOE_DRAWS",
    "MoEDecoderContract",
    "OffsetNormModels",
    "QKNormScores",
    "RefusalChecks",
    "SMALL_MATRIX",
    "TransformerLensWithoutWindows",
    "WINDOW_PROPERTIES",
    "config_strategy",
    "declared_config",
    "decoder_config",
    "keyword_strategy",
    "left_padded_tokens",
    "padded_cache",
    "reinit_offset_norms",
    "rope_type",
]

#: properties that must see a window shorter than the input on every run (the family's window stratum)
WINDOW_PROPERTIES = (
    "test_pattern_matches_hf_eager",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_edits_during_generation_match_one_pass",
)


#: the draws of a small dense decoder: GQA ratios 1, 2, 4 and multi-query attention, one or two layers, MLP widths,
#: vocabularies, rope bases, tied and untied embeddings, SiLU or GELU
DENSE_DRAWS: dict[str, Any] = {
    "n_kv": st.sampled_from([1, 2]),
    "ratio": st.sampled_from([1, 2, 4]),
    "hidden_per_head": st.sampled_from([4, 8]),
    "n_layers": st.integers(1, 2),
    "d_mlp": st.sampled_from([16, 40]),
    "vocab": st.integers(16, 128),
    "theta": st.sampled_from([100.0, 10000.0]),
    "tied": st.booleans(),
    "act": st.sampled_from(["silu", "gelu_new"]),
}

#: the heads of a small decoder whose head size is its own: one or two key/value heads, one or two query heads per
#: key/value head, heads of 4 or 8 columns, a width of 4 or 8 per query head
HEAD_DRAWS: dict[str, Any] = {
    "n_kv": st.sampled_from([1, 2]),
    "ratio": st.sampled_from([1, 2]),
    "head_dim": st.sampled_from([4, 8]),
    "hidden_per_head": st.sampled_from([4, 8]),
}

#: the small models of the LoRA and 8-bit matrices (they build two models per example, or save and reload one): a
#: dense family's ``matrix_overrides`` start from these (one kv head, two query heads per kv head, width 8 per head)
SMALL_MATRIX: dict[str, Any] = {"n_kv": 1, "ratio": 2, "hidden_per_head": 8, "d_mlp": 24, "vocab": 64}

#: the experts a mixture-of-experts family draws: 2 to 5, routed to 1 up to every expert (at most 4)
MOE_DRAWS: dict[str, Any] = {
    "experts": st.integers(2, 5),
    "top_k": lambda drawn: st.integers(1, min(drawn["experts"], 4)),
}


def config_strategy(build: Callable[..., Any], doc: str = "", **defaults: Any) -> Callable[..., st.SearchStrategy]:
    """``configs(**overrides)``: a strategy of ``build(**drawn)`` whose keywords ``defaults`` declares (values or
    strategies; ``overrides`` replace them by name).

    The heads and width are drawn first: ``n_kv`` key/value heads, ``n_kv * ratio`` query heads unless ``n_heads``
    is given, a width of ``n_heads * hidden_per_head`` unless ``d_model`` is given; ``build`` gets them as
    ``n_heads``, ``n_kv`` and ``hidden``. Every other keyword is drawn as :func:`keyword_strategy` draws it (in
    declaration order, under its name; ``n_layers`` as ``layers``).
    """
    shape = {"n_kv": None, "ratio": 1, "n_heads": None, "hidden_per_head": 8, "d_model": None}

    def draw_shape(draw: st.DrawFn, params: dict[str, Any]) -> dict[str, Any]:
        kv = draw(as_strategy(params.pop("n_kv")), label="n_kv")
        ratio, n_heads = params.pop("ratio"), params.pop("n_heads")
        heads = kv * draw(as_strategy(ratio), label="gqa ratio") if n_heads is None else draw(as_strategy(n_heads))
        per_head, d_model = params.pop("hidden_per_head"), params.pop("d_model")
        hidden = (
            heads * draw(as_strategy(per_head), label="hidden per head")
            if d_model is None
            else draw(as_strategy(d_model), label="d_model")
        )
        return {"n_heads": heads, "n_kv": kv, "hidden": hidden}

    return _drawn_configs(build, doc, {**shape, **defaults}, draw_shape, renames={"n_layers": "layers"})


def keyword_strategy(build: Callable[..., Any], doc: str = "", **defaults: Any) -> Callable[..., st.SearchStrategy]:
    """``configs(**overrides)``: a strategy of ``build(**drawn)``, every keyword ``defaults`` declares (a value or a
    strategy; ``overrides`` replace them by name) drawn in declaration order and passed under its name; a callable
    that is not a strategy is called with the values drawn so far and gives the strategy
    (``top_k=lambda drawn: st.integers(1, drawn["experts"])``). :func:`config_strategy` is this with a decoder's
    heads and width drawn first."""
    return _drawn_configs(build, doc, defaults, lambda draw, params: {}, renames={})


def _drawn_configs(
    build: Callable[..., Any],
    doc: str,
    declared: dict[str, Any],
    draw_first: Callable[[st.DrawFn, dict[str, Any]], dict[str, Any]],
    renames: dict[str, str],
) -> Callable[..., st.SearchStrategy]:
    """The strategy function of :func:`config_strategy` and :func:`keyword_strategy`: ``draw_first`` draws (and
    pops) the keywords it owns, then every other keyword is drawn in order."""

    @st.composite
    def configs(draw: st.DrawFn, **overrides: Any) -> Any:
        unknown = set(overrides) - set(declared)
        if unknown:
            raise TypeError(f"{build.__name__} draws no {', '.join(sorted(unknown))}")
        params = {**declared, **overrides}
        drawn = draw_first(draw, params)
        for name, value in params.items():
            if callable(value) and not isinstance(value, st.SearchStrategy):
                value = value(drawn)
            drawn[renames.get(name, name)] = draw(as_strategy(value), label=name)
        return build(**drawn)

    configs.__doc__ = doc
    configs.__name__ = configs.__qualname__ = f"{build.__name__}s"
    return configs


def declared_config(
    name: str,
    config_class: Any,
    doc: str = "",
    *,
    keywords: Optional[Mapping[str, Any]] = None,
    fields: Optional[Mapping[str, Optional[str]]] = None,
    derive: Optional[Callable[[dict[str, Any]], Mapping[str, Any]]] = None,
    build: Callable[..., Any] = decoder_config,
) -> Callable[..., Any]:
    """A family's tiny-config builder ``name(**given)``, declared: ``build(config_class, **passed)`` (``build``:
    :func:`decoder_config`, or ``hf.moe_decoder_config``, or the family's own builder of that signature).

    * ``keywords``: the builder's keywords and their defaults (the family's own, ``window=3``, and ``build``'s shared
      ones where the family's default differs, ``layers=2``); a given keyword of the same name replaces one;
    * ``fields``: the transformers field a keyword sets (``window="sliding_window"``; ``None``: it only feeds
      ``derive``); every other keyword, declared or given (``build``'s, transformers' own names), passes under its
      name;
    * ``derive``: the fields computed from the keywords (a function of all of them, declared and given: a config's
      ``layer_types``, its rope parameters), replacing those of the same name;
    * ``config_class``: a config class, or a function of the keywords choosing it.
    """
    declared = dict(keywords or {})
    renamed = dict(fields or {})

    def config(**given: Any) -> Any:
        values = {**declared, **given}
        passed: dict[str, Any] = {}
        for key, value in values.items():
            field = renamed.get(key, key)
            if field is not None:
                passed[field] = value
        passed.update(derive(values) if derive is not None else {})
        chosen = config_class if isinstance(config_class, type) else config_class(values)
        return build(chosen, **passed)

    config.__doc__ = doc
    config.__name__ = config.__qualname__ = name
    return config


def rope_type(config: Any) -> str:
    """The rope type of a config (transformers 4.57: ``rope_scaling``; 5.x: ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


class DecoderContract(AdapterContract):
    """The contract of a Llama-shaped family: token embeddings without learned positions, rotary attention, a gated
    MLP, attention then MLP. A plugin's contract names its plugin and config strategy and what it changes."""

    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False

    def config_label(self, config: Any) -> Optional[str]:
        return f"{config.num_attention_heads}:{config.num_key_value_heads} heads"


def reinit_offset_norms(model: nn.Module, seed: int) -> None:
    """Unit-ish random weights as ``lensadapters.testing.reinit`` gives, with the weights of ``(1 + weight)`` norms
    drawn around 0 (their effective scale around 1, as in checkpoints of families with such norms)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1:
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(min(param.shape)))


class OffsetNormModels:
    """Contract mixin of a family with ``(1 + weight)`` norms: its models get :func:`reinit_offset_norms` weights."""

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> nn.Module:
        model = super().make_model(config, seed, attn_implementation)  # type: ignore[misc]
        reinit_offset_norms(model, seed)
        return model


def left_padded_tokens(
    length: int = 7, pads: tuple[int, ...] = (2, 0), vocab: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (seed 0, above the special tokens 0-2) and an attention mask: one row per entry of ``pads``, that
    many positions masked on its left."""
    ids = torch.randint(3, vocab, (len(pads), length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(len(pads), length, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


def padded_cache(hm: Any, **tokens: Any) -> Any:
    """``hm``'s activation cache (no gradients) on :func:`left_padded_tokens` (``tokens``: its arguments)."""
    ids, mask = left_padded_tokens(**tokens)
    with torch.no_grad():
        return hm.run_with_cache(ids, attention_mask=mask)[1]


class RefusalChecks:
    """Tests of the refusals every declared family makes, mixed into a plugin's test class next to its contract
    (``class TestMistral(MistralContract, RefusalChecks)``): custom modeling code under the family's
    ``model_type``, a rope type that is not rotate-half, and flash/flex attention (every hook point but the pattern
    ones), and the config settings the family declares refused. ``example_config`` builds the small config they
    wrap."""

    example_config: ClassVar[Callable[[], Any]]
    refused_settings: ClassVar[dict[str, tuple[Any, str]]] = {}
    """Config attributes whose value the family refuses at wrap time: ``{name: (value, pattern of the message)}``."""

    def example_model(self) -> nn.Module:
        return self.make_model(type(self).example_config(), 0)  # type: ignore[attr-defined]

    def test_custom_code_is_refused(self) -> None:
        assert_custom_code_refused(self, self.example_model())

    def test_unknown_rope_type_is_refused(self) -> None:
        model = self.example_model()
        assert_unknown_rope_refused(self, model, model.get_submodule("model.rotary_emb"))

    @pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
    def test_flash_and_flex_refuse_patterns_only(self, impl: str) -> None:
        assert_patterns_refused_under(self, self.example_model(), impl)

    def test_refused_settings_are_refused(self) -> None:
        if not self.refused_settings:
            pytest.skip("the family declares no refused config settings")
        for name, (value, message) in self.refused_settings.items():
            config = type(self).example_config()
            setattr(config, name, value)
            with pytest.raises(UnsupportedModelError, match=message):
                self.wrap(self.make_model(config, 0))  # type: ignore[attr-defined]


class GenerationChecks:
    """A test mixed into a plugin's test class next to its contract (``class TestQwen3(Qwen3Contract,
    RefusalChecks, GenerationChecks)``): greedy generation, with a dynamic and a static cache, with reading hooks on
    every point (patterns included) gives the logits of generation without hooks, on the model of
    ``example_config(**generation_config)`` (seed 1) and two left-padded prompts of 5 tokens."""

    example_config: ClassVar[Callable[..., Any]]
    generation_config: ClassVar[dict[str, Any]] = {}

    @pytest.mark.parametrize("cache", [None, "static"])
    def test_generation_with_hooks(self, cache: Optional[str]) -> None:
        config = type(self).example_config(**self.generation_config)
        hm = self.wrap(self.make_model(config, 1))  # type: ignore[attr-defined]
        generate_with_hooks(hm, *left_padded_tokens(length=5), cache, steps=4)
        hm.unwrap()


class TransformerLensWithoutWindows:
    """Mixin of a family's TransformerLens comparison (``TransformerLensComparison``) whose TransformerLens 2.18
    counterpart has no sliding window, a documented difference: with a window on every layer
    (``window_fields``), TransformerLens attends globally where the HF model (and lensadapters) masks outside the
    window."""

    window_fields: ClassVar[dict[str, Any]] = {"window": 3, "window_from": 0}

    def test_transformerlens_has_no_sliding_window(self) -> None:
        from .tl_compare import compare_hooks, comparison_tokens

        _, hm, tl = self.pair(**self.window_fields)  # type: ignore[attr-defined]
        result = compare_hooks(hm, tl, comparison_tokens(), names=["blocks.0.attn.hook_pattern"])
        assert result.compared["blocks.0.attn.hook_pattern"] > 0.1  # TL spreads attention outside the window
        hm.unwrap()


class QKNormScores:
    """Contract mixin of a family with a norm on the queries between ``hook_q`` and the scores: doubling ``hook_q``
    changes nothing, the norm's output and ``hook_rot_q`` are linear."""

    score_linear_points: ClassVar[tuple[str, ...]] = ("attn.hook_rot_q", "attn.q_norm.hook_normalized")
    score_invariant_points: ClassVar[tuple[str, ...]] = ("attn.hook_q",)


class MoEDecoderContract(MoEContract):
    """The MoE contract of a Llama-shaped family whose blocks' MLPs are mixtures of experts: no block has the dense
    ``mlp.hook_pre_linear`` (each expert is gated: ``mlp.experts.{e}.hook_gate``), so ``gated_mlp`` is off. The LoRA
    matrix builds two models per example: smaller ones."""

    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, False, False
    matrix_overrides = dict(experts=st.integers(2, 3), n_layers=st.integers(1, 2))
