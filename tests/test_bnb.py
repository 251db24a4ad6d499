"""bitsandbytes (lensadapters-bnb): 8-bit and 4-bit models, and LoRA over 8-bit (the seed-002 stack).

Models are built in float32 from a seeded tiny config, saved with ``save_pretrained`` and loaded back
with ``BitsAndBytesConfig`` on the CPU. The contract suite runs on 8-bit GPT-2 (fused ``c_attn``,
quantized from ``Conv1D``), GPT-NeoX (per-head interleaved ``query_key_value``), OPT (pre- and
post-LN, ``project_in``/``project_out``) and Llama (GQA, gated MLP); the TransformerLens identities
and the head-ablation property are checked against the bound of :func:`lensadapters_bnb.matmul_error_bound`
instead of a fixed float tolerance (the suite is :class:`lensadapters_bnb.testing.Int8Contract`, which
third-party plugins subclass too). Architectures whose plugin is not installed are skipped.
"""

from __future__ import annotations

import importlib
import logging
import math
import warnings
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import lensadapters_bnb as lb  # noqa: E402
from lensadapters import HookedModel, Registry, WeightUnavailableError  # noqa: E402
from lensadapters.testing import assert_close, reinit  # noqa: E402
from lensadapters.weights import read_linear  # noqa: E402
from lensadapters_bnb.testing import (Int8Contract, assert_within_bound, check_identities,  # noqa: E402
                                      norm_out, quantize)

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16" on every call
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")


from installed_plugins import (  # noqa: E402
    lensadapters_gpt2, lensadapters_gpt_neox, lensadapters_llama, lensadapters_opt, lensadapters_peft)

# every example saves and reloads a model: few examples; each contract subclass runs the inherited tests
SETTINGS = settings(deadline=None, max_examples=3, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.differing_executors])


def _skip_without(plugin: Any, name: str) -> Any:
    return pytest.mark.skipif(plugin is None, reason=f"{name} is not installed")


# --- tiny configs: the architectures' own strategies (lensadapters_<arch>.testing), narrowed ------------------
# Every example saves and reloads a model: small sizes. The 4-bit tests fix d_model to 64 (bitsandbytes' CPU
# kernel needs in_features divisible by its block size, 64, and out_features by 32).

INT8_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layers=st.integers(1, 2), n_heads=st.sampled_from([1, 2, 4]), d_head=st.sampled_from([4, 8]),
                 d_mlp=st.sampled_from([None, 24]), vocab=st.integers(16, 96), act="gelu_new",
                 scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                 eps=1e-5),
    "gpt_neox": dict(d_head=8, d_mlp=st.sampled_from([24, 64]), vocab=64, rotary_pct=st.sampled_from([0.25, 1.0])),
    "opt": dict(n_heads=st.sampled_from([1, 2, 4]), d_head=8, n_layers=st.integers(1, 2),
                ffn_dim=st.sampled_from([16, 48]), vocab=st.integers(16, 96), affine=True, act="gelu"),
    "llama": dict(ratio=st.sampled_from([1, 2]), head_dim=st.sampled_from([4, 8]), d_model=st.sampled_from([16, 32]),
                  d_mlp=24, vocab=64, rope_types=("default",), theta=10000.0, mlp_bias=False, act="silu", eps=1e-6),
}
FOUR_BIT_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {**INT8_CONFIGS["gpt2"], "d_model": 64, "d_mlp": None},
    "gpt_neox": {**INT8_CONFIGS["gpt_neox"], "d_model": 64, "d_mlp": 128},
    "opt": {**INT8_CONFIGS["opt"], "d_model": 64, "ffn_dim": 128, "project": False},
    "llama": {**INT8_CONFIGS["llama"], "n_heads": 2, "head_dim": 32, "d_model": 64, "d_mlp": 128},
}
KITS = {"gpt2": ("GPT2Contract", "gpt2_configs"), "gpt_neox": ("GPTNeoXContract", "gpt_neox_configs"),
        "opt": ("OPTContract", "opt_configs"), "llama": ("LlamaContract", "llama_configs")}


def _kit(arch: str, which: int) -> Any:
    if ARCHS[arch] is None:
        return None
    return getattr(importlib.import_module(f"lensadapters_{arch}.testing"), KITS[arch][which])


def contract(arch: str) -> Any:
    """The architecture plugin's packaged contract class, or None when the plugin is not installed."""
    return _kit(arch, 0)


def configs(arch: str, four_bit: bool = False) -> st.SearchStrategy:
    """Tiny configs of ``arch`` for the 8-bit (or, with ``four_bit``, the 4-bit) tests: the plugin's strategy."""
    return _kit(arch, 1)(**(FOUR_BIT_CONFIGS if four_bit else INT8_CONFIGS)[arch])


ARCHS = {"gpt2": lensadapters_gpt2, "gpt_neox": lensadapters_gpt_neox, "opt": lensadapters_opt,
         "llama": lensadapters_llama}
ARCH_PARAMS = [pytest.param(name, id=name, marks=_skip_without(ARCHS[name], f"lensadapters-{name}"))
               for name in ARCHS]


# --- building quantized twins ----------------------------------------------------------------------------


def fp32_model(config: Any, seed: int, attn_implementation: str = "sdpa") -> nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    reinit(model, seed)
    return model.eval()


def registry(*plugins: Any) -> Registry:
    reg = Registry()
    for plugin in plugins:
        reg.register(plugin, plugin.__name__)
    return reg


def wrap(model: Any, arch: str, *extra: Any) -> HookedModel:
    return HookedModel.wrap(model, registry=registry(ARCHS[arch], lb, *extra))


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if lb.is_quantized_linear(m)}


# --- the contract suite on 8-bit models (lensadapters_bnb.testing.Int8Contract) ----------------------------


# Each class is Int8Contract over the architecture's packaged contract (what a third-party plugin writes), with
# this file's small sizes; the float contracts cover the architectures' config strata (llama3 rope, OPT-350m).

if contract("gpt2") is not None:
    class TestInt8GPT2(Int8Contract, contract("gpt2")):
        config_overrides, config_strata = INT8_CONFIGS["gpt2"], {}

if contract("gpt_neox") is not None:
    class TestInt8GPTNeoX(Int8Contract, contract("gpt_neox")):
        config_overrides, config_strata = INT8_CONFIGS["gpt_neox"], {}

if contract("opt") is not None:
    class TestInt8OPT(Int8Contract, contract("opt")):
        config_overrides, config_strata = INT8_CONFIGS["opt"], {}

if contract("llama") is not None:
    class TestInt8Llama(Int8Contract, contract("llama")):
        config_overrides, config_strata = INT8_CONFIGS["llama"], {}


# --- 8-bit against the float model ---------------------------------------------------------------------------


def draw_twins(data: st.DataObject, arch: str, mode: str = "int8", dtype: torch.dtype = torch.float32
               ) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A seeded float32 model, its quantized twin (``mode``: int8, nf4, fp4) and unpadded token ids."""
    config = data.draw(configs(arch, four_bit=mode != "int8"), label="config")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    fp = fp32_model(config, seed, "eager")
    ids = torch.randint(3, config.vocab_size, (2, data.draw(st.integers(2, 8), label="length")),
                        generator=torch.Generator().manual_seed(seed))
    return fp, quantize(fp, mode, dtype), ids


def _depth(name: str, n_layers: int) -> int:
    """How many blocks of quantized projections a hook point's value has passed through (its own included)."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return n_layers + 1 if name.startswith("ln_final") else 0


#: normwise relative agreement per block of quantized projections between 8-bit and float hook values.
#: Empirical, not a bound: one int8 matmul moves its output by about 1 % of its norm (it rounds both its
#: weight rows and its input rows to 1/127 of their absmax), but a hook whose value is small next to its
#: inputs (cancellation, e.g. a tiny Llama's gate) moves more: over 100 random tiny models the largest
#: difference per block was 3.3 % (GPT-2, GPT-NeoX, OPT) and 12 % (Llama). A wrong layout, dtype or
#: split gives differences of order 100 %; the exact properties are checked against the int8 bound above.
FLOAT_AGREEMENT_PER_BLOCK = 0.25


@pytest.mark.parametrize("arch", ARCH_PARAMS)
@SETTINGS
@given(data=st.data())
def test_hook_values_close_to_the_float_model(arch: str, data: st.DataObject) -> None:
    fp, q, ids = draw_twins(data, arch)
    with torch.no_grad():
        hm8, hm32 = wrap(q, arch), wrap(fp, arch)
        assert hm8.hook_names == hm32.hook_names
        logits8, c8 = hm8.run_with_cache(ids)
        logits32, c32 = hm32.run_with_cache(ids)
    n = hm8.cfg.n_layers
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
        assert rel <= FLOAT_AGREEMENT_PER_BLOCK * depth, f"{name}: relative difference {rel:.3g} to the float model"
    rel = ((logits8 - logits32).norm() / logits32.norm()).item()
    assert rel <= FLOAT_AGREEMENT_PER_BLOCK * (n + 1), f"logits: relative difference {rel:.3g}"
    hm8.unwrap()
    hm32.unwrap()


def _float_linear_weight(module: nn.Module) -> torch.Tensor:
    """``[d_in, d_out]`` of a float ``nn.Linear`` or GPT-2 ``Conv1D``."""
    return module.weight.T if isinstance(module, nn.Linear) else module.weight


@pytest.mark.parametrize("arch", ARCH_PARAMS)
@SETTINGS
@given(data=st.data())
def test_dequantized_weights_are_the_float_weights_rounded(arch: str, data: st.DataObject) -> None:
    """Each dequantized 8-bit weight is within its row's int8 step of the float weight, in the same layout.

    LLM.int8 stores ``round(W * 127 / absmax_row)``: ``|W_8bit - W| <= absmax_row / 254`` (plus float16
    rounding of the input when the checkpoint is cast first). Fused layouts (GPT-2 ``c_attn``, quantized
    from a ``Conv1D`` with its weight transposed; GPT-NeoX ``query_key_value``) must split the same way as
    the float model's, so ``hm.W_Q``... agree too.
    """
    fp, q, _ = draw_twins(data, arch)
    hm8, hm32 = wrap(q, arch), wrap(fp, arch)
    linears = quantized_linears(q)
    assert linears, "nothing was quantized"
    worst_step = 0.0
    for name, module in linears.items():
        lw = read_linear(hm8, module)
        W = _float_linear_weight(fp.get_submodule(name)).detach()
        assert lw.W.shape == W.shape, name
        step = W.abs().amax(dim=0, keepdim=True) / 254  # per output feature (bitsandbytes row)
        bound = step * (1 + 2**-10) + W.abs() * 2**-11 + 1e-7
        assert_within_bound(lw.W, W, bound, f"{name} dequantized")
        worst_step = max(worst_step, step.max().item())
        b = fp.get_submodule(name).bias
        if b is not None:
            assert torch.equal(lw.b, b), f"{name} bias"
    with torch.no_grad():
        for accessor in ("W_Q", "_W_K", "_W_V", "W_O", "W_in", "W_out", "b_Q", "b_O"):
            a, b = getattr(hm8, accessor), getattr(hm32, accessor)
            assert a.shape == b.shape, accessor
            assert (a - b).abs().max().item() <= worst_step * (1 + 2**-10) + 2**-11 * b.abs().max().item() + 1e-6, accessor
    hm8.unwrap()
    hm32.unwrap()


@pytest.mark.parametrize("arch", ARCH_PARAMS)
@settings(SETTINGS, max_examples=2)
@given(data=st.data())
def test_float16_model_hook_dtypes_and_casts(arch: str, data: st.DataObject) -> None:
    """A float16 8-bit model: hook values and weights are float16, float32 edits are cast back."""
    fp, q, ids = draw_twins(data, arch, dtype=torch.float16)
    hm = wrap(q, arch)
    with torch.no_grad():
        reference = q(ids).logits
        assert torch.equal(hm(ids).logits, reference)
        logits, cache = hm.run_with_cache(ids)
        assert torch.equal(logits, reference)
        assert {v.dtype for v in cache.values()} == {torch.float16}
        assert hm.W_Q.dtype == hm.W_O.dtype == hm.W_out.dtype == torch.float16
        check_identities(hm, cache, torch.ones(ids.shape, dtype=torch.bool))
        name = "blocks.0.hook_resid_pre"
        seen: list[torch.Tensor] = []

        def double_in_float32(t: torch.Tensor, hook: Any) -> torch.Tensor:
            return t.float() * 2

        def record(t: torch.Tensor, hook: Any) -> None:
            seen.append(t)

        edited = hm.run_with_hooks(ids, fwd_hooks=[(name, double_in_float32), (name, record)])
        assert seen[0].dtype == torch.float16 and torch.equal(seen[0], cache[name] * 2)
        assert edited.dtype == torch.float16 and not torch.equal(edited, reference)
    hm.unwrap()


# --- 4-bit (NF4 / FP4) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCH_PARAMS)
@settings(SETTINGS, max_examples=2)
@given(data=st.data())
def test_4bit_weights_and_identities(arch: str, data: st.DataObject) -> None:
    """NF4/FP4 on the CPU: weights within half a code-table gap of the float weights, identities within bound.

    ``d_model`` is 64: bitsandbytes' CPU kernel needs ``in_features`` divisible by its block size (64)
    and ``out_features`` by 32.
    """
    mode = data.draw(st.sampled_from(["nf4", "fp4"]), label="quant_type")
    fp, q, ids = draw_twins(data, arch, mode=mode)
    hm = wrap(q, arch)
    with torch.no_grad():
        reference = q(ids).logits  # the first pass repacks the weights for the CPU kernel
        _, cache = hm.run_with_cache(ids)
        assert torch.equal(hm(ids).logits, reference)
        check_identities(hm, cache, torch.ones(ids.shape, dtype=torch.bool))
        for name, module in quantized_linears(q).items():
            qs = module.weight.quant_state
            code = qs.code.float().sort().values
            half_gap = (code[1:] - code[:-1]).max().item() / 2
            W = _float_linear_weight(fp.get_submodule(name)).T.detach()  # [out, in]: blocks run along rows
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
    layer = bnb.nn.Linear4bit(n_in, n_out, bias=True, quant_type=quant_type, compress_statistics=nested,
                              compute_dtype=torch.float32, quant_storage=storage)
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


# --- formats without a dequantizer: clear errors, never packed storage ----------------------------------------


class PackedInt4Linear(nn.Module):
    """A GPTQ-like layer: 4-bit values packed eight to an int32, with per-row scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        W = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scales = W.abs().amax(1, keepdim=True) / 7
        codes = (torch.round(W / scales).clamp(-8, 7) + 8).to(torch.int32).reshape(W.shape[0], -1, 8)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        self.register_buffer("qweight", (codes << shifts).sum(-1, dtype=torch.int32))
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        codes = (self.qweight.unsqueeze(-1) >> shifts) & 0xF
        W = (codes.reshape(self.out_features, -1).float() - 8) * self.scales
        return x @ W.T.to(x.dtype)


class Int8StorageLinear(nn.Linear):
    """An ``nn.Linear`` subclass whose weight holds int8 codes (scales elsewhere)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False)
        scale = linear.weight.detach().abs().amax(1, keepdim=True) / 127
        self.weight = nn.Parameter(torch.round(linear.weight.detach() / scale).to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.float() * self.scale).T.to(x.dtype)


def _one_layer_llama() -> nn.Module:
    """A one-block float32 Llama (eager: the core's explicit attention equals it bitwise) for weight-format tests."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=8, vocab_size=32, max_position_embeddings=16)
    return fp32_model(config, 0, "eager")


def _hooks_work_but_q_weight_is_refused(model: nn.Module) -> tuple[Any, WeightUnavailableError]:
    """Every hook point runs bitwise (none reads a weight); ``W_Q`` raises naming q_proj; the plain float
    layers still read. Returns the wrapper and the ``W_Q`` error."""
    ids = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(0))
    hm = wrap(model, "llama")
    with torch.no_grad():
        reference = model(ids).logits
        logits, cache = hm.run_with_cache(ids)
    assert torch.equal(logits, reference)  # hook points work: they never read the weight
    assert cache["blocks.0.attn.hook_q"].shape == (1, 5, 2, 8)
    with pytest.raises(WeightUnavailableError, match=r"model\.layers\.0\.self_attn\.q_proj") as info:
        hm.W_Q
    assert hm.W_O.shape == (1, 2, 8, 16) and hm.W_in.shape == (1, 16, 24)  # plain float linears still read
    return hm, info.value


@_skip_without(lensadapters_llama, "lensadapters-llama")
@pytest.mark.parametrize("packed", [PackedInt4Linear, Int8StorageLinear], ids=["packed-int4", "int8-nn.Linear"])
def test_unknown_packed_linear_raises_instead_of_returning_storage(packed: type) -> None:
    model = _one_layer_llama()
    attn = model.model.layers[0].self_attn
    attn.q_proj = packed(attn.q_proj)  # a model whose q_proj comes from some quantization library
    hm, error = _hooks_work_but_q_weight_is_refused(model)
    assert packed.__name__ in str(error)
    hm.unwrap()


class CodesWeight(torch.Tensor):
    """A torchao-style quantized weight: a tensor subclass kept in a plain ``nn.Linear``.

    Its storage holds integer codes (as float32, so the dtype looks like a float matrix); ``F.linear``
    dequantizes them with per-row scales kept on the side, so the model computes with the real weight.
    """

    scale: torch.Tensor

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor) -> "CodesWeight":
        t = torch.Tensor._make_subclass(cls, codes, False)
        t.scale = scale
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            with torch._C.DisableTorchFunctionSubclass():
                return torch.nn.functional.linear(x, w * w.scale, b)
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.detach:  # nn.Parameter(...) detaches: keep the scales
            out.scale = args[0].scale
        return out


@_skip_without(lensadapters_llama, "lensadapters-llama")
def test_plain_linear_with_a_quantized_or_integer_weight_is_refused() -> None:
    """The core's default reader returns the weight of a plain ``nn.Linear`` only when it is a floating-point
    ``torch.Tensor``/``nn.Parameter``: a tensor-subclass weight (torchao style) or an int8 weight is refused."""
    model = _one_layer_llama()
    attn = model.model.layers[0].self_attn
    W = attn.q_proj.weight.detach()
    scale = W.abs().amax(1, keepdim=True) / 127
    attn.q_proj.weight = nn.Parameter(CodesWeight(torch.round(W / scale), scale), requires_grad=False)
    assert type(attn.q_proj) is nn.Linear and attn.q_proj.weight.dtype == torch.float32
    hm, error = _hooks_work_but_q_weight_is_refused(model)
    message = str(error)
    assert "CodesWeight" in message and "float32" in message and "no installed plugin dequantizes it" in message
    # an int8 weight in a plain nn.Linear (codes whose scales live elsewhere)
    o_proj = attn.o_proj
    o_proj.weight = nn.Parameter(torch.round(o_proj.weight.detach() * 100).to(torch.int8), requires_grad=False)
    with pytest.raises(WeightUnavailableError, match=r"model\.layers\.0\.self_attn\.o_proj.*torch\.int8") as info:
        hm.W_O
    assert "no installed plugin dequantizes it" in str(info.value)
    hm.unwrap()
    # outside any wrapped model the default reader still refuses (and names the layer type)
    from lensadapters import defaults

    loose = nn.Linear(4, 2)
    loose.weight = nn.Parameter(torch.zeros(2, 4, dtype=torch.int8), requires_grad=False)
    with pytest.raises(WeightUnavailableError, match="nn.Linear.*int8"):
        defaults.lensadapters_linear_weight(module=loose)
    plain = nn.Linear(4, 2)
    lw = defaults.lensadapters_linear_weight(module=plain)
    assert lw.W is not None and torch.equal(lw.W, plain.weight.T) and lw.b is plain.bias


def test_bitsandbytes_layers_without_a_dequantizer_raise() -> None:
    broken = bnb.nn.Linear8bitLt(8, 4, bias=False, has_fp16_weights=False)
    broken.weight = bnb.nn.Int8Params(torch.ones(4, 8, dtype=torch.int8), has_fp16_weights=False,
                                      requires_grad=False)  # int8 codes, scales lost
    with pytest.raises(WeightUnavailableError, match="Linear8bitLt.*SCB"):
        lb.lensadapters_linear_weight(module=broken, read=None)
    with pytest.raises(WeightUnavailableError, match="OutlierAwareLinear.*no dequantizer"):
        lb.lensadapters_linear_weight(module=bnb.nn.OutlierAwareLinear(8, 4), read=None)
    assert lb.lensadapters_linear_weight(module=nn.Linear(8, 4), read=None) is None  # not ours


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


# --- LoRA over 8-bit: the seed-002 stack ------------------------------------------------------------------------

needs_peft = pytest.mark.skipif(lensadapters_peft is None, reason="lensadapters-peft is not installed")


def _nonzero_lora(model: nn.Module, seed: int) -> None:
    """PEFT starts with B = 0 (a zero delta); give the factors values so the adapter does something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(p.shape)))


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


@needs_peft
@_skip_without(lensadapters_llama, "lensadapters-llama")
def test_seed_stack_llama_8bit_lora_end_to_end() -> None:
    """Llama loaded in 8-bit, prepared for k-bit training, LoRA r=8, alpha 16, dropout 0.05 on q_proj/v_proj."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import LlamaConfig

    import lensadapters_peft as lp

    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    base = quantize(fp32_model(config, 0, "eager"), "int8", torch.float16)
    # float16 -> float32 outside the int8 layers, reentrant gradient checkpointing (PEFT's default, said explicitly)
    base = prepare_model_for_kbit_training(base, gradient_checkpointing_kwargs={"use_reentrant": True})
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, bias="none",
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    _nonzero_lora(peft_model, 0)
    peft_model.eval()
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert lb.is_quantized_linear(q_proj.base_layer) and not lb.is_quantized_linear(q_proj)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(3, 64, (2, 8), generator=g)
    corrupt = clean.clone()
    corrupt[:, 3] = (clean[:, 3] + 7) % 61 + 3
    with torch.no_grad():
        reference = peft_model(clean).logits

    hooks_before = _hook_count(peft_model)
    hm = HookedModel.wrap(peft_model, registry=registry(lensadapters_llama, lb, lp))
    assert hm.model is peft_model
    lora_points = lp.lora_hook_names(hm)
    assert lora_points == [f"blocks.{i}.attn.hook_{p}_lora" for i in range(2) for p in ("q", "v")]
    valid = torch.ones(clean.shape, dtype=torch.bool)
    with torch.no_grad():
        # no hooks: PEFT's own forward, bit for bit
        assert torch.equal(hm(clean).logits, reference)
        logits, cache = hm.run_with_cache(clean)
        assert torch.equal(logits, reference)
        assert set(cache.keys()) == set(hm.cache_names())

        # effective weights = dequantized 8-bit base + B·A·scaling, and the identities hold within the int8 bound
        for i in range(2):
            attn = hm.block_modules[i].self_attn
            base_q = lb.dequantized_weight(attn.q_proj.base_layer).W.unflatten(-1, (4, 8)).permute(1, 0, 2)
            assert_close(hm.W_Q[i], base_q + lp.lora_factors(hm, i, "q").W, "W_Q = dequantized base + LoRA", atol=1e-6)
            base_k = lb.dequantized_weight(attn.k_proj).W.unflatten(-1, (2, 8)).permute(1, 0, 2)
            assert torch.equal(hm._W_K[i], base_k)  # k_proj has no adapter
            x = norm_out(hm, cache, f"blocks.{i}.ln1", hm.block_modules[i].input_layernorm)
            delta = torch.einsum("bpm,hmd->bphd", x, lp.lora_factors(hm, i, "q").W)
            assert_close(cache["blocks.{}.attn.hook_q_lora".format(i)], delta, "hook_q_lora == x @ A @ B * s", atol=1e-5)
        check_identities(hm, cache, valid)

        # activation patching: the clean residual stream patched into the corrupted run gives the clean logits
        _, clean_cache = hm.run_with_cache(clean, names_filter="blocks.1.hook_resid_pre")
        patched = hm.run_with_hooks(corrupt, fwd_hooks=[
            ("blocks.1.hook_resid_pre", lambda t, hook: clean_cache[hook.name])])
        assert torch.equal(patched, reference)
        corrupted = hm(corrupt).logits
        assert not torch.equal(corrupted, reference)

        def patch_z_head0(z: torch.Tensor, hook: Any) -> torch.Tensor:
            z = z.clone()
            z[:, :, 0] = clean_z[:, :, 0]
            return z

        _, z_cache = hm.run_with_cache(clean, names_filter="blocks.0.attn.hook_z")
        clean_z = z_cache["z", 0]
        assert not torch.equal(hm.run_with_hooks(corrupt, fwd_hooks=[("blocks.0.attn.hook_z", patch_z_head0)]),
                               corrupted)

        # LoRA-delta hooks: zeroing every delta is running the 8-bit base model
        zeroed = hm.run_with_hooks(clean, fwd_hooks=[(lambda n: n.endswith("_lora"), lambda t, hook: torch.zeros_like(t))])
        with lp.adapters_disabled(hm):
            base_logits = hm(clean).logits
        assert torch.equal(zeroed, base_logits) and not torch.equal(base_logits, reference)

    # one training step with hooks attached (dropout active, gradient checkpointing from prepare_model_for_kbit_training)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.SGD(trainable, lr=0.05)
    steer = torch.randn(32, generator=torch.Generator().manual_seed(2)) * 0.1
    seen_grads: list[torch.Tensor] = []

    def steer_fn(t: torch.Tensor, hook: Any) -> torch.Tensor:
        return t + steer.to(t.dtype)

    def keep_grad(grad: torch.Tensor, hook: Any) -> None:
        seen_grads.append(grad)

    def eval_loss() -> float:
        peft_model.eval()
        with torch.no_grad(), hm.hooks([("blocks.0.hook_resid_pre", steer_fn)]):
            return hm(clean, labels=clean).loss.item()

    before = eval_loss()
    peft_model.train()
    with hm.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", steer_fn)], bwd_hooks=[("blocks.1.attn.hook_q_lora", keep_grad)]):
        loss = hm(clean, labels=clean, use_cache=False).loss
        loss.backward()
    assert seen_grads and seen_grads[-1].abs().sum() > 0
    grads = [p.grad for p in trainable]
    assert all(gr is not None for gr in grads) and sum(gr.abs().sum() for gr in grads) > 0
    assert all(p.grad is None for n, p in peft_model.named_parameters() if not p.requires_grad)
    optimizer.step()
    optimizer.zero_grad()
    after = eval_loss()
    assert after < before, (before, after)
    assert hm.unwrap() is peft_model
    assert _hook_count(peft_model) == hooks_before  # PEFT's own hooks (input require-grads) only


@needs_peft
@_skip_without(lensadapters_llama, "lensadapters-llama")
def test_lora_over_8bit_disable_switch_merge() -> None:
    """Two LoRA adapters over an 8-bit Llama: disabled is the 8-bit base bitwise, switching follows PEFT
    exactly, merged agrees with unmerged within the int8 requantization bound.

    Merging into 8-bit (PEFT's ``lora.Linear8bitLt.merge``) dequantizes the base, adds ``B·A·scaling`` in
    float32 and quantizes the sum again (``Int8Params``: cast to float16, each row rounded to steps of
    ``absmax_row / 127``). So the merged weight ``W_m`` read by ``hm.W_Q`` is within
    ``absmax_row(W) / 254 · (1 + 2^-10) + |W| · (2^-11 + 5e-5)`` of the unmerged effective weight ``W`` (half an
    int8 step, the float16 cast, the float32 dequantization). With the same input ``x`` the merged projection
    differs from the unmerged one by at most ``|x| @ that bound`` plus the two int8 matmul errors
    (``matmul_error_bound`` of ``W_m`` and of the base): checked on layer 0, whose input the merge does not
    change. Deeper layers see that difference propagated; there the TransformerLens identities are checked
    with the merged weights, which are exactly what the int8 kernel multiplies with.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig

    import lensadapters_peft as lp

    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    fp = fp32_model(config, 3, "eager")
    base8 = quantize(fp, "int8")
    pm = get_peft_model(quantize(fp, "int8"), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                                         target_modules=["q_proj", "v_proj"]))
    pm.add_adapter("other", LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "o_proj"]))
    _nonzero_lora(pm, 3)
    pm.eval()
    hm = HookedModel.wrap(pm, registry=registry(lensadapters_llama, lb, lp))
    hb = wrap(base8, "llama")
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    valid = torch.ones(ids.shape, dtype=torch.bool)
    weights = ("W_Q", "_W_K", "_W_V", "W_O", "W_in", "W_out", "W_gate")
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids)
        assert torch.equal(logits, pm(ids).logits)
        base_logits, base_cache = hb.run_with_cache(ids)

        # disabled: the 8-bit base model, bit for bit (hooks, logits and weights)
        with lp.adapters_disabled(hm):
            off_logits, off_cache = hm.run_with_cache(ids)
            for w in weights:
                assert torch.equal(getattr(hm, w), getattr(hb, w)), f"disabled {w}"
        assert torch.equal(off_logits, base_logits) and not torch.equal(logits, base_logits)
        for name in base_cache.keys():
            assert torch.equal(off_cache[name], base_cache[name]), f"disabled {name}"
        for name in lp.lora_hook_names(hm):
            assert not off_cache[name].any(), name
            # "default" adapts q_proj and v_proj; o_proj has only the inactive "other"
            assert (cache[name].abs().max() > 0) == (not name.endswith("hook_o_lora")), name

        # switched to "other" (q_proj, o_proj): PEFT's forward bitwise, the deltas and weights of "other"
        q0 = pm.base_model.model.model.layers[0].self_attn.q_proj
        seen: list[torch.Tensor] = []
        handle = q0.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        with lp.using_adapter(hm, "other"):
            other_logits, other = hm.run_with_cache(ids)
            handle.remove()
            assert torch.equal(other_logits, pm(ids).logits)
            delta = q0.lora_B["other"](q0.lora_A["other"](seen[0])) * q0.scaling["other"]
            assert torch.equal(other["blocks.0.attn.hook_q_lora"], delta.unflatten(-1, (4, 8)))
            assert not other["blocks.0.attn.hook_v_lora"].any() and other["blocks.0.attn.hook_o_lora"].abs().max() > 0
            for i in range(2):
                factors = lp.lora_factors(hm, i, "q")
                assert factors.adapter == "other"
                assert_close(hm.W_Q[i], hb.W_Q[i] + factors.W, f"W_Q[{i}] with 'other'", atol=1e-6)
            assert torch.equal(hm._W_V, hb._W_V)  # "other" does not adapt v_proj
            check_identities(hm, other, valid)
        assert pm.active_adapters == ["default"] and not torch.equal(other_logits, logits)
        assert torch.equal(hm(ids).logits, logits)

        # merged into the int8 weights
        unmerged = {w: getattr(hm, w) for w in ("W_Q", "_W_V")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Merge lora module to 8-bit linear may get different generations"
            pm.merge_adapter()
        merged_logits, merged = hm.run_with_cache(ids)
        assert torch.equal(merged_logits, pm(ids).logits)
        assert set(merged.keys()) == set(cache.keys())
        for w, W in unmerged.items():
            Wm = getattr(hm, w)
            step = W.abs().amax(dim=-2, keepdim=True) / 254  # per output feature: max over d_model
            bound = step * (1 + 2**-10) + W.abs() * (2**-11 + 5e-5) + 1e-7
            assert_within_bound(Wm, W, bound, f"merged {w} requantized")
            assert not torch.equal(Wm, W)  # the merge really requantized
        # layer 0: the same input before and after the merge
        assert torch.equal(merged["blocks.0.ln1.hook_normalized"], cache["blocks.0.ln1.hook_normalized"])
        x = norm_out(hm, cache, "blocks.0.ln1", hm.block_modules[0].input_layernorm)
        attn = pm.base_model.model.model.layers[0].self_attn
        for short, w, module in (("q", "W_Q", attn.q_proj), ("v", "_W_V", attn.v_proj)):
            W, Wm = unmerged[w][0], getattr(hm, w)[0]  # [h, d_model, d_head]
            flat = lambda t: t.permute(1, 0, 2).flatten(-2)  # noqa: E731  [d_model, h * d_head]
            step = W.abs().amax(dim=-2, keepdim=True) / 254
            w_bound = flat(step * (1 + 2**-10) + W.abs() * (2**-11 + 5e-5) + 1e-7)
            base_W = lb.dequantized_weight(module.base_layer).W  # the unmerged run multiplied x with the base
            bound = (x.abs() @ w_bound + lb.matmul_error_bound(module, x, flat(Wm))
                     + lb.matmul_error_bound(module.base_layer, x, base_W))
            ratio = assert_within_bound(merged[short, 0].flatten(-2), cache[short, 0].flatten(-2), bound,
                                        f"layer 0 hook_{short}, merged vs unmerged")
            assert ratio > 0  # (the values did change)
        check_identities(hm, merged, valid)
        # the merged delta points recompute B·A·x·scaling from the input
        assert_close(merged["blocks.0.attn.hook_q_lora"], cache["blocks.0.attn.hook_q_lora"], "merged q delta",
                     atol=1e-5)
        rel = ((merged_logits - logits).norm() / logits.norm()).item()
        assert rel <= FLOAT_AGREEMENT_PER_BLOCK * 3, f"merged logits: relative difference {rel:.3g}"
    assert hm.unwrap() is pm
    hb.unwrap()


@st.composite
def _fused_lora_case(draw: Any) -> tuple[str, Any]:
    arch = draw(st.sampled_from([a for a in ("gpt2", "gpt_neox") if ARCHS[a] is not None]))
    return arch, draw(configs(arch))


@needs_peft
@pytest.mark.skipif(lensadapters_gpt2 is None and lensadapters_gpt_neox is None, reason="no fused-QKV plugin")
@SETTINGS
@given(data=st.data())
def test_lora_on_fused_8bit_qkv(data: st.DataObject) -> None:
    """LoRA on an 8-bit fused projection (GPT-2 ``c_attn``, GPT-NeoX ``query_key_value``): the delta is split
    with the base weight's layout and the identities hold with base (dequantized) + delta."""
    from peft import LoraConfig, get_peft_model

    import lensadapters_peft as lp

    arch, config = data.draw(_fused_lora_case(), label="case")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    target = "c_attn" if arch == "gpt2" else "query_key_value"
    base = quantize(fp32_model(config, seed, "eager"), "int8")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=[target],
                                                 fan_in_fan_out=False))
    _nonzero_lora(peft_model, seed)
    peft_model.eval()
    ids = torch.randint(3, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed))
    hm = HookedModel.wrap(peft_model, registry=registry(ARCHS[arch], lb, lp))
    with torch.no_grad():
        reference = peft_model(ids).logits
        logits, cache = hm.run_with_cache(ids)
        assert torch.equal(logits, reference)
        check_identities(hm, cache, torch.ones(ids.shape, dtype=torch.bool))
        for i in range(hm.cfg.n_layers):
            for which in "qkv":
                factors = lp.lora_factors(hm, i, which)
                with lp.adapters_disabled(hm):
                    base_W = getattr(hm, {"q": "W_Q", "k": "_W_K", "v": "_W_V"}[which])[i]
                full = getattr(hm, {"q": "W_Q", "k": "_W_K", "v": "_W_V"}[which])[i]
                assert_close(full, base_W + factors.W, f"layer {i} W_{which} = base + LoRA", atol=1e-6)
    hm.unwrap()
