"""Plugin discovery and selection.

Plugins are found through the entry point group ``lensadapters`` and loaded one by one: a plugin
that fails to import or is built for another hookspec major version produces a warning naming it,
and the others keep working. ``LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD=1`` turns autoloading off (tests
and embedders then ``register`` plugins by hand).

A ``model_type`` that no registered plugin claims is served by the core's generic adapter
(:mod:`lensadapters.generic`, also chosen by ``adapter="generic"``); it is not listed among the plugins.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Iterable, Optional

import pluggy

from . import hookspecs
from .errors import PluginConflictError, PluginValidationError, UnsupportedModelError
from .specs import Architecture

ENTRY_POINT_GROUP = "lensadapters"
DISABLE_AUTOLOAD_ENV = "LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD"


class PluginLoadWarning(UserWarning):
    """A plugin could not be loaded; the others still work."""


class TransformersVersionWarning(UserWarning):
    """The installed transformers is outside the range a plugin declares it was tested with."""


@dataclass
class PluginInfo:
    """What the registry knows about one registered plugin."""

    name: str
    plugin: Any
    distribution: Optional[str] = None
    version: Optional[str] = None
    architectures: tuple[Architecture, ...] = ()
    source: str = "manual"  # "entry point", "manual" or "builtin"


@dataclass
class Registry:
    """A pluggy plugin manager plus the bookkeeping lensadapters needs on top of it."""

    pm: pluggy.PluginManager = field(default_factory=lambda: _new_plugin_manager())
    infos: dict[str, PluginInfo] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    _autoloaded: bool = False

    # --- registration -----------------------------------------------------------------------------

    def register(
        self,
        plugin: Any,
        name: Optional[str] = None,
        *,
        distribution: Optional[str] = None,
        version: Optional[str] = None,
        source: str = "manual",
    ) -> PluginInfo:
        """Register ``plugin`` (a module or object with ``@hookimpl`` functions)."""
        _check_hookspec_version(plugin, name)
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        if name in self.infos:
            existing = self.infos[name]
            if existing.plugin is plugin:
                return existing
            raise PluginConflictError(
                f"two plugins are registered under the name {name!r}: {existing.distribution or existing.plugin!r} "
                f"and {distribution or plugin!r}. Uninstall one of them."
            )
        _check_unmarked_hooks(plugin, name)
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()  # a misspelled hook implementation (lensadapters_atn_qkv) matches no hookspec
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(plugin)
            raise PluginValidationError(
                f"plugin {name!r} implements a hook that lensadapters does not define: {exc}. Hook names are listed in "
                f"lensadapters/hookspecs.py (a misspelling, or a plugin written for another lensadapters version?)"
            ) from None
        archs = tuple(_architectures_of(plugin))
        info = PluginInfo(name, plugin, distribution, version, archs, source)
        self.infos[name] = info
        return info

    def unregister(self, name: str) -> None:
        info = self.infos.pop(name)
        self.pm.unregister(info.plugin)

    def load_entry_points(self) -> None:
        """Load every ``lensadapters`` entry point, one by one, warning about the broken ones."""
        self._autoloaded = True
        seen: dict[str, str] = {}
        for ep in _entry_points():
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else None
            dist_version = dist.version if dist is not None else None
            if ep.name in seen and seen[ep.name] != dist_name:
                msg = (
                    f"entry point {ep.name!r} is provided by both {seen[ep.name]} and {dist_name}; "
                    f"keeping {seen[ep.name]}. Uninstall one of them."
                )
                self.failures[f"{ep.name} ({dist_name})"] = msg
                warnings.warn(msg, PluginLoadWarning, stacklevel=2)
                continue
            if ep.name in self.infos:
                continue
            seen[ep.name] = dist_name
            try:
                _check_core_range(dist)
                plugin = ep.load()
                self.register(plugin, ep.name, distribution=dist_name, version=dist_version, source="entry point")
            except Exception as exc:  # a broken plugin must not take the others down
                msg = f"lensadapters plugin {ep.name!r} from {dist_name or 'an unknown distribution'} failed to load: {exc}"
                self.failures[ep.name] = msg
                warnings.warn(msg, PluginLoadWarning, stacklevel=2)

    # --- queries ----------------------------------------------------------------------------------

    def architecture_plugins(self) -> list[PluginInfo]:
        return [i for i in self.infos.values() if i.architectures]

    def claims(self, model_type: str) -> list[tuple[PluginInfo, Architecture]]:
        return [
            (info, arch)
            for info in self.architecture_plugins()
            for arch in info.architectures
            if model_type in arch.model_types
        ]

    def conflicts(self) -> dict[str, list[str]]:
        """Model types claimed by more than one plugin: ``{model_type: [plugin names]}``."""
        owners: dict[str, list[str]] = {}
        for info in self.architecture_plugins():
            for arch in info.architectures:
                for mt in arch.model_types:
                    owners.setdefault(mt, []).append(info.name)
        return {mt: names for mt, names in owners.items() if len(set(names)) > 1}

    @property
    def generic(self) -> PluginInfo:
        """The core's generic adapter, for model types no plugin claims (see :mod:`lensadapters.generic`)."""
        return _generic_info()

    def select(self, model_type: str, adapter: Optional[str] = None) -> tuple[PluginInfo, Architecture]:
        """Pick the plugin and architecture for ``model_type`` (or the one named ``adapter``); the generic adapter
        when no plugin claims ``model_type`` (or ``adapter="generic"``)."""
        if adapter == self.generic.name:
            return self.generic, self.generic.architectures[0]
        if adapter is not None:
            for info in self.architecture_plugins():
                for arch in info.architectures:
                    if adapter in (info.name, arch.name):
                        return info, arch
            raise UnsupportedModelError(f"no installed plugin is named {adapter!r}. {self.describe_installed()}")
        found = self.claims(model_type)
        if not found:
            return self.generic, self.generic.architectures[0]
        if len({info.name for info, _ in found}) > 1:
            names = ", ".join(f"{info.name} ({info.distribution or info.source})" for info, _ in found)
            raise PluginConflictError(
                f"model_type {model_type!r} is claimed by several plugins: {names}. "
                f"Choose one with HookedModel.wrap(model, adapter=NAME) or uninstall the others."
            )
        return found[0]

    def describe_installed(self) -> str:
        archs = [
            f"{info.name} ({', '.join(t for a in info.architectures for t in a.model_types)})"
            for info in self.architecture_plugins()
        ]
        text = "Installed architecture plugins: " + (", ".join(archs) if archs else "none") + "."
        if self.failures:
            text += " Plugins that failed to load: " + "; ".join(self.failures.values()) + "."
        return text

    def hooks_for(self, info: PluginInfo) -> "ScopedHooks":
        """Hook callers over ``info``'s plugin, the cross-cutting plugins and the core defaults."""
        others = [i.plugin for i in self.architecture_plugins() if i.plugin is not info.plugin]
        if info.plugin is not self.generic.plugin:
            others.append(self.generic.plugin)
        return ScopedHooks(self.pm, others)


class ScopedHooks:
    """``hooks.lensadapters_xxx(...)`` calling only the selected architecture plugin's implementations."""

    def __init__(self, pm: pluggy.PluginManager, excluded: list[Any]) -> None:
        self._pm = pm
        self._excluded = excluded

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("lensadapters_"):
            raise AttributeError(name)
        caller = self._pm.subset_hook_caller(name, self._excluded) if self._excluded else getattr(self._pm.hook, name)
        setattr(self, name, caller)
        return caller


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    from . import defaults

    pm.register(defaults, name="lensadapters.defaults")
    pm.register(_generic_info().plugin, name="lensadapters.generic")
    return pm


@functools.lru_cache(maxsize=None)
def _generic_info() -> PluginInfo:
    from ._version import __version__
    from .generic import plugin as generic

    return PluginInfo(generic.NAME, generic, "lensadapters", __version__, (generic.ARCH,), "core")


def _architectures_of(plugin: Any) -> Iterable[Architecture]:
    impl = getattr(plugin, "lensadapters_architectures", None)
    if impl is None:
        return ()
    return tuple(impl())


def _check_unmarked_hooks(plugin: Any, name: str) -> None:
    """A ``lensadapters_*`` function without ``@hookimpl`` would be ignored by pluggy: refuse it by name."""
    marker = hookspecs.hookimpl.project_name + "_impl"
    for attr in dir(plugin):
        if attr.startswith("lensadapters_") and callable(getattr(plugin, attr, None)):
            if not hasattr(getattr(plugin, attr), marker):
                raise PluginValidationError(
                    f"plugin {name!r} defines {attr}() without the @lensadapters.hookimpl decorator, so it would "
                    f"never be called: decorate it (from lensadapters import hookimpl)"
                )


def check_transformers_range(arch: Architecture, plugin_name: str) -> None:
    """Warn when the installed transformers is outside the range the plugin was tested with
    (``Architecture.transformers``, a PEP 440 specifier such as ``">=4.57,<6"``)."""
    if not arch.transformers:
        return
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    import transformers

    try:
        tested = SpecifierSet(arch.transformers)
    except InvalidSpecifier:
        warnings.warn(
            f"plugin {plugin_name!r} declares transformers={arch.transformers!r} for {arch.name!r}, which "
            f"is not a version specifier (like '>=4.57,<6')",
            PluginLoadWarning,
            stacklevel=3,
        )
        return
    if not tested.contains(transformers.__version__, prereleases=True):
        warnings.warn(
            f"plugin {plugin_name!r} is tested with transformers{arch.transformers} for {arch.name!r}, but "
            f"transformers {transformers.__version__} is installed: hook points may be missing or wrong if the "
            f"modeling code changed. Install a transformers version in that range, or a plugin version tested "
            f"with {transformers.__version__}",
            TransformersVersionWarning,
            stacklevel=3,
        )


def _check_hookspec_version(plugin: Any, name: Optional[str]) -> None:
    wanted = getattr(plugin, "LENSADAPTERS_HOOKSPEC", None)
    if wanted is None:
        return
    have = hookspecs.HOOKSPEC_VERSION.split(".")[0]
    if str(wanted).split(".")[0] != have:
        raise ImportError(
            f"plugin {name or plugin!r} was written for lensadapters hookspec {wanted}, "
            f"but the installed core provides hookspec {hookspecs.HOOKSPEC_VERSION}: "
            f"install a version of the plugin built for hookspec {have}.x"
        )


def _check_core_range(dist: Any) -> None:
    """Refuse a plugin distribution whose declared ``lensadapters`` range excludes the installed core.

    A requirement with an environment marker counts when the marker holds in this interpreter
    (``lensadapters>=0.2; python_version >= "3.11"``); one that only applies to an extra of the plugin
    (``extra == "testing"``) or to another environment is skipped, as pip skips it.
    """
    if dist is None:
        return
    from packaging.requirements import InvalidRequirement, Requirement

    from ._version import __version__

    for line in getattr(dist, "requires", None) or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.name.lower() != "lensadapters":
            continue
        if requirement.marker is not None:
            try:
                applies = requirement.marker.evaluate({"extra": ""})
            except Exception:  # a marker this packaging cannot evaluate: do not refuse the plugin over it
                applies = False
            if not applies:
                continue
        if not requirement.specifier.contains(__version__, prereleases=True):
            raise ImportError(
                f"{dist.metadata['Name']} {dist.version} requires lensadapters{requirement.specifier}, but the "
                f"installed lensadapters is {__version__}: install a version of {dist.metadata['Name']} built for "
                f"lensadapters {__version__}, or a lensadapters version in that range"
            )


def _entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


_DEFAULT: Optional[Registry] = None


def get_registry() -> Registry:
    """The process-wide registry, with entry points loaded unless autoloading is disabled."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Registry()
        if not os.environ.get(DISABLE_AUTOLOAD_ENV):
            _DEFAULT.load_entry_points()
    return _DEFAULT


def set_registry(registry: Optional[Registry]) -> None:
    """Replace the process-wide registry (tests)."""
    global _DEFAULT
    _DEFAULT = registry


def register_module(module: ModuleType, name: Optional[str] = None) -> PluginInfo:
    """Register a plugin module with the process-wide registry."""
    return get_registry().register(module, name)
