"""The plugin API is public: the plugin guide's examples import only public names, ``lensadapters.plugin_api``
exports what it lists, and the order of hooks on a module that a plugin's site and a core site share is the
documented rule (a site that ``reads_output`` sees the core's edits of that output, whichever point was hooked
first)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import lensadapters.plugin_api as api
from lensadapters import HookedModel, LensAdaptersError, Registry, get_registry, hookimpl
from lensadapters.testing import reinit

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "writing-a-plugin.md"
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
IDS = torch.tensor([[1, 5, 7, 3, 9, 2]])


def _public(module_name: str, name: str) -> bool:
    """Whether ``from module_name import name`` takes a public name: no part of the module path starts with an
    underscore, and the name is in the module's ``__all__`` (a module without one: does not start with ``_``)."""
    if any(part.startswith("_") for part in module_name.split(".")):
        return False
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return name in exported
    return not name.startswith("_") and hasattr(module, name)


def _core_imports(code: str) -> list[tuple[str, str]]:
    """``(module, name)`` for each name the code imports from the core (``name`` empty: ``import module``)."""
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lensadapters":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "lensadapters"]
    return found


def test_the_plugin_guide_imports_only_public_names() -> None:
    blocks = PYTHON_BLOCK.findall(GUIDE.read_text())
    imports = [found for block in blocks for found in _core_imports(block)]
    assert any(module == "lensadapters.plugin_api" for module, _ in imports)  # the guide shows the API it documents
    private = []
    for module, name in imports:
        if name:
            if not _public(module, name):
                private.append(f"from {module} import {name}")
        elif any(part.startswith("_") for part in module.split(".")):
            private.append(f"import {module}")
    assert not private, f"the plugin guide imports private names: {private}"


# The modules documented as public: lensadapters.plugin_api and those its docstring names as the others a plugin
# may import from (``:mod:`lensadapters.hf```...); every other module of the core is its own, even without "_".
PUBLIC_MODULES = frozenset({"lensadapters.plugin_api", *re.findall(r":mod:`(lensadapters[\w.]*)`", api.__doc__ or "")})
GPTJ_PACKAGE = ROOT / "examples" / "gptj" / "lensadapters_gptj"


def _documented_public(module_name: str, name: str) -> bool:
    """``_public``, and the module is one documented as public (``import module``: ``name`` empty)."""
    return module_name in PUBLIC_MODULES and (not name or _public(module_name, name))


def _undocumented_imports(code: str) -> list[str]:
    return [
        f"from {module} import {name}" if name else f"import {module}"
        for module, name in _core_imports(code)
        if not _documented_public(module, name)
    ]


def test_the_plugin_guide_imports_only_documented_public_modules() -> None:
    private = [found for block in PYTHON_BLOCK.findall(GUIDE.read_text()) for found in _undocumented_imports(block)]
    assert not private, f"the plugin guide imports from modules not documented as public: {private}"


def test_the_example_third_party_plugin_imports_only_documented_public_names() -> None:
    """The package of examples/gptj (what a third-party plugin ships; imports inside functions too) imports from
    the core only documented public modules and, from them, only their exported names."""
    sources = sorted(GPTJ_PACKAGE.glob("*.py"))
    assert sources
    private = [f"{path.name}: {found}" for path in sources for found in _undocumented_imports(path.read_text())]
    assert not private, f"examples/gptj imports names that are not public: {private}"


def test_the_public_check_refuses_private_names() -> None:
    """The check above can fail: a private module, a name outside ``__all__``, an underscore name."""
    assert not _public("lensadapters._version", "__version__")
    assert not _public("lensadapters.plugin_api", "importlib")  # imported there, not exported
    assert not _public("lensadapters.testing", "_EXPORTS")
    assert _public("lensadapters.plugin_api", "Site") and _public("lensadapters.testing", "AdapterContract")
    # a module without "_" is still the core's own unless documented as public
    assert PUBLIC_MODULES >= {"lensadapters", "lensadapters.plugin_api", "lensadapters.hf", "lensadapters.testing"}
    assert not _documented_public("lensadapters.copying", "InstanceOverride")
    assert not _documented_public("lensadapters.adapters.registry", "Registry")
    assert _documented_public("lensadapters.plugin_api", "InstanceOverride") and _documented_public("lensadapters", "")
    assert _undocumented_imports("def f():\n    from lensadapters.attention import explicit_attention\n") == [
        "from lensadapters.attention import explicit_attention"
    ]


def test_plugin_api_exports_every_name_it_lists() -> None:
    assert len(set(api.__all__)) == len(api.__all__)
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing
    # the pieces the guide names for sites and per-forward state
    for name in ("Site", "HookPoint", "ForwardState", "Hooked", "completes_output", "reads_output", "read_weight"):
        assert name in api.__all__


class _NormOutputSite(api.Site):
    """A plugin's point on a norm's output, registered as the guide says (``reads_output``)."""

    def __init__(self, module: torch.nn.Module, point: api.HookPoint) -> None:
        self.module, self.point = module, point
        self.points = (point,)

    def install(self) -> list[Any]:
        return [api.reads_output(self.module, self._hook)]

    def _hook(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        value, changed = self.point.apply(api.first_output(output))
        return api.replace_first_output(output, value) if changed else None


def _wrapped() -> HookedModel:
    owners = get_registry().owners("gpt2")
    if not owners:
        pytest.skip("no installed plugin declares gpt2")
    plugin = types.ModuleType("norm_reader")

    @hookimpl
    def lensadapters_extra_sites(arch: Any, hooked: api.Hooked) -> list[api.Site]:
        point = hooked.new_point("ln_final.hook_plugin_out", after="ln_final.hook_normalized")
        return [_NormOutputSite(hooked.hf_model.get_submodule(hooked.layout.ln_final), point)]

    plugin.lensadapters_extra_sites = lensadapters_extra_sites  # type: ignore[attr-defined]
    registry = Registry()
    registry.register(get_registry().infos[owners[0]].plugin, owners[0])
    registry.register(plugin, "norm_reader")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=16))
    reinit(model, 0)
    return HookedModel.wrap(model.eval(), registry=registry)


@pytest.mark.parametrize("plugin_point_first", [True, False])
def test_a_site_reading_a_norms_output_sees_the_cores_edit_whichever_is_hooked_first(plugin_point_first: bool) -> None:
    hm = _wrapped()
    try:
        seen: dict[str, torch.Tensor] = {}

        def double(value: torch.Tensor, hook: Any) -> torch.Tensor:
            return value * 2

        def record(value: torch.Tensor, hook: Any) -> None:
            seen[hook.name] = value.detach().clone()

        clean = hm.run_with_cache(IDS, names_filter="ln_final.hook_normalized")[1]["ln_final.hook_normalized"]
        hooks = [("ln_final.hook_normalized", double), ("ln_final.hook_plugin_out", record)]
        for name, fn in hooks if not plugin_point_first else reversed(hooks):
            hm.add_hook(name, fn)  # attached one after the other: the sites install in this order
        logits = hm(IDS).logits
        hm.reset_hooks()
        torch.testing.assert_close(seen["ln_final.hook_plugin_out"], 2 * clean)  # after the core's edit
        assert hm.hook_names.index("ln_final.hook_plugin_out") == hm.hook_names.index("ln_final.hook_normalized") + 1
        with hm.hooks(fwd_hooks=[("ln_final.hook_normalized", double)]):
            torch.testing.assert_close(logits, hm(IDS).logits)  # the plugin's reading changed nothing
    finally:
        hm.unwrap()


def test_sites_on_one_module_install_in_the_order_they_were_registered() -> None:
    """Sixteen sites hooking one module the same way, all hooked together: their PyTorch hooks run in the order
    the sites were registered (here on purpose not the points' naming order), not in the order of a set of them (which
    follows their ids: this fails on that code)."""
    owners = get_registry().owners("gpt2")
    if not owners:
        pytest.skip("no installed plugin declares gpt2")
    plugin = types.ModuleType("many_readers")
    names = [f"ln_final.hook_reader_{i}" for i in range(16)]

    @hookimpl
    def lensadapters_extra_sites(arch: Any, hooked: api.Hooked) -> list[api.Site]:
        module, after, sites = hooked.hf_model.get_submodule(hooked.layout.ln_final), "ln_final.hook_normalized", []
        for name in names:
            sites.append(_NormOutputSite(module, hooked.new_point(name, after=after)))
            after = name
        return sites[::2] + sites[1::2]  # registered out of naming order: the order to keep is the registration's

    plugin.lensadapters_extra_sites = lensadapters_extra_sites  # type: ignore[attr-defined]
    registry = Registry()
    registry.register(get_registry().infos[owners[0]].plugin, owners[0])
    registry.register(plugin, "many_readers")
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16))
    hm = HookedModel.wrap(model.eval(), registry=registry)
    try:
        fired: list[str] = []
        with hm.hooks(fwd_hooks=[(name, lambda value, hook: fired.append(hook.name)) for name in reversed(names)]):
            hm(IDS)
        assert fired == names[::2] + names[1::2]
    finally:
        hm.unwrap()


def test_projection_parts_are_declared_once_with_existing_points_while_wrapping() -> None:
    """``hooked.declare_projection_parts``: what a plugin declares is what ``projection_parts`` answers (to the plugins
    called after it, and on the wrapped model); a module declared twice, a point that does not exist and a
    declaration after wrapping are refused by name."""
    owners = get_registry().owners("gpt2")
    if not owners:
        pytest.skip("no installed plugin declares gpt2")
    plugin = types.ModuleType("parts_declarer")
    errors: list[str] = []

    @hookimpl
    def lensadapters_extra_sites(arch: Any, hooked: api.Hooked) -> list[api.Site]:
        c_fc = hooked.block_modules[0].get_submodule("mlp.c_fc")
        parts = api.ProjectionParts(c_fc, ("blocks.0.mlp.hook_pre",), lambda t: (t,), lambda t: t)
        hooked.declare_projection_parts(parts)
        for bad in (parts, dataclasses.replace(parts, module=torch.nn.Linear(1, 1), points=("blocks.0.no_such",))):
            try:
                hooked.declare_projection_parts(bad)
            except LensAdaptersError as exc:
                errors.append(str(exc))
        assert list(hooked.projection_parts) == [parts]
        return []

    plugin.lensadapters_extra_sites = lensadapters_extra_sites  # type: ignore[attr-defined]
    registry = Registry()
    registry.register(get_registry().infos[owners[0]].plugin, owners[0])
    registry.register(plugin, "parts_declarer")
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16))
    hm = HookedModel.wrap(model.eval(), registry=registry)
    try:
        assert len(errors) == 2 and "declared twice" in errors[0] and "no_such" in errors[1], errors
        (parts,) = hm.wiring.projection_parts
        assert parts.module is hm.block_modules[0].get_submodule("mlp.c_fc") and parts.first_point == parts.points[0]
        with pytest.raises(LensAdaptersError, match="only inside lensadapters_extra_sites"):
            hm.wiring.declare_projection_parts(parts)
    finally:
        hm.unwrap()
