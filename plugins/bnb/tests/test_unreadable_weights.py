"""Weights that cannot be read: formats without a dequantizer give a clear error naming the layer and the
format, never packed storage returned as if it were a matrix; hook points keep working.

The model is a tiny Hugging Face Llama (its ``q_proj``/``o_proj`` replaced by other storage formats), wrapped
with the installed plugin that supports it (skipped when none is installed).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
import lensadapters_bnb as lb  # noqa: E402

from lensadapters import HookedModel, WeightUnavailableError, hf  # noqa: E402
from lensadapters.testing import registry_for, seeded_model  # noqa: E402


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

    sizes = hf.size_fields(hidden=16, d_mlp=24, layers=1, heads=2, kv_heads=2, vocab=32, positions=16)
    config = LlamaConfig(**sizes, head_dim=8)
    return seeded_model(config, 0, "eager")


def _hooks_work_but_q_weight_is_refused(model: nn.Module) -> tuple[Any, WeightUnavailableError]:
    """Every hook point runs bitwise (none reads a weight); ``W_Q`` raises naming q_proj; the plain float
    layers still read. Returns the wrapper and the ``W_Q`` error."""
    ids = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(0))
    hm = HookedModel.wrap(model, registry=registry_for("llama", lb))
    with torch.no_grad():
        reference = model(ids).logits
        logits, cache = hm.run_with_cache(ids)
    assert torch.equal(logits, reference)  # hook points work: they never read the weight
    assert cache["blocks.0.attn.hook_q"].shape == (1, 5, 2, 8)
    with pytest.raises(WeightUnavailableError, match=r"model\.layers\.0\.self_attn\.q_proj") as info:
        _ = hm.W_Q
    assert hm.W_O.shape == (1, 2, 8, 16) and hm.W_in.shape == (1, 16, 24)  # plain float linears still read
    return hm, info.value


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
        _ = hm.W_O
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
    broken.weight = bnb.nn.Int8Params(
        torch.ones(4, 8, dtype=torch.int8), has_fp16_weights=False, requires_grad=False
    )  # int8 codes, scales lost
    with pytest.raises(WeightUnavailableError, match="Linear8bitLt.*SCB"):
        lb.lensadapters_linear_weight(module=broken, read=None)
    with pytest.raises(WeightUnavailableError, match="OutlierAwareLinear.*no dequantizer"):
        lb.lensadapters_linear_weight(module=bnb.nn.OutlierAwareLinear(8, 4), read=None)
    assert lb.lensadapters_linear_weight(module=nn.Linear(8, 4), read=None) is None  # not ours
