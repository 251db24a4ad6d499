"""``harvest``: run a model over packed text and write the chosen hook points' activations to disk in shards.

The run loop and the resume handling it interleaves with stay together here; the output folder (manifests, locks,
damaged shards, listings) is :mod:`.folder`, the points and the probing forward :mod:`.points`, reading a harvest
back :mod:`.loading`, the model a harvest runs :mod:`.hooked`, the kill test hook :mod:`.kill_switch`, and packing,
manifests, listings and storage are their own modules beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import types
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from lensadapters.api import tokens as _tokens
from lensadapters.hooks.distributed import barrier, launch_rank
from lensadapters.integrations.harvest import folder
from lensadapters.integrations.harvest.fingerprint import adapter_state, model_fingerprint, tokenizer_fingerprint
from lensadapters.integrations.harvest.hooked import hooked
from lensadapters.integrations.harvest.kill_switch import KILL_ENV, kill_switch  # noqa: F401  (KILL_ENV: old path)
from lensadapters.integrations.harvest.listing import harvest_features, union_listing
from lensadapters.integrations.harvest.loading import load_harvest  # noqa: F401  (its old import path)
from lensadapters.integrations.harvest.manifest import Manifest, ShardRecord, check_identity
from lensadapters.integrations.harvest.packing import (
    Cursor,
    PackingRule,
    Separator,
    contexts_of_rows,
    pack,
    packing_rule,
)
from lensadapters.integrations.harvest.partition import Partition, shard_file
from lensadapters.integrations.harvest.points import (  # noqa: F401  (HarvestContextError: its old import path)
    HarvestContextError,
    HarvestHookError,
    check_context_size,
    check_points,
    probe,
    stop_layer,
)
from lensadapters.integrations.harvest.sources import open_source
from lensadapters.integrations.harvest.storage import (  # noqa: F401  (DEFAULT_SHARD_BYTES: its old import path)
    DEFAULT_SHARD_BYTES,
    STORAGE_DTYPES,
    ShardWriter,
    default_shard_contexts,
    to_numpy,
    write_dataset_listing,
)


@dataclass(frozen=True)
class HarvestResult:
    """What a :func:`harvest` call left on disk (for this rank)."""

    out: str
    contexts: int
    tokens: int
    shards: int
    resumed_from: int
    finished: bool
    #: whether every rank of the harvest has finished (the dataset is complete); a single process: ``finished``
    all_finished: bool = False


def harvest(
    model: Any,
    data: str,
    hooks: Sequence[str],
    out: str,
    *,
    tokenizer: Any = None,
    context_size: int = 128,
    batch_size: int = 8,
    max_tokens: Optional[int] = None,
    dtype: str = "float32",
    drop_bos: bool = False,
    flatten: bool = False,
    prepend_bos: bool = True,
    sequence_separator: Separator = "bos",
    text_column: str = "text",
    split: Optional[str] = None,
    shard_contexts: Optional[int] = None,
    progress: bool = True,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> HarvestResult:
    """Write the activations of ``hooks`` over ``data`` to ``out``; ``datasets.load_from_disk(out)`` reads them.

    ``model``: a :class:`~lensadapters.HookedModel`, a Hugging Face model (wrapped for the call) or a checkpoint
    folder. ``data``: a text file (one row per line), a JSONL file (``text_column`` of each object) or a folder
    saved with ``datasets``' ``save_to_disk`` (of text, or of token ids -- ``input_ids``/``tokens``, one context per
    row, as SAELens reads a pretokenized dataset). Rows of text are tokenized without BOS and packed into contexts of
    ``context_size`` tokens as SAELens packs them (BOS first in each context when ``prepend_bos``,
    ``sequence_separator`` — ``"bos"``, ``"eos"``, a token id or ``None`` — between rows); only full contexts
    are kept, so nothing is padding. The model runs ``batch_size`` contexts at a time and stops after the last
    block that holds a requested point. Each row of the result is one context: ``token_ids`` and ``is_bos``
    ``[context_size]`` and one ``[context_size, ...]`` column per hook point in ``dtype`` (``float32``,
    ``float16``, or ``bfloat16``: rounded to bfloat16 and stored as float32, which Arrow can hold).
    ``drop_bos``: leave out position 0 (the context's BOS) in every column. ``flatten``: store each point as
    ``[context_size, d]`` (per-head points ``[pos, head, d_head]`` as ``[pos, head * d_head]``, the 2-D layout
    SAELens trains from, as it flattens ``hook_z``). ``max_tokens``: stop after
    ``max_tokens // context_size`` contexts.

    Shards of ``shard_contexts`` contexts (default: about 256 MiB each) are written one by one and recorded in
    a manifest; calling again with the same arguments after an interruption (even ``kill -9``) continues after
    the last complete shard, and different arguments on an existing output are refused.
    Under a launcher (``torchrun``, ``accelerate launch``: an initialized process group, or ``RANK`` and
    ``WORLD_SIZE`` in the environment) each process harvests its own shards (shard ``k`` is rank
    ``k % world_size``'s) into the same ``out``, with a manifest of its own, and is resumed on its own; every
    rank rewrites the dataset listing from all ranks' manifests after each shard, so ``load_from_disk(out)`` reads
    the union of the complete shards, in order: once every rank has finished, exactly the single process's
    dataset. With an initialized process group the call returns when every rank has finished. ``rank`` and
    ``world_size`` (both or neither) set this process's place explicitly.
    """
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(STORAGE_DTYPES)}, not {dtype!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if drop_bos and not prepend_bos:
        raise ValueError(
            "drop_bos=True leaves out the BOS token each context starts with; with prepend_bos=False there is none"
        )
    partition = _partition(rank, world_size)
    with hooked(model, tokenizer) as hm:
        tok = tokenizer if tokenizer is not None else getattr(hm, "tokenizer", None)
        if tok is None:
            raise _tokens.NoTokenizerError("harvest needs a tokenizer: pass tokenizer=, or wrap the model with one")
        rule = packing_rule(tok, context_size, prepend_bos, sequence_separator)
        points = check_points(list(hooks), hm.hook_names)
        stop = stop_layer(points, hm.hook_names, hm.cfg.n_layers)
        check_context_size(hm, context_size)
        source = open_source(data, text_column, split)
        columns = probe(hm, points, stop, context_size)
        if flatten:
            columns = {name: [math.prod(shape)] for name, shape in columns.items()}
        identity = {
            "model": model_fingerprint(hm.model, hm.hf_model),
            "adapters": adapter_state(hm.model),
            "tokenizer": tokenizer_fingerprint(tok),
            "data": source.fingerprint(),
            "hooks": points,
            "context_size": context_size,
            "begin_context_token": rule.begin_context_token,
            "separator_token": rule.separator_token,
            "drop_bos": drop_bos,
            "flatten": flatten,
            "dtype": dtype,
            "max_tokens": max_tokens,
        }
        folder.refuse_foreign_folder(out, partition)
        folder.check_existing_manifests(out, identity, partition)  # before anything is written
        os.makedirs(out, exist_ok=True)
        with folder.exclusive(out, partition):
            result = _run(
                hm,
                tok,
                source,
                rule,
                points,
                stop,
                out,
                identity,
                columns,
                partition,
                shard_contexts,
                context_size,
                dtype,
                batch_size,
                max_tokens,
                progress,
            )
    if partition.world_size > 1 and barrier(partition.world_size):
        result = dataclasses.replace(result, all_finished=union_listing(out)[1])
    return result


def _partition(rank: Optional[int], world_size: Optional[int]) -> Partition:
    """This process's place: as given, else the launcher's (process group or environment)."""
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"pass rank and world_size together (or neither, to take the launcher's): "
            f"rank={rank}, world_size={world_size}"
        )
    if rank is None or world_size is None:
        rank, world_size = launch_rank()
    return Partition(rank, world_size)


def _run(
    hm: Any,
    tok: Any,
    source: Any,
    rule: PackingRule,
    points: list[str],
    stop: Optional[int],
    out: str,
    identity: dict[str, Any],
    columns: dict[str, list[int]],
    partition: Partition,
    shard_contexts: Optional[int],
    context_size: int,
    dtype: str,
    batch_size: int,
    max_tokens: Optional[int],
    progress: bool,
) -> HarvestResult:
    manifest = folder.open_manifest(out, identity, partition)
    if shard_contexts is not None:
        if manifest.shard_contexts not in (None, shard_contexts):
            check_identity({"shard_contexts": manifest.shard_contexts}, {"shard_contexts": shard_contexts}, out)
        manifest.shard_contexts = shard_contexts
    if manifest.columns is None:
        manifest.columns = columns
    elif manifest.columns != columns:
        check_identity({"columns": manifest.columns}, {"columns": columns}, out)
    damaged = folder.drop_damaged_shards(out, manifest)
    if manifest.finished and not damaged:
        all_finished = folder.refresh_union(out, partition, manifest)
        return _result(out, manifest, manifest.contexts_done, context_size, all_finished)
    manifest.finished = False
    if manifest.shard_contexts is None:
        manifest.shard_contexts = default_shard_contexts(manifest.columns, context_size, dtype, batch_size)
    manifest.save(out)
    run = _Run(hm, tok, source, rule, points, stop, manifest, partition, out, batch_size, max_tokens, progress)
    resumed = manifest.contexts_done
    run.loop(damaged)
    return _result(out, manifest, resumed, context_size, folder.refresh_union(out, partition, manifest))


# --- the run ---------------------------------------------------------------------------------------------------


class _Run:
    def __init__(
        self,
        hm: Any,
        tokenizer: Any,
        source: Any,
        rule: PackingRule,
        points: list[str],
        stop: Optional[int],
        manifest: Manifest,
        partition: Partition,
        out: str,
        batch_size: int,
        max_tokens: Optional[int],
        progress: bool,
    ) -> None:
        self.hm, self.source, self.rule, self.points, self.stop = hm, source, rule, points, stop
        self.manifest, self.partition, self.out, self.batch_size = manifest, partition, out, batch_size
        self.size = rule.context_size
        self.max_contexts = None if max_tokens is None else max_tokens // self.size
        self.bos = tokenizer.bos_token_id
        self.first = 1 if manifest.identity["drop_bos"] else 0
        self.features = harvest_features(manifest)  # columns in execution order, as the hooks are listed
        owner = types.SimpleNamespace(
            tokenizer=tokenizer, default_prepend_bos=False, default_padding_side="right", cfg=None
        )
        self.tokenize = lambda text: _tokens.tokenize(owner, text, prepend_bos=False, truncate=False)[0][0].tolist()
        self.kill = kill_switch(partition.rank)
        self.progress = progress

    def loop(self, damaged: Sequence[int] = ()) -> None:
        manifest = self.manifest
        per_shard = manifest.shard_contexts
        done = {s.index for s in manifest.shards}
        start, cursor = manifest.resume_point(before=min(damaged, default=None))
        self._clean_temporary()
        if self.partition.world_size == 1:
            if manifest.shards:
                self._refresh_listing()
            else:  # no complete shard (any listed before was damaged): nothing to list
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.out, "state.json"))
        if self.hm.hf_model.training:
            warnings.warn(
                "harvesting a model in training mode (dropout active): call model.eval() for reproducible activations",
                stacklevel=3,
            )
        total = None if self.max_contexts is None else self.max_contexts * self.size
        bar = _progress_bar(total, manifest.contexts_done * self.size, self.progress)
        writer: Optional[ShardWriter] = None
        batch: list[torch.Tensor] = []
        first = shard = -1
        last: Optional[tuple[int, Cursor]] = None
        try:
            for number, (context, after) in enumerate(self._contexts(cursor), start):
                if self.max_contexts is not None and number >= self.max_contexts:
                    break
                if not self.partition.owns_context(number, per_shard) or number // per_shard in done:
                    continue
                if writer is None:
                    shard, first = number // per_shard, number
                    writer = ShardWriter(os.path.join(self.out, shard_file(shard)), self.features)
                batch.append(context)
                last = (number, after)
                shard_full = (number + 1) % per_shard == 0
                capped = self.max_contexts is not None and number + 1 == self.max_contexts
                if len(batch) == self.batch_size or shard_full or capped:
                    self._write_batch(writer, batch, bar)
                    batch = []
                    if not shard_full:
                        self.kill("batch")
                if shard_full:
                    self._commit(writer, shard, first, *last)
                    writer = None
            if batch:
                self._write_batch(writer, batch, bar)
            if writer is not None and last is not None:
                self._commit(writer, shard, first, *last)
                writer = None
            manifest.finished = True
            manifest.save(self.out)
        finally:
            bar.close()
            if writer is not None:
                writer.discard()

    def _contexts(self, cursor: Cursor) -> Iterator[tuple[torch.Tensor, Cursor]]:
        rows = self.source.rows(cursor.row)
        if self.source.kind == "tokens":
            return contexts_of_rows(rows, self.size, cursor)
        return pack(rows, self.tokenize, self.rule, cursor)

    @torch.no_grad()
    def _write_batch(self, writer: ShardWriter, batch: list[torch.Tensor], bar: Any) -> None:
        tokens = torch.stack(batch)
        on_device = tokens.to(self.hm.device)
        _, cache = self.hm.run_with_cache(
            on_device,
            names_filter=self.points,
            stop_at_layer=self.stop,
            return_type=None,
            attention_mask=torch.ones_like(on_device),
        )
        dtype = self.manifest.identity["dtype"]
        keep = slice(self.first, None)
        columns = {
            "token_ids": tokens[:, keep].numpy().astype(np.int32),
            "is_bos": (tokens[:, keep] == self.bos).numpy()
            if self.bos is not None
            else np.zeros((len(batch), self.size - self.first), dtype=bool),
        }
        for name in self.points:
            value = cache[name]
            if self.manifest.identity["flatten"] and value.dim() > 3:
                value = value.flatten(2)
            expected = (len(batch), self.size, *self.manifest.columns[name])
            if tuple(value.shape) != expected:
                raise HarvestHookError(
                    f"{name} has shape {tuple(value.shape)} for a batch of {len(batch)} contexts "
                    f"of {self.size} tokens; a harvest stores [batch, pos, ...] values of shape "
                    f"{expected}"
                )
            columns[name] = to_numpy(value[:, keep], dtype)
        writer.write(columns)
        bar.update(len(batch) * self.size)

    def _commit(self, writer: ShardWriter, shard: int, first: int, number: int, after: Cursor) -> None:
        checksum = writer.commit()
        self.kill("shard-file")
        record = ShardRecord(
            shard, shard_file(shard), first, number + 1, after.row, after.offset, writer.rows, checksum
        )
        self.manifest.shards.append(record)
        self.manifest.shards.sort(key=lambda s: s.index)
        self.manifest.save(self.out)
        self.kill("manifest")
        if self.partition.world_size == 1:
            self._refresh_listing()
        else:
            union_listing(self.out)

    def _refresh_listing(self) -> None:
        write_dataset_listing(self.out, [s.file for s in self.manifest.shards], self.features)

    def _clean_temporary(self) -> None:
        for path in glob.glob(os.path.join(self.out, "shard-*.arrow.tmp")):
            index = int(os.path.basename(path)[len("shard-") :].split(".")[0])
            if self.partition.owns_shard(index):
                os.remove(path)


def _result(out: str, manifest: Manifest, resumed: int, context_size: int, all_finished: bool) -> HarvestResult:
    done = manifest.contexts_done
    return HarvestResult(out, done, done * context_size, len(manifest.shards), resumed, manifest.finished, all_finished)


def _progress_bar(total: Optional[int], initial: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="tok",
        unit_scale=True,
        desc="harvest",
        disable=not enabled,
        dynamic_ncols=True,
    )
