"""Harvesting activations: run a model over a text dataset and write hook points' activations to disk.

``lensadapters.harvest(model, data, hooks, out)`` (and ``lensadapters harvest`` on the command line) packs text
into fixed-length contexts as SAELens does, runs the model only as far as the requested points, and writes one
row per context to shards that ``datasets.load_from_disk(out)`` reads as one dataset. Shards are complete or
absent: a harvest stopped at any point, even by ``kill -9``, continues where it stopped when run again -- only with
the same model (every parameter and buffer value), adapters, tokenizer, data (every byte) and settings. Every shard
is verified against its manifest (row count and checksum) when it is loaded or resumed.
"""

from lensadapters.integrations.harvest.loading import load_harvest
from lensadapters.integrations.harvest.manifest import HarvestDamagedError, HarvestMismatchError
from lensadapters.integrations.harvest.packing import Cursor, PackingRule, pack
from lensadapters.integrations.harvest.partition import Partition
from lensadapters.integrations.harvest.points import HarvestContextError, HarvestHookError
from lensadapters.integrations.harvest.runner import HarvestResult, harvest
from lensadapters.integrations.harvest.sources import DataSourceError, open_source

__all__ = [
    "harvest",
    "load_harvest",
    "HarvestResult",
    "HarvestMismatchError",
    "HarvestDamagedError",
    "HarvestContextError",
    "HarvestHookError",
    "DataSourceError",
    "Cursor",
    "PackingRule",
    "pack",
    "Partition",
    "open_source",
]
