"""Rows of text from a local file or dataset, in a fixed order, restartable at any row.

A *row* is one line of a text file (as ``datasets.load_dataset("text")`` reads it), one JSON object of a JSONL
file, or one row of a saved Hugging Face dataset (``datasets.load_from_disk``). A saved dataset without a text
column but with token ids (``input_ids`` or ``tokens``, as SAELens' pretokenizing writes) is a *tokens* source:
its rows are lists of token ids.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from lensadapters.errors import LensAdaptersError
from lensadapters.integrations.harvest.checksum import file_checksum

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TOKEN_COLUMNS = ("input_ids", "tokens")


class DataSourceError(LensAdaptersError, ValueError):
    """The data to harvest cannot be read as rows of text."""


@dataclass(frozen=True)
class TextSource:
    """Where the text comes from: ``kind`` is ``"text"``, ``"jsonl"``, ``"dataset"`` or ``"tokens"`` (a saved
    dataset of token ids; ``text_column`` is then the token column)."""

    path: str
    kind: str
    text_column: str = "text"
    split: Optional[str] = None

    def rows(self, start: int = 0) -> Iterator[Any]:
        """The rows' texts (token id lists for a tokens source) from row ``start`` on."""
        if self.kind in ("dataset", "tokens"):
            yield from _dataset_rows(self._dataset(), self.text_column, start)
            return
        with open(self.path, encoding="utf-8") as handle:
            index = 0
            for number, line in enumerate(handle, 1):
                if self.kind == "jsonl":
                    if not line.strip():
                        continue
                    if index >= start:
                        yield _json_text(line, self.text_column, self.path, number)
                elif index >= start:
                    yield line.rstrip("\r\n")
                index += 1

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data: every byte of it (a checksum of the file, or of a saved dataset's data files,
        see :mod:`.checksum`), so a harvest resumed on other data is refused."""
        if self.kind in ("dataset", "tokens"):
            ds = self._dataset()
            files = [entry["filename"] for entry in getattr(ds, "cache_files", []) or []]
            return {
                "kind": self.kind,
                "rows": len(ds),
                "columns": list(ds.column_names),
                "files": {os.path.basename(name): file_checksum(name) for name in files},
                "text_column": self.text_column,
                "split": self.split,
            }
        fingerprint = {"kind": self.kind, "bytes": os.path.getsize(self.path), "checksum": file_checksum(self.path)}
        if self.kind == "jsonl":
            fingerprint["text_column"] = self.text_column
        return fingerprint

    def _dataset(self) -> Any:
        import datasets

        loaded = datasets.load_from_disk(self.path)
        if isinstance(loaded, datasets.DatasetDict):
            split = self.split or ("train" if "train" in loaded else None)
            if split not in loaded:
                raise DataSourceError(
                    f"{self.path} holds the splits {sorted(loaded)}: choose one with split= (--split)"
                )
            loaded = loaded[split]
        if self.text_column not in loaded.column_names:
            tokens = [c for c in TOKEN_COLUMNS if c in loaded.column_names]
            if self.kind == "dataset" and tokens and self.text_column == "text":
                return loaded
            raise DataSourceError(
                f"the dataset at {self.path} has no {self.text_column!r} column (it has "
                f"{loaded.column_names}): name the text column with text_column= (--text-column)"
            )
        return loaded


def open_source(path: str, text_column: str = "text", split: Optional[str] = None) -> TextSource:
    """A :class:`TextSource` for a text file, a JSONL file (``.jsonl``/``.json``/``.ndjson``) or a dataset folder
    saved with ``save_to_disk``."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")):
            raise DataSourceError(
                f"{path} is a folder but not a dataset saved with save_to_disk (no state.json or dataset_dict.json)"
            )
        source = TextSource(path, "dataset", text_column, split)
        columns = source._dataset().column_names
        if text_column not in columns:
            return TextSource(path, "tokens", next(c for c in TOKEN_COLUMNS if c in columns), split)
        return source
    if not os.path.isfile(path):
        raise DataSourceError(f"no such data file or dataset folder: {path}")
    kind = "jsonl" if path.endswith(_JSONL_SUFFIXES) else "text"
    return TextSource(path, kind, text_column, None)


def _json_text(line: str, column: str, path: str, number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataSourceError(f"{path}:{number} is not a JSON object ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get(column), str):
        raise DataSourceError(
            f"{path}:{number} has no string field {column!r}: name the text field with text_column= (--text-column)"
        )
    return record[column]


def _dataset_rows(ds: Any, column: str, start: int, chunk: int = 1024) -> Iterator[str]:
    for first in range(start, len(ds), chunk):
        yield from ds[first : first + chunk][column]
