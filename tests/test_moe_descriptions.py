"""The MoE description language on its own (no architecture): routing orders, fused expert storage (transposed,
interleaved, biased, a declared GLU) as the core computes experts and reads their weights, routers with a bias."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lensadapters.adapters.moe import routing
from lensadapters.adapters.moe.experts import bind, expert_weights_and_biases, router_bias, router_weight
from lensadapters.moe import FusedExperts, MoELayout, Routing

E, D, M = 3, 5, 4


class _Experts(nn.Module):
    def __init__(self, transposed: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        shape_up, shape_down = ((E, D, 2 * M), (E, M, D)) if transposed else ((E, 2 * M, D), (E, D, M))
        self.gate_up_proj = nn.Parameter(torch.randn(shape_up, generator=g))
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * M, generator=g))
        self.down_proj = nn.Parameter(torch.randn(shape_down, generator=g))
        self.down_proj_bias = nn.Parameter(torch.randn(E, D, generator=g))
        self.shift = 0.25


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.weight = nn.Parameter(torch.randn(E, D, generator=g))
        self.bias = nn.Parameter(torch.randn(E, generator=g))


class _Hooks:
    """What the core asks the plugins (nothing answers: plain modules)."""

    def lensadapters_module_attribute(self, module: nn.Module, name: str) -> Any:
        return None

    def lensadapters_wrapped_layer(self, module: nn.Module) -> Any:
        return None


class _Hooked:
    def __init__(self, block: nn.Module, layout: MoELayout) -> None:
        self.block_modules, self.mlp_layouts, self.plugin_hooks = [block], [layout], _Hooks()

    def module_name(self, module: nn.Module) -> str:
        return "block.mlp"

    def read_linear(self, module: nn.Module) -> Any:
        from lensadapters.errors import WeightUnavailableError

        raise WeightUnavailableError("not a linear layer")


def _glu(module: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (up + module.shift) * torch.sigmoid(gate)


def _setup(transposed: bool, interleaved: bool) -> tuple[_Hooked, _Experts]:
    block = nn.Module()
    block.experts, block.router = _Experts(transposed), _Router()
    experts = FusedExperts(
        "experts",
        transposed=transposed,
        interleaved=interleaved,
        gate_up_bias="gate_up_proj_bias",
        down_bias="down_proj_bias",
        glu=_glu,
    )
    layout = MoELayout("router", Routing(E, 2, normalize=False, order="topk_softmax"), experts, "scores")
    return _Hooked(block, layout), block.experts


def test_fused_storage_flags_compute_each_expert_and_read_its_weights() -> None:
    """Transposed (``x @ W``) or not (``F.linear``), interleaved (gate at even features) or halved gate/up, with
    biases and a declared GLU: each expert computes ``glu(x W_gate + b_gate, x W_in + b_in) W_out + b_out``, the
    read weights in TransformerLens' orientation."""
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(2))
    for transposed in (True, False):
        for interleaved in (True, False):
            hooked, module = _setup(transposed, interleaved)
            compute = bind(hooked, hooked.block_modules[0], hooked.mlp_layouts[0])  # type: ignore[arg-type]
            (W_gate, b_gate), (W_in, b_in), (W_out, b_out) = (
                expert_weights_and_biases(hooked, 0, role)  # type: ignore[arg-type]
                for role in ("gate", "in", "out")
            )
            assert W_gate.shape == W_in.shape == (E, D, M) and W_out.shape == (E, M, D)
            W = module.gate_up_proj if transposed else module.gate_up_proj.transpose(-2, -1)
            gate_cols = slice(0, None, 2) if interleaved else slice(0, M)
            assert torch.equal(W_gate, W[..., gate_cols]) and torch.equal(
                b_gate, module.gate_up_proj_bias[:, gate_cols]
            )
            for e in range(E):
                gate, up = compute.gate_up(e, x)
                torch.testing.assert_close(gate, x @ W_gate[e] + b_gate[e])
                torch.testing.assert_close(up, x @ W_in[e] + b_in[e])
                post = compute.glu(gate, up)
                assert torch.equal(post, (up + 0.25) * torch.sigmoid(gate))
                torch.testing.assert_close(compute.down(e, post), post @ W_out[e] + b_out[e])


def test_topk_then_softmax_routing_and_a_router_bias() -> None:
    """``order="topk_softmax"``: the top-k logits are selected, the softmax taken over them and scattered (zeros
    elsewhere); the selection comes from the logits, the weights are read from the probabilities there (an edit of
    an unselected probability changes nothing). A router module with a bias: ``router_weight``/``router_bias``."""
    hooked, _ = _setup(True, True)
    spec = hooked.mlp_layouts[0].routing
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(3))
    probs, weights, index = routing.route(spec, logits)
    top = torch.topk(logits, 2, dim=-1)
    assert torch.equal(index, top.indices)
    assert torch.equal(weights, torch.softmax(top.values, dim=-1))
    assert torch.equal(probs.gather(-1, index), weights) and (probs.count_nonzero(-1) == 2).all()
    edited = probs + (probs == 0) * 5.0
    assert torch.equal(routing.select(spec, edited, logits)[0], weights)
    router = hooked.block_modules[0].router
    assert torch.equal(router_weight(hooked, 0), router.weight.T)  # type: ignore[arg-type]
    assert torch.equal(router_bias(hooked, 0), router.bias)  # type: ignore[arg-type]


def test_topk_then_sigmoid_routing() -> None:
    """``order="topk_sigmoid"``: the top-k logits are selected and the sigmoid of each taken (in float32, then the
    logits' dtype), scattered over the experts with zeros elsewhere; no renormalization; an edit of a probability
    outside the selection changes nothing, one inside it is that slot's weight."""
    spec = Routing(E, 2, normalize=False, probabilities="sigmoid", order="topk_sigmoid")
    logits = torch.randn(6, E, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    probs, weights, index = routing.route(spec, logits)
    top = torch.topk(logits, 2, dim=-1)
    assert torch.equal(index, top.indices) and weights.dtype == probs.dtype == torch.float64
    assert torch.equal(weights, top.values.float().sigmoid().double())
    assert torch.equal(probs.gather(-1, index), weights) and (probs.count_nonzero(-1) == 2).all()
    assert not torch.allclose(weights.sum(-1), torch.ones(6, dtype=torch.float64))
    outside = probs + (probs == 0) * 5.0
    assert torch.equal(routing.select(spec, outside, logits)[0], weights)
    inside = probs.scatter(-1, index[:, :1], 0.75)
    assert torch.equal(routing.select(spec, inside, logits)[0][:, 0], torch.full((6,), 0.75, dtype=torch.float64))
