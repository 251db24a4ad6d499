"""Concurrency checks: runs of a wrapped model in two threads at once, held together inside the forward."""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Sequence, TypeVar

__all__ = ["run_at_a_barrier"]

K = TypeVar("K", bound=Hashable)


def run_at_a_barrier(
    run: Callable[[K, list[tuple[str, Callable[..., None]]]], Any],
    keys: Sequence[K],
    meet: Sequence[str],
    timeout: float = 120.0,
) -> dict[K, Any]:
    """``{key: run(key, hooks)}`` for each of ``keys``, every run in its own thread at once, the threads held
    together by one barrier at each hook point of ``meet``: ``hooks`` (``fwd_hooks`` to add to the run's own) waits
    there until every thread has reached that point, so that all forwards are between the same points at the same
    time (what a per-forward state kept on the model, instead of on the forward, gets wrong).

    ``run`` is called with ``key`` and the list of ``(name, hook)`` to install, and returns what the check compares
    (typically with what ``run(key, [])`` gives alone, in sequence). An exception in a thread aborts the barrier (so
    that the other threads do not wait) and is raised here; ``timeout`` (seconds) guards against a hang and is never
    reached by a passing run.
    """
    barrier = threading.Barrier(len(keys), timeout=timeout)

    def wait(t: Any, hook: Any) -> None:
        barrier.wait()

    hooks = [(name, wait) for name in meet]
    results: dict[K, Any] = {}
    errors: list[BaseException] = []

    def worker(key: K) -> None:
        try:
            results[key] = run(key, list(hooks))
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(key,)) for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:  # the first error; a BrokenBarrierError of the other threads follows from it
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    return results
