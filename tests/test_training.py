"""Probes during training in one process (a custom loop): record_probe writes what the model computes at each step,
base and adapted for a LoRA model, and leaves the model's modes and flags as they were."""

from __future__ import annotations

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.testing.tiny_models import needs, tiny
from lensadapters.training import ProbeCallback, ProbeMismatchError, load_probes, record_probe

POINTS = ["blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]


@needs("llama")
def test_a_custom_loop_records_base_and_adapted_probes_by_step(tmp_path) -> None:
    peft = pytest.importorskip("peft")
    model = tiny("llama")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    pm.train()
    probe = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, model.config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    for step in range(3):
        assert record_probe(pm, probe, POINTS, str(tmp_path), step) is not None
        assert pm.training and all(p.requires_grad for n, p in pm.named_parameters() if "lora_" in n)
        pm(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    record = load_probes(str(tmp_path))
    assert record.steps == [0, 1, 2]
    hm = HookedModel.wrap(pm)
    pm.eval()
    with torch.no_grad():
        _, before_last = hm.run_with_cache(probe, names_filter=POINTS)  # one step after the last record
    hm.unwrap()
    for name in POINTS:
        assert record[name].shape == (3, *before_last[name].shape)
        assert torch.equal(record[name][0], record["base/" + name][0])  # LoRA's B starts at zero
        assert all(torch.equal(record["base/" + name][0], b) for b in record["base/" + name])
        assert not torch.allclose(record[name][2], record[name][1])  # the adapter learns
        assert not torch.allclose(record[name][2], before_last[name])


@needs("llama")
def test_a_model_without_adapters_records_no_base_and_refuses_base_true(tmp_path) -> None:
    model = tiny("llama")
    probe = torch.randint(0, model.config.vocab_size, (1, 4))
    record_probe(model, probe, POINTS, str(tmp_path), 7, write=True)
    assert sorted(load_probes(str(tmp_path)).values) == sorted(POINTS + ["inputs/input_ids"])
    with pytest.raises(ValueError, match="no adapters to disable"):
        record_probe(model, probe, POINTS, str(tmp_path), 8, base=True)
    assert record_probe(model, probe, POINTS, str(tmp_path), 9, write=False) is None
    assert load_probes(str(tmp_path)).steps == [7]
    with pytest.raises(ValueError, match="every must be at least 1"):
        ProbeCallback(probe, POINTS, str(tmp_path), every=0)


@needs("llama")
def test_steps_that_recorded_different_hooks_or_shapes_are_named_never_dropped(tmp_path) -> None:
    model = tiny("llama")
    probe = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    record_probe(model, probe, POINTS[:1], str(tmp_path), 0, write=True)
    record_probe(model, probe, POINTS, str(tmp_path), 5, write=True)  # a hook added at step 5
    record_probe(model, probe, POINTS, str(tmp_path), 10, write=True)
    with pytest.raises(
        ProbeMismatchError,
        match=r"step-000000000\.safetensors \(step 0\) did not record "
        r"'blocks\.1\.mlp\.hook_post', which 2 of the 3 steps recorded \(first at step 5",
    ):
        load_probes(str(tmp_path))
    record = load_probes(str(tmp_path), partial=True)
    assert record.steps == [0, 5, 10]
    assert record.steps_of(POINTS[0]) == [0, 5, 10] and record.steps_of(POINTS[1]) == [5, 10]
    assert record[POINTS[0]].shape[0] == 3 and record[POINTS[1]].shape[0] == 2
    assert torch.equal(record[POINTS[1]][0], record[POINTS[1]][1])  # the same model: the same values
    longer = torch.randint(0, model.config.vocab_size, (1, 6))
    record_probe(model, longer, POINTS, str(tmp_path), 15, write=True)  # another probe batch: other shapes
    for partial in (False, True):
        with pytest.raises(
            ProbeMismatchError,
            match=r"step-000000015\.safetensors \(step 15\) recorded "
            r"'blocks\.0\.hook_resid_post' as \(1, 6, \d+\) float32, .*step-000000000\.safetensors "
            r"\(step 0\) as \(1, 4, \d+\) float32",
        ):
            load_probes(str(tmp_path), partial=partial)
