"""Launching small multi-process jobs from tests: torchrun on the CPU (gloo), each process its own interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Sequence

#: a job of tiny models finishes in seconds; this bounds a job that hangs (a rank waiting on a dead peer)
TIMEOUT_S = 300


def torchrun(
    args: Sequence[str], nproc: int = 2, env: Optional[dict[str, str]] = None, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node NPROC ARGS`` (a free port of its own, no
    restarts), one thread per process; its output captured."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # never an outer job's
        environment.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max_restarts",
        "0",
        *args,
    ]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)


def described(job: subprocess.CompletedProcess, limit: int = 6000) -> str:
    """A failed job's exit status and the end of its output, for an assertion message."""
    return f"exit status {job.returncode}\n--- stdout\n{job.stdout[-limit:]}\n--- stderr\n{job.stderr[-limit:]}"
