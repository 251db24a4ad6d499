"""lensadapters.testing.run_at_a_barrier: every run waits at each meeting point until all have reached it, and an
error in one run is raised in the caller's thread without leaving the others waiting."""

from __future__ import annotations

import threading

import pytest

from lensadapters.testing import run_at_a_barrier


def test_the_runs_meet_at_each_point_and_return_their_own_results() -> None:
    order: list[tuple[str, int]] = []
    lock = threading.Lock()

    def run(key: int, hooks: list) -> int:
        for name, hook in hooks:
            with lock:
                order.append((f"before {name}", key))
            hook(None, None)
            with lock:
                order.append((f"after {name}", key))
        return key * 10

    assert run_at_a_barrier(run, [1, 2], ["a", "b"]) == {1: 10, 2: 20}
    steps = [step for step, _ in order]
    # nobody passes a point before everybody has reached it
    assert steps.index("after a") > max(i for i, s in enumerate(steps) if s == "before a")
    assert steps.index("after b") > max(i for i, s in enumerate(steps) if s == "before b")


def test_an_error_in_one_run_is_raised_and_releases_the_other() -> None:
    def run(key: int, hooks: list) -> None:
        if key == 1:
            raise ValueError("the run's own error")
        for _, hook in hooks:
            hook(None, None)

    with pytest.raises(ValueError, match="the run's own error"):
        run_at_a_barrier(run, [1, 2], ["a"], timeout=60)
