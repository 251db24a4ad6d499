"""The kill -9 and restart test of the harvest command line (in subprocesses): a killed harvest restarted with the
same command is bitwise the uninterrupted one; ranks of one harvest, in one process or under torchrun (gloo on
the CPU), write the single-process harvest between them."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from lensadapters.harvest import (
    HarvestMismatchError,
    harvest,
    load_harvest,
)
from lensadapters.testing.harvesting import (
    ARCH,
    SEVERAL,
    VOCAB,
    assert_same_harvest,
    harvest_at,
    run_cli,
    run_cli_command,
    torchrun_cli,
    wrapped,
    write_text,
)
from lensadapters.testing.tiny_models import tiny, tokenizer

datasets = pytest.importorskip("datasets")


# --- kill -9 and restart (the command line, in subprocesses) ------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harvest-checkpoint")
    model = tiny(ARCH)
    model.save_pretrained(str(folder / "model"))
    tokenizer(model.config.vocab_size).save_pretrained(str(folder / "model"))
    write_text(folder / "data.txt", 150, vocab=VOCAB)
    return folder


@pytest.fixture(scope="module")
def uninterrupted(checkpoint):
    done = run_cli(checkpoint, checkpoint / "reference")
    assert done.returncode == 0, done.stderr
    assert "tok/s" in done.stderr  # the progress bar shows the rate
    return checkpoint / "reference"


@pytest.mark.one_environment
@pytest.mark.parametrize("kill", ["batch:5", "shard-file:3", "manifest:2"])
def test_killed_harvest_restarted_with_the_same_command_is_bitwise_the_uninterrupted_one(
    checkpoint, uninterrupted, tmp_path, kill
) -> None:
    out = tmp_path / "out"
    killed = run_cli(checkpoint, out, kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    shards_before = len(json.loads((out / "manifest.json").read_text())["shards"])
    reference = json.loads((uninterrupted / "manifest.json").read_text())
    assert 0 < shards_before < len(reference["shards"])
    resumed = run_cli(checkpoint, out)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed after {shards_before * 7} contexts" in resumed.stdout
    assert json.loads((out / "manifest.json").read_text())["shards"] == reference["shards"]
    files = sorted(f for f in os.listdir(uninterrupted) if f.endswith(".arrow"))
    assert sorted(f for f in os.listdir(out) if f.endswith(".arrow") or f.endswith(".tmp")) == files
    for name in files:
        assert (out / name).read_bytes() == (uninterrupted / name).read_bytes(), name
    a = load_harvest(str(out)).with_format("torch")[:]
    b = load_harvest(str(uninterrupted)).with_format("torch")[:]
    assert list(a.keys()) == list(b.keys()) == ["token_ids", "is_bos", *SEVERAL]
    assert all(torch.equal(a[c], b[c]) for c in b)


def test_a_typo_in_hooks_is_a_message_without_a_traceback_and_writes_nothing(checkpoint, tmp_path, capsys) -> None:
    from lensadapters.cli import main

    command = run_cli_command(checkpoint, tmp_path / "out")
    command[command.index("--hooks") + 1] = "blocks.0.hook_resid_postt"
    assert main(command[command.index("harvest") :] + ["--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown hook point 'blocks.0.hook_resid_postt'" in err and "blocks.0.hook_resid_post" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_ranks_split_the_shards_of_one_harvest_and_write_the_same_files(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 60)
    args = dict(context_size=8, batch_size=2, shard_contexts=3, progress=False)
    try:
        single = harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(tmp_path / "one"), **args)
        parts = [
            harvest(
                hm,
                str(tmp_path / "data.txt"),
                ["blocks.0.hook_resid_post"],
                str(tmp_path / "split"),
                rank=rank,
                world_size=3,
                **args,
            )
            for rank in range(3)
        ]
    finally:
        hm.unwrap()
    shards = sorted(f for f in os.listdir(tmp_path / "one") if f.endswith(".arrow"))
    assert len(shards) == single.shards > 3 and sum(p.shards for p in parts) == single.shards
    assert sorted(f for f in os.listdir(tmp_path / "split") if f.endswith(".arrow")) == shards
    for name in shards:
        assert (tmp_path / "split" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    for rank in range(3):
        manifest = json.loads((tmp_path / "split" / f"manifest-rank{rank:05d}-of-00003.json").read_text())
        assert all(s["index"] % 3 == rank for s in manifest["shards"]) and manifest["finished"]


# --- several processes (torchrun, gloo on the CPU) ------------------------------------------------------------------


@pytest.mark.one_environment
def test_torchrun_ranks_write_the_single_process_harvest_between_them(checkpoint, uninterrupted, tmp_path) -> None:
    from lensadapters.testing.distributed import described

    out = tmp_path / "out"
    job = torchrun_cli(checkpoint, out)
    assert job.returncode == 0, described(job)
    reference = json.loads((uninterrupted / "manifest.json").read_text())["shards"]
    manifests = [json.loads((out / f"manifest-rank{r:05d}-of-00002.json").read_text()) for r in range(2)]
    for rank, manifest in enumerate(manifests):
        assert manifest["finished"] and manifest["shards"]
        assert manifest["shards"] == [s for s in reference if s["index"] % 2 == rank]
    assert "rank 0 of 2" in job.stdout and "rank 1 of 2" in job.stdout
    assert_same_harvest(out, uninterrupted)
    again = torchrun_cli(checkpoint, out)  # finished: nothing is redone
    assert again.returncode == 0, described(again)
    assert_same_harvest(out, uninterrupted)


@pytest.mark.one_environment
def test_a_killed_rank_is_resumed_by_the_same_command(checkpoint, uninterrupted, tmp_path) -> None:
    from lensadapters.testing.distributed import described

    out = tmp_path / "out"
    killed = torchrun_cli(checkpoint, out, kill="shard-file:2@1")
    assert killed.returncode != 0, described(killed)
    before = json.loads((out / "manifest-rank00001-of-00002.json").read_text())
    assert len(before["shards"]) == 1 and not before["finished"]
    assert (out / "shard-00003.arrow").exists()  # its file moved into place, its manifest not written: redone
    resumed = torchrun_cli(checkpoint, out)
    assert resumed.returncode == 0, described(resumed)
    assert "rank 1 of 2" in resumed.stdout and "resumed after 7 contexts" in resumed.stdout
    assert_same_harvest(out, uninterrupted)


def test_a_harvest_split_over_other_process_counts_is_refused(checkpoint, uninterrupted, tmp_path) -> None:
    hm = wrapped()
    try:
        with pytest.raises(HarvestMismatchError, match="split over a single process"):
            harvest(
                hm,
                str(checkpoint / "data.txt"),
                ["blocks.0.hook_resid_post"],
                str(uninterrupted),
                context_size=12,
                rank=0,
                world_size=2,
                progress=False,
            )
        with pytest.raises(ValueError, match="rank and world_size together"):
            harvest(hm, str(checkpoint / "data.txt"), ["blocks.0.hook_resid_post"], str(tmp_path / "x"), rank=1)
    finally:
        hm.unwrap()


def test_the_launchers_environment_gives_the_rank(tmp_path, monkeypatch) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 40)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        result = harvest_at(hm, tmp_path, "data.txt", "out", context_size=8, batch_size=2, shard_contexts=3)
    finally:
        hm.unwrap()
    manifest = json.loads((tmp_path / "out" / "manifest-rank00001-of-00002.json").read_text())
    assert result.finished and not result.all_finished  # rank 0 has not run
    assert [s["index"] for s in manifest["shards"]] == list(range(1, 2 * result.shards, 2))
    rows = load_harvest(str(tmp_path / "out"))  # the complete shards so far: rank 1's
    assert len(rows) == result.contexts
