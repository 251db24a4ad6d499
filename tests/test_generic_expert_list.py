"""Experts in a ``ModuleList`` of gated MLPs, routed by the MoE module itself from a linear router's logits (softmax,
top-k, each expert called on the rows of its tokens, its output times the routing weight ``index_add``-ed:
transformers 4.57's Jamba, Mixtral and Qwen2-MoE blocks, Qwen2-MoE's with a shared expert the MoE module adds times
the sigmoid of its gate's logit), described by the generic adapter with no plugin
(:class:`lensadapters.moe.ExpertModules`, ``router_output="logits"``): every claim proven on the probe. Their layers
get ``mlp.hook_router_logits``, ``mlp.hook_routing_weights`` and each chosen expert's ``hook_gate`` / ``hook_pre`` /
``hook_post``. Their values are what the HF modules compute (written out here from the router's and the experts'
weights), an edit of each moves the logits as the same plain PyTorch hook on the HF modules does, and the gradients
through an edit are the plain hook's. Before, these layers had no ``mlp.*`` point. (transformers 5 stores these
experts in 3-D parameters: skipped there.)"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
import transformers

from lensadapters.adapters.generic.verify import check_points
from lensadapters.moe import ExpertModules
from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import (
    add_to_output,
    edit_error,
    record,
    relative_error,
    seeded_delta,
    served_and_plain_gradients,
    tiny_model,
    wrap_generic,
)

pytestmark = pytest.mark.skipif(
    not transformers.__version__.startswith("4."), reason="transformers 4.x's experts in a ModuleList (5.x: 3-D)"
)

Tensor = torch.Tensor
ROUTING = ["mlp.hook_router_logits", "mlp.hook_routing_weights"]
#: model_type: (config, the MoE layers, the MoE module's name, its router's, each expert's gate/up/down, whether the
#: top-k weights are renormalized) — the HF modules the references below are written from, not the description
MODELS: dict[str, tuple[dict, tuple[int, ...], str, str, tuple[str, str, str], bool]] = {
    "jamba": (
        {"use_mamba_kernels": False},
        (1, 3),
        "feed_forward",
        "router",
        ("gate_proj", "up_proj", "down_proj"),
        False,
    ),
    "mixtral": ({}, (0, 1, 2, 3), "block_sparse_moe", "gate", ("w1", "w3", "w2"), True),
    # a shared expert the MoE module adds times the sigmoid of its gate's logit (MoELayout.shared_gate)
    "qwen2_moe": ({"norm_topk_prob": True}, (0, 1), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"), True),
}


@pytest.fixture(scope="module", params=list(MODELS))
def wrapped(request: Any) -> Any:
    model = tiny_model(request.param, **MODELS[request.param][0])
    hm = wrap_generic(model)
    yield request.param, model, hm
    hm.unwrap()


def _moe(model_type: str, model: torch.nn.Module, layer: int) -> torch.nn.Module:
    return getattr(model.model.layers[layer], MODELS[model_type][2])


def _router(model_type: str, moe: torch.nn.Module) -> torch.nn.Module:
    return getattr(moe, MODELS[model_type][3])


def _by_hand(model_type: str, model: torch.nn.Module, layer: int) -> dict[str, Tensor]:
    """The MoE module's input ``x`` ``[tokens, d]``, its router's logits, top-k weights and indices, written out here
    from the router's weight: softmax in float32, top-k, renormalized where the family does, in the input's dtype."""
    moe = _moe(model_type, model, layer)
    seen = record(model, {"x": (moe, "in")})
    x = seen["x"].reshape(-1, seen["x"].shape[-1])
    with torch.no_grad():
        logits = F.linear(x, _router(model_type, moe).weight)
    weights, index = torch.softmax(logits.float(), dim=-1).topk(model.config.num_experts_per_tok, dim=-1)
    if MODELS[model_type][5]:
        weights = weights / weights.sum(-1, keepdim=True)
    return {"x": x, "logits": logits, "weights": weights.to(x.dtype), "index": index, "lead": seen["x"]}


def test_every_moe_layer_is_described_and_its_routing_points_verified(wrapped: Any) -> None:
    model_type, model, hm = wrapped
    _, layers, moe_name, router_name, (gate, up, down), _ = MODELS[model_type]
    for i in layers:
        layout = hm.mlp_layouts[i]
        names = [f"blocks.{i}.{n}" for n in ROUTING]
        assert set(names) <= set(hm.hook_names), i
        assert check_points(hm.wiring, input_ids(), names) == dict.fromkeys(names)
        if layout is not None:  # the decoder form (Mixtral); Jamba's layers are the mixer form's
            assert layout.router == f"{moe_name}.{router_name}"
            assert layout.experts == ExpertModules(f"{moe_name}.experts", gate=gate, up=up, down=down)
            gated = model_type == "qwen2_moe"
            assert layout.shared == (f"{moe_name}.shared_expert" if gated else None)
            assert layout.shared_gate == (f"{moe_name}.shared_expert_gate" if gated else None)
    with torch.no_grad():
        assert torch.equal(hm(input_ids()).logits, model(input_ids()).logits)  # no hooks: the model's own forward


def test_each_point_reads_what_the_hf_modules_compute(wrapped: Any) -> None:
    model_type, model, hm = wrapped
    gate, up, down = MODELS[model_type][4]
    for i in MODELS[model_type][1]:
        ref = _by_hand(model_type, model, i)
        lead = ref["lead"].shape[:-1]
        _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n, i=i: n.startswith(f"blocks.{i}.mlp."))
        assert relative_error(cache[f"blocks.{i}.mlp.hook_router_logits"], ref["logits"].reshape(*lead, -1)) < 1e-6
        assert torch.equal(cache[f"blocks.{i}.mlp.hook_routing_weights"], ref["weights"].reshape(*lead, -1))
        experts = _moe(model_type, model, i).experts
        served = 0
        for e, expert in enumerate(experts):
            slot, token = torch.where(ref["index"].T == e)  # the rows of expert e: slot, then token
            if f"blocks.{i}.mlp.experts.{e}.hook_gate" not in cache:
                continue
            if not token.numel():  # no token chose it: the point fires with no rows
                assert cache[f"blocks.{i}.mlp.experts.{e}.hook_gate"].shape[0] == 0
                continue
            xs = ref["x"][token]
            g, u = F.linear(xs, getattr(expert, gate).weight), F.linear(xs, getattr(expert, up).weight)
            assert relative_error(cache[f"blocks.{i}.mlp.experts.{e}.hook_gate"], g) < 1e-6
            assert relative_error(cache[f"blocks.{i}.mlp.experts.{e}.hook_pre"], u) < 1e-6
            post = cache[f"blocks.{i}.mlp.experts.{e}.hook_post"]
            assert relative_error(post, expert.act_fn(g) * u) < 1e-6
            served += 1
        assert served >= 1
        # the MoE module's output: the routed sum written out here from those weights
        out = torch.zeros_like(ref["x"])
        for e, expert in enumerate(experts):
            slot, token = torch.where(ref["index"].T == e)
            xs = ref["x"][token]
            h = expert.act_fn(F.linear(xs, getattr(expert, gate).weight)) * F.linear(xs, getattr(expert, up).weight)
            out.index_add_(0, token, F.linear(h, getattr(expert, down).weight) * ref["weights"][token, slot, None])
        out = out.detach()
        moe = _moe(model_type, model, i)
        if hasattr(moe, "shared_expert_gate"):  # Qwen2-MoE: plus the gated shared expert, written out too
            shared = moe.shared_expert
            with torch.no_grad():
                h = shared.act_fn(F.linear(ref["x"], shared.gate_proj.weight)) * F.linear(
                    ref["x"], shared.up_proj.weight
                )
                gate_logit = F.linear(ref["x"], moe.shared_expert_gate.weight)
                out = out + torch.sigmoid(gate_logit) * F.linear(h, shared.down_proj.weight)
        y = record(model, {"y": (moe, "out")})["y"]
        assert relative_error(out.reshape(y.shape), y) < 1e-5


def _scale_experts(experts: torch.nn.Module, index: Tensor, weights: Tensor, d: Tensor) -> Callable[[], list]:
    """Plain hooks on each expert multiplying its output rows (slot, then token) by ``(w + d) / w``: the MoE module
    then adds each expert's output times ``w + d``."""

    def hook(e: int) -> Callable[..., Tensor]:
        def post(m: Any, a: Any, o: Tensor) -> Tensor:
            slot, token = torch.where(index.T == e)
            w = weights[token, slot]
            return o * ((w + d[token, slot]) / w)[:, None].to(o.dtype)

        return post

    return lambda: [expert.register_forward_hook(hook(e)) for e, expert in enumerate(experts)]


def _plain_edits(model_type: str, model: torch.nn.Module, layer: int) -> dict[str, tuple[Tensor, Callable]]:
    """Each routing point's value as the HF modules hold it (``[tokens, ...]``) and its plain-hook edit."""
    ref = _by_hand(model_type, model, layer)
    moe = _moe(model_type, model, layer)
    k = ref["weights"].shape[-1]
    return {
        "mlp.hook_router_logits": (
            ref["logits"],
            lambda d: add_to_output(_router(model_type, moe), d.reshape(-1, d.shape[-1])),
        ),
        "mlp.hook_routing_weights": (
            ref["weights"],
            lambda d: _scale_experts(moe.experts, ref["index"], ref["weights"], d.reshape(-1, k)),
        ),
    }


@pytest.mark.parametrize("point", ROUTING)
def test_an_edit_changes_the_logits_as_the_same_plain_hook_does(wrapped: Any, point: str) -> None:
    """An edit of the logits large enough to change which experts some tokens choose (the MoE module routes them),
    or of the routing weights: the logits of the same plain hook on the HF modules."""
    model_type, model, hm = wrapped
    layer = MODELS[model_type][1][-1]
    like, install = _plain_edits(model_type, model, layer)[point]
    scale = float(like.abs().max())
    d = seeded_delta(like, 3) * (scale if point == "mlp.hook_router_logits" else 0.3 * scale)
    if point == "mlp.hook_router_logits":  # the edit changes the selection of some tokens
        k = model.config.num_experts_per_tok
        assert not torch.equal(like.topk(k).indices, (like + d).topk(k).indices)
    error = edit_error(hm, model, f"blocks.{layer}.{point}", d, install(d))
    assert error <= (0.0 if point == "mlp.hook_router_logits" else 1e-5)


def test_an_experts_gate_edit_is_a_plain_hooks(wrapped: Any) -> None:
    """An edit of ``mlp.experts.{e}.hook_gate``: the logits of a plain hook adding it to expert ``e``'s gate
    projection's output."""
    model_type, model, hm = wrapped
    layer = MODELS[model_type][1][-1]
    ref = _by_hand(model_type, model, layer)
    e = int(torch.bincount(ref["index"].flatten()).argmax())
    gate_module = getattr(_moe(model_type, model, layer).experts[e], MODELS[model_type][4][0])
    name = f"blocks.{layer}.mlp.experts.{e}.hook_gate"
    assert name in hm.hook_names
    _, cache = hm.run_with_cache(input_ids(), names_filter=[name])
    d = seeded_delta(cache[name], 4) * float(cache[name].abs().max())
    assert edit_error(hm, model, name, d, add_to_output(gate_module, d)) < 1e-5


@pytest.mark.parametrize("point", ROUTING)
def test_gradients_through_an_edit_are_the_plain_hooks(wrapped: Any, point: str) -> None:
    model_type, model, hm = wrapped
    layer = MODELS[model_type][1][0]
    like, install = _plain_edits(model_type, model, layer)[point]
    served, direct = served_and_plain_gradients(hm, model, f"blocks.{layer}.{point}", like, lambda d: install(d)())
    assert relative_error(served.reshape(direct.shape), direct) < 1e-5
