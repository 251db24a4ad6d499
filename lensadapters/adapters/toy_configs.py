"""The toy configs of Llama-shaped families (``lensadapters_tiny_config``'s answers): :func:`toy_config` (a
family's toy model), :func:`sliding_toy` (one whose seeds vary depth, heads and a sliding window),
:func:`decoder_config` (a tiny config with the shared fields), :func:`moe_decoder_config` (one of a
mixture-of-experts family), :func:`toy_draw` (the values a seed varies), :func:`sliding_layers` (a config's
``layer_types``), :func:`window_from_fields` (the ``use_sliding_window`` fields) and :func:`tiny_config_of` (a
test's tiny config of any family, its sizes in one place). Exported by
:mod:`lensadapters.hf`; import them from there.
"""

from __future__ import annotations

import functools
import inspect
import random
from typing import Any, Callable, Optional, Sequence

from lensadapters.adapters.hf_helpers import router_fields, size_fields, without_dropout

__all__ = ["decoder_config", "moe_decoder_config", "sliding_layers", "sliding_toy", "toy_config", "toy_draw"]
__all__ += ["TINY_SIZES", "tiny_config_of", "window_from_fields"]

#: a test's tiny config's sizes, under :func:`~lensadapters.adapters.hf_helpers.size_fields`' short names: width 32,
#: MLP width 48, 2 layers, 4 query heads over 2 key/value heads, vocabulary 64, 64 positions
TINY_SIZES: dict[str, int] = dict(hidden=32, d_mlp=48, layers=2, heads=4, kv_heads=2, vocab=64, positions=64)


def toy_draw(seed: int, demo: Sequence[Any], *choices: Any) -> tuple[Any, ...]:
    """The values a toy config varies: ``demo`` for seed 0 (the demo's model); for another seed one draw per
    choice, in order, from ``random.Random(seed)``: a list draws one of its items, a float ``p`` is true with
    probability ``p``, a callable is called with the generator and the values drawn before it."""
    if seed == 0:
        return tuple(demo)
    rng = random.Random(seed)
    drawn: list[Any] = []
    for choice in choices:
        if isinstance(choice, float):
            drawn.append(rng.random() < choice)
        elif callable(choice):
            drawn.append(choice(rng, *drawn))
        else:
            drawn.append(rng.choice(choice))
    return tuple(drawn)


def sliding_layers(layers: int, full_every: int, last_full: bool = False) -> list[str]:
    """A config's ``layer_types`` with every ``full_every``-th layer (and, ``last_full``, the last one)
    ``"full_attention"`` and the others ``"sliding_attention"``."""
    full = [(i + 1) % full_every == 0 or (last_full and i == layers - 1) for i in range(layers)]
    return ["full_attention" if f else "sliding_attention" for f in full]


def window_from_fields(
    window: Optional[int], window_from: Optional[int] = 0, layers: Optional[int] = None
) -> dict[str, Any]:
    """The window fields of a config that switches its window on with ``use_sliding_window``: ``sliding_window``
    (``window``; 4096, unused, when it is None), ``use_sliding_window`` (``window`` is set and, given ``layers``,
    some layer from ``window_from`` on exists) and ``max_window_layers`` (``window_from``; left out when None)."""
    use = window is not None and (layers is None or window_from is None or window_from < layers)
    fields: dict[str, Any] = {"sliding_window": window or 4096, "use_sliding_window": use}
    if window_from is not None:
        fields["max_window_layers"] = window_from
    return fields


def sliding_toy(config_class: Callable[..., Any], seed: int, demo: Sequence[Any], **fields: Any) -> Any:
    """A :func:`toy_config` with a sliding window: seed 0 has ``demo`` (layers, (heads, key/value heads)) and a
    4-token window; another seed draws 1 to 3 layers, 4 query heads over 2, 4 or 1 key/value heads and a window of
    3 or 8. ``full_every=N`` (and ``last_full=True``): ``layer_types`` from :func:`sliding_layers`; then ``fields``."""
    layers, (heads, kv), window = toy_draw(seed, (*demo, 4), [1, 2, 3], [(4, 2), (4, 4), (4, 1)], [3, 8])
    full_every, last_full = fields.pop("full_every", None), fields.pop("last_full", False)
    if full_every is not None:
        fields = {"layer_types": sliding_layers(layers, full_every, last_full), **fields}
    return toy_config(config_class, layers, heads, kv, sliding_window=window, **fields)


def _sized_config(
    config_class: Callable[..., Any],
    sizes: tuple[int, int, int, int, int, int, int],
    fields: dict[str, Any],
) -> Any:
    """``config_class`` of ``sizes`` (width, MLP width, layers, heads, key/value heads, vocabulary, positions), bos
    1, eos 2, pad 0, then ``fields`` (which may replace any of those)."""
    named = size_fields(**dict(zip(("hidden", "d_mlp", "layers", "heads", "kv_heads", "vocab", "positions"), sizes)))
    return config_class(**{**named, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **fields})


def toy_config(config_class: Callable[..., Any], layers: int, heads: int, kv_heads: int, **fields: Any) -> Any:
    """A toy config of a Llama-shaped family for ``lensadapters_tiny_config``: width 64, MLP width 128, vocabulary
    512, 128 positions, bos 1, eos 2, pad 0, then the family's ``fields`` (which may replace any of those)."""
    return _sized_config(config_class, (64, 128, layers, heads, kv_heads, 512, 128), fields)


def decoder_config(
    config_class: Callable[..., Any],
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 32,
    vocab: int = 64,
    theta: float = 10000.0,
    tied: bool = False,
    eps: float = 1e-6,
    act: str = "silu",
    act_field: str = "hidden_act",
    max_pos: int = 64,
    **fields: Any,
) -> Any:
    """A tiny config of a Llama-shaped family (bos 1, eos 2, pad 0, no attention dropout): the shared fields, then
    the family's own ``fields`` (transformers' names: ``head_dim=8``, ``sliding_window=3``..., which may replace
    shared ones such as ``bos_token_id``); the activation under the config's name for it, ``act_field``."""
    shared = dict(rms_norm_eps=eps, tie_word_embeddings=tied, rope_theta=theta, attention_dropout=0.0)
    sizes = (hidden, d_mlp, layers, n_heads, n_kv, vocab, max_pos)
    return _sized_config(config_class, sizes, {**shared, act_field: act, **fields})


def moe_decoder_config(config_class: Callable[..., Any], *, experts: int = 4, top_k: int = 2, **fields: Any) -> Any:
    """A :func:`decoder_config` of a mixture-of-experts family: ``experts`` experts, ``top_k`` of them per token and
    no router logits (:func:`~lensadapters.adapters.hf_helpers.router_fields`); ``d_mlp`` 16 and ``max_pos`` 32
    unless ``fields`` says otherwise."""
    fields = {"d_mlp": 16, "max_pos": 32, **fields}
    return decoder_config(config_class, **router_fields(config_class, experts, top_k), **fields)


def tiny_config_of(config_class: Callable[..., Any], *, dropout_free: bool = False, **fields: Any) -> Any:
    """A tiny ``config_class``: the :data:`TINY_SIZES`, each replaced by a short name of ``fields`` (``layers=3``;
    ``None``: the family's default), under the config's own name for it (its ``attribute_map``'s: GPT-2's
    ``n_embd``, T5's ``d_model``...) and only where its constructor takes it (no heads for Mamba, no
    ``intermediate_size`` for OPT); then the other ``fields`` (transformers' names, replacing a size too).
    ``dropout_free``: every dropout rate of the model body zero where ``fields`` does not set it
    (:func:`~lensadapters.adapters.hf_helpers.without_dropout`)."""
    short = {name: fields.pop(name) for name in list(fields) if name in TINY_SIZES}
    given = {k: v for k, v in {**TINY_SIZES, **short}.items() if v is not None}
    aliases = getattr(config_class, "attribute_map", {})
    takes = inspect.signature(config_class.__init__).parameters
    sizes = {aliases.get(k, k): v for k, v in size_fields(**given).items()}
    build = functools.partial(without_dropout, config_class) if dropout_free else config_class
    return build(**{**{k: v for k, v in sizes.items() if k in takes}, **fields})
