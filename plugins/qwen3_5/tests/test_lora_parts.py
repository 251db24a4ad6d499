"""Qwen 3.5 under PEFT LoRA: the LoRA delta of each projection whose output the plugin's points show in parts is
served split the same way (the core's ``ProjectionParts``, read by the PEFT plugin):

* the gated ``q_proj``: ``attn.hook_q_lora`` / ``attn.hook_gate_lora`` ``[b, p, h, d_head]``, the query and gate
  columns of each head (the delta's parts that ``attn.hook_q`` / ``attn.hook_gate`` show);
* the DeltaNet's separate projections: ``linear_attn.hook_qkv_lora`` (``in_proj_qkv``), ``hook_z_lora``
  ``[b, p, hv, dv]`` (``in_proj_z``, per value head like ``linear_attn.hook_z``), ``hook_b_lora`` / ``hook_a_lora``;
* the DeltaNet's ``out_proj``: ``hook_attn_out_lora`` (its output is the block's ``hook_attn_out``).

Each value is checked against plain PyTorch hooks on the LoRA modules (``lora_B(lora_A(x)) * scaling``, regrouped
as the model's forward regroups them), each edit's logits against the same edit made by a plain hook on
``lora_B``'s output, gradients through the edits likewise; and each point fires once per forward, in
``hook_names`` order, while the DeltaNet's own points are hooked too (they recompute the mixer)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

peft = pytest.importorskip("peft")

from lensadapters_qwen3_5.configs import qwen3_5_config  # noqa: E402

from lensadapters import HookedModel  # noqa: E402

pytestmark = pytest.mark.transformers5_only

Tensor = torch.Tensor
TARGETS = ["q_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "linear_attn.out_proj"]
#: point -> (its LoRA module relative to the block, the part's index in the model's own regrouping)
POINTS = {
    "blocks.1.attn.hook_q_lora": ("self_attn.q_proj", 0),
    "blocks.1.attn.hook_gate_lora": ("self_attn.q_proj", 1),
    "blocks.0.linear_attn.hook_qkv_lora": ("linear_attn.in_proj_qkv", 0),
    "blocks.0.linear_attn.hook_z_lora": ("linear_attn.in_proj_z", 0),
    "blocks.0.linear_attn.hook_b_lora": ("linear_attn.in_proj_b", 0),
    "blocks.0.linear_attn.hook_a_lora": ("linear_attn.in_proj_a", 0),
    "blocks.0.hook_attn_out_lora": ("linear_attn.out_proj", 0),
}
HEADS = [(2, 4), (1, 1)]  # the DeltaNet's (key, value) heads


def _adapted(heads: tuple[int, int]) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = qwen3_5_config(
        layer_types=["linear_attention", "full_attention"], linear_heads=heads, linear_dims=(4, 6), head_dim=4
    )
    model = AutoModelForCausalLM.from_config(config).double().eval()
    pm = peft.get_peft_model(model, peft.LoraConfig(target_modules=TARGETS, r=3, lora_alpha=5, init_lora_weights=False))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random, non-zero B (PEFT's default B = 0 adds nothing)
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / 3)
    return pm.eval()


def _module(pm: Any, point: str) -> Any:
    layer = pm.get_base_model().model.layers[int(point.split(".")[1])]
    return layer.get_submodule(POINTS[point][0])


def _parts(pm: Any, point: str, t: Tensor) -> tuple[Tensor, ...]:
    """A projection output's parts, regrouped as the model's own code regroups it."""
    layer = pm.get_base_model().model.layers[int(point.split(".")[1])]
    path, lead = POINTS[point][0], t.shape[:-1]
    if path == "self_attn.q_proj":  # Qwen3_5Attention.forward: chunk each head's 2 * d_head columns
        return tuple(torch.chunk(t.view(*lead, -1, layer.self_attn.head_dim * 2), 2, dim=-1))
    if path == "linear_attn.in_proj_z":  # Qwen3_5GatedDeltaNet.forward: z per value head
        return (t.reshape(*lead, -1, layer.linear_attn.head_v_dim),)
    return (t,)


def _in_columns(pm: Any, point: str, part: Tensor) -> Tensor:
    """The projection output holding ``part`` where the model's regrouping takes it from, zeros elsewhere (the
    regrouping is a permutation of the columns: its inverse from the columns' indices)."""
    module = _module(pm, point)
    width = module.base_layer.out_features
    columns = _parts(pm, point, torch.arange(width, dtype=torch.float64)[None, None])[POINTS[point][1]]
    full = part.new_zeros(*part.shape[:2], width)
    full[..., columns.flatten().long()] = part.flatten(2)
    return full


def _ids(pm: Any) -> Tensor:
    vocab = pm.get_base_model().config.vocab_size
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(2))


def _served(pm: Any, point: str, edit: Callable[[Tensor], Tensor]) -> Tensor:
    hm = HookedModel.wrap(pm)
    try:
        return hm.run_with_hooks(_ids(pm), fwd_hooks=[(point, lambda t, hook: edit(t))])
    finally:
        hm.unwrap()


def _plain(pm: Any, point: str, edit: Callable[[Tensor], Tensor]) -> Tensor:
    """The logits with the edit made by a plain hook on ``lora_B``'s output (``delta = lora_B(.) * scaling``)."""
    module = _module(pm, point)
    scaling = module.scaling["default"]

    def hook(m: Any, args: tuple, out: Tensor) -> Tensor:
        delta = out * scaling
        part = _parts(pm, point, delta)[POINTS[point][1]]
        return out + _in_columns(pm, point, edit(part) - part) / scaling

    handle = module.lora_B["default"].register_forward_hook(hook)
    try:
        return pm(_ids(pm)).logits
    finally:
        handle.remove()


def _relative(got: Tensor, want: Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("heads", HEADS)
def test_values_are_the_lora_delta_in_parts(heads: tuple[int, int]) -> None:
    pm = _adapted(heads)
    seen: dict[str, Tensor] = {}
    handles = [
        _module(pm, p).register_forward_pre_hook(lambda m, args, p=p: seen.__setitem__(p, args[0])) for p in POINTS
    ]
    hm = HookedModel.wrap(pm)
    try:
        assert set(POINTS) <= set(hm.hook_names)
        with torch.no_grad():
            _, cache = hm.run_with_cache(_ids(pm), names_filter=list(POINTS))
        for point, (_, index) in POINTS.items():
            m = _module(pm, point)
            delta = m.lora_B["default"](m.lora_A["default"](seen[point])) * m.scaling["default"]
            assert torch.equal(cache[point], _parts(pm, point, delta)[index]), point
    finally:
        hm.unwrap()
        for h in handles:
            h.remove()


@pytest.mark.parametrize("heads", HEADS)
def test_edits_are_the_edit_of_the_lora_output(heads: tuple[int, int]) -> None:
    pm = _adapted(heads)
    with torch.no_grad():
        reference = pm(_ids(pm)).logits
        for i, point in enumerate(POINTS):
            shape = _parts(pm, point, torch.zeros(2, 6, _module(pm, point).base_layer.out_features))
            g = torch.Generator().manual_seed(i)
            e = torch.randn(shape[POINTS[point][1]].shape, generator=g, dtype=torch.float64)

            def edit(t: Tensor, e: Tensor = e) -> Tensor:
                return t * -0.5 + e

            served, plain = _served(pm, point, edit), _plain(pm, point, edit)
            assert _relative(plain, reference) > 1e-4, f"{point}: the edit does not change the logits"
            assert _relative(served, plain) < 1e-12, point


@pytest.mark.parametrize("heads", HEADS[:2])
def test_gradients_through_edits(heads: tuple[int, int]) -> None:
    pm = _adapted(heads)
    for i, point in enumerate(POINTS):
        shape = _parts(pm, point, torch.zeros(2, 6, _module(pm, point).base_layer.out_features))[POINTS[point][1]]
        w = torch.randn(shape.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        grads = []
        for run in (_served, _plain):
            e = torch.zeros(shape.shape, dtype=torch.float64, requires_grad=True)
            run(pm, point, lambda t, e=e, w=w: t + e * w).square().sum().backward()
            grads.append(e.grad)
        assert grads[1].norm() > 0, point
        assert _relative(grads[0], grads[1]) < 1e-10, point


def test_each_point_fires_once_in_order() -> None:
    """With every point hooked (the DeltaNet's own points recompute the mixer at ``out_proj``'s call), each fires
    once per forward, in ``hook_names`` order, and an identity edit keeps the logits."""
    pm = _adapted((2, 4))
    hm = HookedModel.wrap(pm)
    calls: list[str] = []

    def copy(t: Tensor, hook: Any) -> Tensor:
        calls.append(hook.name)
        return t.clone()

    try:
        with torch.no_grad():
            logits = hm.run_with_hooks(_ids(pm), fwd_hooks=[(lambda n: True, copy)])
            assert torch.allclose(logits, pm(_ids(pm)).logits, rtol=0, atol=1e-12)
        assert set(POINTS) <= set(calls)
        assert calls == hm.hook_names
    finally:
        hm.unwrap()
