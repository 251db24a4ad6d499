"""Harvesting: SAELens-style packing (no token lost, restartable at every context), the dataset written to disk
(its rows are the model's own activations on its own token ids), layers past the last requested point never
run, refusals, and the kill -9 and restart test of the command line."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensadapters import HookedModel, UnknownHookError
from lensadapters.harvest import (
    Cursor,
    DataSourceError,
    HarvestContextError,
    HarvestDamagedError,
    HarvestHookError,
    HarvestMismatchError,
    PackingRule,
    Partition,
    harvest,
    load_harvest,
    open_source,
    pack,
)
from lensadapters.integrations.harvest.checksum import BLOCK, file_checksum, tensor_checksum
from lensadapters.integrations.harvest.runner import KILL_ENV
from lensadapters.testing.tiny_models import ARCH_NAMES, needs, tiny, tokenizer

datasets = pytest.importorskip("datasets")

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
BOS, EOS = 1, 2
VOCAB = 48
ARCH = "llama" if "llama" in ARCH_NAMES else ARCH_NAMES[0]


def write_text(path, n_rows: int, seed: int = 0, vocab: int = VOCAB) -> list[str]:
    rng = random.Random(seed)
    rows = [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randrange(0, 30))) for _ in range(n_rows)]
    path.write_text("".join(row + "\n" for row in rows))
    return rows


def wrapped(arch: str = ARCH, seed: int = 0) -> HookedModel:
    model = tiny(arch, seed)
    return HookedModel.wrap(model, tokenizer=tokenizer(model.config.vocab_size))


# --- packing ----------------------------------------------------------------------------------------------------


@st.composite
def packings(draw: st.DrawFn):
    rows = draw(st.lists(st.lists(st.integers(3, 20), max_size=25), max_size=12))
    rule = PackingRule(
        draw(st.integers(2, 9)), draw(st.sampled_from([BOS, None])), draw(st.sampled_from([BOS, EOS, None]))
    )
    return rows, rule


def packed(rows: list[list[int]], rule: PackingRule, start: Cursor = Cursor()) -> list[tuple[list[int], Cursor]]:
    texts = [" ".join(map(str, row)) for row in rows]
    tokenize = lambda text: [int(t) for t in text.split()]  # noqa: E731
    return [(c.tolist(), cursor) for c, cursor in pack(texts[start.row :], tokenize, rule, start)]


@SETTINGS
@given(case=packings())
def test_packing_loses_no_token_and_restarts_at_every_cursor(case) -> None:
    rows, rule = case
    contexts = packed(rows, rule)
    stream = [t for row in rows for t in row]
    inserted = {rule.begin_context_token, rule.separator_token} - {None}
    kept = [t for context, _ in contexts for t in context if t not in inserted]
    assert all(len(context) == rule.context_size for context, _ in contexts)
    assert kept == stream[: len(kept)]  # every token, in order, none twice
    assert len(stream) - len(kept) < rule.context_size  # only the last, incomplete context is dropped
    if rule.begin_context_token is not None:
        assert all(context[0] == rule.begin_context_token for context, _ in contexts)
    for i, (_, cursor) in enumerate(contexts):  # restarting after any context packs exactly what followed it
        assert packed(rows, rule, cursor) == contexts[i + 1 :]


def test_packing_puts_the_separator_between_rows() -> None:
    rule = PackingRule(6, BOS, EOS)
    contexts = [c for c, _ in packed([[5, 6], [7, 8, 9, 10, 11], [12]], rule)]
    assert contexts == [[BOS, 5, 6, EOS, 7, 8], [BOS, 9, 10, 11, EOS, 12]]


def test_sources_read_the_same_rows_from_text_jsonl_and_a_saved_dataset(tmp_path) -> None:
    rows = write_text(tmp_path / "rows.txt", 20)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": r, "n": i}) + "\n" for i, r in enumerate(rows)))
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows})}).save_to_disk(str(tmp_path / "dd"))
    for name in ("rows.txt", "rows.jsonl", "ds", "dd"):
        source = open_source(str(tmp_path / name))
        assert list(source.rows()) == rows, name
        assert list(source.rows(7)) == rows[7:], name
    with pytest.raises(DataSourceError, match="'body'"):
        list(open_source(str(tmp_path / "rows.jsonl"), text_column="body").rows())
    with pytest.raises(DataSourceError, match="no such data file"):
        open_source(str(tmp_path / "missing.txt"))


def test_a_pretokenized_dataset_gives_one_context_per_row(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 60)
    try:
        harvest(
            hm,
            str(tmp_path / "data.txt"),
            ["blocks.0.hook_resid_post"],
            str(tmp_path / "text"),
            context_size=8,
            progress=False,
        )
        text = load_harvest(str(tmp_path / "text")).with_format("torch")[:]
        rows = text["token_ids"].tolist()
        datasets.Dataset.from_dict({"input_ids": [row + [5, 6] for row in rows]}).save_to_disk(str(tmp_path / "tok"))
        harvest(
            hm,
            str(tmp_path / "tok"),
            ["blocks.0.hook_resid_post"],
            str(tmp_path / "out"),
            context_size=8,
            shard_contexts=4,
            progress=False,
        )
        out = load_harvest(str(tmp_path / "out")).with_format("torch")[:]
        assert out["token_ids"].tolist() == rows  # each row's first 8 tokens, as they are
        assert torch.equal(out["blocks.0.hook_resid_post"], text["blocks.0.hook_resid_post"])
        datasets.Dataset.from_dict({"input_ids": [[1, 5, 6]]}).save_to_disk(str(tmp_path / "short"))
        with pytest.raises(DataSourceError, match="fewer than context_size=8"):
            harvest(hm, str(tmp_path / "short"), ["hook_embed"], str(tmp_path / "x"), context_size=8, progress=False)
    finally:
        hm.unwrap()


def test_partition_gives_every_shard_to_exactly_one_rank() -> None:
    for world in (1, 2, 3, 5):
        ranks = [Partition(r, world) for r in range(world)]
        for shard in range(20):
            assert sum(p.owns_shard(shard) for p in ranks) == 1
        for p in ranks:
            assert all(p.owns_shard(p.next_shard(after)) and p.next_shard(after) > after for after in range(-1, 9))


# --- the harvest on disk -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rows_are_the_models_activations_on_their_token_ids(tmp_path, dtype) -> None:
    hm = wrapped()
    rows = write_text(tmp_path / "data.txt", 60)
    hooks = ["blocks.0.attn.hook_z", "blocks.0.hook_resid_post", "hook_embed"]
    try:
        result = harvest(
            hm,
            str(tmp_path / "data.txt"),
            hooks,
            str(tmp_path / "out"),
            context_size=8,
            batch_size=3,
            shard_contexts=5,
            dtype=dtype,
            progress=False,
        )
        ds = datasets.load_from_disk(str(tmp_path / "out")).with_format("torch")
        table = ds[:]
        assert len(ds) == result.contexts > 10 and result.finished and result.shards == -(-len(ds) // 5)
        expected = [
            c for c, _ in pack(rows, lambda t: hm.to_tokens(t, prepend_bos=False)[0].tolist(), PackingRule(8, BOS, BOS))
        ]
        assert table["token_ids"].tolist() == [c.tolist() for c in expected]
        assert torch.equal(table["is_bos"], table["token_ids"] == BOS)
        for start in range(0, len(ds), 5):  # each shard ran in batches of 3
            for first in range(start, min(start + 5, len(ds)), 3):
                last = min(first + 3, start + 5, len(ds))
                tokens = table["token_ids"][first:last].long()
                _, cache = hm.run_with_cache(tokens, names_filter=hooks)
                for name in hooks:
                    want = cache[name].to(getattr(torch, dtype))
                    assert torch.equal(table[name][first:last].to(want.dtype), want), (name, first)
        assert ds.features["blocks.0.attn.hook_z"].shape == (8, hm.cfg.n_heads, hm.cfg.d_head)
        assert ds.features["blocks.0.hook_resid_post"].dtype == ("float16" if dtype == "float16" else "float32")
    finally:
        hm.unwrap()


def test_drop_bos_leaves_out_position_zero_flags_the_separators_and_flatten_joins_heads(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 40)
    points = ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_z"]
    try:
        harvest(hm, str(tmp_path / "data.txt"), points, str(tmp_path / "all"), context_size=8, progress=False)
        harvest(
            hm,
            str(tmp_path / "data.txt"),
            points,
            str(tmp_path / "cut"),
            context_size=8,
            drop_bos=True,
            flatten=True,
            progress=False,
        )
    finally:
        hm.unwrap()
    cut_ds = load_harvest(str(tmp_path / "cut"))
    assert cut_ds.features["blocks.0.hook_resid_pre"].shape == (7, hm.cfg.d_model)
    assert cut_ds.features["blocks.0.attn.hook_z"].shape == (7, hm.cfg.n_heads * hm.cfg.d_head)
    full = load_harvest(str(tmp_path / "all")).with_format("torch")[:]
    cut = cut_ds.with_format("torch")[:]
    assert torch.equal(cut["token_ids"], full["token_ids"][:, 1:])
    assert torch.equal(cut["blocks.0.hook_resid_pre"], full["blocks.0.hook_resid_pre"][:, 1:])
    assert torch.equal(cut["blocks.0.attn.hook_z"], full["blocks.0.attn.hook_z"][:, 1:].flatten(2))
    assert bool(full["is_bos"][:, 0].all()) and bool(cut["is_bos"].any())  # separators stay, flagged


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_blocks_after_the_last_requested_point_never_run(tmp_path, arch) -> None:
    hm = wrapped(arch)
    write_text(tmp_path / "data.txt", 10, vocab=min(VOCAB, hm.cfg.d_vocab))
    n = hm.cfg.n_layers
    calls = [0] * n
    handles = [
        block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, block in enumerate(hm.block_modules)
    ]
    try:
        for layer in range(n):
            calls[:] = [0] * n
            out = tmp_path / f"out{layer}"
            harvest(
                hm,
                str(tmp_path / "data.txt"),
                [f"blocks.{layer}.hook_mlp_out"],
                str(out),
                context_size=8,
                batch_size=4,
                progress=False,
            )
            assert all(calls[i] > 0 for i in range(layer + 1)) and calls[layer + 1 :] == [0] * (n - layer - 1)
        calls[:] = [0] * n
        harvest(hm, str(tmp_path / "data.txt"), ["hook_embed"], str(tmp_path / "embed"), context_size=8, progress=False)
        assert calls == [0] * n
    finally:
        for handle in handles:
            handle.remove()
        hm.unwrap()


def test_a_different_command_on_an_existing_harvest_is_refused_by_name(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 30)
    write_text(tmp_path / "other.txt", 30, seed=1)
    out = str(tmp_path / "out")
    args = dict(context_size=8, progress=False)
    try:
        first = harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], out, **args)
        again = harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], out, **args)
        assert again.contexts == first.contexts and again.resumed_from == first.contexts
        with pytest.raises(HarvestMismatchError, match="different hooks"):
            harvest(hm, str(tmp_path / "data.txt"), ["blocks.1.hook_resid_post"], out, **args)
        with pytest.raises(HarvestMismatchError, match="different data"):
            harvest(hm, str(tmp_path / "other.txt"), ["blocks.0.hook_resid_post"], out, **args)
        with pytest.raises(HarvestMismatchError, match="different dtype"):
            harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], out, dtype="float16", **args)
    finally:
        hm.unwrap()
    other = wrapped(seed=1)
    try:
        with pytest.raises(HarvestMismatchError, match="different model"):
            harvest(other, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], out, **args)
    finally:
        other.unwrap()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(HarvestMismatchError, match="not empty"):
        harvest(
            hm.model,
            str(tmp_path / "data.txt"),
            ["blocks.0.hook_resid_post"],
            str(tmp_path / "busy"),
            tokenizer=hm.tokenizer,
            **args,
        )


def test_a_second_process_on_the_same_output_is_refused_while_the_first_runs(tmp_path) -> None:
    fcntl = pytest.importorskip("fcntl")
    hm = wrapped()
    write_text(tmp_path / "data.txt", 20)
    (tmp_path / "out").mkdir()
    try:
        with open(tmp_path / "out" / ".harvest.lock", "a") as held:  # what a running harvest holds
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(HarvestMismatchError, match="another process is harvesting"):
                harvest(hm, str(tmp_path / "data.txt"), ["hook_embed"], str(tmp_path / "out"), progress=False)
        result = harvest(
            hm, str(tmp_path / "data.txt"), ["hook_embed"], str(tmp_path / "out"), context_size=8, progress=False
        )  # released (as it is when the holder dies): the harvest runs
        assert result.finished and result.contexts > 0
    finally:
        hm.unwrap()


def test_points_that_are_not_per_token_or_unknown_are_refused(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 5)
    try:
        with pytest.raises(HarvestHookError, match="per-token"):
            harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.attn.hook_pattern"], str(tmp_path / "a"))
        with pytest.raises(UnknownHookError, match="blocks.0.hook_resid_post"):
            harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_postt"], str(tmp_path / "b"))
    finally:
        hm.unwrap()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- integrity: resumes refused when anything differs, shards verified, manifests trusted only for own files --------

#: points whose execution order is not their alphabetical order
SEVERAL = ["hook_embed", "blocks.0.attn.hook_z", "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]


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
    hm = wrapped()
    write_text(tmp_path / "data.txt", 20)
    args = dict(context_size=8, progress=False)
    try:
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
    finally:
        hm.unwrap()


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


def drop_last_batch(path) -> None:
    """Rewrite an Arrow stream file without its last record batch (what a lost write leaves)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        schema, batches = reader.schema, list(reader)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches[:-1]:
            writer.write_batch(batch)


def snapshot(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name.endswith(".arrow")}


def test_a_damaged_shard_is_named_when_loaded_and_harvested_anew_on_resume(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 60)
    out = tmp_path / "out"
    args = dict(context_size=8, batch_size=2, shard_contexts=4, progress=False)
    try:
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
    finally:
        hm.unwrap()


@pytest.mark.parametrize("name", ["../victim/shard-00000.arrow", "/tmp/shard-00000.arrow", "shard-00001.arrow", "x"])
def test_manifests_naming_files_the_harvest_does_not_write_are_refused(tmp_path, name) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 20)
    out = tmp_path / "out"
    try:
        harvest(hm, str(tmp_path / "data.txt"), ["hook_embed"], str(out), context_size=8, progress=False)
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "shard-00000.arrow").write_bytes((out / "shard-00000.arrow").read_bytes())
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["shards"][0]["file"] = name
        (out / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(HarvestDamagedError, match=f"names the file {re.escape(repr(name))}, not the harvest"):
            load_harvest(str(out))
        with pytest.raises(HarvestDamagedError, match="not the harvest's own file for shard 0"):
            harvest(hm, str(tmp_path / "data.txt"), ["hook_embed"], str(out), context_size=8, progress=False)
    finally:
        hm.unwrap()


def test_a_truncated_manifest_is_a_named_error(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 20)
    out = tmp_path / "out"
    try:
        harvest(hm, str(tmp_path / "data.txt"), ["hook_embed"], str(out), context_size=8, progress=False)
        text = (out / "manifest.json").read_text()
        (out / "manifest.json").write_text(text[: len(text) // 2])
        before = snapshot(out)
        with pytest.raises(HarvestDamagedError, match=r"manifest\.json is not a whole manifest .*delete the folder"):
            load_harvest(str(out))
        with pytest.raises(HarvestDamagedError, match=r"manifest\.json is not a whole manifest"):
            harvest(hm, str(tmp_path / "data.txt"), ["hook_embed"], str(out), context_size=8, progress=False)
        assert snapshot(out) == before
    finally:
        hm.unwrap()


def test_a_rank_with_other_hooks_is_refused_before_writing_anything(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 40)
    out = tmp_path / "out"
    args = dict(context_size=8, shard_contexts=3, world_size=2, progress=False)
    try:
        harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(out), rank=0, **args)
        before = {name: (out / name).read_bytes() for name in os.listdir(out) if not name.endswith(".lock")}
        with pytest.raises(HarvestMismatchError, match=r"different hooks .*blocks\.1\.hook_resid_post"):
            harvest(hm, str(tmp_path / "data.txt"), ["blocks.1.hook_resid_post"], str(out), rank=1, **args)
        after = {name: (out / name).read_bytes() for name in os.listdir(out) if not name.endswith(".lock")}
        assert after == before  # no manifest, shard or listing of rank 1
        done = harvest(hm, str(tmp_path / "data.txt"), ["blocks.0.hook_resid_post"], str(out), rank=1, **args)
        assert done.finished  # the right command still runs
    finally:
        hm.unwrap()


def test_a_resumed_harvest_of_several_points_stores_the_columns_of_an_uninterrupted_one(tmp_path) -> None:
    hm = wrapped()
    write_text(tmp_path / "data.txt", 40)
    args = dict(context_size=8, batch_size=2, shard_contexts=3, progress=False)
    try:
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
    finally:
        hm.unwrap()


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


# --- kill -9 and restart (the command line, in subprocesses) ------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harvest-checkpoint")
    model = tiny(ARCH)
    model.save_pretrained(str(folder / "model"))
    tokenizer(model.config.vocab_size).save_pretrained(str(folder / "model"))
    write_text(folder / "data.txt", 150, vocab=VOCAB)
    return folder


def run_cli(checkpoint, out, kill: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0"}
    env.pop(KILL_ENV, None)
    if kill:
        env[KILL_ENV] = kill
    return subprocess.run(run_cli_command(checkpoint, out), env=env, capture_output=True, text=True, timeout=300)


def run_cli_command(checkpoint, out) -> list[str]:
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


@pytest.fixture(scope="module")
def uninterrupted(checkpoint):
    done = run_cli(checkpoint, checkpoint / "reference")
    assert done.returncode == 0, done.stderr
    assert "tok/s" in done.stderr  # the progress bar shows the rate
    return checkpoint / "reference"


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


@SETTINGS
@given(case=packings())
def test_packing_is_saelens_packing(case) -> None:
    batching = pytest.importorskip("sae_lens.tokenization_and_batching")
    rows, rule = case
    theirs = batching.concat_and_batch_sequences(
        iter(torch.tensor(row, dtype=torch.long) for row in rows),
        context_size=rule.context_size,
        begin_batch_token_id=rule.begin_context_token,
        sequence_separator_token_id=rule.separator_token,
    )
    assert [c for c, _ in packed(rows, rule)] == [c.tolist() for c in theirs]


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


def torchrun_cli(checkpoint, out, kill: str | None = None):
    from lensadapters.testing.distributed import torchrun

    command = run_cli_command(checkpoint, out)
    return torchrun(["-m", "lensadapters", *command[command.index("harvest") :]], env={KILL_ENV: kill} if kill else {})


def assert_same_harvest(out, reference) -> None:
    files = sorted(f for f in os.listdir(reference) if f.endswith(".arrow"))
    assert sorted(f for f in os.listdir(out) if f.endswith(".arrow") or f.endswith(".tmp")) == files
    for name in files:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    listing = json.loads((out / "state.json").read_text())["_data_files"]
    assert listing == json.loads((reference / "state.json").read_text())["_data_files"]
    a = load_harvest(str(out)).with_format("torch")[:]
    b = datasets.load_from_disk(str(reference)).with_format("torch")[:]
    assert a.keys() == b.keys() and all(torch.equal(a[c], b[c]) for c in b)


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
        result = harvest(
            hm,
            str(tmp_path / "data.txt"),
            ["blocks.0.hook_resid_post"],
            str(tmp_path / "out"),
            context_size=8,
            batch_size=2,
            shard_contexts=3,
            progress=False,
        )
    finally:
        hm.unwrap()
    manifest = json.loads((tmp_path / "out" / "manifest-rank00001-of-00002.json").read_text())
    assert result.finished and not result.all_finished  # rank 0 has not run
    assert [s["index"] for s in manifest["shards"]] == list(range(1, 2 * result.shards, 2))
    rows = load_harvest(str(tmp_path / "out"))  # the complete shards so far: rank 1's
    assert len(rows) == result.contexts
