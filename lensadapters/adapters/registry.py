"""Plugin discovery and selection.

Plugins are found through the entry point group ``lensadapters`` and loaded one by one: a plugin
that fails to import (whatever it raises, ``sys.exit`` included), is built for another hookspec major version
or declares something malformed produces a warning naming it, is left unregistered, and the others keep
working. ``LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD=1`` (any value but ``0``, ``false``, ``no``, ``off`` or empty)
turns autoloading off: entry points run arbitrary code at import, and embedders then ``register`` the plugins
they trust by hand.

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

from lensadapters.adapters import hookspecs
from lensadapters.adapters.layer_claims import declared_layers
from lensadapters.adapters.plugin_calls import ScopedHooks
from lensadapters.adapters.validation import architectures_of, check_required_hooks
from lensadapters.errors import PluginConflictError, PluginValidationError, UnsupportedModelError
from lensadapters.hooks.specs import Architecture

ENTRY_POINT_GROUP = "lensadapters"
DISABLE_AUTOLOAD_ENV = "LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD"
_FALSE_WORDS = ("", "0", "false", "no", "off")


def autoload_disabled() -> bool:
    """Whether ``LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD`` turns entry-point loading off (``0``/``false``/``no``/
    ``off``/empty mean it does not)."""
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in _FALSE_WORDS


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
    #: the entry points behind ``failures`` (same keys): ``(entry-point name, distribution, version)``
    failed: dict[str, tuple[str, Optional[str], Optional[str]]] = field(default_factory=dict)
    _autoloaded: bool = False
    autoload_disabled: bool = False  # the process-wide registry, with LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD set

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
        """Register ``plugin`` (a module or object with ``@hookimpl`` functions).

        Everything it declares is checked first (hook names, decorators, architectures); a plugin refused with a
        ``PluginValidationError`` is left unregistered, so it takes no part in any wrap.
        """
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
        declared_layers(plugin, name)  # LENSADAPTERS_LAYERS, if given, is well formed
        archs = architectures_of(plugin, name)  # before pluggy sees it: a refused plugin is never registered
        try:
            self.pm.register(plugin, name=name)
        except ValueError as exc:  # pluggy: the same object or name twice
            raise PluginConflictError(f"plugin {name!r} cannot be registered: {exc}") from None
        try:
            self.pm.check_pending()  # a misspelled hook implementation (lensadapters_atn_qkv) matches no hookspec
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(plugin)
            raise PluginValidationError(
                f"plugin {name!r} implements a hook that lensadapters does not define: {exc}. Hook names are listed in "
                f"lensadapters/hookspecs.py (a misspelling, or a plugin written for another lensadapters version?)"
            ) from None
        except BaseException:
            self.pm.unregister(plugin)
            raise
        info = PluginInfo(name, plugin, distribution, version, archs, source)
        self.infos[name] = info
        return info

    def unregister(self, name: str) -> None:
        info = self.infos.pop(name)
        if self.pm.is_registered(info.plugin):
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
                self.failed[f"{ep.name} ({dist_name})"] = (ep.name, dist_name, dist_version)
                warnings.warn(msg, PluginLoadWarning, stacklevel=2)
                continue
            if ep.name in self.infos:
                continue
            seen[ep.name] = dist_name
            try:
                _check_core_range(dist)
                plugin = ep.load()
                self.register(plugin, ep.name, distribution=dist_name, version=dist_version, source="entry point")
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - a broken plugin (even one calling sys.exit) must not
                # take the host or the others down
                if ep.name in self.infos:
                    self.unregister(ep.name)
                what = f"{type(exc).__name__}: {exc}" if not isinstance(exc, Exception) or not str(exc) else str(exc)
                msg = (
                    f"lensadapters plugin {ep.name!r} from {dist_name or 'an unknown distribution'} failed to "
                    f"load and is not used: {what}"
                )
                self.failures[ep.name] = msg
                self.failed[ep.name] = (ep.name, dist_name, dist_version)
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
            named = [
                (info, arch)
                for info in self.architecture_plugins()
                for arch in info.architectures
                if adapter in (info.name, arch.name)
            ]
            if not named:
                raise UnsupportedModelError(f"no installed plugin is named {adapter!r}. {self.describe_installed()}")
            if len({id(info.plugin) for info, _ in named}) > 1:
                names = ", ".join(f"{arch.name!r} of plugin {info.name!r}" for info, arch in named)
                raise PluginConflictError(
                    f"adapter={adapter!r} names several architectures: {names}. Use a name "
                    f"only one of them has (`lensadapters plugins` lists them)"
                )
            if len(named) > 1:  # a plugin's name with several architectures: the one declaring the model type
                named = [pair for pair in named if model_type in pair[1].model_types] or named[:1]
            return named[0]
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

    def owners(self, model_type: str) -> list[str]:
        """The names of the plugins that declare ``model_type``."""
        return list(dict.fromkeys(info.name for info, _ in self.claims(model_type)))

    def describe_installed(self) -> str:
        archs = [
            f"{info.name} ({', '.join(t for a in info.architectures for t in a.model_types)})"
            for info in self.architecture_plugins()
        ]
        text = "Installed architecture plugins: " + (", ".join(archs) if archs else "none") + "."
        if self.failures:
            text += " Plugins that failed to load: " + "; ".join(self.failures.values()) + "."
        return text + self.autoload_note()

    def autoload_note(self) -> str:
        """A sentence saying that plugin autoloading is off and how to turn it on ("" when it is on)."""
        if not self.autoload_disabled:
            return ""
        return (
            f" Plugin autoloading is disabled ({DISABLE_AUTOLOAD_ENV}="
            f"{os.environ.get(DISABLE_AUTOLOAD_ENV, '')!r}): installed plugins were not loaded from their "
            f"entry points; unset it, or register the plugins you trust with "
            f"lensadapters.registry.register_module(module)."
        )

    def hooks_for(self, info: PluginInfo, left_out: Iterable[Any] = ()) -> ScopedHooks:
        """Hook callers over ``info``'s plugin, the cross-cutting plugins (but those ``left_out``) and the core."""
        others = [i.plugin for i in self.architecture_plugins() if i.plugin is not info.plugin]
        if info.plugin is not self.generic.plugin:
            others.append(self.generic.plugin)
        return ScopedHooks(self.pm, others + list(left_out))

    def all_hooks(self, left_out: Iterable[Any] = ()) -> ScopedHooks:
        """Hook callers over every registered plugin (but those ``left_out``), for hooks called before a plugin is
        selected (``lensadapters_resolve_model``)."""
        return ScopedHooks(self.pm, list(left_out))

    def check_architecture_plugin(self, info: PluginInfo) -> None:
        """The selected plugin implements every hook the core needs (named when one is missing); the core's generic
        adapter describes only opaque blocks."""
        if info is self.generic:
            return
        check_required_hooks(info.plugin, info.name, hookspecs.hookimpl.project_name + "_impl")


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    from lensadapters.adapters import defaults

    pm.register(defaults, name="lensadapters.defaults")
    pm.register(_generic_info().plugin, name="lensadapters.generic")
    return pm


@functools.lru_cache(maxsize=None)
def _generic_info() -> PluginInfo:
    from lensadapters._version import __version__
    from lensadapters.adapters.generic import plugin as generic

    return PluginInfo(generic.NAME, generic, "lensadapters", __version__, (generic.ARCH,), "core")


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
    import transformers
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

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

    from lensadapters._version import __version__

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
        if autoload_disabled():
            _DEFAULT.autoload_disabled = True
        else:
            _DEFAULT.load_entry_points()
    return _DEFAULT


def set_registry(registry: Optional[Registry]) -> None:
    """Replace the process-wide registry (tests)."""
    global _DEFAULT
    _DEFAULT = registry


def register_module(module: ModuleType, name: Optional[str] = None) -> PluginInfo:
    """Register a plugin module with the process-wide registry."""
    return get_registry().register(module, name)
