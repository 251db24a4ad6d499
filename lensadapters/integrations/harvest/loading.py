"""Reading a harvest back: :func:`load_harvest` verifies every complete shard against its manifest (row count and
checksum) and returns the dataset ``datasets.load_from_disk`` reads, refusing a damaged shard by name."""

from __future__ import annotations

import os
from typing import Any

from lensadapters.errors import LensAdaptersError
from lensadapters.integrations.harvest import folder
from lensadapters.integrations.harvest.listing import harvest_features, rank_manifests, union_listing
from lensadapters.integrations.harvest.manifest import HarvestDamagedError, Manifest, manifest_path
from lensadapters.integrations.harvest.partition import Partition
from lensadapters.integrations.harvest.storage import shard_problem, write_dataset_listing


def load_harvest(out: str) -> Any:
    """The harvest in ``out`` as a ``datasets.Dataset`` (what ``datasets.load_from_disk(out)`` reads), after
    verifying every complete shard against its manifest: its file's row count and checksum. A damaged shard is
    refused by name (run the harvest's command again to harvest it anew), never served."""
    import datasets

    paths = rank_manifests(out) or [p for p in [manifest_path(out, Partition())] if os.path.exists(p)]
    if not paths:
        raise LensAdaptersError(f"{out} holds no harvest (no manifest.json or manifest-rank*.json)")
    manifests = [Manifest.load(path) for path in paths]
    problems = [
        f"{record.file} ({problem})"
        for manifest in manifests
        for record in manifest.shards
        if (problem := shard_problem(out, record)) is not None
    ]
    if problems:
        raise HarvestDamagedError(
            f"{out}: {len(problems)} damaged shard(s): {'; '.join(problems)}. Run the same harvest command again: "
            f"it harvests damaged shards anew"
        )
    if len(paths) > 1 or manifests[0].world_size > 1:
        union_listing(out)  # every rank's complete shards, whatever each rank had listed when it stopped
    elif manifests[0].shards and manifests[0].columns is not None and not folder.lists_shards(out, manifests[0]):
        write_dataset_listing(out, [s.file for s in manifests[0].shards], harvest_features(manifests[0]))
    if not os.path.exists(os.path.join(out, "state.json")) or not any(m.shards for m in manifests):
        raise LensAdaptersError(f"{out} holds no complete harvest shard yet")
    return datasets.load_from_disk(out)
