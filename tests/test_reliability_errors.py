"""Errors that name the problem and the fix, raised before the forward runs.

Every check counts the model's forwards: a refused call must not have started one.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config

from lensadapters import HookedModel, LensAdaptersError
from lensadapters.testing import reinit


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=16))
    reinit(model, 0)
    return model.eval()


@pytest.fixture
def counted():
    """A wrapped GPT-2 and a list that grows by one at every forward of the model."""
    model = _gpt2()
    forwards: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    hm = HookedModel.wrap(model)
    yield hm, forwards
    hm.unwrap()
    handle.remove()


IDS = torch.zeros(1, 4, dtype=torch.long)


def _refused(call: Any, forwards: list[int], error: type[BaseException], pattern: str) -> None:
    before = len(forwards)
    with pytest.raises(error, match=pattern):
        call()
    assert len(forwards) == before, "the refusal came after a forward had started"


@pytest.mark.parametrize(
    "names_filter, pattern",
    [
        (3, "names_filter must be a hook name.*not a int"),
        ([3], "names_filter contains 3"),
        (b"hook_embed", "names_filter must be a hook name.*bytes"),
        ({"hook_embed": 1}, "names_filter must be a hook name.*dict"),
        (re.compile("resid"), r"names_filter=pattern\.search"),
    ],
)
def test_a_names_filter_of_the_wrong_type_is_refused_by_name(counted, names_filter, pattern) -> None:
    hm, forwards = counted
    _refused(lambda: hm.run_with_cache(IDS, names_filter=names_filter), forwards, TypeError, pattern)


def test_hook_lists_given_as_a_dict_or_a_single_pair_are_refused_with_the_fix(counted) -> None:
    hm, forwards = counted
    fn = lambda t, hook: None  # noqa: E731
    _refused(
        lambda: hm.run_with_hooks(IDS, fwd_hooks={"hook_embed": fn}),
        forwards,
        TypeError,
        r"fwd_hooks must be a list of \(name, hook\) pairs, not a dict: pass fwd_hooks=list\(hooks.items\(\)\)",
    )
    _refused(
        lambda: hm.run_with_hooks(IDS, fwd_hooks=("hook_embed", fn)),
        forwards,
        TypeError,
        r"single \(name, hook\) pair; pass a list of pairs",
    )
    _refused(
        lambda: hm.run_with_hooks(IDS, bwd_hooks=[("hook_embed", fn, 1)]),
        forwards,
        TypeError,
        r"bwd_hooks\[0\] is .*each entry must be a \(name, hook\) pair",
    )
    _refused(
        lambda: hm.run_with_hooks(IDS, fwd_hooks=[("hook_embed", fn), ("blocks.0.hook_resid_pree", fn)]),
        forwards,
        KeyError,
        "blocks.0.hook_resid_pre",
    )
    assert not hm.has_hooks, "a refused hook list left hooks behind"


@given(bad=st.one_of(st.integers(), st.text(max_size=5), st.none(), st.just(torch.zeros(2))))
@settings(max_examples=8, deadline=None)
def test_a_hook_that_is_not_callable_is_refused_naming_the_point(bad: Any) -> None:
    model = _gpt2()
    hm = HookedModel.wrap(model)
    for call in (
        lambda: hm.run_with_hooks(IDS, fwd_hooks=[("blocks.1.hook_resid_post", bad)]),
        lambda: hm.add_hook("blocks.1.hook_resid_post", bad),
    ):
        with pytest.raises(TypeError, match="hook for 'blocks.1.hook_resid_post'.*not a function"):
            call()
    assert not hm.has_hooks
    hm.unwrap()


@pytest.mark.parametrize("fn", [lambda t: None, lambda t, h: None, lambda: None, lambda t, hook, extra: None])
def test_a_hook_with_the_wrong_signature_is_refused_naming_the_point(counted, fn) -> None:
    hm, forwards = counted
    _refused(
        lambda: hm.run_with_hooks(IDS, fwd_hooks=[("blocks.0.attn.hook_z", fn)]),
        forwards,
        TypeError,
        r"hook for 'blocks.0.attn.hook_z' cannot be called as fn\(tensor, hook=hook_point\)",
    )


def test_hooks_with_other_valid_signatures_are_accepted(counted) -> None:
    hm, _ = counted

    class Callable_:
        def __call__(self, tensor, hook):  # noqa: ANN001, ANN204
            return None

    import functools

    for fn in (
        lambda t, hook: None,
        lambda *a, **k: None,
        lambda t, **kw: None,
        Callable_(),
        functools.partial(lambda scale, t, hook: t * scale, 1.0),
    ):
        hm.run_with_hooks(IDS, fwd_hooks=[("blocks.0.attn.hook_z", fn)])


def test_cache_device_meta_and_nonsense_devices_are_refused(counted) -> None:
    hm, forwards = counted
    _refused(lambda: hm.run_with_cache(IDS, device="meta"), forwards, TypeError, r"device='meta'\) would keep shapes")
    _refused(lambda: hm.run_with_cache(IDS, device="gpu-ish"), forwards, TypeError, "device='gpu-ish'.* not a device")


def test_incl_bwd_under_inference_mode_is_refused(counted) -> None:
    hm, forwards = counted
    with torch.inference_mode():
        _refused(
            lambda: hm.run_with_cache(IDS, labels=IDS, incl_bwd=True), forwards, LensAdaptersError, "inference_mode"
        )
    _refused(lambda: hm.run_with_cache(IDS, incl_bwd=True), forwards, ValueError, "pass labels=")
    _refused(
        lambda: hm.run_with_cache(torch.zeros(2, 4, dtype=torch.long), remove_batch_dim=True),
        forwards,
        ValueError,
        "batch of one; the input has a batch of 2",
    )


@given(layer=st.one_of(st.text(alphabet="0123456789", min_size=1, max_size=2), st.floats(0, 3), st.just([1])))
@settings(max_examples=8, deadline=None)
def test_cache_shorthand_with_a_layer_that_is_not_an_int_names_the_fix(layer: Any) -> None:
    hm = HookedModel.wrap(_gpt2())
    _, cache = hm.run_with_cache(IDS, names_filter=lambda n: n.endswith("hook_resid_pre"))
    with pytest.raises(TypeError, match=r"the layer must be an int, not .*write cache\['resid_pre', "):
        cache["resid_pre", layer]
    assert ("resid_pre", layer) not in cache
    assert torch.equal(cache["resid_pre", 1], cache["blocks.1.hook_resid_pre"])
    assert torch.equal(cache["resid_pre", -1], cache["blocks.1.hook_resid_pre"])
    with pytest.raises(KeyError, match="layer 5 is out of range; the model has 2 layers"):
        cache["resid_pre", 5]
    hm.unwrap()


def test_an_adapter_forced_on_another_architecture_says_so() -> None:
    """``adapter=`` names a plugin whose architecture does not declare the model's type: the error says that the
    plugin was forced and which plugin declares the type, instead of blaming the model."""
    from lensadapters.registry import get_registry

    registry = get_registry()
    others = [
        a.name for info in registry.architecture_plugins() for a in info.architectures if "gpt2" not in a.model_types
    ]
    if not others or not registry.owners("gpt2"):
        pytest.skip("needs the GPT-2 plugin and another architecture plugin")
    for adapter in others:
        with pytest.raises(LensAdaptersError) as info:
            HookedModel.wrap(_gpt2(), adapter=adapter)
        message = str(info.value)
        assert f"adapter={adapter!r}" in message and "model_type is 'gpt2'" in message, message
        assert f"the installed plugin for 'gpt2' is {registry.owners('gpt2')[0]!r}" in message, message
