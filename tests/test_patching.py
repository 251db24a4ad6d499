"""lensadapters.patching: TransformerLens' sweeps on a HookedModel (values against TransformerLens itself are in
test_tl_reference.py); here: what a sweep must find, shapes, index rows, progress bars."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from lensadapters import HookedModel, patching
from lensadapters.analysis.utils import get_act_name
from lensadapters.testing import attention_layers
from lensadapters.testing.tiny_models import ARCH_NAMES, first_causal, from_config, gqa_llama, needs, tiny


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
    others = [p for p in range(5) if p != 1]
    assert torch.allclose(result[0, others], dirty.expand(4), atol=1e-4)  # identical positions change nothing
    side = [f"blocks.{i}.{name}" for i in range(hm.cfg.n_layers) for name in hm.layout.side_inputs]
    if not side:  # the residual stream is the whole state: patching the corrupted token's residual restores all
        assert torch.allclose(result[0, 1], clean, atol=1e-4)  # the corrupted token itself, before any block
    else:  # the blocks also read inputs computed from the corrupted token: patched with it, the run is clean
        assert not torch.allclose(result[0, 1], clean, atol=1e-4)  # the side inputs still carry the corruption

        def patch(x: torch.Tensor, hook) -> torch.Tensor:
            x = x.clone()
            x[:, 1] = cache[hook.name][:, 1]
            return x

        with torch.no_grad():
            logits = hm.run_with_hooks(corrupted, fwd_hooks=[(n, patch) for n in ["blocks.0.hook_resid_pre", *side]])
        assert torch.allclose(metric(logits), clean, atol=1e-4)
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_head_sweeps_have_transformer_lens_shapes(arch: str) -> None:
    hm, corrupted, cache, metric, _, _ = setup(arch, 1)
    n, h, kv = hm.cfg.n_layers, hm.cfg.n_heads, hm.cfg.n_key_value_heads
    layers = attention_layers(hm)
    head_sweeps = {
        patching.get_act_patch_attn_head_out_all_pos: (n, h),
        patching.get_act_patch_attn_head_k_all_pos: (n, kv),
        patching.get_act_patch_attn_head_by_pos_every: (5, n, 5, h),
    }
    for sweep, shape in head_sweeps.items():
        if len(layers) == n:
            assert sweep(hm, corrupted, cache, metric).shape == shape
        else:  # a hybrid: no heads in the blocks with another token mixer; refused by name
            others = [i for i in range(n) if i not in layers]
            with pytest.raises(ValueError, match=rf"blocks \[{', '.join(map(str, others))}\] have no attn\.hook_"):
                sweep(hm, corrupted, cache, metric)
    if len(layers) < n:  # ... and the attention blocks' heads patched through index rows
        rows = [[i, head] for i in layers for head in range(h)]
        out = patching.generic_activation_patch(
            hm, corrupted, cache, metric, patching.layer_head_vector_patch_setter, "z", index_df=rows
        )
        assert out.shape == (len(rows),) and out.std() > 0
    assert patching.get_act_patch_block_every(hm, corrupted, cache, metric).shape == (3, n, 5)
    hm.unwrap()


@needs("llama")
def test_key_value_sweeps_run_over_key_value_heads() -> None:
    config = gqa_llama()
    hm = HookedModel.wrap(from_config(config))
    tokens = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(0))
    _, cache = hm.run_with_cache(tokens)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, 0]

    every = patching.get_act_patch_attn_head_all_pos_every(hm, tokens, cache, metric)
    assert every.shape == (5, 1, 4)
    assert torch.equal(every[2, :, 2:], torch.zeros(1, 2))  # keys: two key/value heads, padded to four
    hm.unwrap()


def resid_pre_patch(*run: Any, **kw: Any) -> Any:
    """``generic_activation_patch`` of ``resid_pre`` by (layer, pos); ``run``: model, tokens, cache, metric."""
    return patching.generic_activation_patch(*run, patching.layer_pos_patch_setter, "resid_pre", **kw)


def test_index_rows_give_a_flat_result_and_the_sweep_shows_progress(capsys) -> None:
    hm, corrupted, cache, metric, _, _ = setup(first_causal(), 2)
    full = patching.get_act_patch_resid_pre(hm, corrupted, cache, metric)
    assert "patching resid_pre" in capsys.readouterr().err  # a tqdm progress bar
    rows = [[0, 1], [hm.cfg.n_layers - 1, 3]]
    flat = resid_pre_patch(hm, corrupted, cache, metric, index_df=rows)
    assert torch.allclose(flat, torch.stack([full[0, 1], full[-1, 3]]), atol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        resid_pre_patch(hm, corrupted, cache, metric, index_axis_names=("layer", "pos"), index_df=rows)
    hm.unwrap()


def test_return_index_df_gives_a_dataframe() -> None:
    pandas = pytest.importorskip("pandas")
    hm, corrupted, cache, metric, _, _ = setup(first_causal(), 2)
    by = ("layer", "pos")
    result, frame = resid_pre_patch(hm, corrupted, cache, metric, index_axis_names=by, return_index_df=True)
    assert isinstance(frame, pandas.DataFrame) and list(frame.columns) == ["layer", "pos"]
    assert len(frame) == result.numel()
    hm.unwrap()


def test_a_sweep_takes_text() -> None:
    from lensadapters.testing.tiny_models import tokenizer

    hm = HookedModel.wrap(tiny(first_causal()), tokenizer=tokenizer(40))
    _, cache = hm.run_with_cache("w5 w6 w7")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, 7]

    from_text = patching.get_act_patch_resid_pre(hm, "w5 w9 w7", cache, metric)
    from_tokens = patching.get_act_patch_resid_pre(hm, hm.to_tokens("w5 w9 w7"), cache, metric)
    assert torch.equal(from_text, from_tokens) and from_text.shape == (hm.cfg.n_layers, 4)  # BOS + 3 words
    hm.unwrap()


# --- batched sweeps: several patched copies per forward ---------------------------------------------------------

# every single sweep (the "every" ones stack several of them)
SWEEPS = [n for n in patching.__all__ if n.startswith("get_act_patch_") and not n.endswith("_every")]


def two_prompts(arch: str, seed: int = 3):
    """A batch of two prompts, each corrupted at its own position, and a metric that tells the two rows apart."""
    hm = HookedModel.wrap(tiny(arch, seed))
    clean = torch.randint(0, hm.cfg.d_vocab, (2, 3), generator=torch.Generator().manual_seed(seed))
    corrupted = clean.clone()
    corrupted[0, 1] = (clean[0, 1] + 7) % hm.cfg.d_vocab
    corrupted[1, 0] = (clean[1, 0] + 5) % hm.cfg.d_vocab
    answers = clean[:, -1]
    with torch.no_grad():
        _, cache = hm.run_with_cache(clean, return_type="logits")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[:2] == (2, 3)  # one corrupted run's logits, as in TransformerLens
        logprobs = logits[:, -1].log_softmax(-1)[torch.arange(2), answers]
        return logprobs[0] + 2 * logprobs[1]

    return hm, corrupted, cache, metric


def reordering(hm, corrupted, copies: int = 7) -> float:
    """How far the unhooked model's own logits move when its batch is repeated ``copies`` times (the floating-point
    reordering of its kernels: Hugging Face's chunked linear attention and grouped expert matmuls depend on the batch
    size). A log-probability moves by at most twice that: batched and one-at-a-time sweeps may differ by so much."""
    rows = corrupted.shape[0]
    with torch.no_grad():
        one = hm(corrupted, return_type="logits")
        many = hm(corrupted.repeat(copies, 1), return_type="logits")
    return max(float((many[j * rows : (j + 1) * rows] - one).abs().max()) for j in range(copies))


def sweeps_of(hm) -> list[str]:
    """The sweeps a model serves: no ``resid_mid`` sweep without the point."""
    return [s for s in SWEEPS if s != "get_act_patch_resid_mid" or "blocks.0.hook_resid_mid" in hm.hook_dict]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_batched_sweeps_equal_one_at_a_time_patches(arch: str) -> None:
    """Every sweep, batched (7 copies a forward, a ragged last batch), against single patches at the first, the
    last and two random indices of the same sweep (a full comparison is below; this keeps CI short)."""
    hm, corrupted, cache, metric = two_prompts(arch)
    generator = torch.Generator().manual_seed(0)
    atol = 1e-5 + 2 * 3 * reordering(hm, corrupted)  # two log-probabilities in the metric, one weighted 2
    for name in sweeps_of(hm):
        sweep = getattr(patching, name)
        setter, activation = sweep.keywords["patch_setter"], sweep.keywords["activation_name"]
        layers = [i for i in range(hm.cfg.n_layers) if get_act_name(activation, layer=i) in hm.hook_names]
        if len(layers) == hm.cfg.n_layers:
            full = sweep(hm, corrupted, cache, metric, batch_size=7)
            indices = [list(torch.unravel_index(torch.tensor(i), full.shape)) for i in range(full.numel())]
            batched = full.flatten()
        else:  # heads of a hybrid's attention blocks only (the others have none): every index row of those
            ranges = patching._axis_ranges(hm, corrupted, activation)
            axes = [range(ranges[a]) for a in sweep.keywords["index_axis_names"][1:]]
            indices = [[i, *rest] for i in layers for rest in itertools.product(*axes)]
            batched = patching.generic_activation_patch(
                hm, corrupted, cache, metric, setter, activation, index_df=indices, batch_size=7
            )
        picks = [0, batched.numel() - 1] + torch.randint(0, batched.numel(), (2,), generator=generator).tolist()
        single = patching.generic_activation_patch(
            hm,
            corrupted,
            cache,
            metric,
            setter,
            activation,
            index_df=[[int(v) for v in indices[i]] for i in picks],
            batch_size=1,
        )
        got = batched[picks]
        assert torch.allclose(got, single, atol=atol, rtol=0), (name, (got - single).abs().max(), atol)
    hm.unwrap()


@pytest.mark.parametrize(("arch", "seed"), [("mixtral", 3), ("llama", 1)])
def test_batched_sweeps_equal_the_one_at_a_time_sweeps(arch: str, seed: int) -> None:
    """Every index of every sweep on two grouped-query models (these seeds' tiny configs: 4 query heads on 1 and 2
    key/value heads), one a mixture of experts, and the sweeps of sweeps at the default batch size."""
    hm, corrupted, cache, metric = two_prompts(arch, seed)
    assert hm.cfg.n_key_value_heads < hm.cfg.n_heads
    sweeps = sweeps_of(hm)
    single = {name: getattr(patching, name)(hm, corrupted, cache, metric, batch_size=1) for name in sweeps}
    for name in sweeps:
        batched = getattr(patching, name)(hm, corrupted, cache, metric, batch_size=7)  # 7: a ragged last batch
        assert batched.shape == single[name].shape, name
        assert torch.allclose(batched, single[name], atol=1e-5, rtol=0), (name, (batched - single[name]).abs().max())
    assert single["get_act_patch_resid_pre"].std() > 0  # the sweep finds something to compare
    block = patching.get_act_patch_block_every(hm, corrupted, cache, metric)  # the default: a memory budget
    expected = [single[f"get_act_patch_{n}"] for n in ("resid_pre", "attn_out", "mlp_out")]
    assert torch.allclose(block, torch.stack(expected), atol=1e-5, rtol=0)
    every = patching.get_act_patch_attn_head_all_pos_every(hm, corrupted, cache, metric, batch_size=5)
    heads = [single[f"get_act_patch_attn_head_{n}_all_pos"] for n in ("out", "q", "k", "v", "pattern")]
    assert torch.allclose(every[[0, 1, 4]], torch.stack([heads[0], heads[1], heads[4]]), atol=1e-5, rtol=0)
    kv = hm.cfg.n_key_value_heads
    assert torch.allclose(every[2, :, :kv], heads[2], atol=1e-5, rtol=0)
    assert torch.allclose(every[3, :, :kv], heads[3], atol=1e-5, rtol=0)
    by_pos = patching.get_act_patch_attn_head_by_pos_every(hm, corrupted, cache, metric, batch_size=9)
    assert torch.allclose(by_pos[0], single["get_act_patch_attn_head_out_by_pos"], atol=1e-5, rtol=0)
    hm.unwrap()


def test_a_batched_sweep_takes_a_setter_that_returns_a_new_tensor_and_index_rows() -> None:
    hm, corrupted, cache, metric = two_prompts(first_causal())

    def setter(corrupted_activation: torch.Tensor, index, clean_activation: torch.Tensor) -> torch.Tensor:
        out = corrupted_activation.clone()
        out[:, index[1]] = clean_activation[:, index[1]]
        return out

    rows = [[0, 1], [hm.cfg.n_layers - 1, 0], [0, 2], [0, 1]]
    one = patching.generic_activation_patch(
        hm, corrupted, cache, metric, setter, "resid_pre", index_df=rows, batch_size=1
    )
    many = patching.generic_activation_patch(
        hm, corrupted, cache, metric, setter, "resid_pre", index_df=rows, batch_size=4
    )
    assert torch.allclose(one, many, atol=1e-5, rtol=0) and one[0] == one[3] and one[0] != one[2]
    with pytest.raises(ValueError, match="batch_size"):
        patching.get_act_patch_resid_pre(hm, corrupted, cache, metric, batch_size=0)
    hm.unwrap()


def test_the_default_batch_size_fits_the_memory_budget() -> None:
    hm, corrupted, _, _ = two_prompts(first_causal())
    per_copy = patching.copy_bytes(hm, corrupted)
    assert per_copy >= corrupted.numel() * hm.cfg.d_vocab * 4  # at least the logits
    assert patching.default_batch_size(hm, corrupted, budget=10 * per_copy) == 10
    assert patching.default_batch_size(hm, corrupted, budget=1) == 1
    assert patching.default_batch_size(hm, corrupted) == patching.MEMORY_BUDGET // per_copy
    hm.unwrap()


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_batched_sweep_over_padded_prompts_repeats_their_masks_and_positions(side: str) -> None:
    from lensadapters.testing.tiny_models import tokenizer

    hm = HookedModel.wrap(tiny("llama" if "llama" in ARCH_NAMES else first_causal(), 1), tokenizer=tokenizer(40))
    hm.default_padding_side = side
    clean = hm.to_tokens(["w5 w6 w7 w8", "w9 w3"])  # the second prompt padded
    corrupted = hm.to_tokens(["w5 w6 w1 w8", "w9 w4"])
    assert bool((clean == hm.tokenizer.pad_token_id).any())
    _, cache = hm.run_with_cache(clean, return_type="logits")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :, 7].sum()  # every position, padded ones included: any mask or position mix-up shows

    one = patching.get_act_patch_resid_pre(hm, corrupted, cache, metric, batch_size=1)
    many = patching.get_act_patch_resid_pre(hm, corrupted, cache, metric, batch_size=4)
    assert torch.allclose(one, many, atol=1e-5, rtol=0) and one.std() > 0
    hm.unwrap()
