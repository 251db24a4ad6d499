"""The per-forward state of the mixer form's sites (:mod:`lensadapters.adapters.generic.mixer_sites`) is each
forward's own: ``ResidMidSite``'s edit difference (added to the layer's output after the MLP) and
``InternalsSite``'s record of which internal points fired. A forward a hook runs inside another, or another thread's
forward of the same wrapped model, leaves the outer forward's edits and values bit for bit those of a run alone.

Jamba (``hook_resid_mid`` of a mixer-form layer with an MLP: ``ResidMidSite``) and Mamba (a mixer's ``hook_in_proj``
and ``hook_x_proj``: ``InternalsSite``), tiny models from ``lensadapters.testing.every_model_type.build``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lensadapters import HookedModel, Registry
from lensadapters.adapters.generic import GenericAdapterWarning
from lensadapters.testing import run_at_a_barrier
from lensadapters.testing.every_model_type import NotBuildable, build, input_ids

#: (the model type, layers, the edited point, the points read, where the nested call or the threads' meeting is:
#: after the edit's site recorded its state, before the site uses it)
CASES = {
    # ResidMidSite: the difference set at ln2's input, added to the layer's output after the MLP
    "resid_mid": ("jamba", 8, "blocks.1.hook_resid_mid", ("hook_resid_mid", "hook_mlp_out", "hook_resid_post")),
    # InternalsSite: in_proj fired, x_proj still to fire in this run of the mixer
    "internals": ("mamba", None, "blocks.0.mixer.hook_x_proj", ("mixer.hook_in_proj", "mixer.hook_x_proj")),
}
MEET = {"resid_mid": "blocks.1.hook_mlp_out", "internals": "blocks.0.mixer.hook_in_proj"}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: Any) -> Any:
    model_type, layers, edited, read = CASES[request.param]
    try:
        model = build(model_type, layers=layers)
    except NotBuildable as why:
        pytest.skip(f"{model_type}: {why}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        hm: Any = HookedModel.wrap(model, registry=Registry())
    block = edited.split(".")[1]
    names = [f"blocks.{block}.{n}" for n in read]
    assert edited in hm.hook_dict and all(n in hm.hook_dict for n in names), (edited, names)
    yield request.param, model, hm, edited, names
    hm.unwrap()


def _run(hm: Any, edited: str, names: list[str], seed: int, extra: list) -> tuple[torch.Tensor, dict]:
    """The logits and the points ``names`` of one forward on ``input_ids(seed)`` with an edit at ``edited`` (one of
    its own: it depends on the seed), and ``extra`` hooks."""
    seen: dict = {}
    hooks: list = [(edited, lambda t, hook: t + (0.2 + 0.1 * seed) * torch.sin(t))]
    hooks += [(n, lambda t, hook: seen.__setitem__(hook.name, t.detach().clone())) for n in names]
    return hm.run_with_hooks(input_ids(seed), fwd_hooks=hooks + extra), seen


def _same(got: tuple, expected: tuple, what: str) -> None:
    assert torch.equal(got[0], expected[0]), f"{what}: the logits (the edit lost or another forward's added)"
    assert sorted(got[1]) == sorted(expected[1]), what
    for name, value in expected[1].items():
        assert torch.equal(got[1][name], value), f"{what}: {name}"


def test_a_forward_run_inside_a_mixer_layer_leaves_the_outer_edit_exact(case) -> None:
    """A hook of the outer forward, between the edit's site recording its state and using it, runs the model on
    another input (through the same layer and its sites): the outer forward's logits and points are those of a run
    without it, bit for bit, its edit changes them, and the nested call gives the model's own logits."""
    kind, model, hm, edited, names = case
    with torch.no_grad():
        expected = _run(hm, edited, names, 1, [])
        unedited = model(input_ids(1)).logits
        clean_inner = model(input_ids(2)).logits
        nested: list = []
        got = _run(hm, edited, names, 1, [(MEET[kind], lambda t, hook: nested.append(hm(input_ids(2)).logits))])
    _same(got, expected, "the outer forward")
    assert not torch.equal(got[0], unedited), "the edit changes the logits"
    assert len(nested) == 1 and torch.equal(nested[0], clean_inner)
    assert not hm.has_hooks


def test_two_threads_get_exactly_their_sequential_values(case) -> None:
    """Two threads run the wrapped model at once, each with its own input and edit, held together by a barrier at the
    point between the edit's site recording its state and using it (both forwards are then inside the layer): each
    gets bit for bit what it gets alone."""
    kind, model, hm, edited, names = case
    seeds = (1, 2)
    with torch.no_grad():
        expected = {s: _run(hm, edited, names, s, []) for s in seeds}

    def run(seed: int, hooks: list) -> tuple:
        with torch.no_grad():
            return _run(hm, edited, names, seed, hooks)

    results = run_at_a_barrier(run, seeds, [MEET[kind]])
    for s in seeds:
        _same(results[s], expected[s], f"seed {s}")
    assert not hm.has_hooks
