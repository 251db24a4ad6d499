"""The output folder of a harvest: each rank's manifest (new or resumed, checked against every other manifest there),
the lock a rank holds while it writes, damaged shards found and dropped on resumption, and the listings of the
shards (one rank's, or the union of all ranks')."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any, Iterator

from lensadapters.integrations.harvest.listing import (
    LISTING_LOCK,
    check_world_size,
    locked,
    rank_manifests,
    union_listing,
)
from lensadapters.integrations.harvest.manifest import HarvestMismatchError, Manifest, check_identity, manifest_path
from lensadapters.integrations.harvest.partition import Partition
from lensadapters.integrations.harvest.storage import shard_problem


def lists_shards(out: str, manifest: Manifest) -> bool:
    """Whether ``out``'s dataset listing (``state.json``) lists exactly the manifest's shards, in order."""
    try:
        with open(os.path.join(out, "state.json"), encoding="utf-8") as handle:
            listed = [entry.get("filename") for entry in json.load(handle).get("_data_files", [])]
    except (OSError, ValueError, AttributeError):
        return False
    return listed == [s.file for s in manifest.shards]


def open_manifest(out: str, identity: dict[str, Any], partition: Partition) -> Manifest:
    """This rank's manifest (new or resumed), after checking it against every manifest in ``out``; a new one is saved
    at once, under the listing lock, so that ranks started at the same time with different commands cannot both
    write."""
    with locked(os.path.join(out, LISTING_LOCK)) if partition.world_size > 1 else contextlib.nullcontext():
        check_existing_manifests(out, identity, partition)
        path = manifest_path(out, partition)
        if os.path.exists(path):
            manifest = Manifest.load(path)
            if (manifest.rank, manifest.world_size) != (partition.rank, partition.world_size):
                raise HarvestMismatchError(f"{path} belongs to rank {manifest.rank} of {manifest.world_size}")
            return manifest
        manifest = Manifest(identity=identity, rank=partition.rank, world_size=partition.world_size)
        if partition.world_size > 1:
            manifest.save(out)
        return manifest


def check_existing_manifests(out: str, identity: dict[str, Any], partition: Partition) -> None:
    """Refuse, naming what differs, a harvest into ``out`` whose manifests (this rank's, and every other rank's)
    record another command."""
    if not os.path.isdir(out):
        return
    paths = rank_manifests(out) if partition.world_size > 1 else [manifest_path(out, partition)]
    for path in paths:
        if os.path.exists(path):
            check_identity(Manifest.load(path).identity, identity, out)


def drop_damaged_shards(out: str, manifest: Manifest) -> list[int]:
    """Verify this rank's complete shards against the manifest (row count and checksum); a damaged one is named
    (a warning), its file deleted and its record dropped, so that it is harvested anew. Returns their indices."""
    damaged = []
    for record in list(manifest.shards):
        problem = shard_problem(out, record)
        if problem is None:
            continue
        warnings.warn(f"{out}: {record.file} is damaged ({problem}): harvesting it again", stacklevel=4)
        damaged.append(record.index)
        manifest.shards.remove(record)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, record.file))
    if damaged:
        manifest.finished = False
        manifest.save(out)
    return damaged


def refuse_foreign_folder(out: str, partition: Partition) -> None:
    """A non-empty folder that holds no harvest, or a harvest split over another number of processes, is not
    written into."""
    if not os.path.isdir(out):
        return
    check_world_size(out, partition.world_size)
    if partition.world_size > 1 or os.path.exists(manifest_path(out, partition)):
        return
    if any(not _is_lock(name) for name in os.listdir(out)):
        raise HarvestMismatchError(f"{out} is not empty and holds no harvest manifest: choose an empty or new folder")


def _is_lock(name: str) -> bool:
    return name.startswith(".harvest") and name.endswith(".lock")


@contextlib.contextmanager
def exclusive(out: str, partition: Partition) -> Iterator[None]:
    """Only one process writes a rank's shards at a time; the lock goes with its process, even one killed."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no advisory locks on this platform
        yield
        return
    name = ".harvest.lock" if partition.world_size == 1 else f".harvest-rank{partition.rank:05d}.lock"
    with open(os.path.join(out, name), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise HarvestMismatchError(
                f"another process is harvesting into {out} ({name} is locked): wait for it, or stop it first"
            ) from None
        yield


def refresh_union(out: str, partition: Partition, manifest: Manifest) -> bool:
    """Rewrite the listing of all ranks' shards (several ranks); whether every rank has finished."""
    if partition.world_size == 1:
        return manifest.finished
    return union_listing(out)[1]
