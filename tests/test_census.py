"""The census (:mod:`lensadapters.testing.census`) on a sample of model types, and the wrap-time verification of the
generic adapter's automatic description: a served point whose value or edit is not what its name says is caught.

The sample: a plugin family, and decoders no plugin claims that the automatic description serves in full under
transformers 4.57 and 5.23 (parallel blocks with interleaved rotary, interleaved rotary with a gated MLP, per-layer
rotary with norms after the branches, branch multipliers). ``LENSADAPTERS_EVERY_MODEL_TYPE=1`` runs the census over
every causal-LM model type (several minutes).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters import HookedModel
from lensadapters.adapters.generic import GenericAdapterWarning, findings
from lensadapters.adapters.generic.verify import check_points
from lensadapters.analysis.threads import single_thread
from lensadapters.testing.census import CANONICAL, census_entry, main
from lensadapters.testing.every_model_type import build, input_ids

SAMPLE = ("llama", "cohere", "helium", "olmo3", "granite")
EVERY = os.environ.get("LENSADAPTERS_EVERY_MODEL_TYPE", "") not in ("", "0")
MODEL_TYPES = (
    sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if EVERY
    else [t for t in SAMPLE if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_census_finds_no_wrong_value_or_ignored_edit(model_type: str) -> None:
    entry = census_entry(model_type)
    assert not entry.wrong, entry.wrong
    if not EVERY:  # the sample is served in full, by its plugin or the automatic description
        assert entry.status == "FULL", (entry.missing, entry.why)


def test_census_cli_prints_the_table_and_the_summary(capsys: pytest.CaptureFixture) -> None:
    assert main(["--markdown", "llama"]) == 0
    out = capsys.readouterr().out
    assert "| llama | llama | 17/17 | FULL |" in out and "FULL 1/1 = 100.0%" in out


def test_census_cli_gives_the_callers_thread_count_back() -> None:
    """The census runs its tiny models on one thread, then restores the caller's count: it left one thread to
    everything after it in the test session (CI's whole suite ran the plugins' tests on one of its two cores, where
    float32 rounding differs, and Gemma 4's exactness test failed only there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["--markdown", "llama"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_single_thread_gives_the_count_back_when_the_block_raises() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(KeyError), single_thread():
            assert torch.get_num_threads() == 1
            raise KeyError("stop")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def _described(model_type: str = "helium") -> tuple[torch.nn.Module, HookedModel]:
    model = build(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        return model, HookedModel.wrap(model, adapter="generic")


def test_the_verification_catches_swapped_queries_and_keys_and_a_wrong_mlp() -> None:
    """Regression guard of the verifier itself: a description that reads the key projection as the queries, or the
    up projection as the gate, fails on exactly those points (and the points it does not touch still pass)."""
    model, hm = _described()
    wiring = hm.wiring
    qkv, mlp = wiring.qkv_layouts[0], wiring.mlp_layouts[0]
    names = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_rot_q", "blocks.0.mlp.hook_pre", "blocks.0.hook_resid_pre"]
    assert all(why is None for why in check_points(wiring, input_ids(), names).values())
    wiring.qkv_layouts[0] = dataclasses.replace(qkv, q=qkv.k, k=qkv.q)
    wiring.mlp_layouts[0] = dataclasses.replace(mlp, pre=mlp.pre_linear, pre_linear=mlp.pre)
    try:
        problems = check_points(wiring, input_ids(), ["blocks.0.attn.hook_q", "blocks.0.mlp.hook_pre"])
    finally:
        wiring.qkv_layouts[0], wiring.mlp_layouts[0] = qkv, mlp
    assert problems["blocks.0.attn.hook_q"] is not None and problems["blocks.0.mlp.hook_pre"] is not None, problems
    hm.unwrap()


def test_batched_verification_gives_every_point_the_verdict_it_gets_alone(monkeypatch) -> None:
    """Points are checked many at a time, each edited in its own batch row: on a description that reads the keys as
    the queries and the up projection as the gate, every point of the layer gets the verdict a check of it alone
    gives (the wrong ones fail, the others pass), and a batched pass that raises is redone point by point."""
    from lensadapters.adapters.generic import verify

    model, hm = _described("olmo3")
    wiring = hm.wiring
    names = [n for n in hm.hook_names if not n.startswith("blocks.") or n.startswith(("blocks.0.", "blocks.1."))]
    qkv, mlp = wiring.qkv_layouts[0], wiring.mlp_layouts[0]
    wiring.qkv_layouts[0] = dataclasses.replace(qkv, q=qkv.k, k=qkv.q)
    wiring.mlp_layouts[0] = dataclasses.replace(mlp, pre=mlp.pre_linear, pre_linear=mlp.pre)
    passes: list[int] = []
    original = verify._check_batch

    def counted(hooked: object, ids: torch.Tensor, owner: object, points: list, *rest: object) -> dict:
        verdicts = original(hooked, ids, owner, points, *rest)
        passes.append(len(points))
        return verdicts

    try:
        alone = check_points(wiring, input_ids(), names, points_per_pass=1)
        monkeypatch.setattr(verify, "_check_batch", counted)
        batched = check_points(wiring, input_ids(), names)
        assert passes and max(passes) > 1 and len(passes) < len(names) // 2, passes  # batched, without a fallback

        def broken(*args: object) -> None:
            raise RuntimeError("a pass that fails")

        monkeypatch.setattr(verify, "_check_batch", broken)
        redone = check_points(wiring, input_ids(), names)
    finally:
        wiring.qkv_layouts[0], wiring.mlp_layouts[0] = qkv, mlp
    assert batched == alone == redone
    assert alone["blocks.0.attn.hook_q"] is not None and alone["blocks.0.mlp.hook_pre"] is not None
    assert alone["blocks.1.attn.hook_q"] is None and alone["blocks.0.hook_resid_mid"] is None
    assert sum(why is None for why in alone.values()) > len(names) // 2
    hm.unwrap()


def test_a_point_that_fails_verification_is_not_served_and_the_warning_says_why(monkeypatch) -> None:
    """Regression: with the verification reporting hook_v of every layer wrong, the wrap serves no hook_v, keeps the
    rest, and the warning names the points and the reason."""
    from lensadapters.adapters.generic import verify

    original = verify.check_points

    def failing(hooked, ids, names, *args):
        results = original(hooked, ids, names, *args)
        return {name: "a deliberate failure" if name.endswith("attn.hook_v") else why for name, why in results.items()}

    monkeypatch.setattr(verify, "check_points", failing)
    model = build("helium")
    with pytest.warns(GenericAdapterWarning) as warned:
        hm = HookedModel.wrap(model)
    message = " ".join(str(w.message) for w in warned)
    assert not any(n.endswith("attn.hook_v") for n in hm.hook_names)
    assert "blocks.0.attn.hook_q" in hm.hook_names and "blocks.0.mlp.hook_post" in hm.hook_names
    assert "hook_v" in message and "a deliberate failure" in message, message
    assert findings(model).unverified["blocks.0.attn.hook_v"] == "a deliberate failure"
    with torch.no_grad():  # the remaining points work and cost nothing unhooked
        plain = model(input_ids()).logits
        assert torch.equal(hm(input_ids()).logits, plain)
        _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n in CANONICAL)
    assert set(cache.keys()) == {n for n in CANONICAL if n in hm.hook_names}
    hm.unwrap()
