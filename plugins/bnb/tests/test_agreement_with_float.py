"""8-bit models against their float twins, for every installed architecture's declared contract.

Models are built in float32 from the contract's configs (narrowed by its ``matrix_overrides``), saved with
``save_pretrained`` and loaded back with ``BitsAndBytesConfig(load_in_8bit=True)`` on the CPU
(:func:`lensadapters_bnb.testing.quantized_twins`); the architecture plugins are found through their entry
points. Fused layouts (GPT-2 ``c_attn`` quantized from a ``Conv1D``, GPT-NeoX's per-head interleaved
``query_key_value``) must read and split as the float model's do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

bnb = pytest.importorskip("bitsandbytes")
import lensadapters_bnb as lb  # noqa: E402
from lensadapters_bnb.testing import (  # noqa: E402
    FLOAT_AGREEMENT_PER_BLOCK,
    RELOAD_SETTINGS,
    Int8Contract,
    assert_within_bound,
    check_identities,
    float_weight,
    quantized_linears,
    quantized_twins,
    wrap_quantized,
)

from lensadapters.testing import declared_contracts, served_weights  # noqa: E402
from lensadapters.weights import read_linear  # noqa: E402

#: every installed architecture's declared contract (its plugin found through the entry point)
CONTRACTS = [c for c in declared_contracts() if Int8Contract.supports(c) is None]  # as the 8-bit matrix
NAMES = [contract.__name__ for contract in CONTRACTS]


def _depth(name: str, n_layers: int) -> int:
    """How many blocks of quantized projections a hook point's value has passed through (its own included)."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return n_layers + 1 if name.startswith("ln_final") else 0


@pytest.mark.parametrize("contract", CONTRACTS, ids=NAMES)
@RELOAD_SETTINGS
@given(data=st.data())
def test_hook_values_close_to_the_float_model(contract: type, data: st.DataObject) -> None:
    fp, q, ids = quantized_twins(data, contract)
    with torch.no_grad():
        hm8, hm32 = wrap_quantized(q, contract), wrap_quantized(fp, contract)
        assert hm8.hook_names == hm32.hook_names
        logits8, c8 = hm8.run_with_cache(ids)
        logits32, c32 = hm32.run_with_cache(ids)
    n = hm8.cfg.n_layers
    per_block = contract.quantized_drift_per_block or FLOAT_AGREEMENT_PER_BLOCK
    for name in hm32.hook_names:
        if name not in c32:
            continue
        a, b = c8[name], c32[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        depth = max(_depth(name, n), 1)  # OPT's project_in (8-bit too) may precede the blocks
        finite = torch.isfinite(b)  # attention scores: masked entries are -inf in both
        assert torch.equal(finite, torch.isfinite(a)), name
        a, b = a[finite], b[finite]
        rel = ((a - b).norm() / b.norm().clamp_min(1e-6)).item()
        assert rel <= per_block * depth, f"{name}: relative difference {rel:.3g} to the float model"
    rel = ((logits8 - logits32).norm() / logits32.norm()).item()
    assert rel <= per_block * (n + 1), f"logits: relative difference {rel:.3g}"
    hm8.unwrap()
    hm32.unwrap()


@pytest.mark.parametrize("contract", CONTRACTS, ids=NAMES)
@RELOAD_SETTINGS
@given(data=st.data())
def test_dequantized_weights_are_the_float_weights_rounded(contract: type, data: st.DataObject) -> None:
    """Each dequantized 8-bit weight is within its row's int8 step of the float weight, in the same layout.

    LLM.int8 stores ``round(W * 127 / absmax_row)``: ``|W_8bit - W| <= absmax_row / 254`` (plus float16
    rounding of the input when the checkpoint is cast first). Fused layouts (GPT-2 ``c_attn``, quantized
    from a ``Conv1D`` with its weight transposed; GPT-NeoX ``query_key_value``) must split the same way as
    the float model's, so ``hm.W_Q``... agree too.
    """
    fp, q, _ = quantized_twins(data, contract)
    hm8, hm32 = wrap_quantized(q, contract), wrap_quantized(fp, contract)
    linears = quantized_linears(q)
    assert linears, "nothing was quantized"
    worst_step = 0.0
    for name, module in linears.items():
        lw = read_linear(hm8, module)
        W = float_weight(fp.get_submodule(name)).detach()
        assert lw.W.shape == W.shape, name
        step = W.abs().amax(dim=0, keepdim=True) / 254  # per output feature (bitsandbytes row)
        bound = step * (1 + 2**-10) + W.abs() * 2**-11 + 1e-7
        assert_within_bound(lw.W, W, bound, f"{name} dequantized")
        worst_step = max(worst_step, step.max().item())
        b = fp.get_submodule(name).bias
        if b is not None:
            assert torch.equal(lw.b, b), f"{name} bias"
    with torch.no_grad():
        names = ("W_Q", "_W_K", "_W_V", "W_O", "W_in", "W_out", "b_Q", "b_O")
        served8, served32 = served_weights(hm8, names), served_weights(hm32, names)
        assert served8.keys() == served32.keys()
        for accessor, b in served32.items():
            a = served8[accessor]
            assert a.shape == b.shape, accessor
            assert (a - b).abs().max().item() <= worst_step * (1 + 2**-10) + 2**-11 * b.abs().max().item() + 1e-6, (
                accessor
            )
    hm8.unwrap()
    hm32.unwrap()


@pytest.mark.parametrize("contract", CONTRACTS, ids=NAMES)
@settings(RELOAD_SETTINGS, max_examples=2)
@given(data=st.data())
def test_float16_model_hook_dtypes_and_casts(contract: type, data: st.DataObject) -> None:
    """A float16 8-bit model: hook values have the dtypes of the same model in float16 (float16, except where the
    architecture itself upcasts, as GPT-2's ``reorder_and_upcast_attn`` and GPT-J do for attention scores),
    weights are float16, float32 edits are cast back."""
    fp, q, ids = quantized_twins(data, contract, dtype=torch.float16)
    hm = wrap_quantized(q, contract)
    with torch.no_grad():
        reference = q(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        logits, cache = hm.run_with_cache(ids)
        assert torch.equal(logits, reference)
        hm16 = wrap_quantized(fp.half(), contract)
        _, cache16 = hm16.run_with_cache(ids)
        hm16.unwrap()
        assert {n: v.dtype for n, v in cache.items()} == {n: v.dtype for n, v in cache16.items()}
        assert torch.float16 in {v.dtype for v in cache.values()} <= {torch.float16, torch.float32}
        weights = served_weights(hm, ("W_Q", "W_O", "W_out"))  # a hybrid refuses the stacked attention weights
        assert "W_out" in weights and {w.dtype for w in weights.values()} == {torch.float16}
        check_identities(hm, cache, torch.ones(ids.shape, dtype=torch.bool))
        name = "blocks.0.hook_resid_pre"
        seen: list[torch.Tensor] = []

        def double_in_float32(t: torch.Tensor, hook: Any) -> torch.Tensor:
            return t.float() * 2

        def record(t: torch.Tensor, hook: Any) -> None:
            seen.append(t)

        edited = hm.run_with_hooks(ids, fwd_hooks=[(name, double_in_float32), (name, record)])
        assert seen[0].dtype == torch.float16 and torch.equal(seen[0], cache[name] * 2)
        # (the logits' dtype is the model's: GPT-J under transformers 4.57 returns them in float32)
        assert edited.dtype == reference.dtype and not torch.equal(edited, reference)
    hm.unwrap()


def test_has_fp16_weights_layer_reads_the_weight_it_quantizes() -> None:
    """``has_fp16_weights=True`` keeps a float weight and quantizes it per pass: the read mirrors that."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear8bitLt(32, 16, bias=True, has_fp16_weights=True, threshold=0.0)
    x = torch.randn(3, 32)
    lw = lb.dequantized_weight(layer, torch.float32)
    W = layer.weight.detach().T
    step = W.abs().amax(0, keepdim=True) / 254  # quantized per row after a cast to float16
    assert_within_bound(lw.W, W, step * (1 + 2**-10) + W.abs() * 2**-11 + 1e-7, "fp16-weight layer read")
    with torch.no_grad():
        y = layer(x)
    assert_within_bound(y, x @ lw.W + lw.b, lb.matmul_error_bound(layer, x, lw.W, lw.b), "has_fp16_weights matmul")
