"""What the model-sweep benchmarks (``bench_attribution.py``, ``bench_patching.py``) share: their command line and
their results files, ``NAME.md`` (a header and the table) and ``NAME.json`` (the rows, the arguments, the versions
and the machine)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench_peers import machine, versions


def sweep_parser(description: str, length: int, batch: int) -> argparse.ArgumentParser:
    """The options every sweep takes: ``--models``, ``--layers``, ``--length`` (default ``length``), ``--batch``
    (default ``batch``), ``--rounds``, ``--threads`` and ``--out`` (the results' folder); a benchmark adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--length", type=int, default=length)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return parser


def write_results(args: argparse.Namespace, name: str, header: str, table: str, rows: list, **extra: Any) -> None:
    """Write ``header`` and the markdown ``table`` to ``args.out/NAME.md``, and the arguments, the versions, the
    machine, ``rows`` and ``extra`` to ``args.out/NAME.json``."""
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.md").write_text(header + "\n\n" + table + "\n")
    payload = {"args": vars(args), "versions": versions(), "machine": machine(), "rows": rows, **extra}
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
