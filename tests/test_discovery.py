"""What the core discovers instead of naming plugins: wrapper layers peeled through the plugins that own them,
the built-in plugins from the core distribution's extras (the demo's order and install hints), and the
contract kit's declared configs."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from torch import nn

from lensadapters import demo, hookimpl, innermost_layer, wrapped_layers
from lensadapters.registry import Registry
from lensadapters.testing import AdapterContract, plugin_projects, registry_with

ROOT = Path(__file__).resolve().parents[1]


class Wrapper(nn.Module):
    """A toy adapter layer around its base layer."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def _wrapper_plugin() -> types.ModuleType:
    plugin = types.ModuleType("toy_wrapper_plugin")

    @hookimpl
    def lensadapters_wrapped_layer(module):
        return module.inner if isinstance(module, Wrapper) else None

    plugin.lensadapters_wrapped_layer = lensadapters_wrapped_layer
    return plugin


def test_wrapper_layers_are_peeled_by_the_plugin_that_owns_them():
    base = nn.Linear(3, 2)
    outer = Wrapper(Wrapper(base))
    registry = registry_with(_wrapper_plugin())
    assert list(wrapped_layers(outer, registry)) == [outer, outer.inner, base]
    assert innermost_layer(outer, registry) is base and innermost_layer(base, registry) is base
    assert list(wrapped_layers(outer, Registry())) == [outer]  # no plugin owns the wrapper: nothing is peeled


def test_builtin_plugins_come_from_the_core_extras():
    """The demo's order and its "not installed" hints: the extras of the installed core that each install one
    plugin folder's distribution, in the order the root pyproject declares them."""
    extras = demo.plugin_extras()
    if not extras:
        pytest.skip("the core is not installed as a distribution")
    projects = {p.distribution.replace("_", "-").lower(): p for p in plugin_projects(ROOT)}
    assert set(extras) == set(projects), (sorted(extras), sorted(projects))
    lines: list[str] = []
    installed = demo._installed
    try:
        demo._installed = lambda dist: False  # as if no plugin were installed
        assert demo.run(Registry(), echo=lines.append) == []
    finally:
        demo._installed = installed
    hints = [line for line in lines if "not installed (pip install" in line]
    assert hints == [f"- {extra}: not installed (pip install lensadapters[{extra}])" for extra in extras.values()]


@st.composite
def _toy_configs(draw, *, size=st.integers(1, 3), kind="a"):
    return (draw(st.just(size) if isinstance(size, int) else size), kind)


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_declared_configs():
    class Toy(AdapterContract):
        config_strategy = _toy_configs
        config_overrides = {"size": 2}
        config_strata = {"kind b": ("test_no_hooks_is_bitwise",)}
        stratum_overrides = {"kind b": {"kind": "b"}}
        matrix_overrides = {"size": 1}

    assert Toy.configs().example() == (2, "a")
    assert Toy.stratum_configs("kind b").example() == (2, "b")
    assert Toy().configs().example() == (2, "a")  # the strategy function is not bound to an instance
    assert hasattr(Toy, "test_no_hooks_is_bitwise__kind_b")
    with pytest.raises(TypeError, match="stratum 'c'"):
        type("Undeclared", (Toy,), {"config_strata": {"c": ("test_no_hooks_is_bitwise",)}})
    with pytest.raises(NotImplementedError, match="config_strategy"):
        type("Bare", (AdapterContract,), {}).configs()


def test_not_served_properties_are_skipped_in_every_variant():
    """Regression: a plugin's test file skipped the properties its hybrid models do not serve, but the cross-cutting
    variants (bnb's int8 contract, PEFT's LoRA one) built over the declared contract ran and failed them. A property
    named in ``not_served`` is skipped with its reason in the contract, in subclasses and in every matrix variant
    (a variant's own override included); its strata still run it; the base classes keep it."""
    from lensadapters.testing import matrix_class

    prop = "test_no_hooks_is_bitwise"

    class Variant(AdapterContract):
        def test_no_hooks_is_bitwise(self, data):  # a variant's override, as Int8Contract's
            raise AssertionError("ran")

    class Toy(AdapterContract):
        config_strategy = _toy_configs
        config_strata = {"kind b": (prop,)}
        stratum_overrides = {"kind b": {"kind": "b"}}
        not_served = {prop: "toys have no such thing"}

    def skip_reason(cls):
        marks = [m for m in getattr(getattr(cls, prop), "pytestmark", []) if m.name == "skip"]
        return marks[0].kwargs["reason"] if marks else None

    matrix = matrix_class(Variant, Toy)
    for cls in (Toy, type("Sub", (Toy,), {}), matrix):
        assert "toys have no such thing" in skip_reason(cls), cls
        with pytest.raises(pytest.skip.Exception, match="toys have no such thing"):
            getattr(cls(), prop)()
    assert skip_reason(AdapterContract) is None and skip_reason(Variant) is None
    assert hasattr(getattr(AdapterContract, prop), "hypothesis")  # the kit's property is left as it was
    stratum = getattr(Toy, f"{prop}__kind_b")  # the property on the stratum's configs: not skipped
    assert hasattr(stratum, "hypothesis") and not [m for m in getattr(stratum, "pytestmark", []) if m.name == "skip"]
    with pytest.raises(TypeError, match="not_served names 'test_nothing'"):
        type("Wrong", (AdapterContract,), {"not_served": {"test_nothing": "why"}})


def test_strata_only_properties_run_on_their_strata_only():
    """``strata_only``: the property runs on each of its strata (the tests ``<prop>__<stratum>``), the unstratified
    test is skipped naming them, and a matrix variant (built without the contract's strata) skips it instead of
    failing at class definition."""
    from lensadapters.testing import matrix_class

    prop = "test_no_hooks_is_bitwise"

    class Toy(AdapterContract):
        config_strategy = _toy_configs
        config_strata = {"kind a": (prop,), "kind b": (prop,)}
        stratum_overrides = {"kind a": {"kind": "a"}, "kind b": {"kind": "b"}}
        strata_only = (prop,)

    class Variant(AdapterContract):
        pass

    for name in (f"{prop}__kind_a", f"{prop}__kind_b"):
        stratum = getattr(Toy, name)
        skips = [m for m in getattr(stratum, "pytestmark", []) if m.name == "skip"]
        assert hasattr(stratum, "hypothesis") and not skips, name
    with pytest.raises(pytest.skip.Exception, match=f"strata only.*{prop}__kind_a, {prop}__kind_b"):
        getattr(Toy(), prop)()
    with pytest.raises(pytest.skip.Exception, match="strata only.*none in this class"):
        getattr(matrix_class(Variant, Toy)(), prop)()
    assert hasattr(getattr(AdapterContract, prop), "hypothesis")  # the kit's property is left as it was


def test_declared_logit_softcap():
    class Capped(AdapterContract):
        logit_softcap = "final_logit_softcapping"

    x = torch.tensor([-100.0, 0.5, 100.0])
    capped = types.SimpleNamespace(config=types.SimpleNamespace(final_logit_softcapping=30.0))
    unset = types.SimpleNamespace(config=types.SimpleNamespace(final_logit_softcapping=None))
    assert torch.equal(Capped().expected_logits(capped, x), 30.0 * torch.tanh(x / 30.0))
    assert torch.equal(Capped().expected_logits(unset, x), x)
    assert torch.equal(AdapterContract().expected_logits(capped, x), x)  # not declared: the logits as unembedded
