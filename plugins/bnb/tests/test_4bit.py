"""4-bit (NF4 / FP4) layers: weights within the code table's resolution, the TransformerLens identities within
the bound, bitsandbytes' CPU layout read as the weight it packs, quantized embeddings.

The whole-model test runs for every installed architecture contract that declares ``aligned_overrides``
(bitsandbytes' CPU kernel needs input widths divisible by its block size, 64, and output widths by 32).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
import lensadapters_bnb as lb  # noqa: E402
from lensadapters_bnb.testing import (  # noqa: E402
    RELOAD_SETTINGS,
    assert_within_bound,
    check_identities,
    float_weight,
    quantized_linears,
    quantized_twins,
    wrap_quantized,
)

from lensadapters.testing import declared_contracts  # noqa: E402
from lensadapters.weights import read_linear  # noqa: E402

#: the installed architectures' declared contracts that can build 4-bit-aligned configs
CONTRACTS = [contract for contract in declared_contracts() if contract.aligned_overrides is not None]
NAMES = [contract.__name__ for contract in CONTRACTS]


@pytest.mark.parametrize("contract", CONTRACTS, ids=NAMES)
@settings(RELOAD_SETTINGS, max_examples=2)
@given(data=st.data())
def test_4bit_weights_and_identities(contract: type, data: st.DataObject) -> None:
    """NF4/FP4 on the CPU: weights within half a code-table gap of the float weights, identities within bound.

    The contract's ``aligned_overrides``: bitsandbytes' CPU kernel needs ``in_features`` divisible by its
    block size (64) and ``out_features`` by 32.
    """
    mode = data.draw(st.sampled_from(["nf4", "fp4"]), label="quant_type")
    fp, q, ids = quantized_twins(data, contract, mode=mode)
    hm = wrap_quantized(q, contract)
    with torch.no_grad():
        reference = q(ids).logits  # the first pass repacks the weights for the CPU kernel
        _, cache = hm.run_with_cache(ids)
        assert torch.equal(hm(ids).logits, reference)
        check_identities(hm, cache, torch.ones(ids.shape, dtype=torch.bool))
        for name, module in quantized_linears(q).items():
            qs = module.weight.quant_state
            code = qs.code.float().sort().values
            half_gap = (code[1:] - code[:-1]).max().item() / 2
            W = float_weight(fp.get_submodule(name)).T.detach()  # [out, in]: blocks run along rows
            absmax = W.reshape(-1, qs.blocksize).abs().amax(-1, keepdim=True).expand(-1, qs.blocksize).reshape(W.shape)
            bound = absmax * (half_gap + 2**-7) + 1e-6  # bfloat16 block scales of the CPU layout
            assert_within_bound(read_linear(hm, module).W.T, W, bound, f"{mode} {name}")
    hm.unwrap()


def test_4bit_cpu_repacking_keeps_the_weight() -> None:
    """The weight read before the first pass (bitsandbytes' layout) and after (the CPU kernel's) agree."""
    torch.manual_seed(0)
    for quant_type in ("nf4", "fp4"):
        layer = bnb.nn.Linear4bit(128, 64, bias=True, quant_type=quant_type, compute_dtype=torch.float32)
        layer.load_state_dict(nn.Linear(128, 64).state_dict())
        layer = layer.to("cpu").eval()
        before = lb.dequantize_4bit(layer)
        x = torch.randn(5, 128)
        with torch.no_grad():
            y = layer(x)
        after = lb.dequantize_4bit(layer)
        if getattr(layer.weight.quant_state, "packing_format_for_cpu", False):
            scale = before.abs().reshape(-1, 64).amax(-1, keepdim=True).expand(-1, 64).reshape(before.shape)
            assert ((after - before).abs() <= scale * 2**-8 + 1e-7).all()  # block scales in bfloat16
        else:
            assert torch.equal(after, before)
        lw = lb.dequantized_weight(layer, torch.float32)
        assert_within_bound(y, x @ lw.W + lw.b, lb.matmul_error_bound(layer, x, lw.W, lw.b), f"{quant_type} matmul")


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["uint8", "bf16-storage"])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_cpu_packed_layout_is_unpacked(quant_type: str, nested: bool, storage: torch.dtype) -> None:
    """bitsandbytes' CPU layout (``packing_format_for_cpu``), produced by its own converter, reads as the weight.

    bitsandbytes repacks a ``Linear4bit`` with ``_convert_weight_packed_for_cpu`` at the first inference pass
    only on CPUs with AVX512-BF16, so the other tests may never see that layout: here the layer is converted
    the way ``Linear4bit.forward`` does it. The codes must come back exactly, and the weight within the
    bfloat16 rounding of the block scales (the bound of ``test_4bit_cpu_repacking_keeps_the_weight``).
    """
    import copy

    from bitsandbytes.functional import _convert_weight_packed_for_cpu, _convert_weight_packed_for_cpu_inverse
    from lensadapters_bnb._dequant import _cpu_packed_codes

    torch.manual_seed(1)
    n_out, n_in = 64, 128
    layer = bnb.nn.Linear4bit(
        n_in,
        n_out,
        bias=True,
        quant_type=quant_type,
        compress_statistics=nested,
        compute_dtype=torch.float32,
        quant_storage=storage,
    )
    layer.load_state_dict(nn.Linear(n_in, n_out).state_dict())
    layer = layer.to("cpu").eval()
    qs = layer.weight.quant_state
    assert qs.nested == nested and layer.weight.dtype == storage
    unpacked = lb.dequantize_4bit(layer)  # bitsandbytes' own dequantize_4bit on its usual layout
    raw = layer.weight.data.clone()
    # as Linear4bit.forward does on an AVX512-BF16 CPU (it changes quant_state in place)
    layer.weight.data, state = _convert_weight_packed_for_cpu(layer.weight.data, qs)
    assert state is layer.weight.quant_state and state.packing_format_for_cpu and not state.nested
    absmax = state.absmax.clone()
    packed = lb.dequantize_4bit(layer)
    # the codes: the original bytes hold two codes each, high nibble first
    bytes_ = raw.view(torch.uint8).reshape(-1)
    codes = torch.stack([bytes_ >> 4, bytes_ & 0xF], dim=-1).reshape(n_out, n_in).long()
    assert torch.equal(_cpu_packed_codes(layer.weight.data), codes)
    # the weight: block scales rounded to bfloat16 by the conversion
    scale = unpacked.abs().reshape(-1, qs.blocksize).amax(-1, keepdim=True).expand(-1, qs.blocksize)
    assert_within_bound(packed, unpacked, scale.reshape(unpacked.shape) * 2**-8 + 1e-7, f"{quant_type} CPU layout")
    assert not torch.equal(packed, unpacked)  # the layout was really converted (bfloat16 scales)
    # reading changed nothing (bitsandbytes' inverse would rewrite quant_state in place)
    assert state.packing_format_for_cpu and torch.equal(state.absmax, absmax)
    assert torch.equal(lb.dequantize_4bit(layer), packed)
    # the layout was bitsandbytes' own: its inverse (on copies) gives the original bytes back
    inverse, _ = _convert_weight_packed_for_cpu_inverse(layer.weight.data.clone(), copy.deepcopy(state))
    assert torch.equal(inverse.view(torch.uint8), raw.view(torch.uint8))
    lw = lb.dequantized_weight(layer, torch.float32)
    assert torch.equal(lw.W, packed.T) and torch.equal(lw.b, layer.bias)


def test_quantized_embeddings_dequantize() -> None:
    ids = torch.arange(20)
    for cls, dim in ((bnb.nn.Embedding8bit, 8), (bnb.nn.Embedding4bit, 64)):
        emb = cls(20, dim)
        emb.load_state_dict(nn.Embedding(20, dim).state_dict())
        emb = emb.to("cpu")
        assert not emb.weight.is_floating_point()
        with torch.no_grad():
            assert torch.allclose(lb.dequantize_embedding(emb), emb(ids), atol=1e-6), cls.__name__
