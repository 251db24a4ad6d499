"""Calling plugins' hook implementations one by one, so that every answer and every failure has a name.

pluggy calls all implementations of a hook in one go: an exception from any of them reaches the caller without
saying which plugin raised it, and a ``firstresult`` answer does not say who gave it. :class:`ScopedHooks` calls
the implementations itself, in pluggy's order (``tryfirst``/``trylast`` and registration order respected):

* an error a plugin raises names it: a lensadapters error (``UnsupportedModelError``, ``WeightUnavailableError``...)
  keeps its type and gets ``plugin 'NAME':`` in front of its message (unless the message names the plugin
  already); any other exception becomes a :class:`~lensadapters.errors.PluginError` naming the plugin and the
  hook, with the original exception as its cause;
* :meth:`PluginCaller.answer` returns the answer of a ``firstresult`` hook together with the plugin that gave it,
  and :meth:`PluginCaller.answers` every plugin's answer (to tell when more than one plugin could supply a value).
"""

from __future__ import annotations

from typing import Any, Optional

import pluggy

from lensadapters.errors import LensAdaptersError, PluginError

CORE_PLUGIN = "lensadapters.defaults"  # the core's own default implementations: their errors are the core's


# exceptions that keep their type because the hook documents them as answers: ``lensadapters_weight`` raises
# AttributeError for a weight the model does not have (``hasattr(hm, "W_U")``)
_ANSWERS: dict[str, tuple[type[BaseException], ...]] = {"lensadapters_weight": (AttributeError,)}


def attribute(exc: BaseException, plugin: str, hook: str) -> BaseException:
    """``exc`` raised by ``plugin``'s ``hook`` implementation, named (see the module docstring)."""
    if getattr(exc, "_lensadapters_plugin", None) is not None:  # named already (an inner call)
        return exc
    if plugin == CORE_PLUGIN:
        _mark(exc, plugin)
        return exc
    if isinstance(exc, LensAdaptersError) or isinstance(exc, _ANSWERS.get(hook, ())):
        message = str(exc)
        if plugin not in message:
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (f"plugin {plugin!r}: {exc.args[0]}",) + exc.args[1:]
            if hasattr(exc, "message") and isinstance(exc.message, str):
                exc.message = f"plugin {plugin!r}: {exc.message}"
        _mark(exc, plugin)
        return exc
    error = PluginError(f"plugin {plugin!r} failed in {hook}: {type(exc).__name__}: {exc}", plugin, hook)
    error.__cause__ = exc
    _mark(error, plugin)
    return error


def _mark(exc: BaseException, plugin: str) -> None:
    try:
        exc._lensadapters_plugin = plugin  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - exceptions with __slots__
        pass


def plugin_of(exc: BaseException) -> Optional[str]:
    """The plugin an exception was attributed to (``None``: not raised by a plugin's hook implementation)."""
    return getattr(exc, "_lensadapters_plugin", None)


def _same_objects(a: tuple[tuple[Any, ...], ...], b: tuple[tuple[Any, ...], ...]) -> bool:
    return all(len(x) == len(y) and all(p is q for p, q in zip(x, y)) for x, y in zip(a, b))


class PluginCaller:
    """``caller(**kwargs)`` calls one hook's implementations over the plugins not excluded (module docstring)."""

    def __init__(self, pm: pluggy.PluginManager, name: str, excluded: list[Any]) -> None:
        self.name = name
        self._pm = pm
        self._hook = getattr(pm.hook, name)
        self._excluded = excluded
        spec = self._hook.spec
        self.firstresult = bool(spec is not None and spec.opts.get("firstresult"))
        self._chosen_from: Optional[tuple[tuple[Any, ...], tuple[Any, ...]]] = None
        self._chosen: list[Any] = []

    def implementations(self) -> list[Any]:
        """The ``HookImpl`` objects called, in call order: chosen again only when the registered implementations or
        the excluded plugins change (hot: hooked forwards ask per point and per layer)."""
        hookimpls = self._hook.get_hookimpls()
        key = (tuple(hookimpls), tuple(self._excluded))  # held, so no id of theirs is reused while it is compared
        if self._chosen_from is None or not _same_objects(key, self._chosen_from):
            excluded = {id(e) for e in self._excluded}
            self._chosen = [i for i in reversed(hookimpls) if id(i.plugin) not in excluded]
            self._chosen_from = key
        return list(self._chosen)

    def __call__(self, **kwargs: Any) -> Any:
        if self.firstresult:
            return self.answer(**kwargs)[0]
        return [value for _, value in self.answers(**kwargs)]

    def _call(self, impl: Any, kwargs: dict[str, Any]) -> Any:
        if impl.hookwrapper or impl.wrapper:  # pragma: no cover - lensadapters' hooks have no wrappers
            raise PluginError(
                f"plugin {impl.plugin_name!r} implements {self.name} as a hook wrapper, which "
                f"lensadapters does not support",
                impl.plugin_name,
                self.name,
            )
        try:
            args = [kwargs[a] for a in impl.argnames]
        except KeyError as missing:
            raise PluginError(
                f"plugin {impl.plugin_name!r}: {self.name} takes an argument {missing} that the hook "
                f"does not provide ({', '.join(kwargs)})",
                impl.plugin_name,
                self.name,
            ) from None
        try:
            return impl.function(*args)
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a plugin must not end the host either
            named = attribute(exc, impl.plugin_name, self.name)
            if named is exc:
                raise
            raise named from exc

    def answer(self, **kwargs: Any) -> tuple[Any, Optional[str]]:
        """The first non-``None`` answer and the name of the plugin that gave it (``(None, None)``: no answer)."""
        for impl in self.implementations():
            value = self._call(impl, kwargs)
            if value is not None:
                return value, impl.plugin_name
        return None, None

    def answers(self, *, tolerate_errors: bool = False, **kwargs: Any) -> list[tuple[str, Any]]:
        """Every non-``None`` answer as ``(plugin name, value)``, in call order; with ``tolerate_errors`` an
        implementation that raises is left out (for probes that only ask who *could* answer)."""
        out = []
        for impl in self.implementations():
            try:
                value = self._call(impl, kwargs)
            except Exception:
                if not tolerate_errors:
                    raise
                continue
            if value is not None:
                out.append((impl.plugin_name, value))
        return out


class ScopedHooks:
    """``hooks.lensadapters_xxx(...)`` over the selected architecture plugin, the cross-cutting plugins and the
    core's defaults (``excluded``: the other architecture plugins, and cross-cutting plugins left out of a wrap)."""

    def __init__(self, pm: pluggy.PluginManager, excluded: list[Any]) -> None:
        self._pm = pm
        self._excluded = list(excluded)

    def __getattr__(self, name: str) -> PluginCaller:
        if not name.startswith("lensadapters_"):
            raise AttributeError(name)
        caller = PluginCaller(self._pm, name, self._excluded)
        setattr(self, name, caller)
        return caller
