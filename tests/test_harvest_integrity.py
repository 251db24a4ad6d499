"""Harvesting's integrity: a resume is refused when anything differs (parameters, data, the active adapter), a
damaged shard is named and harvested anew, manifests are trusted only for the harvest's own files."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.harvest import (
    HarvestContextError,
    HarvestDamagedError,
    HarvestMismatchError,
    harvest,
    load_harvest,
)
from lensadapters.integrations.harvest.checksum import BLOCK, file_checksum, tensor_checksum
from lensadapters.testing.harvesting import (
    SEVERAL,
    drop_last_batch,
    harvest_at,
    snapshot,
    wrapped,
    wrapped_with_text,
    write_text,
)
from lensadapters.testing.tiny_models import needs, tiny, tokenizer

datasets = pytest.importorskip("datasets")


def test_the_checksum_sees_every_byte_on_any_split_and_files_and_tensors_agree(tmp_path) -> None:
    values = torch.randn(3 * BLOCK + 11, generator=torch.Generator().manual_seed(0))
    whole = tensor_checksum(values)
    assert tensor_checksum(values, piece_bytes=8 * BLOCK) == whole == tensor_checksum(values, piece_bytes=80 * BLOCK)
    (tmp_path / "v.bin").write_bytes(values.numpy().tobytes())
    assert file_checksum(str(tmp_path / "v.bin")) == whole
    assert tensor_checksum(values[:-1]) != whole  # the length counts
    for index in (0, 64, BLOCK, 2 * BLOCK + 5, values.numel() - 1):  # a change anywhere
        changed = values.clone()
        changed[index] = torch.nextafter(changed[index], torch.tensor(float("inf")))
        assert tensor_checksum(changed) != whole, index
    halves = torch.randn(4096, generator=torch.Generator().manual_seed(1)).bfloat16()
    base = tensor_checksum(halves)
    for word in range(0, 1000, 4):  # sign flips of two values in the top half of two words do not cancel
        flipped = halves.clone()
        flipped[word + 3], flipped[word + 7] = -flipped[word + 3], -flipped[word + 7]
        assert tensor_checksum(flipped) != base, word


def test_a_resume_is_refused_when_any_parameter_value_differs_naming_it(tmp_path) -> None:
    args = dict(context_size=8, progress=False)
    with wrapped_with_text(tmp_path, 20) as hm:
        harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(tmp_path / "out"), **args)
        weight = hm.hf_model.model.layers[1].mlp.down_proj.weight
        original = weight[-1, -1].item()
        with torch.no_grad():
            weight[-1, -1] += 0.5  # one value far past the first 64: a ROME-style edit of one row
        with pytest.raises(HarvestMismatchError, match=r"different model .*model\.layers\.1\.mlp\.down_proj\.weight"):
            harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(tmp_path / "out"), **args)
        with torch.no_grad():
            weight[-1, -1] = original
        again = harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(tmp_path / "out"), **args)
        assert again.finished and again.resumed_from == again.contexts  # the same values: accepted


def test_a_resume_is_refused_when_any_byte_of_the_data_differs(tmp_path) -> None:
    hm = wrapped()
    data = tmp_path / "data.txt"
    line = " ".join(f"w{3 + i % 40}" for i in range(60)) + "\n"
    data.write_text(line * (3 * 2**20 // len(line)))  # 3 MiB: the middle is neither the first nor the last MiB
    args = dict(context_size=8, max_tokens=64, progress=False)
    try:
        harvest(hm, str(data), ["hook_embed"], str(tmp_path / "out"), **args)
        raw = bytearray(data.read_bytes())
        middle = len(raw) // 2
        middle += raw[middle:].index(b"w4") + 1
        raw[middle] = ord("5")  # w4 -> w5: the same size
        data.write_bytes(bytes(raw))
        with pytest.raises(HarvestMismatchError, match="different data .*checksum"):
            harvest(hm, str(data), ["hook_embed"], str(tmp_path / "out"), **args)
    finally:
        hm.unwrap()


@needs("llama")
def test_a_resume_is_refused_when_the_active_adapter_or_its_weights_differ(tmp_path) -> None:
    peft = pytest.importorskip("peft")
    model = tiny("llama")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "up_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(model, config, adapter_name="one")
    pm.add_adapter("two", config)
    pm.set_adapter("one")
    pm.eval()
    write_text(tmp_path / "data.txt", 20)
    out = str(tmp_path / "out")
    args = dict(tokenizer=tokenizer(model.config.vocab_size), context_size=8, progress=False)
    first = harvest(pm, str(tmp_path / "data.txt"), ["blocks.1.hook_resid_post"], out, **args)
    pm.set_adapter("two")
    switched = r"different adapters .*active adapters \['one'\] there, \['two'\] now"
    with pytest.raises(HarvestMismatchError, match=switched):
        harvest(pm, str(tmp_path / "data.txt"), ["blocks.1.hook_resid_post"], out, **args)
    pm.set_adapter("one")
    lora = model.model.layers[1].mlp.up_proj.lora_B["one"].weight
    original = lora[-1, -1].item()
    with torch.no_grad():
        lora[-1, -1] += 1.0
    with pytest.raises(HarvestMismatchError, match=r"layers\.1\.mlp\.up_proj\.lora_B\.one\.weight"):
        harvest(pm, str(tmp_path / "data.txt"), ["blocks.1.hook_resid_post"], out, **args)
    with torch.no_grad():
        lora[-1, -1] = original
    with pm.disable_adapter(), pytest.raises(HarvestMismatchError, match="disabled False there, True now"):
        harvest(pm, str(tmp_path / "data.txt"), ["blocks.1.hook_resid_post"], out, **args)
    again = harvest(pm, str(tmp_path / "data.txt"), ["blocks.1.hook_resid_post"], out, **args)
    assert again.resumed_from == first.contexts


def test_a_damaged_shard_is_named_when_loaded_and_harvested_anew_on_resume(tmp_path) -> None:
    out = tmp_path / "out"
    args = dict(context_size=8, batch_size=2, shard_contexts=4, progress=False)
    with wrapped_with_text(tmp_path, 60) as hm:
        done = harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(out), **args)
        good = snapshot(out)
        assert done.shards >= 3
        drop_last_batch(out / "shard-00001.arrow")  # 2 rows where the manifest lists 4
        raw = bytearray((out / "shard-00002.arrow").read_bytes())
        raw[-100] ^= 1  # one bit of one activation
        (out / "shard-00002.arrow").write_bytes(bytes(raw))
        with pytest.raises(HarvestDamagedError, match=r"shard-00001\.arrow \(2 rows where the manifest lists 4\)"):
            load_harvest(str(out))
        with pytest.raises(HarvestDamagedError, match=r"shard-00002\.arrow \(its bytes differ"):
            load_harvest(str(out))
        with pytest.warns(UserWarning, match="is damaged") as caught:
            again = harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(out), **args)
        named = [str(w.message) for w in caught]
        assert any(re.search(r"shard-00001\.arrow is damaged \(2 rows where .*harvesting it again", m) for m in named)
        assert any(re.search(r"shard-00002\.arrow is damaged \(its bytes differ", m) for m in named)
        assert again.resumed_from == done.contexts - 8 and again.contexts == done.contexts and again.finished
        assert snapshot(out) == good  # the two shards harvested anew, byte for byte
        assert len(load_harvest(str(out))) == done.contexts


@pytest.mark.parametrize("name", ["../victim/shard-00000.arrow", "/tmp/shard-00000.arrow", "shard-00001.arrow", "x"])
def test_manifests_naming_files_the_harvest_does_not_write_are_refused(tmp_path, name) -> None:
    out = tmp_path / "out"
    with wrapped_with_text(tmp_path, 20) as hm:
        harvest_at(hm, tmp_path, "data.txt", "out", ["hook_embed"], context_size=8)
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "shard-00000.arrow").write_bytes((out / "shard-00000.arrow").read_bytes())
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["shards"][0]["file"] = name
        (out / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(HarvestDamagedError, match=f"names the file {re.escape(repr(name))}, not the harvest"):
            load_harvest(str(out))
        with pytest.raises(HarvestDamagedError, match="not the harvest's own file for shard 0"):
            harvest_at(hm, tmp_path, "data.txt", "out", ["hook_embed"], context_size=8)


def test_a_truncated_manifest_is_a_named_error(tmp_path) -> None:
    out = tmp_path / "out"
    with wrapped_with_text(tmp_path, 20) as hm:
        harvest_at(hm, tmp_path, "data.txt", "out", ["hook_embed"], context_size=8)
        text = (out / "manifest.json").read_text()
        (out / "manifest.json").write_text(text[: len(text) // 2])
        before = snapshot(out)
        with pytest.raises(HarvestDamagedError, match=r"manifest\.json is not a whole manifest .*delete the folder"):
            load_harvest(str(out))
        with pytest.raises(HarvestDamagedError, match=r"manifest\.json is not a whole manifest"):
            harvest_at(hm, tmp_path, "data.txt", "out", ["hook_embed"], context_size=8)
        assert snapshot(out) == before


def test_a_rank_with_other_hooks_is_refused_before_writing_anything(tmp_path) -> None:
    out = tmp_path / "out"
    args = dict(context_size=8, shard_contexts=3, world_size=2, progress=False)
    with wrapped_with_text(tmp_path, 40) as hm:
        harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(out), rank=0, **args)
        before = {name: (out / name).read_bytes() for name in os.listdir(out) if not name.endswith(".lock")}
        with pytest.raises(HarvestMismatchError, match=r"different hooks .*blocks\.1\.hook_resid_post"):
            harvest(hm, str(tmp_path / "data.txt"), ["blocks.1.hook_resid_post"], str(out), rank=1, **args)
        after = {name: (out / name).read_bytes() for name in os.listdir(out) if not name.endswith(".lock")}
        assert after == before  # no manifest, shard or listing of rank 1
        done = harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(out), rank=1, **args)
        assert done.finished  # the right command still runs


def test_a_resumed_harvest_of_several_points_stores_the_columns_of_an_uninterrupted_one(tmp_path) -> None:
    args = dict(context_size=8, batch_size=2, shard_contexts=3, progress=False)
    with wrapped_with_text(tmp_path, 40) as hm:
        whole = harvest(hm, str(tmp_path / "data.txt"), SEVERAL, str(tmp_path / "whole"), **args)
        reference = snapshot(tmp_path / "whole")
        assert list(load_harvest(str(tmp_path / "whole")).features)[2:] == SEVERAL  # execution order
        manifest = json.loads((tmp_path / "whole" / "manifest.json").read_text())
        for name in list(reference)[1:]:  # stopped after its first shard
            os.remove(tmp_path / "whole" / name)
        manifest["shards"], manifest["finished"] = manifest["shards"][:1], False
        (tmp_path / "whole" / "manifest.json").write_text(json.dumps(manifest))
        resumed = harvest(hm, str(tmp_path / "data.txt"), SEVERAL, str(tmp_path / "whole"), **args)
        assert resumed.resumed_from == 3 and resumed.contexts == whole.contexts
        assert snapshot(tmp_path / "whole") == reference
        assert list(load_harvest(str(tmp_path / "whole")).features)[2:] == SEVERAL


@needs("gpt2")
def test_a_context_longer_than_the_models_positions_is_refused_before_writing(tmp_path) -> None:
    model = tiny("gpt2")
    hm = HookedModel.wrap(model, tokenizer=tokenizer(model.config.vocab_size))
    write_text(tmp_path / "data.txt", 300)
    n_ctx = model.config.n_positions
    try:
        with pytest.raises(HarvestContextError, match=f"context_size={n_ctx + 1} is longer than the model's {n_ctx}"):
            harvest(hm, str(tmp_path / "data.txt"), ["hook_embed"], str(tmp_path / "out"), context_size=n_ctx + 1)
    finally:
        hm.unwrap()
    assert not (tmp_path / "out").exists()
