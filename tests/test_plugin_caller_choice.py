""":class:`lensadapters.adapters.plugin_calls.PluginCaller` chooses the implementations it calls once, until the
registered plugins or the excluded ones change (hooked forwards ask per point and per layer); a change is seen on
the next call, whatever it is."""

from __future__ import annotations

import pluggy

from lensadapters.adapters.plugin_calls import PluginCaller

spec = pluggy.HookspecMarker("choice_test")
impl = pluggy.HookimplMarker("choice_test")


class Spec:
    @spec
    def answer(self) -> int:  # type: ignore[empty-body]
        """Each plugin's number."""


def _plugin(n: int) -> object:
    class Plugin:
        @impl
        def answer(self) -> int:
            return n

    return Plugin()


def test_registered_and_excluded_plugins_are_seen_on_the_next_call() -> None:
    pm = pluggy.PluginManager("choice_test")
    pm.add_hookspecs(Spec)
    one, two, three = _plugin(1), _plugin(2), _plugin(3)
    pm.register(one)
    excluded: list[object] = []
    caller = PluginCaller(pm, "answer", excluded)
    assert caller() == [1]
    assert caller.implementations() is not caller.implementations(), "the chosen list is handed out, not a copy"
    pm.register(two)
    assert caller() == [2, 1]  # pluggy's order: the last registered first
    excluded.append(one)
    assert caller() == [2]
    pm.register(three)
    excluded.remove(one)
    assert caller() == [3, 2, 1]
    pm.unregister(two)
    assert caller() == [3, 1]
    excluded[:] = [three]
    assert caller() == [1]
