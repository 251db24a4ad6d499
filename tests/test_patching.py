"""lensadapters.patching: TransformerLens' sweeps on a HookedModel (values against TransformerLens itself are in
test_tl_reference.py); here: what a sweep must find, shapes, index rows, progress bars."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from lensadapters import HookedModel, patching
from lensadapters.testing.tiny_models import ARCH_NAMES, from_config, needs, tiny


def setup(arch: str, seed: int = 0):
    hm = HookedModel.wrap(tiny(arch, seed))
    clean = torch.randint(0, hm.cfg.d_vocab, (1, 5), generator=torch.Generator().manual_seed(seed))
    corrupted = clean.clone()
    corrupted[0, 1] = (clean[0, 1] + 7) % hm.cfg.d_vocab
    answer = int(clean[0, -1])
    with torch.no_grad():
        clean_logits, cache = hm.run_with_cache(clean, return_type="logits")
        corrupted_logits = hm(corrupted, return_type="logits")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1].log_softmax(-1)[answer]

    return hm, corrupted, cache, metric, metric(clean_logits), metric(corrupted_logits)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_residual_patching_restores_the_clean_run_exactly_where_the_inputs_differ(arch: str) -> None:
    hm, corrupted, cache, metric, clean, dirty = setup(arch)
    result = patching.get_act_patch_resid_pre(hm, corrupted, cache, metric)  # gradients on, as TransformerLens
    assert result.shape == (hm.cfg.n_layers, 5)
    assert torch.allclose(result[0, 1], clean, atol=1e-4)  # the corrupted token itself, before any block
    others = [p for p in range(5) if p != 1]
    assert torch.allclose(result[0, others], dirty.expand(4), atol=1e-4)  # identical positions change nothing
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_head_sweeps_have_transformer_lens_shapes(arch: str) -> None:
    hm, corrupted, cache, metric, _, _ = setup(arch, 1)
    n, h, kv = hm.cfg.n_layers, hm.cfg.n_heads, hm.cfg.n_key_value_heads
    assert patching.get_act_patch_attn_head_out_all_pos(hm, corrupted, cache, metric).shape == (n, h)
    assert patching.get_act_patch_attn_head_k_all_pos(hm, corrupted, cache, metric).shape == (n, kv)
    assert patching.get_act_patch_attn_head_by_pos_every(hm, corrupted, cache, metric).shape == (5, n, 5, h)
    assert patching.get_act_patch_block_every(hm, corrupted, cache, metric).shape == (3, n, 5)
    hm.unwrap()


@needs("llama")
def test_key_value_sweeps_run_over_key_value_heads() -> None:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        max_position_embeddings=32,
    )
    hm = HookedModel.wrap(from_config(config))
    tokens = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(0))
    _, cache = hm.run_with_cache(tokens)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, 0]

    every = patching.get_act_patch_attn_head_all_pos_every(hm, tokens, cache, metric)
    assert every.shape == (5, 1, 4)
    assert torch.equal(every[2, :, 2:], torch.zeros(1, 2))  # keys: two key/value heads, padded to four
    hm.unwrap()


def test_index_rows_give_a_flat_result_and_the_sweep_shows_progress(capsys) -> None:
    hm, corrupted, cache, metric, _, _ = setup(ARCH_NAMES[0], 2)
    full = patching.get_act_patch_resid_pre(hm, corrupted, cache, metric)
    assert "patching resid_pre" in capsys.readouterr().err  # a tqdm progress bar
    rows = [[0, 1], [hm.cfg.n_layers - 1, 3]]
    flat = patching.generic_activation_patch(
        hm, corrupted, cache, metric, patching.layer_pos_patch_setter, "resid_pre", index_df=rows
    )
    assert torch.allclose(flat, torch.stack([full[0, 1], full[-1, 3]]), atol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        patching.generic_activation_patch(
            hm,
            corrupted,
            cache,
            metric,
            patching.layer_pos_patch_setter,
            "resid_pre",
            index_axis_names=("layer", "pos"),
            index_df=rows,
        )
    hm.unwrap()


def test_return_index_df_gives_a_dataframe() -> None:
    pandas = pytest.importorskip("pandas")
    hm, corrupted, cache, metric, _, _ = setup(ARCH_NAMES[0], 2)
    result, frame = patching.generic_activation_patch(
        hm,
        corrupted,
        cache,
        metric,
        patching.layer_pos_patch_setter,
        "resid_pre",
        index_axis_names=("layer", "pos"),
        return_index_df=True,
    )
    assert isinstance(frame, pandas.DataFrame) and list(frame.columns) == ["layer", "pos"]
    assert len(frame) == result.numel()
    hm.unwrap()


def test_a_sweep_takes_text() -> None:
    from lensadapters.testing.tiny_models import tokenizer

    hm = HookedModel.wrap(tiny(ARCH_NAMES[0]), tokenizer=tokenizer(40))
    _, cache = hm.run_with_cache("w5 w6 w7")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, 7]

    from_text = patching.get_act_patch_resid_pre(hm, "w5 w9 w7", cache, metric)
    from_tokens = patching.get_act_patch_resid_pre(hm, hm.to_tokens("w5 w9 w7"), cache, metric)
    assert torch.equal(from_text, from_tokens) and from_text.shape == (hm.cfg.n_layers, 4)  # BOS + 3 words
    hm.unwrap()
