"""Comparing a wrapped model with TransformerLens 2.x's ``HookedTransformer`` on the same weights.

TransformerLens (TL) 2.x is the definition of the hook names and semantics lensadapters borrows. A plugin's
``reference.py`` builds TL's model from the Hugging Face model with TL's own weight conversion and every processing
step off (:func:`hooked_transformer`); the plugin's tests then compare every hook point both have
(:func:`compare_hooks`) and the effect of the same edit at each of them (:func:`compare_edit`);
:class:`TransformerLensComparison` holds those two tests for a family, which declares how to build the pair. TL 2.x
needs transformers 4.x and numpy < 2 (``benchmarks/constraints-bench-tl2.txt``): the tests skip where it is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence

import pytest
import torch

from lensadapters.testing.contract import perturb
from lensadapters.testing.reference import seeded_tokens
from lensadapters.testing.tl_reference import load_unprocessed

__all__ = [
    "transformer_lens_available",
    "tl_config_from_hf",
    "hooked_transformer",
    "converted_by_tl",
    "rotary_decoder_fields",
    "compare_hooks",
    "compare_edit",
    "Comparison",
    "as_ours",
    "as_theirs",
    "comparable_names",
    "comparison_tokens",
    "TransformerLensComparison",
]

Tensor = torch.Tensor


def transformer_lens_available() -> bool:
    """Whether TransformerLens can be imported here (it needs transformers 4.x)."""
    if importlib.util.find_spec("transformer_lens") is None:
        return False
    try:
        import transformer_lens  # noqa: F401
    except Exception:  # noqa: BLE001 - an incompatible environment counts as missing
        return False
    return True


def tl_config_from_hf(hf_model: Any) -> dict:
    """TL's own ``convert_hf_model_config`` on ``hf_model``'s config (saved to a temporary directory, so nothing is
    downloaded): what ``HookedTransformer.from_pretrained`` would build for a checkpoint with this config. TL maps
    architectures by ``config.architectures`` here, except the families it matches by checkpoint name (Llama,
    Gemma), for which a plugin's reference mirrors TL's table instead."""
    from transformer_lens.loading_from_pretrained import convert_hf_model_config

    with tempfile.TemporaryDirectory(prefix="lensadapters-tl-config-") as folder:
        config = hf_model.config
        if not getattr(config, "architectures", None):
            config.architectures = [type(hf_model).__name__]
        config.save_pretrained(folder)
        return convert_hf_model_config(folder)


def hooked_transformer(hf_model: Any, convert: Callable[[Any, Any], dict], fields: dict) -> Any:
    """TL's ``HookedTransformer`` with ``fields`` as its config and ``convert(hf_model, cfg)`` (TL's weight
    conversion) as its weights, loaded with fold_ln, centering and value-bias folding off (``from_pretrained_no_
    processing``), float32 on the CPU, in eval mode. ``hook_result`` and ``hook_mlp_in`` are switched on (they
    change no number)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    fields = {k: v for k, v in fields.items() if k in HookedTransformerConfig.__dataclass_fields__}
    fields.update(device="cpu", dtype=torch.float32, init_weights=False, tokenizer_name=None)  # nothing to fetch
    cfg = HookedTransformerConfig(**fields)
    model = HookedTransformer(cfg, tokenizer=None, move_to_device=False)
    with torch.no_grad():
        state = convert(hf_model, cfg)
    model = load_unprocessed(model, state)
    model.set_use_attn_result(True)
    model.set_use_hook_mlp_in(True)
    return model


def converted_by_tl(conversion: str) -> Callable[[Any], Any]:
    """A plugin reference's ``to_hooked_transformer`` for a family TL converts from an HF config: TL's model with
    ``hf_model``'s weights, from TL's own config conversion (:func:`tl_config_from_hf`) and weight conversion
    (``transformer_lens.pretrained.weight_conversions.<conversion>``), no weight processing. ``n_ctx`` is the HF
    model's (TL caps it at 2048 for memory)."""

    def to_hooked_transformer(hf_model: Any) -> Any:
        from transformer_lens.pretrained import weight_conversions

        fields = tl_config_from_hf(hf_model)
        fields["n_ctx"] = hf_model.config.max_position_embeddings
        return hooked_transformer(hf_model, getattr(weight_conversions, conversion), fields)

    return to_hooked_transformer


def rotary_decoder_fields(config: Any, **fields: Any) -> dict:
    """TL config fields of a pre-norm decoder with RMSNorm, a gated MLP and RoPE on every dimension of a head, from
    an HF ``config`` (its sizes, ``rms_norm_eps``, ``initializer_range``, and ``sliding_window`` with ``layer_types``
    as TL's local/global attention), then ``fields`` (a family's flags): what a reference mirrors of TL's tables for
    a family TL matches by checkpoint name."""
    return {
        "d_model": config.hidden_size,
        "d_head": config.head_dim,
        "n_heads": config.num_attention_heads,
        "d_mlp": config.intermediate_size,
        "n_layers": config.num_hidden_layers,
        "n_ctx": config.max_position_embeddings,
        "eps": config.rms_norm_eps,
        "d_vocab": config.vocab_size,
        "initializer_range": config.initializer_range,
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "n_key_value_heads": config.num_key_value_heads,
        "window_size": config.sliding_window,
        "use_local_attn": True,
        "attn_types": ["local" if t == "sliding_attention" else "global" for t in config.layer_types],
        "gated_mlp": True,
        "final_rms": True,
        "rotary_dim": config.head_dim,
        **fields,
    }


def as_ours(theirs: Tensor, ours: Tensor) -> Tensor:
    """TL's value in lensadapters' layout: the same values, reshaped where TL flattens (q/k norms: ``[b*p*h, ...]``)."""
    return theirs if theirs.shape == ours.shape else theirs.reshape(ours.shape)


def as_theirs(ours: Tensor, theirs_shape: torch.Size) -> Tensor:
    return ours if ours.shape == theirs_shape else ours.reshape(theirs_shape)


@dataclass
class Comparison:
    """What :func:`compare_hooks` found: the points compared, the largest difference at each, the names only one
    side has."""

    compared: dict[str, float] = field(default_factory=dict)
    only_ours: list[str] = field(default_factory=list)
    only_theirs: list[str] = field(default_factory=list)
    logits: float = 0.0

    def mismatches(self, atol: float) -> dict[str, float]:
        return {name: diff for name, diff in self.compared.items() if diff > atol}


def _difference(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return float("inf")  # one side masks what the other does not
    return (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0


#: the head-input points exist in TL only with ``use_split_qkv_input``/``use_attn_in``, which the family references
#: leave off (the analysis layer's own comparison, ``tests/test_tl_reference.py``, turns them on)
HEAD_INPUT_POINTS = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")


def comparable_names(hm: Any) -> list[str]:
    """``hm.hook_names`` without the head-input points (see ``HEAD_INPUT_POINTS``)."""
    return [n for n in hm.hook_names if not n.endswith(HEAD_INPUT_POINTS)]


def compare_hooks(
    hm: Any, tl: Any, tokens: Tensor, skip: Iterable[str] = (), names: Optional[Iterable[str]] = None
) -> Comparison:
    """Run both on ``tokens`` (unpadded) and compare every hook point both have (or ``names``), and the logits."""
    skip = set(skip)
    ours_names = set(hm.hook_names)
    theirs_names = set(tl.hook_dict)
    shared = [n for n in comparable_names(hm) if n in theirs_names and n not in skip] if names is None else list(names)
    result = Comparison(only_ours=sorted(ours_names - theirs_names), only_theirs=sorted(theirs_names - ours_names))
    with torch.no_grad():
        logits, ours = hm.run_with_cache(tokens, names_filter=shared)
        tl_logits, theirs = tl.run_with_cache(tokens, names_filter=shared)
    for name in shared:
        result.compared[name] = _difference(ours[name], as_ours(theirs[name], ours[name]))
    result.logits = _difference(logits, tl_logits)
    return result


def compare_edit(hm: Any, tl: Any, tokens: Tensor, name: str, edit: Callable[[Tensor], Tensor]) -> tuple[float, float]:
    """The same edit (a function of the value in lensadapters' layout) at ``name`` in both: ``(largest difference
    between the two edited logits, largest change the edit made to lensadapters' logits)``."""

    def ours_hook(t: Tensor, hook: Any) -> Tensor:
        return edit(t)

    def theirs_hook(t: Tensor, hook: Any) -> Tensor:
        shape = _our_shapes.get(name)
        return as_theirs(edit(t.reshape(shape) if shape is not None else t), t.shape)

    _our_shapes: dict[str, torch.Size] = {}
    with torch.no_grad():
        _, cache = hm.run_with_cache(tokens, names_filter=[name])
        _our_shapes[name] = cache[name].shape
        reference = hm(tokens).logits
        ours = hm.run_with_hooks(tokens, fwd_hooks=[(name, ours_hook)])
        theirs = tl.run_with_hooks(tokens, fwd_hooks=[(name, theirs_hook)])
    return _difference(ours, theirs), _difference(ours, reference)


def comparison_tokens(length: int = 9) -> Tensor:
    """Two unpadded rows of seeded tokens (ids 3 to 63: every tiny test vocabulary has them)."""
    return seeded_tokens(length)


class TransformerLensComparison:
    """A family's comparison with TL, as a test class: subclass it as ``Test<Family>TransformerLens`` and declare
    how the pair is built; the tests compare every hook point both have, the logits, the declared weights, and the
    effect of the same edit at every shared point. Family-specific differences stay tests of the subclass, built
    with :meth:`pair`."""

    #: the family's contract (an instance): builds and wraps the model
    contract: ClassVar[Any] = None
    #: the family's config function (``mistral_config``...), called with ``config_defaults`` and overrides
    config: ClassVar[Optional[Callable[..., Any]]] = None
    config_defaults: ClassVar[Mapping[str, Any]] = {}
    #: the compared models' size, in ``config``'s keywords: two layers, four query heads over two key/value heads
    #: (``config_defaults`` and overrides replace them)
    model_size: ClassVar[Mapping[str, Any]] = {"layers": 2, "n_heads": 4, "n_kv": 2}
    #: ``"module:function"`` building TL's model from the HF model (imported only here: it imports TL); by default
    #: ``to_hooked_transformer`` of the plugin's ``reference`` module
    reference: ClassVar[str] = ""
    #: config overrides of each model ``test_hook_values_match_transformerlens`` compares
    cases: ClassVar[Sequence[Mapping[str, Any]]] = ({},)
    #: weight accessors that must equal TL's
    weights: ClassVar[Sequence[str]] = ()
    #: hook points that must be among the compared ones (lensadapters' layout differing from TL's, say)
    compared_points: ClassVar[Sequence[str]] = ()
    #: edit every block's points; otherwise every kind of point once (the last blocks' and the model's own)
    edit_every_block: ClassVar[bool] = False
    #: edits must change the logits, but at points ending with one of these (a saturated softmax hides them)
    inert_points: ClassVar[Optional[Sequence[str]]] = None
    atol: ClassVar[float] = 2e-4

    def setup_method(self) -> None:
        """Skips the class's tests where TransformerLens cannot be imported (it needs transformers 4.x)."""
        if not transformer_lens_available():
            pytest.skip("transformer_lens is not installed")

    def pair(self, **overrides: Any) -> tuple[Any, Any, Any]:
        """``(HF model, wrapped model, TL's model)`` for the family's config with ``overrides``."""
        reference = self.reference or f"{self.contract.plugin.__name__}.reference:to_hooked_transformer"
        module, function = reference.split(":")
        to_hooked_transformer = getattr(importlib.import_module(module), function)
        make_config = type(self).config
        if make_config is None:
            raise TypeError(f"{type(self).__name__} sets no `config` function")
        config = make_config(**{**self.model_size, **self.config_defaults, **overrides})
        model = self.contract.make_model(config, 0, "eager")
        return model, self.contract.wrap(model), to_hooked_transformer(model)

    def test_hook_values_match_transformerlens(self) -> None:
        for case in self.cases:
            _, hm, tl = self.pair(**case)
            result = compare_hooks(hm, tl, comparison_tokens())
            assert not result.mismatches(self.atol), (case, result.mismatches(self.atol))
            assert result.logits < self.atol, (case, result.logits)
            # every lensadapters point is one TL has (TL's extra points fire only with its flags)
            assert not result.only_ours, (case, result.only_ours)
            assert len(result.compared) == len(comparable_names(hm)), case
            missing = [name for name in self.compared_points if name not in result.compared]
            assert not missing, f"not compared: {missing}"
            for name in self.weights:
                assert torch.allclose(getattr(hm, name), getattr(tl, name)), name
            hm.unwrap()

    def test_edits_have_the_effect_they_have_in_transformerlens(self) -> None:
        _, hm, tl = self.pair(**self.cases[0])
        names = comparable_names(hm)
        if not self.edit_every_block:  # the blocks share one layout
            names = [n for n in names if not n.startswith("blocks.0.")]
        for name in names:

            def edit(t: Tensor, name: str = name) -> Tensor:
                return perturb(t, type("H", (), {"name": name})())

            difference, effect = compare_edit(hm, tl, comparison_tokens(), name, edit)
            assert difference < self.atol * max(1.0, effect), (
                f"{name}: edited logits differ from TL's by {difference:.3g}"
            )
            if self.inert_points is not None:
                assert effect > 1e-4 or name.endswith(tuple(self.inert_points)), f"{name}: the edit changed nothing"
        hm.unwrap()
