"""The manifest: what a harvest is (its identity) and how far it got (its complete shards).

It is rewritten atomically after every complete shard, and is the only truth on restart: a shard file that
the manifest does not list is redone. A restart whose identity differs is refused, naming what differs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lensadapters.errors import LensAdaptersError
from lensadapters.integrations.harvest.packing import Cursor
from lensadapters.integrations.harvest.partition import Partition
from lensadapters.integrations.harvest.storage import write_json_atomic

FORMAT = "lensadapters-harvest/1"


class HarvestMismatchError(LensAdaptersError, ValueError):
    """The output folder holds a harvest of a different command (other hooks, model, data or settings)."""


@dataclass
class ShardRecord:
    """A complete shard: its global index and file, its contexts ``[first, next_context)`` and the packing cursor
    after its last context."""

    index: int
    file: str
    first: int
    next_context: int
    row: int
    offset: int

    @property
    def cursor(self) -> Cursor:
        return Cursor(self.row, self.offset)


@dataclass
class Manifest:
    identity: dict[str, Any]
    rank: int = 0
    world_size: int = 1
    shard_contexts: Optional[int] = None
    columns: Optional[dict[str, list[int]]] = None
    shards: list[ShardRecord] = field(default_factory=list)
    finished: bool = False
    format: str = FORMAT

    @property
    def contexts_done(self) -> int:
        return sum(s.next_context - s.first for s in self.shards)

    def resume_point(self) -> tuple[int, Cursor]:
        """The next context to pack (its global number) and the packing cursor before it."""
        if not self.shards:
            return 0, Cursor()
        last = self.shards[-1]
        return last.next_context, last.cursor

    def save(self, out: str) -> None:
        write_json_atomic(manifest_path(out, Partition(self.rank, self.world_size)), asdict(self))

    @classmethod
    def load(cls, path: str) -> "Manifest":
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if data.get("format") != FORMAT:
            raise HarvestMismatchError(
                f"{path} is not a manifest this version can resume (format {data.get('format')!r}, expected {FORMAT!r})"
            )
        data["shards"] = [ShardRecord(**s) for s in data.get("shards", [])]
        return cls(**data)


def manifest_path(out: str, partition: Partition) -> str:
    if partition.world_size == 1:
        return os.path.join(out, "manifest.json")
    return os.path.join(out, f"manifest-rank{partition.rank:05d}-of-{partition.world_size:05d}.json")


def check_identity(stored: dict[str, Any], wanted: dict[str, Any], out: str) -> None:
    """Refuse to continue a harvest whose identity differs, naming every difference."""
    keys = sorted(set(stored) | set(wanted))
    differences = [key for key in keys if stored.get(key) != wanted.get(key)]
    if differences:
        details = "; ".join(
            f"{key}: {_short(stored.get(key))} there, {_short(wanted.get(key))} now" for key in differences
        )
        raise HarvestMismatchError(
            f"{out} holds a harvest made with a different {', '.join(differences)} ({details}). Run the same command "
            f"to resume it, or choose another output folder (or delete this one) to start a new harvest"
        )


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
