"""SAELens itself, where it is installed (the transformers-4.57 environment): its SAEs spliced into a HookedModel
give the same numbers as its HookedSAETransformer, and its training runner and evals run on a HookedModel (from
text, and from a harvest as cached activations)."""

from __future__ import annotations

import os

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.testing.saes import (
    ARCH,
    build,
    ids,
    make_sae,
    needs_saelens,
    random_texts,
    runner_config,
    sae_lens,
)
from lensadapters.testing.tiny_models import tiny


@needs_saelens
@pytest.mark.parametrize("use_error_term", [False, True])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_spliced_saes_match_hooked_sae_transformer(arch, use_error_term, tmp_path) -> None:

    from lensadapters.testing.tiny_models import CLIENT_LLAMA, from_config, gqa_llama, installed
    from lensadapters.testing.tl_reference import ReferenceUnavailable, hooked_transformer, word_tokenizer

    if not installed(arch):
        pytest.skip(f"no plugin for {arch}")
    if arch == "llama":  # grouped-query attention, plain RoPE (what TransformerLens 2.x rotates with)
        model = from_config(gqa_llama(**CLIENT_LLAMA))
    else:
        model = tiny(arch)
    tok = word_tokenizer(model.config.vocab_size)
    try:
        reference = hooked_transformer(model, tokenizer=tok)
    except ReferenceUnavailable as exc:
        pytest.skip(str(exc))
    hst = sae_lens.HookedSAETransformer(reference.cfg, tokenizer=tok, move_to_device=False)
    hst.load_state_dict(reference.state_dict())
    hst.eval()
    hm = HookedModel.wrap(model, tokenizer=tok)
    d_z = hm.cfg.n_heads * hm.cfg.d_head
    saes = [
        make_sae("saelens", "blocks.0.hook_resid_post", hm.cfg.d_model, 0),
        make_sae("saelens", "blocks.1.attn.hook_z", d_z, 1, reshape_activations="hook_z"),
    ]
    tokens = ids()
    try:
        ours = hm.run_with_saes(tokens, saes=saes, use_error_term=use_error_term)
        theirs = hst.run_with_saes(tokens, saes=saes, use_error_term=use_error_term)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        _, cache = hm.run_with_cache_with_saes(tokens, saes=saes, use_error_term=use_error_term)
        _, ref = hst.run_with_cache_with_saes(tokens, saes=saes, use_error_term=use_error_term)
        sae_keys = sorted(k for k in ref.keys() if ".hook_sae_" in k)
        assert sae_keys == sorted(k for k in cache if ".hook_sae_" in k)
        for key in sae_keys:
            torch.testing.assert_close(cache[key], ref[key], atol=1e-4, rtol=1e-4)
        saes[0].save_model(str(tmp_path / "sae"))  # SAELens' saved weights and config load by path
        assert torch.equal(
            hm.run_with_saes(tokens, saes=[str(tmp_path / "sae")]), hm.run_with_saes(tokens, saes=saes[:1])
        )
        torch.testing.assert_close(
            hm.run_with_saes("w3 w4 w5", saes=saes[:1], exclude_special_tokens=True),
            hst.run_with_saes("w3 w4 w5", saes=saes[:1], exclude_special_tokens=True),
            atol=1e-4,
            rtol=1e-4,
        )
    finally:
        hm.unwrap()


@needs_saelens
def test_saelens_trains_and_evaluates_an_sae_on_a_hooked_model(monkeypatch) -> None:
    import datasets
    from sae_lens.evals import EvalConfig, run_evals
    from sae_lens.training.activation_scaler import ActivationScaler

    monkeypatch.setenv("WANDB_MODE", "disabled")
    hm = build(ARCH)
    stops = []
    run_with_cache = hm.run_with_cache

    def recording(*args, **kwargs):
        stops.append(kwargs.get("stop_at_layer"))
        return run_with_cache(*args, **kwargs)

    monkeypatch.setattr(hm, "run_with_cache", recording)
    try:
        runner = sae_lens.LanguageModelSAETrainingRunner(
            runner_config(hm), override_dataset=datasets.Dataset.from_dict({"text": random_texts()}), override_model=hm
        )
        before = {k: v.clone() for k, v in runner.sae.state_dict().items()}
        sae = runner.run()
        assert all(not torch.equal(v, before[k]) for k, v in sae.state_dict().items())  # every parameter trained
        assert stops and set(stops) == {1}  # activations from block 0 only
        metrics, _ = run_evals(
            sae,
            runner.activations_store,
            hm,
            ActivationScaler(),
            EvalConfig(
                batch_size_prompts=4,
                n_eval_reconstruction_batches=2,
                compute_kl=True,
                compute_ce_loss=True,
                n_eval_sparsity_variance_batches=2,
                compute_variance_metrics=True,
                compute_sparsity_metrics=True,
            ),
        )
        ce = metrics["model_performance_preservation"]
        assert all(torch.isfinite(torch.tensor(float(v))) for v in ce.values())
        assert ce["ce_loss_with_sae"] != ce["ce_loss_without_sae"] != ce["ce_loss_with_ablation"]
        assert 0 < metrics["sparsity"]["l0"] <= 32
    finally:
        hm.unwrap()


@needs_saelens
def test_saelens_trains_from_a_harvest_as_cached_activations(tmp_path, monkeypatch) -> None:
    import datasets

    from lensadapters.testing.harvesting import harvest_at

    monkeypatch.setenv("WANDB_MODE", "disabled")
    hm = build(ARCH)
    (tmp_path / "data.txt").write_text("\n".join(random_texts()) + "\n")
    try:
        harvest_at(hm, tmp_path, "data.txt", "acts", context_size=12, batch_size=4)
        n_rows = len(datasets.load_from_disk(str(tmp_path / "acts")))
        cfg = runner_config(
            hm,
            use_cached_activations=True,
            cached_activations_path=str(tmp_path / "acts"),
            training_tokens=12 * n_rows // 2,
        )
        runner = sae_lens.LanguageModelSAETrainingRunner(
            cfg, override_dataset=datasets.Dataset.from_dict({"text": random_texts()}), override_model=hm
        )
        before = {k: v.clone() for k, v in runner.sae.state_dict().items()}
        cached = runner.activations_store.cached_activation_dataset
        assert cached is not None and len(cached) == n_rows
        sae = runner.run()
        assert all(not torch.equal(v, before[k]) for k, v in sae.state_dict().items())
    finally:
        hm.unwrap()
    assert os.path.exists(tmp_path / "acts" / "manifest.json")


@needs_saelens
def test_a_harvest_holds_what_saelens_activation_store_computes(tmp_path) -> None:
    import datasets

    from lensadapters.testing.harvesting import harvest_at
    from lensadapters.testing.sae_clients import small_activations_store

    hm = build(ARCH)
    texts = random_texts()
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "texts"))
    name = "blocks.1.hook_resid_pre"
    try:
        harvest_at(hm, tmp_path, "texts", "acts", [name], context_size=12, batch_size=4)
        store = small_activations_store(hm, datasets.load_from_disk(str(tmp_path / "texts")), name, hm.cfg.d_model)
        ours = datasets.load_from_disk(str(tmp_path / "acts")).with_format("torch")[:]
        for first in range(0, len(ours["token_ids"]) - 3, 4):
            tokens = store.get_batch_tokens(4)
            assert torch.equal(tokens, ours["token_ids"][first : first + 4].long())
            assert torch.equal(store.get_activations(tokens), ours[name][first : first + 4])
    finally:
        hm.unwrap()
