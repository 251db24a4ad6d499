"""Builders and checks shared by the tests of harvesting (``lensadapters.harvest``): a text file of random rows,
a wrapped tiny model, packings drawn by Hypothesis and their packed contexts, a harvest's command line (in one
process or under torchrun) and the comparison of two harvests' files, byte for byte."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from lensadapters import HookedModel
from lensadapters.harvest import Cursor, PackingRule, harvest, load_harvest, pack
from lensadapters.integrations.harvest.runner import KILL_ENV
from lensadapters.testing.tiny_models import ARCH_NAMES, tiny, tokenizer

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
BOS, EOS = 1, 2
VOCAB = 48
ARCH = "llama" if "llama" in ARCH_NAMES else ARCH_NAMES[0]


def write_text(path: Path, n_rows: int, seed: int = 0, vocab: int = VOCAB) -> list[str]:
    rng = random.Random(seed)
    rows = [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randrange(0, 30))) for _ in range(n_rows)]
    path.write_text("".join(row + "\n" for row in rows))
    return rows


def wrapped(arch: str = ARCH, seed: int = 0) -> HookedModel:
    model: Any = tiny(arch, seed)
    return HookedModel.wrap(model, tokenizer=tokenizer(model.config.vocab_size))


@contextmanager
def wrapped_with_text(folder: Path, n_rows: int) -> Iterator[HookedModel]:
    """A wrapped tiny model (:func:`wrapped`, unwrapped on leaving) and ``n_rows`` random rows in
    ``folder / "data.txt"``."""
    hm = wrapped()
    write_text(folder / "data.txt", n_rows)
    try:
        yield hm
    finally:
        hm.unwrap()


def harvest_at(
    model: Any, folder: Path, source: str, out: str, points: Sequence[str] = ("blocks.0.hook_resid_post",), **kw: Any
) -> Any:
    """:func:`~lensadapters.harvest.harvest` of ``points`` (block 0's residual stream) from ``folder / source`` into
    ``folder / out``, without a progress bar; ``kw`` are the harvest's other arguments."""
    return harvest(model, str(folder / source), list(points), str(folder / out), progress=False, **kw)


@st.composite
def packings(draw: st.DrawFn) -> tuple[list[list[int]], PackingRule]:
    rows = draw(st.lists(st.lists(st.integers(3, 20), max_size=25), max_size=12))
    rule = PackingRule(
        draw(st.integers(2, 9)), draw(st.sampled_from([BOS, None])), draw(st.sampled_from([BOS, EOS, None]))
    )
    return rows, rule


def packed(rows: list[list[int]], rule: PackingRule, start: Cursor = Cursor()) -> list[tuple[list[int], Cursor]]:
    texts = [" ".join(map(str, row)) for row in rows]
    tokenize = lambda text: [int(t) for t in text.split()]  # noqa: E731
    return [(c.tolist(), cursor) for c, cursor in pack(texts[start.row :], tokenize, rule, start)]


#: points whose execution order is not their alphabetical order
SEVERAL = ["hook_embed", "blocks.0.attn.hook_z", "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]


def drop_last_batch(path: Path) -> None:
    """Rewrite an Arrow stream file without its last record batch (what a lost write leaves)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        schema, batches = reader.schema, list(reader)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches[:-1]:
            writer.write_batch(batch)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name.endswith(".arrow")}


def run_cli(checkpoint: Path, out: Path, kill: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0"}
    env.pop(KILL_ENV, None)
    if kill:
        env[KILL_ENV] = kill
    return subprocess.run(run_cli_command(checkpoint, out), env=env, capture_output=True, text=True, timeout=300)


def run_cli_command(checkpoint: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lensadapters.cli",
        "harvest",
        str(checkpoint / "model"),
        "--data",
        str(checkpoint / "data.txt"),
        "--hooks",
        *SEVERAL,
        "--out",
        str(out),
        "--context-size",
        "12",
        "--batch-size",
        "3",
        "--shard-contexts",
        "7",
        "--dtype",
        "float16",
    ]


def torchrun_cli(checkpoint: Path, out: Path, kill: str | None = None) -> Any:
    from lensadapters.testing.distributed import torchrun

    command = run_cli_command(checkpoint, out)
    return torchrun(["-m", "lensadapters", *command[command.index("harvest") :]], env={KILL_ENV: kill} if kill else {})


def assert_same_harvest(out: Path, reference: Path) -> None:
    import datasets

    files = sorted(f for f in os.listdir(reference) if f.endswith(".arrow"))
    assert sorted(f for f in os.listdir(out) if f.endswith(".arrow") or f.endswith(".tmp")) == files
    for name in files:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    listing = json.loads((out / "state.json").read_text())["_data_files"]
    assert listing == json.loads((reference / "state.json").read_text())["_data_files"]
    a = load_harvest(str(out)).with_format("torch")[:]
    b = datasets.load_from_disk(str(reference)).with_format("torch")[:]
    assert a.keys() == b.keys() and all(torch.equal(a[c], b[c]) for c in b)
