"""The installed plugins, for test suites that must not name them: registries, the plugin that supports a
model type, the plugins that open a wrapper model, the contracts architecture plugins declare, and the
cross-cutting test matrices (a variant's contract over every installed architecture's contract).

Everything is found through the ``lensadapters`` entry points, as ``HookedModel.wrap`` finds plugins.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, MutableMapping, Optional

import pytest

from lensadapters.adapters.registry import PluginInfo, Registry, get_registry

__all__ = [
    "installed_plugins",
    "needs_plugin",
    "assert_entry_point",
    "architecture_plugins",
    "architecture_plugin",
    "model_openers",
    "registry_with",
    "registry_for",
    "declared_contracts",
    "matrix_class",
    "contract_matrix",
    "variant_matrix",
    "PluginProject",
    "plugin_projects",
]


def needs_plugin(name: str, what: str) -> None:
    """Skip the calling test unless the installed plugins include the plugin ``name`` (found by discovery), the one
    that reads ``what``."""
    if name not in get_registry().infos:
        pytest.skip(f"no installed plugin named {name!r} reads {what}")


def assert_entry_point(name: str, module: Any, *, skip_uninstalled: bool = False) -> None:
    """The ``lensadapters`` entry point ``name`` is declared and loads ``module``; ``skip_uninstalled``: skip where
    no distribution declares it (tests that register the plugin by hand)."""
    eps = [ep for ep in metadata.entry_points(group="lensadapters") if ep.name == name]
    if not eps and skip_uninstalled:
        pytest.skip(f"no installed distribution declares the plugin {name!r}")
    assert [ep.value for ep in eps] == [module.__name__], eps
    assert eps[0].load() is module


@functools.lru_cache(maxsize=None)
def installed_plugins() -> tuple[PluginInfo, ...]:
    """Every plugin installed in this environment, loaded once through its entry point (broken ones warn)."""
    registry = Registry()
    registry.load_entry_points()
    return tuple(registry.infos.values())


def architecture_plugins() -> list[PluginInfo]:
    """The installed plugins that claim architectures declared for the installed transformers, by entry-point name,
    each with only those architectures (a family that exists in newer transformers releases only is left out under
    an older one: there is no model of it to build). Encoder-decoders (``Architecture.encoder_decoder``) are left
    out too: the cross-plugin matrices build single-stack models and call them with token ids alone; an
    encoder-decoder plugin's own contract tests it."""
    found = []
    for info in installed_plugins():
        here = tuple(
            arch
            for arch in info.architectures
            if arch.declared_for_installed_transformers() and not arch.encoder_decoder
        )
        if here:
            found.append(info if here == info.architectures else replace(info, architectures=here))
    return sorted(found, key=lambda info: info.name)


def architecture_plugin(model_type: str) -> Optional[PluginInfo]:
    """The installed plugin claiming ``model_type`` (the first by name when several do), or ``None``."""
    for info in architecture_plugins():
        if any(model_type in arch.model_types for arch in info.architectures):
            return info
    return None


def model_openers(model: Any) -> tuple[PluginInfo, ...]:
    """The installed plugins that open ``model`` (a wrapper such as a ``PeftModel``) through
    ``lensadapters_resolve_model``."""
    found = []
    for info in installed_plugins():
        resolve = getattr(info.plugin, "lensadapters_resolve_model", None)
        if resolve is not None and resolve(model=model) is not None:
            found.append(info)
    return tuple(found)


def registry_with(*plugins: Any) -> Registry:
    """A fresh registry holding ``plugins`` (modules or objects with hook implementations, or ``PluginInfo``s);
    a plugin given twice is registered once."""
    registry = Registry()
    for plugin in plugins:
        if isinstance(plugin, PluginInfo):
            if plugin.name not in registry.infos:
                registry.register(
                    plugin.plugin,
                    plugin.name,
                    distribution=plugin.distribution,
                    version=plugin.version,
                    source=plugin.source,
                )
        elif not any(info.plugin is plugin for info in registry.infos.values()):
            registry.register(plugin, getattr(plugin, "__name__", None))
    return registry


def registry_for(model_type: str, *plugins: Any) -> Registry:
    """A registry with the installed plugin claiming ``model_type`` and ``plugins``; skips the calling test
    (pytest) when no installed plugin claims that model type."""
    info = architecture_plugin(model_type)
    if info is None:
        import pytest

        pytest.skip(f"no installed lensadapters plugin supports model_type {model_type!r}")
    return registry_with(info, *plugins)


def declared_contracts() -> list[type]:
    """The ``AdapterContract`` classes that installed architecture plugins declare (``LENSADAPTERS_CONTRACT``),
    ordered by plugin name. Plugins without a declared contract are left out, and so are plugins none of whose
    architectures is declared for the installed transformers (``Architecture.transformers``: a family that exists
    in newer releases only)."""
    from lensadapters.testing.check import declared_contract

    contracts = []
    for info in architecture_plugins():
        if not any(arch.declared_for_installed_transformers() for arch in info.architectures):
            continue
        contract = declared_contract(info.name, info.plugin)
        if contract is not None:
            contracts.append(contract)
    return contracts


def _short(cls: type) -> str:
    name = cls.__name__
    return name[: -len("Contract")] if name.endswith("Contract") and name != "Contract" else name


def matrix_class(mixin: type, contract: type, name: Optional[str] = None, module: Optional[str] = None) -> type:
    """``mixin`` (a contract variant) over ``contract`` as the cross-cutting matrices run it: the contract's
    configs narrowed by its ``matrix_overrides`` (every example builds more than one model), no config strata
    (the architecture's own contract covers them)."""
    name = name or f"Test{_short(mixin)}{_short(contract)}"
    overrides = {**contract.config_overrides, **contract.matrix_overrides}
    return type(
        name,
        (mixin, contract),
        {
            "__module__": module or mixin.__module__,
            "__qualname__": name,
            "config_overrides": overrides,
            "config_strata": {},
            "__doc__": f"{mixin.__name__} over {contract.__module__}:{contract.__qualname__} (its matrix_overrides).",
        },
    )


def _unsupported(mixin: type, contract: type) -> Optional[str]:
    """A variant's reason not to run over ``contract``: its optional classmethod ``supports(contract)`` returns one
    (``None``: it runs)."""
    supports = getattr(mixin, "supports", None)
    return supports(contract) if supports is not None else None


def contract_matrix(mixin: type, namespace: MutableMapping[str, Any]) -> list[str]:
    """Put one test class per installed architecture contract (:func:`declared_contracts`) into ``namespace``
    (a test module's ``globals()``): ``mixin`` over that contract, as :func:`matrix_class` builds it. Returns
    the class names."""
    return _put_classes(((mixin, contract) for contract in declared_contracts()), namespace)


def _put_classes(pairs: Iterable[tuple[type, type]], namespace: MutableMapping[str, Any]) -> list[str]:
    """:func:`matrix_class` of each ``(mixin, contract)`` pair the mixin supports, put into ``namespace``; their
    names."""
    names = []
    for mixin, contract in pairs:
        if _unsupported(mixin, contract):
            continue
        cls = matrix_class(mixin, contract, module=namespace.get("__name__"))
        namespace[cls.__name__] = cls
        names.append(cls.__name__)
    return names


@dataclass(frozen=True)
class PluginProject:
    """A plugin distribution's folder in a checkout (``plugins/<name>``, with its ``pyproject.toml``)."""

    path: Path
    distribution: str
    modules: tuple[str, ...]
    entry_points: tuple[str, ...]

    @property
    def installed(self) -> bool:
        from importlib import metadata

        try:
            metadata.distribution(self.distribution)
        except metadata.PackageNotFoundError:
            return False
        return True


def plugin_projects(root: Path, pattern: str = "plugins/*") -> list[PluginProject]:
    """The plugin distributions of a checkout (``root``): every ``pattern/pyproject.toml`` (default: the
    built-in plugins, ``plugins/*/``), sorted by folder."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    found = []
    for pyproject in sorted(Path(root).glob(f"{pattern}/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        packages = data.get("tool", {}).get("setuptools", {}).get("packages", [])
        modules = tuple(p for p in packages if "." not in p)
        found.append(
            PluginProject(
                pyproject.parent,
                project["name"],
                modules,
                tuple(project.get("entry-points", {}).get("lensadapters", {})),
            )
        )
    return found


def variant_matrix(contract: type, namespace: MutableMapping[str, Any]) -> list[str]:
    """The dual of :func:`contract_matrix`, for a plugin's own tests: put ``contract`` under every contract
    variant installed plugins declare (``lensadapters_contract_variants``: LoRA-adapted, 8-bit...) into
    ``namespace``, as :func:`matrix_class` builds them. Returns the class names (none without such plugins)."""
    from lensadapters.adapters.variants import contract_variants
    from lensadapters.testing.check import _import

    return _put_classes(((_import(variant.contract), contract) for variant in contract_variants().values()), namespace)
