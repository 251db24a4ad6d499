"""The manifest: what a harvest is (its identity) and how far it got (its complete shards).

It is rewritten atomically after every complete shard, and is the only truth on restart: a shard file that
the manifest does not list is redone. A restart whose identity differs is refused, naming what differs. Each shard
record holds the shard's row count and the checksum of its file, against which the shard is verified whenever it
is read or resumed; a record naming any other file than the one the harvest writes for its index is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lensadapters.errors import LensAdaptersError
from lensadapters.integrations.harvest.fingerprint import explain_adapters, explain_model
from lensadapters.integrations.harvest.packing import Cursor
from lensadapters.integrations.harvest.partition import Partition, shard_file
from lensadapters.integrations.harvest.storage import write_json_atomic

FORMAT = "lensadapters-harvest/2"


class HarvestMismatchError(LensAdaptersError, ValueError):
    """The output folder holds a harvest of a different command (other hooks, model, data or settings)."""


class HarvestDamagedError(LensAdaptersError, ValueError):
    """A manifest or a shard of a harvest is damaged (unreadable, truncated, edited, or naming a foreign file)."""


@dataclass
class ShardRecord:
    """A complete shard: its global index and file, its contexts ``[first, next_context)``, the packing cursor
    after its last context, and its file's row count and checksum."""

    index: int
    file: str
    first: int
    next_context: int
    row: int
    offset: int
    rows: int
    checksum: str

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

    def resume_point(self, before: Optional[int] = None) -> tuple[int, Cursor]:
        """The next context to pack (its global number) and the packing cursor before it: after the last complete
        shard, or (``before``: a shard index) after the last complete shard before that one."""
        shards = [s for s in self.shards if before is None or s.index < before]
        if not shards:
            return 0, Cursor()
        last = shards[-1]
        return last.next_context, last.cursor

    def save(self, out: str) -> None:
        write_json_atomic(manifest_path(out, Partition(self.rank, self.world_size)), asdict(self))

    @classmethod
    def load(cls, path: str) -> "Manifest":
        """The manifest at ``path``, after checking that it is whole and names only the harvest's own shard files."""
        fix = (
            "delete the folder (or choose another) to start the harvest again; it cannot be resumed without its "
            "manifest"
        )
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HarvestDamagedError(f"{path} is not a whole manifest (truncated or edited: {exc}): {fix}") from None
        if not isinstance(data, dict):
            raise HarvestDamagedError(f"{path} is not a harvest manifest (not a JSON object): {fix}")
        if data.get("format") != FORMAT:
            raise HarvestMismatchError(
                f"{path} is not a manifest this version can resume (format {data.get('format')!r}, expected "
                f"{FORMAT!r}): harvest into another folder"
            )
        fields = {f.name: f.type for f in dataclasses.fields(ShardRecord)}
        shards = data.get("shards", [])
        if not isinstance(shards, list):
            raise HarvestDamagedError(f"{path}: 'shards' is not a list: {fix}")
        records = []
        for number, entry in enumerate(shards):
            if not isinstance(entry, dict) or set(entry) != set(fields):
                raise HarvestDamagedError(f"{path}: shard record {number} is not a shard record ({entry!r}): {fix}")
            for name, kind in fields.items():
                wanted = str if kind in ("str", str) else int
                if not isinstance(entry[name], wanted) or isinstance(entry[name], bool):
                    raise HarvestDamagedError(f"{path}: shard record {number} has {name}={entry[name]!r}: {fix}")
            if entry["index"] < 0 or entry["file"] != shard_file(entry["index"]):
                raise HarvestDamagedError(
                    f"{path}: shard record {number} names the file {entry['file']!r}, not the harvest's own file for "
                    f"shard {entry['index']} ({shard_file(max(entry['index'], 0))!r} in the harvest's folder): "
                    f"refusing to read it. {fix[0].upper()}{fix[1:]}"
                )
            records.append(ShardRecord(**entry))
        data["shards"] = records
        try:
            return cls(**data)
        except TypeError as exc:
            raise HarvestDamagedError(f"{path} is not a harvest manifest ({exc}): {fix}") from None


def manifest_path(out: str, partition: Partition) -> str:
    if partition.world_size == 1:
        return os.path.join(out, "manifest.json")
    return os.path.join(out, f"manifest-rank{partition.rank:05d}-of-{partition.world_size:05d}.json")


def check_identity(stored: dict[str, Any], wanted: dict[str, Any], out: str) -> None:
    """Refuse to continue a harvest whose identity differs, naming every difference."""
    keys = sorted(set(stored) | set(wanted))
    differences = [key for key in keys if stored.get(key) != wanted.get(key)]
    if differences:
        details = "; ".join(f"{key}: {_explain(key, stored.get(key), wanted.get(key))}" for key in differences)
        raise HarvestMismatchError(
            f"{out} holds a harvest made with a different {', '.join(differences)} ({details}). Run the same command "
            f"to resume it, or choose another output folder (or delete this one) to start a new harvest"
        )


def _explain(key: str, stored: Any, wanted: Any) -> str:
    if key == "model":
        return explain_model(stored, wanted)
    if key == "adapters":
        return explain_adapters(stored, wanted)
    if key == "data" and isinstance(stored, dict) and isinstance(wanted, dict):
        keys = [k for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k)]
        return ", ".join(f"{k} {_short(stored.get(k))} there, {_short(wanted.get(k))} now" for k in keys)
    return f"{_short(stored)} there, {_short(wanted)} now"


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
