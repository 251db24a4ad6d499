"""Two processes (torchrun, gloo on the CPU): a model wrapped under DistributedDataParallel or FSDP2's fully_shard
caches, edits and backpropagates through hook points on every rank as the undistributed model does on the same
inputs, weight accessors give whole matrices, and unwrap leaves the distributed model as it was.

The checks run inside the ranks (tests/distributed_worker.py); each rank reports what it checked."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lensadapters.testing.distributed import described, torchrun
from lensadapters.testing.tiny_models import installed

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")

pytestmark = [
    pytest.mark.one_environment,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch is built without torch.distributed"),
    pytest.mark.skipif(not installed("llama"), reason="the workers use the llama plugin's tiny model"),
]


def run_worker(scenario: str, out) -> list[dict]:
    job = torchrun([WORKER, scenario, str(out)])
    assert job.returncode == 0, described(job)
    reports = [json.loads((out / f"{scenario}-rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in reports] == [0, 1] and all(r["world_size"] == 2 for r in reports)
    return reports


def test_ddp_hook_points_edits_gradients_and_weights_on_every_rank(tmp_path) -> None:
    for report in run_worker("ddp", tmp_path):
        assert report["gradients"] > 0 and report["points"] and report["weights"]
        assert report["wrapped_before_ddp"]


def test_fsdp2_hook_points_edits_gradients_and_whole_weights_on_every_rank(tmp_path) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 fully_shard")
    for report in run_worker("fsdp2", tmp_path):
        for order in ("sharded-then-wrapped", "wrapped-then-sharded"):
            assert report[order]["gradients"] > 0 and report[order]["weights"]


def test_probe_callback_records_a_lora_fine_tune_under_the_trainer_with_ddp(tmp_path) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("accelerate")
    for report in run_worker("trainer", tmp_path):
        assert report["steps"] == [0, 2, 4]
