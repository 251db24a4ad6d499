"""pluggy's safety nets: hook implementations that match no hookspec, undecorated hooks, tested transformers ranges."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch
import transformers

from lensadapters import Architecture, HookedModel, PluginValidationError, Registry, hookimpl
from lensadapters.registry import TransformersVersionWarning, check_transformers_range, get_registry


def _toy_module(**functions: object) -> types.ModuleType:
    module = types.ModuleType("toy_plugin")
    for name, fn in functions.items():
        setattr(module, name, fn)
    return module


def test_misspelled_hook_implementation_is_refused_by_name() -> None:
    @hookimpl
    def lensadapters_atn_qkv(arch, model, layer):  # noqa: ANN001, ANN202 - the misspelling under test
        return None

    registry = Registry()
    with pytest.raises(PluginValidationError, match="toy_plugin.*lensadapters_atn_qkv"):
        registry.register(_toy_module(lensadapters_atn_qkv=lensadapters_atn_qkv), "toy_plugin")
    assert "toy_plugin" not in registry.infos
    assert registry.pm.get_plugin("toy_plugin") is None, "a refused plugin must not stay registered"


def test_hook_without_the_decorator_is_refused_by_name() -> None:
    def lensadapters_architectures():  # noqa: ANN202 - no @hookimpl: pluggy would ignore it silently
        return [Architecture("toy", ("toy",))]

    registry = Registry()
    with pytest.raises(PluginValidationError, match="lensadapters_architectures.*without the @lensadapters.hookimpl"):
        registry.register(_toy_module(lensadapters_architectures=lensadapters_architectures), "toy_plugin")
    assert "toy_plugin" not in registry.infos


def test_transformers_outside_the_tested_range_warns_naming_both() -> None:
    arch = Architecture("toy", ("toy",), transformers="<1")
    with pytest.warns(TransformersVersionWarning, match=rf"toy_plugin.*transformers<1.*{transformers.__version__}"):
        check_transformers_range(arch, "toy_plugin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_transformers_range(dataclasses.replace(arch, transformers=f">={transformers.__version__}"), "toy_plugin")
        check_transformers_range(dataclasses.replace(arch, transformers=""), "toy_plugin")


def _tiny_model(config: object) -> torch.nn.Module:
    from lensadapters.testing import reinit

    model = transformers.AutoModelForCausalLM.from_config(config)
    reinit(model, 0)
    return model.eval()


def _installed_architecture() -> tuple[object, Architecture, object]:
    """An installed architecture plugin with a tiny config (whichever is installed first; not an encoder-decoder,
    which a causal LM's call does not run)."""
    registry = get_registry()
    for info in registry.architecture_plugins():
        for arch in info.architectures:
            if arch.encoder_decoder:
                continue
            config = registry.hooks_for(info).lensadapters_tiny_config(arch=arch, seed=0)
            if config is not None:
                return info.plugin, arch, config
    pytest.skip("no architecture plugin with a tiny config is installed")


def test_wrapping_under_an_untested_transformers_warns() -> None:
    plugin, arch, config = _installed_architecture()
    narrowed = dataclasses.replace(arch, transformers="<1")

    @hookimpl
    def lensadapters_architectures():  # noqa: ANN202
        return [narrowed]

    clone = _toy_module(**{name: getattr(plugin, name) for name in dir(plugin) if name.startswith("lensadapters_")})
    clone.lensadapters_architectures = lensadapters_architectures
    registry = Registry()
    registry.register(clone, "narrowed_plugin")
    model = _tiny_model(config)
    with pytest.warns(TransformersVersionWarning, match="narrowed_plugin"):
        hm = HookedModel.wrap(model, registry=registry)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, model(ids).logits)
    hm.unwrap()


def _protocol_members() -> set[str]:
    from lensadapters.protocol import Hooked

    members = set(getattr(Hooked, "__annotations__", {}))
    members |= {name for name in vars(Hooked) if not name.startswith("_")}
    return members


def test_plugins_use_only_the_plugin_protocol() -> None:
    """Every attribute a plugin (built-in or example) reads from the ``hooked`` object it is given is a member of
    ``lensadapters.protocol.Hooked``: plugins do not reach into the core's private state."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    allowed = _protocol_members()
    sources = [p for pattern in ("plugins/*/*/*.py", "examples/*/*/*.py") for p in root.glob(pattern)]
    assert sources, "no plugin sources found"
    offences = []
    for path in sources:
        if path.name == "testing.py" or "/tests/" in str(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "hooked"
                and node.attr not in allowed
            ):
                offences.append(f"{path.relative_to(root)}:{node.lineno}: hooked.{node.attr}")
    assert not offences, "plugins use members outside lensadapters.protocol.Hooked:\n" + "\n".join(offences)


def test_a_plugin_can_serve_a_point_the_core_would_create() -> None:
    """``claim_point``: the plugin's site serves the point, the core builds nothing for it (the hook runs once,
    through the plugin's site), and the point keeps its name and place."""
    from lensadapters.sites import OutputSite

    plugin, arch, config = _installed_architecture()
    served = []

    class CountingSite(OutputSite):
        def _hook(self, module, args, output):  # noqa: ANN001, ANN202
            served.append(self.point.name)
            return super()._hook(module, args, output)

    @hookimpl
    def lensadapters_extra_sites(arch, hooked):  # noqa: ANN001, ANN202
        embed = hooked.hf_model.get_submodule(hooked.layout.embed)
        return [CountingSite(embed, hooked.claim_point("hook_embed"))]

    registry = Registry()
    registry.register(plugin, "architecture")
    registry.register(_toy_module(lensadapters_extra_sites=lensadapters_extra_sites), "claiming_plugin")
    model = _tiny_model(config)
    hm = HookedModel.wrap(model, registry=registry)
    assert hm.hook_names[0] == "hook_embed"
    ids = torch.zeros(1, 3, dtype=torch.long)
    calls = []
    with torch.no_grad():
        reference = model(ids).logits
        logits = hm.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda t, hook: calls.append(1) or t * 2)])
    assert served == ["hook_embed"] and calls == [1], "the claimed point must be served once, by the plugin's site"
    assert not torch.allclose(logits, reference), "the plugin's site must apply the edit"
    with pytest.raises(Exception, match="only inside lensadapters_extra_sites"):
        hm.wiring.claim_point("hook_embed")
    hm.unwrap()
