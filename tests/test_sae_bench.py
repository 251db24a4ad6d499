"""sae-bench 0.6 on a HookedModel (through ``as_hooked_transformer``) equals sae-bench on TransformerLens 2.x with the
same weights: its ``activation_collection`` functions (type-checked ``model: HookedTransformer``) and its core
eval. Needs sae-bench in an environment with TransformerLens 2.x (README, "Tools that run on lensadapters";
scripts/setup-tl-clients.sh)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from lensadapters import HookedModel

pytest.importorskip("sae_bench")
pytest.importorskip("transformer_lens")


def _models() -> tuple[Any, Any]:
    from lensadapters.integrations.transformer_lens import as_hooked_transformer
    from lensadapters.testing.tiny_models import CLIENT_LLAMA, from_config, gqa_llama
    from lensadapters.testing.tl_reference import hooked_transformer, word_tokenizer

    model = from_config(gqa_llama(**CLIENT_LLAMA))
    tok = word_tokenizer(model.config.vocab_size)
    reference = hooked_transformer(model, tokenizer=tok)
    return as_hooked_transformer(HookedModel.wrap(model, tokenizer=tok)), reference


def _sae(hook: str) -> Any:
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    sae = sae_lens.StandardSAE(
        sae_lens.StandardSAEConfig(d_in=32, d_sae=24, metadata=SAEMetadata(hook_name=hook, hook_layer=1))
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return sae


def _bench_sae(hook: str) -> Any:
    """sae-bench's own ReLU SAE (its core eval reads ``sae.cfg.hook_name``, which sae-lens 6's SAEs keep in
    ``cfg.metadata``), with seeded weights."""
    from sae_bench.custom_saes.relu_sae import ReluSAE

    sae = ReluSAE(32, 24, "tiny-llama", 1, torch.device("cpu"), torch.float32, hook_name=hook)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return sae


def test_activation_collection_equals_transformer_lens() -> None:
    from sae_bench.sae_bench_utils import activation_collection as ac

    ours, reference = _models()
    hook = "blocks.1.hook_resid_post"
    tokens = torch.randint(3, 48, (6, 8), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 1  # a BOS for the masking
    classes = {"a": {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}}
    sae = _sae(hook)
    for fn, args in (
        (ac.get_all_llm_activations, (classes,)),
        (ac.collect_sae_activations, (tokens,)),
        (ac.get_feature_activation_sparsity, (tokens,)),
    ):
        extra = (sae,) if fn is not ac.get_all_llm_activations else ()
        got = fn(*args, ours, *extra, 4, 1, hook, mask_bos_pad_eos_tokens=True)
        expected = fn(*args, reference, *extra, 4, 1, hook, mask_bos_pad_eos_tokens=True)
        got, expected = (got["a"], expected["a"]) if isinstance(got, dict) else (got, expected)
        assert got.abs().max() > 0
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_core_eval_equals_transformer_lens() -> None:
    import datasets
    from sae_bench.evals.core.eval_config import CoreEvalConfig
    from sae_bench.evals.core.main import run_evals

    from lensadapters.testing.sae_clients import small_activations_store

    rng = random.Random(0)
    texts = [" ".join(f"w{rng.randrange(3, 48)}" for _ in range(rng.randrange(4, 40))) for _ in range(60)]
    hook = "blocks.1.hook_resid_post"
    results = []
    for model in _models():
        store = small_activations_store(model, datasets.Dataset.from_dict({"text": texts}), hook, 32)
        config = CoreEvalConfig(
            batch_size_prompts=4,
            n_eval_reconstruction_batches=2,
            n_eval_sparsity_variance_batches=2,
            context_size=12,
            compute_kl=True,
            compute_ce_loss=True,
            compute_sparsity_metrics=True,
            compute_variance_metrics=True,
            compute_featurewise_density_statistics=True,
            compute_featurewise_weight_based_metrics=False,  # sae-bench 0.6 reads cfg.architecture_str, absent
        )
        metrics, features = run_evals(_bench_sae(hook), store, model, config)
        results.append((metrics, features))
    (ours, our_features), (theirs, their_features) = results
    assert ours.keys() == theirs.keys() and our_features.keys() == their_features.keys()
    compared = 0
    for group, values in ours.items():
        assert values.keys() == theirs[group].keys(), group
        for name, value in values.items():  # CE losses, KL, explained variance, MSE, cosine, L0, L1, token counts
            # float32 rounding: the measured values agree to 1 ulp (CE 4.8e-7 of 3.87); a score divides a difference
            # of two near-equal losses (ablation - clean = 0.004 here) and magnifies that ulp ~250 times
            tolerance = {"abs": 5e-4} if name.endswith("_score") else {"rel": 2e-6, "abs": 1e-8}
            assert value == pytest.approx(theirs[group][name], **tolerance), (group, name)
            compared += 1
    assert compared >= 15 and ours["sparsity"]["l0"] > 0
    for name, value in our_features.items():  # per-feature density and its consistency heuristic
        ours_, theirs_ = torch.as_tensor(value), torch.as_tensor(their_features[name])  # nan: a feature never active
        torch.testing.assert_close(ours_, theirs_, rtol=1e-5, atol=1e-7, equal_nan=True)
        assert not ours_.isnan().all()
