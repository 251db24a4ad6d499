"""Which contexts and shards belong to which process, so that ranks of one job split a harvest deterministically.

Contexts are numbered in packing order and grouped into shards of ``shard_contexts`` contexts; shard ``k`` is
written by rank ``k % world_size`` under a name of its own (:func:`shard_file`). A single process is rank 0 of 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """This process's share of a harvest."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size): rank={self.rank}, world_size={self.world_size}")

    def owns_shard(self, shard: int) -> bool:
        return shard % self.world_size == self.rank

    def owns_context(self, context: int, shard_contexts: int) -> bool:
        """Whether context number ``context`` (in packing order) is this rank's to harvest."""
        return self.owns_shard(context // shard_contexts)

    def next_shard(self, after: int = -1) -> int:
        """This rank's first shard with an index greater than ``after``."""
        shard = after + 1
        return shard + (self.rank - shard) % self.world_size


def shard_of(context: int, shard_contexts: int) -> int:
    return context // shard_contexts


def shard_file(shard: int) -> str:
    """The file name of shard ``shard`` (unique across ranks: the index is global)."""
    return f"shard-{shard:05d}.arrow"
