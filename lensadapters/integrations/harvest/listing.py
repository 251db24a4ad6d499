"""The dataset listing of a harvest split over several processes: the union of every rank's complete shards.

Each rank records its own complete shards in its own manifest; the listing (``state.json`` and
``dataset_info.json``, what ``datasets.load_from_disk`` reads) is a pure function of those manifests. Any rank may
rewrite it at any time -- each does after every shard it completes, one at a time under a file lock -- so a rank
that is killed and restarted, or finishes last, leaves a listing of everything complete on disk; no rank waits for
another.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from typing import Any, Iterator

from lensadapters.integrations.harvest.manifest import HarvestMismatchError, Manifest, check_identity
from lensadapters.integrations.harvest.storage import features, write_dataset_listing

_RANK_MANIFEST = re.compile(r"manifest-rank(\d{5})-of-(\d{5})\.json$")
LISTING_LOCK = ".harvest-listing.lock"


def rank_manifests(out: str) -> list[str]:
    """The per-rank manifests in ``out`` (a harvest split over several processes), by name."""
    return sorted(
        path for path in glob.glob(os.path.join(out, "manifest-rank*-of-*.json")) if _RANK_MANIFEST.search(path)
    )


def world_sizes(out: str) -> set[int]:
    """The numbers of processes the harvests in ``out`` were split over (1 for a single process's)."""
    sizes = {int(_RANK_MANIFEST.search(path).group(2)) for path in rank_manifests(out)}  # type: ignore[union-attr]
    if os.path.exists(os.path.join(out, "manifest.json")):
        sizes.add(1)
    return sizes


def check_world_size(out: str, world_size: int) -> None:
    """Refuse to add a rank of a ``world_size``-process harvest to a folder split another way: the shards' owners
    would differ."""
    others = sorted(world_sizes(out) - {world_size})
    if others:
        described = ", ".join("a single process" if n == 1 else f"{n} processes" for n in others)
        raise HarvestMismatchError(
            f"{out} holds a harvest split over {described}, and this process is one of {world_size}: resume it with "
            f"the same number of processes ({others[0]}), or choose another output folder"
        )


def union_listing(out: str) -> tuple[list[str], bool]:
    """Write the listing of every rank's complete shards, in shard order; returns the files and whether every rank
    has finished (then the listing is the whole harvest)."""
    with locked(os.path.join(out, LISTING_LOCK)):
        manifests = [Manifest.load(path) for path in rank_manifests(out)]
        if not manifests:
            return [], False
        first = manifests[0]
        sizes = {m.world_size for m in manifests}
        if len(sizes) > 1:
            raise HarvestMismatchError(f"{out} holds manifests of harvests split over {sorted(sizes)} processes")
        for other in manifests[1:]:
            check_identity(first.identity, other.identity, out)
            if other.columns is not None and first.columns is not None and other.columns != first.columns:
                raise HarvestMismatchError(f"{out}: ranks {first.rank} and {other.rank} store different shapes")
        shards = sorted((s for m in manifests for s in m.shards), key=lambda s: s.index)
        indices = [s.index for s in shards]
        if len(set(indices)) != len(indices):
            raise HarvestMismatchError(f"{out}: a shard is listed by two ranks' manifests ({indices})")
        described = next((m for m in manifests if m.columns is not None), None)
        files = [s.file for s in shards]
        if files and described is not None:
            write_dataset_listing(out, files, harvest_features(described))
        ranks = {m.rank for m in manifests}
        finished = len(ranks) == first.world_size and all(m.finished for m in manifests)
        return files, finished


def harvest_features(manifest: Manifest) -> Any:
    """The ``datasets.Features`` of a harvest's shards: ``token_ids``, ``is_bos``, then one column per hook point
    in the order the hooks are listed (the model's execution order), whatever order the manifest's JSON keeps."""
    identity = manifest.identity
    if manifest.columns is None:
        raise ValueError("the manifest records no columns yet")
    context = identity["context_size"] - (1 if identity["drop_bos"] else 0)
    columns = {name: tuple(manifest.columns[name]) for name in identity["hooks"]}
    return features(columns, identity["dtype"], context)


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` for the block (waits for the holder; released if it dies)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no advisory locks on this platform
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
