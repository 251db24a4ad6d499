"""What the single-device benchmarks (``bench_checksum.py``, ``bench_describe.py``) write: their result with the
machine it ran on, printed and saved as ``benchmarks/results/NAME{_DEVICE}.{json,md}``."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Any

import torch


def device_name(device: str) -> str:
    """``cpu``, or the GPU's name."""
    return device if device == "cpu" else torch.cuda.get_device_name(torch.device(device))


def save(name: str, device: str, threads: int, rounds: int, rows: list[dict[str, Any]], lines: list[str]) -> None:
    """Print ``lines`` (the table) and write it and ``rows`` with the date, device, CPU, torch version, threads and
    rounds (the device in the file names when it is not the CPU)."""
    result = {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": threads,
        "rounds": rounds,
        "rows": rows,
    }
    print("\n".join(lines))
    suffix = "" if device == "cpu" else "_" + device.replace(":", "")
    folder = Path(__file__).parent / "results"
    (folder / f"{name}{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / f"{name}{suffix}.md").write_text("\n".join(lines) + "\n")
