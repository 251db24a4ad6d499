"""Harvesting: SAELens-style packing (no token lost, restartable at every context), the dataset written to disk
(its rows are the model's own activations on its own token ids), layers past the last requested point never
run, refusals. Resumes and integrity: ``test_harvest_integrity.py``; the kill -9 and restart test of the command
line and several processes: ``test_harvest_restart.py``."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given

from lensadapters import UnknownHookError
from lensadapters.harvest import (
    DataSourceError,
    HarvestHookError,
    HarvestMismatchError,
    PackingRule,
    Partition,
    harvest,
    load_harvest,
    open_source,
    pack,
)
from lensadapters.testing.harvesting import (
    BOS,
    EOS,
    SETTINGS,
    VOCAB,
    harvest_at,
    packed,
    packings,
    wrapped,
    write_text,
)
from lensadapters.testing.tiny_models import ARCH_NAMES

datasets = pytest.importorskip("datasets")


# --- packing ----------------------------------------------------------------------------------------------------


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
        harvest_at(hm, tmp_path, "data.txt", "text", context_size=8)
        text = load_harvest(str(tmp_path / "text")).with_format("torch")[:]
        rows = text["token_ids"].tolist()
        datasets.Dataset.from_dict({"input_ids": [row + [5, 6] for row in rows]}).save_to_disk(str(tmp_path / "tok"))
        harvest_at(hm, tmp_path, "tok", "out", context_size=8, shard_contexts=4)
        out = load_harvest(str(tmp_path / "out")).with_format("torch")[:]
        assert out["token_ids"].tolist() == rows  # each row's first 8 tokens, as they are
        assert torch.equal(out["blocks.0.hook_resid_post"], text["blocks.0.hook_resid_post"])
        datasets.Dataset.from_dict({"input_ids": [[1, 5, 6]]}).save_to_disk(str(tmp_path / "short"))
        with pytest.raises(DataSourceError, match="fewer than context_size=8"):
            harvest_at(hm, tmp_path, "short", "x", ["hook_embed"], context_size=8)
    finally:
        hm.unwrap()


def test_partition_gives_every_shard_to_exactly_one_rank() -> None:
    for world in (1, 2, 3, 5):
        ranks = [Partition(r, world) for r in range(world)]
        for shard in range(20):
            assert sum(p.owns_shard(shard) for p in ranks) == 1
        for p in ranks:
            assert all(p.owns_shard(p.next_shard(after)) and p.next_shard(after) > after for after in range(-1, 9))


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


# --- the harvest on disk -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rows_are_the_models_activations_on_their_token_ids(tmp_path, dtype) -> None:
    hm = wrapped()
    rows = write_text(tmp_path / "data.txt", 60)
    hooks = ["blocks.0.attn.hook_z", "blocks.0.hook_resid_post", "hook_embed"]
    try:
        result = harvest_at(
            hm, tmp_path, "data.txt", "out", hooks, context_size=8, batch_size=3, shard_contexts=5, dtype=dtype
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
        harvest_at(hm, tmp_path, "data.txt", "all", points, context_size=8)
        harvest_at(hm, tmp_path, "data.txt", "cut", points, context_size=8, drop_bos=True, flatten=True)
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
        harvest_at(hm, tmp_path, "data.txt", "embed", ["hook_embed"], context_size=8)
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
                harvest_at(hm, tmp_path, "data.txt", "out", ["hook_embed"])
        result = harvest_at(
            hm, tmp_path, "data.txt", "out", ["hook_embed"], context_size=8
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
