"""Shards on disk in the layout of a ``datasets`` dataset saved with ``save_to_disk``.

Each shard is one Arrow stream file written batch by batch (memory holds one batch, never the dataset) to a
temporary name and moved into place with ``os.replace`` once complete. ``state.json`` and
``dataset_info.json`` list the complete shards, so ``datasets.load_from_disk(out)`` reads them as one dataset.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch

from lensadapters.integrations.harvest.checksum import file_checksum

#: storage dtype of each activation dtype: Arrow has no bfloat16, so bfloat16 values are stored exactly as float32
STORAGE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "float32"}
#: default shard size: about this many bytes of activations (a shard is the unit of resumption)
DEFAULT_SHARD_BYTES = 256 * 2**20
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def features(columns: dict[str, tuple[int, ...]], dtype: str, context_size: int) -> Any:
    """``datasets.Features``: ``token_ids`` and ``is_bos`` ``[context_size]``, one ``[context_size, ...]``
    column per hook point."""
    from datasets import Array2D, Array3D, Array4D, Array5D, Features, Sequence, Value

    arrays = {2: Array2D, 3: Array3D, 4: Array4D, 5: Array5D}
    storage = STORAGE_DTYPES[dtype]
    spec: dict[str, Any] = {
        "token_ids": Sequence(Value("int32"), length=context_size),
        "is_bos": Sequence(Value("bool"), length=context_size),
    }
    for name, rest in columns.items():
        shape = (context_size, *rest)
        if len(shape) == 1:
            spec[name] = Sequence(Value(storage), length=context_size)
        elif len(shape) in arrays:
            spec[name] = arrays[len(shape)](shape=shape, dtype=storage)
        else:
            raise ValueError(f"{name}: per-context shape {shape} has more than 5 dimensions")
    return Features(spec)


def to_numpy(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """The values in ``dtype``, as the array that is stored (bfloat16 rounded, then widened to float32)."""
    value = tensor.detach().to(TORCH_DTYPES[dtype])
    if dtype == "bfloat16":
        value = value.float()
    return value.cpu().numpy()


def _nested(values: np.ndarray, arrow_type: Any) -> Any:
    """An Arrow array of type ``arrow_type`` (nested lists, possibly an extension type) over ``values``
    ``[rows, ...]``, built from the flat buffer without per-value conversion."""
    import pyarrow as pa

    storage_type = arrow_type.storage_type if isinstance(arrow_type, pa.ExtensionType) else arrow_type
    levels = []
    level = storage_type
    while pa.types.is_list(level) or pa.types.is_large_list(level) or pa.types.is_fixed_size_list(level):
        levels.append(level)
        level = level.value_type
    if len(levels) != values.ndim - 1:
        raise ValueError(f"an array of shape {values.shape} does not fit the Arrow type {storage_type}")
    array = pa.array(np.ascontiguousarray(values).reshape(-1), type=level)
    for size, list_type in zip(reversed(values.shape[1:]), reversed(levels)):
        if pa.types.is_fixed_size_list(list_type):
            array = pa.FixedSizeListArray.from_arrays(array, size)
        else:
            offsets_type = np.int64 if pa.types.is_large_list(list_type) else np.int32
            offsets = np.arange(0, len(array) + 1, size, dtype=offsets_type)
            build = pa.LargeListArray if pa.types.is_large_list(list_type) else pa.ListArray
            array = build.from_arrays(pa.array(offsets), array)
    if isinstance(arrow_type, pa.ExtensionType):
        array = pa.ExtensionArray.from_storage(arrow_type, array)
    return array


class ShardWriter:
    """One shard: ``write`` batches of rows, then ``commit`` (atomic) or ``discard``."""

    def __init__(self, path: str, feature_spec: Any) -> None:
        import pyarrow as pa

        self.path = path
        self.temporary = f"{path}.tmp"
        self.schema = feature_spec.arrow_schema
        self.rows = 0
        self._sink = pa.OSFile(self.temporary, "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)

    def write(self, columns: dict[str, np.ndarray]) -> None:
        import pyarrow as pa

        arrays = [_nested(columns[field.name], field.type) for field in self.schema]
        self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.rows += len(next(iter(columns.values())))

    def commit(self) -> str:
        """Move the complete shard into place (after flushing it to disk); returns its file's checksum."""
        self._close()
        with open(self.temporary, "rb") as handle:
            os.fsync(handle.fileno())
        checksum = file_checksum(self.temporary)
        os.replace(self.temporary, self.path)
        return checksum

    def discard(self) -> None:
        self._close()
        if os.path.exists(self.temporary):
            os.remove(self.temporary)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = None


def shard_rows(path: str) -> int:
    """The number of rows in a shard file (an Arrow stream), read from its record batches' headers."""
    import pyarrow as pa

    with pa.memory_map(path) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


def shard_problem(out: str, record: Any) -> Optional[str]:
    """What is wrong with a complete shard's file, measured against its manifest record (its row count and
    checksum), or ``None`` when it is whole."""
    path = os.path.join(out, record.file)
    if not os.path.isfile(path):
        return "its file is missing"
    checksum = file_checksum(path)
    if checksum == record.checksum:
        return None
    try:
        rows = shard_rows(path)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is described, not raised
        return f"unreadable ({type(exc).__name__}: {exc})"
    if rows != record.rows:
        return f"{rows} rows where the manifest lists {record.rows}"
    size = os.path.getsize(path)
    return f"its bytes differ from the manifest's checksum ({size} bytes, {checksum}; manifest {record.checksum})"


def write_json_atomic(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so that a reader (or a restart after a kill) sees the old file or the
    new one, never a part: a temporary file, flushed to disk, then ``os.replace``."""
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_dataset_listing(out: str, files: Sequence[str], feature_spec: Any) -> None:
    """``dataset_info.json`` and ``state.json``: the shard ``files`` (in order) as one ``datasets`` dataset."""
    import tempfile

    from datasets import DatasetInfo

    with tempfile.TemporaryDirectory(dir=out, prefix=".info-") as folder:
        DatasetInfo(features=feature_spec).write_to_directory(folder)
        os.replace(os.path.join(folder, "dataset_info.json"), os.path.join(out, "dataset_info.json"))
    sizes = [f"{name}:{os.path.getsize(os.path.join(out, name))}" for name in files]
    fingerprint = hashlib.sha256("\n".join(sizes).encode()).hexdigest()[:16]
    write_json_atomic(
        os.path.join(out, "state.json"),
        {
            "_data_files": [{"filename": name} for name in files],
            "_fingerprint": fingerprint,
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        },
    )


def default_shard_contexts(columns: dict[str, list[int]], context_size: int, dtype: str, batch_size: int) -> int:
    """Contexts per shard for about :data:`DEFAULT_SHARD_BYTES` of ``columns`` (per-token shapes) stored as
    ``dtype`` (plus the token ids), a multiple of ``batch_size``."""
    itemsize = np.dtype(STORAGE_DTYPES[dtype]).itemsize
    per_context = context_size * (5 + sum(math.prod(shape) * itemsize for shape in columns.values()))
    contexts = max(1, DEFAULT_SHARD_BYTES // per_context)
    return max(batch_size, contexts // batch_size * batch_size)
