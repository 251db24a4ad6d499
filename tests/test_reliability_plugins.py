"""Plugins cannot take the host down: broken plugin distributions are refused by name and left unregistered, a
plugin's failure at wrap time is isolated or named, and autoloading can be turned off.

Broken plugins are real distributions (a dist-info with an entry point and a module, laid out as pip installs
them) in a temporary directory put on ``sys.path``, or modules registered through the ``Registry`` API.
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config

from lensadapters import (
    Architecture,
    HookedModel,
    LensAdaptersError,
    PluginValidationError,
    Registry,
    UnsupportedModelError,
    hookimpl,
)
from lensadapters.errors import PluginError
from lensadapters.generic import GenericAdapterWarning
from lensadapters.registry import DISABLE_AUTOLOAD_ENV, PluginLoadWarning, get_registry, set_registry
from lensadapters.testing import reinit
from lensadapters.weights import WeightSourceWarning

IDS = torch.zeros(1, 4, dtype=torch.long)


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=16))
    reinit(model, 0)
    return model.eval()


def _gpt2_plugin() -> tuple[str, Any]:
    """The installed plugin that declares GPT-2 (found through the registry, never imported by name)."""
    registry = get_registry()
    owners = registry.owners("gpt2")
    if not owners:
        pytest.skip("no installed plugin declares gpt2")
    return owners[0], registry.infos[owners[0]].plugin


def _registry(*plugins: tuple[str, Any]) -> Registry:
    registry = Registry()
    name, plugin = _gpt2_plugin()
    registry.register(plugin, name)
    for extra_name, extra in plugins:
        registry.register(extra, extra_name)
    return registry


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(
        compile("from lensadapters import Architecture, hookimpl\n" + textwrap.dedent(source), name, "exec"),
        module.__dict__,
    )
    return module


def _install(root: Path, name: str, source: str) -> None:
    """A plugin distribution ``lensadapters-NAME`` with module ``lensadapters_NAME`` and entry point ``NAME``."""
    (root / f"lensadapters_{name}.py").write_text(textwrap.dedent(source))
    info = root / f"lensadapters_{name}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lensadapters-{name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[lensadapters]\n{name} = lensadapters_{name}\n")
    (info / "RECORD").write_text("")


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Install broken plugin distributions into a directory on sys.path; only those are loaded."""
    from importlib import metadata

    from lensadapters import registry as registry_module

    get_registry()  # the process-wide registry loads the real plugins first (the tests find GPT-2's there)
    monkeypatch.syspath_prepend(str(tmp_path))

    def entry_points() -> list[Any]:
        return [
            ep
            for dist in metadata.distributions(path=[str(tmp_path)])
            for ep in dist.entry_points
            if ep.group == "lensadapters"
        ]

    monkeypatch.setattr(registry_module, "_entry_points", entry_points)

    def install(name: str, source: str) -> None:
        _install(tmp_path, name, source)
        sys.modules.pop(f"lensadapters_{name}", None)

    return install


BROKEN_AT_IMPORT = {
    "exits": "import sys\nsys.exit(3)\n",
    "base_exception": "class Stop(BaseException):\n    pass\nraise Stop('plugin gave up')\n",
    "syntax": "def broken(:\n",
    "raises": "raise RuntimeError('cannot import this')\n",
}


@pytest.mark.parametrize("kind", sorted(BROKEN_AT_IMPORT))
def test_a_plugin_that_exits_or_raises_at_import_is_reported_and_the_host_goes_on(installed, kind: str) -> None:
    installed(kind, BROKEN_AT_IMPORT[kind])
    installed(
        "fine",
        """
        from lensadapters import hookimpl

        @hookimpl
        def lensadapters_resolve_model(model):
            return None
    """,
    )
    registry = Registry()
    with pytest.warns(PluginLoadWarning, match=f"plugin {kind!r} from lensadapters-{kind} failed to load"):
        registry.load_entry_points()
    assert kind in registry.failures and kind not in registry.infos and "fine" in registry.infos
    assert registry.pm.get_plugin(kind) is None
    name, plugin = _gpt2_plugin()
    registry.register(plugin, name)
    hm = HookedModel.wrap(_gpt2(), registry=registry)
    hm.run_with_cache(IDS)
    hm.unwrap()


DECLARATIONS = {
    "none": ("None", "must return a list of lensadapters.Architecture, not a NoneType"),
    "a_string": ("'gpt2'", "must return a list of lensadapters.Architecture, not a str"),
    "strings": ("['gpt2']", "returned a str .* among its architectures"),
    "dicts": ("[{'name': 'x'}]", "returned a dict"),
    "model_types_string": (
        "[Architecture('sub', 'gpt2')]",
        r"model_types='gpt2', a string: it would be matched as a substring.*\('gpt2',\)",
    ),
    "model_types_empty": ("[Architecture('sub', ())]", "non-empty tuple of strings"),
    "name_empty": ("[Architecture('', ('x',))]", "name must be a non-empty string"),
    "raises": ("1 / 0", "lensadapters_architectures\\(\\) raised ZeroDivisionError"),
    "twice": ("[Architecture('a', ('x',)), Architecture('a', ('y',))]", r"architecture name\(s\) \['a'\] twice"),
}


@pytest.mark.parametrize("kind", sorted(DECLARATIONS))
def test_malformed_declarations_are_refused_at_registration_and_never_veto_a_model(installed, kind: str) -> None:
    """The plugin also implements ``validate`` refusing every model: once refused, it must take no part in a wrap."""
    expression, message = DECLARATIONS[kind]
    installed(
        kind,
        f"""
        from lensadapters import Architecture, UnsupportedModelError, hookimpl

        @hookimpl
        def lensadapters_architectures():
            return {expression}

        @hookimpl
        def lensadapters_validate(arch, model):
            raise UnsupportedModelError("vetoed by a plugin that failed to load")
    """,
    )
    registry = Registry()
    with pytest.warns(PluginLoadWarning, match=f"plugin {kind!r}"):
        registry.load_entry_points()
    assert kind not in registry.infos and registry.pm.get_plugin(kind) is None
    assert re.search(message, registry.failures[kind]), registry.failures[kind]
    name, plugin = _gpt2_plugin()
    registry.register(plugin, name)
    hm = HookedModel.wrap(_gpt2(), registry=registry)  # not vetoed
    hm.unwrap()


_texts = st.one_of(st.text(max_size=6), st.sampled_from(["gpt2", "llama", ""]))
_tuples = st.one_of(st.tuples(_texts), st.lists(_texts, max_size=3).map(tuple), _texts, st.none(), st.integers())


@given(
    name=st.one_of(_texts, st.none()),
    model_types=_tuples,
    impls=_tuples,
    version=st.one_of(st.just(""), st.just(">=4.57"), st.integers()),
)
@settings(max_examples=25, deadline=None)
def test_any_declaration_is_either_usable_or_refused_by_name(
    name: Any, model_types: Any, impls: Any, version: Any
) -> None:
    arch = Architecture(name, model_types, transformers=version, attn_implementations=impls)
    plugin = _module("drawn", "")

    @hookimpl
    def lensadapters_architectures():  # noqa: ANN202
        return [arch]

    plugin.lensadapters_architectures = lensadapters_architectures
    registry = Registry()
    try:
        info = registry.register(plugin, "drawn")
    except PluginValidationError as exc:
        assert "plugin 'drawn'" in str(exc)
        assert registry.pm.get_plugin("drawn") is None and "drawn" not in registry.infos
        return
    (declared,) = info.architectures
    assert isinstance(declared.name, str) and declared.name
    assert isinstance(declared.model_types, tuple) and all(isinstance(t, str) and t for t in declared.model_types)
    assert isinstance(declared.attn_implementations, tuple)
    for model_type in ("gpt", "gpt2x", "2"):  # never matched as a substring
        assert [a for _, a in registry.claims(model_type)] == ([declared] if model_type in declared.model_types else [])


def _cross_cutting(hook: str, body: str, args: str) -> types.ModuleType:
    return _module(
        "flaky",
        f"""
        @hookimpl
        def {hook}({args}):
            {body}
    """,
    )


@pytest.mark.parametrize(
    "hook, args",
    [
        ("lensadapters_extra_sites", "arch, hooked"),
        ("lensadapters_validate", "arch, model"),
        ("lensadapters_resolve_model", "model"),
    ],
)
def test_a_cross_cutting_plugin_that_fails_at_wrap_time_is_named_and_left_out(hook: str, args: str) -> None:
    registry = _registry(("flaky", _cross_cutting(hook, "raise KeyError('oops')", args)))
    model = _gpt2()
    with pytest.warns(PluginLoadWarning, match=rf"plugin 'flaky' failed in {hook}: KeyError: 'oops'.*without that"):
        hm = HookedModel.wrap(model, registry=registry)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(IDS, names_filter=lambda n: not n.endswith(("pattern", "scores")))
        assert torch.equal(logits, model(IDS).logits)
    hm.unwrap()


def test_a_cross_cutting_refusal_keeps_its_type_and_names_the_plugin() -> None:
    registry = _registry(
        (
            "picky",
            _module(
                "picky",
                """
        from lensadapters import UnsupportedModelError

        @hookimpl
        def lensadapters_validate(arch, model):
            raise UnsupportedModelError("this model has a setting I cannot represent")
    """,
            ),
        )
    )
    with pytest.raises(UnsupportedModelError, match="plugin 'picky': this model has a setting"):
        HookedModel.wrap(_gpt2(), registry=registry)


def test_a_failing_weight_hook_is_named_when_the_weight_is_read() -> None:
    registry = _registry(
        ("broken_weights", _cross_cutting("lensadapters_linear_weight", "return 1 / 0", "module, read"))
    )
    hm = HookedModel.wrap(_gpt2(), registry=registry)
    with pytest.raises(
        PluginError, match="plugin 'broken_weights' failed in lensadapters_linear_weight: ZeroDivisionError"
    ) as info:
        _ = hm.W_Q
    assert isinstance(info.value.__cause__, ZeroDivisionError) and info.value.plugin == "broken_weights"
    hm.unwrap()


@given(scale=st.sampled_from([0.0, 2.0]), transpose=st.booleans(), bias=st.sampled_from(["keep", "drop", "bad"]))
@settings(max_examples=6, deadline=None)
def test_a_cross_cutting_plugin_supplying_weights_is_named_and_its_shapes_checked(
    scale: float, transpose: bool, bias: str
) -> None:
    """A cross-cutting plugin answering ``lensadapters_linear_weight`` for modules another plugin reads: the
    warning names both and the one used; a weight of the wrong shape is refused naming the plugin."""
    from lensadapters import LinearWeight

    @hookimpl(tryfirst=True)
    def lensadapters_linear_weight(module, read):  # noqa: ANN001, ANN202
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2:
            return None
        W = weight * scale
        W = W.T if transpose else W
        b = {"keep": getattr(module, "bias", None), "drop": None, "bad": torch.zeros(3)}[bias]
        return LinearWeight(W, b)

    plugin = types.ModuleType("overriding")
    plugin.lensadapters_linear_weight = lensadapters_linear_weight
    plugin.LENSADAPTERS_LAYERS = ("transformers.pytorch_utils.Conv1D",)  # GPT-2's projections: declared
    registry = _registry(("overriding", plugin))
    hm = HookedModel.wrap(_gpt2(), registry=registry)
    module = hm.wiring.block_modules[0].get_submodule(hm.qkv_layouts[0].module)
    d_in, d_out = module.weight.shape  # Conv1D stores [in, out]
    square = d_in == d_out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            W_Q = hm.W_Q
        except PluginValidationError as exc:
            assert "plugin 'overriding' returned from lensadapters_linear_weight" in str(exc)
            assert transpose and not square or bias == "bad"
            W_Q = None
    if W_Q is not None:
        assert not (transpose and not square) and bias != "bad"
        sources = [w for w in caught if issubclass(w.category, WeightSourceWarning)]
        assert sources and "'overriding'" in str(sources[0].message) and _gpt2_plugin()[0] in str(sources[0].message)
        assert "use 'overriding'" in str(sources[0].message)
    hm.unwrap()


def test_an_override_of_the_wrong_shape_is_refused_naming_the_plugin() -> None:
    registry = _registry(
        (
            "shapes",
            _module(
                "shapes",
                """
        import torch

        LENSADAPTERS_LAYERS = ("torch.nn.modules.sparse.Embedding",)  # the layer W_E reads

        @hookimpl
        def lensadapters_weight(arch, hooked, name):
            return torch.zeros(3) if name == "W_E" else None
    """,
            ),
        )
    )
    hm = HookedModel.wrap(_gpt2(), registry=registry)
    with pytest.raises(PluginValidationError, match=r"plugin 'shapes' returned W_E of shape \(3,\).* \(32, 16\)"):
        _ = hm.W_E
    assert hm.W_Q.shape == (2, 2, 16, 8)
    hm.unwrap()


def _architecture_plugin(**overrides: Any) -> types.ModuleType:
    """A copy of the installed GPT-2 plugin's hook implementations, some replaced or removed."""
    _, plugin = _gpt2_plugin()
    clone = types.ModuleType("clone")
    for attr in dir(plugin):
        if attr.startswith("lensadapters_") and attr not in overrides:
            setattr(clone, attr, getattr(plugin, attr))
    for attr, value in overrides.items():
        if value is not None:
            setattr(clone, attr, value)
    return clone


def test_an_architecture_plugin_missing_a_required_hook_is_named() -> None:
    registry = Registry()
    registry.register(_architecture_plugin(lensadapters_mlp_act=None), "incomplete")
    with pytest.raises(
        PluginValidationError,
        match="plugin 'incomplete' declares architectures but does not implement lensadapters_mlp_act",
    ):
        HookedModel.wrap(_gpt2(), registry=registry)


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "ln1",
            "ln_one",
            r"BlockLayout.ln1='ln_one' \(a path from block 0, .*no 'ln_one' under the top level .*"
            r"closest names there: .*ln_1",
        ),
        (
            "o_proj",
            "attn.c_prj",
            r"BlockLayout.o_proj='attn.c_prj'.*no 'c_prj' under attn .*closest names there: c_proj",
        ),
        ("mlp", 3, r"BlockLayout.mlp must be a dotted module path \(a string\), not 3"),
    ],
)
def test_a_layout_path_that_does_not_exist_is_named_with_the_plugin(field: str, value: Any, message: str) -> None:
    import dataclasses

    _, plugin = _gpt2_plugin()

    @hookimpl
    def lensadapters_block(arch, model, layer):  # noqa: ANN001, ANN202
        return dataclasses.replace(plugin.lensadapters_block(arch=arch, model=model, layer=layer), **{field: value})

    registry = Registry()
    registry.register(_architecture_plugin(lensadapters_block=lensadapters_block), "misdescribed")
    with pytest.raises(UnsupportedModelError, match="plugin 'misdescribed'.*" + message):
        HookedModel.wrap(_gpt2(), registry=registry)


def test_an_architecture_hook_that_raises_or_returns_nothing_is_named() -> None:
    @hookimpl
    def lensadapters_config(arch, model):  # noqa: ANN001, ANN202
        return model.config.no_such_setting

    registry = Registry()
    registry.register(_architecture_plugin(lensadapters_config=lensadapters_config), "buggy")
    with pytest.raises(PluginError, match="plugin 'buggy' failed in lensadapters_config: AttributeError"):
        HookedModel.wrap(_gpt2(), registry=registry)

    @hookimpl
    def lensadapters_embed(arch, model):  # noqa: ANN001, ANN202
        return None

    registry = Registry()
    registry.register(_architecture_plugin(lensadapters_embed=lensadapters_embed), "silent")
    with pytest.raises(UnsupportedModelError, match="plugin 'silent': lensadapters_embed returned nothing"):
        HookedModel.wrap(_gpt2(), registry=registry)


@pytest.mark.parametrize(
    "value, disabled",
    [("1", True), ("yes", True), ("0", False), ("false", False), ("False", False), ("", False), ("off", False)],
)
def test_autoload_switch_and_the_unsupported_model_error(monkeypatch, value: str, disabled: bool) -> None:
    from lensadapters import registry as registry_module

    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, value)
    loaded: list[int] = []
    monkeypatch.setattr(registry_module, "_entry_points", lambda: loaded.append(1) or [])
    set_registry(None)
    try:
        registry = get_registry()
        assert bool(loaded) is not disabled
        with pytest.warns(GenericAdapterWarning) as record:  # no plugin registered: the generic adapter serves it
            HookedModel.wrap(_gpt2(), registry=registry).unwrap()
        message = str(record[0].message)
        assert (f"autoloading is disabled ({DISABLE_AUTOLOAD_ENV}={value!r})" in message) is disabled
        assert ("autoloading is disabled" in registry.describe_installed()) is disabled
    finally:
        set_registry(None)


def test_the_readme_documents_the_autoload_switch() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index(DISABLE_AUTOLOAD_ENV) - 600 : readme.index(DISABLE_AUTOLOAD_ENV) + 600]
    assert "arbitrary code" in section and "`0`" in section


def test_errors_of_one_wrap_do_not_leave_the_model_wrapped() -> None:
    registry = _registry(
        (
            "picky",
            _module(
                "picky2",
                """
        from lensadapters import UnsupportedModelError

        @hookimpl
        def lensadapters_validate(arch, model):
            raise UnsupportedModelError("no")
    """,
            ),
        )
    )
    model = _gpt2()
    with pytest.raises(LensAdaptersError):
        HookedModel.wrap(model, registry=registry)
    hm = HookedModel.wrap(model, registry=_registry())
    assert not model._forward_hooks and not model._forward_pre_hooks
    hm.unwrap()
