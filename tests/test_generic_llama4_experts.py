"""Llama 4's mixture of experts (its routing weights scale the experts' *input*), described by the generic adapter:
``mlp.hook_expert_weights`` (the router's scores), ``mlp.hook_expert_indices`` (the top-k of its logits) and the
per-expert points ``mlp.experts.{e}.hook_gate``/``hook_pre``/``hook_post``/``hook_result`` are served (verified at
wrap), read what the experts written out by hand from the live HF parameters compute (the expert's input being the
token's MLP input times its score, as the model computes it), and an edit of each changes the logits exactly as the
same edit in a hand-written MoE forward does; gradients through an edit match finite differences; with no hook the
model runs HF's own forward bitwise. Before this, none of these points was served (the generic adapter had no
reference for them)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lensadapters import HookedModel
from lensadapters.adapters.generic import findings
from lensadapters.moe import MoELayout
from lensadapters.testing import assert_close
from lensadapters.testing.every_model_type import input_ids
from lensadapters.testing.scan_checks import check_gradient_through_an_edit
from tests.llama4_helpers import TOP_K, llama4_model, llama4_parts, llama4_wrap

STEPS = ("hook_gate", "hook_pre", "hook_post", "hook_result")


@pytest.fixture(scope="module", params=["llama4_text", "llama4"])
def wrapped(request: Any) -> Any:
    model = llama4_model(request.param)
    hm = llama4_wrap(model)
    yield model, hm
    hm.unwrap()


Edit = Optional[Callable[[torch.Tensor], torch.Tensor]]


def _by_hand(hm: HookedModel, layer: int, edits: dict[str, Any], seen: dict[str, Any]) -> Any:
    """A forward hook replacing the MoE module's output by a hand-written MoE forward from the HF parameters (read
    live), with ``edits`` made inside it: ``"weights"`` of the scores ``[t, E]`` at the selected experts,
    ``"indices"`` ``[t, k]`` (each slot keeping its score), ``(e, step)`` of expert ``e``'s step on its rows (slot,
    then token). ``seen`` gets the unedited values under the same keys."""
    moe, router, experts, shared = llama4_parts(hm, layer)
    n, m = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[-1] // 2

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        x = args[0].reshape(-1, args[0].shape[-1])
        logits = F.linear(x, router.weight)
        top, index = torch.topk(logits, TOP_K, dim=-1)
        scores = torch.zeros_like(logits).scatter(-1, index, torch.sigmoid(top))
        seen.setdefault("weights", scores)
        seen.setdefault("indices", index)
        if "weights" in edits:
            scores = torch.where(scores != 0, edits["weights"](scores), scores)
        weights = scores.gather(-1, index)
        if "indices" in edits:
            index = edits["indices"](index)
        out = shared(x)
        for e in range(n):
            slot, token = torch.where(index.T == e)
            xs = x[token] * weights[token, slot, None]
            gate_up = xs @ experts.gate_up_proj[e]
            steps = {"hook_gate": gate_up[:, :m], "hook_pre": gate_up[:, m:]}
            for step in ("hook_gate", "hook_pre"):
                seen.setdefault((e, step), steps[step])
                steps[step] = edits.get((e, step), lambda t: t)(steps[step])
            post = experts.act_fn(steps["hook_gate"]) * steps["hook_pre"]
            seen.setdefault((e, "hook_post"), post)
            post = edits.get((e, "hook_post"), lambda t: t)(post)
            result = post @ experts.down_proj[e]
            seen.setdefault((e, "hook_result"), result)
            result = edits.get((e, "hook_result"), lambda t: t)(result)
            out = out.index_add(0, token, result)
        return (out, logits)

    return moe.register_forward_hook(hook)


def test_the_points_are_served_on_every_moe_layer_and_nothing_is_unverified(wrapped: Any) -> None:
    model, hm = wrapped
    names = set(hm.hook_names)
    n = hm.mlp_layouts[0].routing.n_experts
    for i, layout in enumerate(hm.mlp_layouts):
        assert isinstance(layout, MoELayout)
        expected = {f"blocks.{i}.mlp.hook_expert_weights", f"blocks.{i}.mlp.hook_expert_indices"}
        expected |= {f"blocks.{i}.mlp.experts.{e}.{s}" for e in range(n) for s in STEPS}
        assert expected <= names
    assert "unverified" not in findings(model).missing


def test_values_are_the_hand_written_experts_and_no_hook_is_hfs_forward_bitwise(wrapped: Any) -> None:
    model, hm = wrapped
    ids = input_ids()
    layer = len(hm.block_modules) - 1
    n = hm.mlp_layouts[layer].routing.n_experts
    names = [f"blocks.{layer}.mlp.hook_expert_weights", f"blocks.{layer}.mlp.hook_expert_indices"]
    names += [f"blocks.{layer}.mlp.experts.{e}.{s}" for e in range(n) for s in STEPS]
    with torch.no_grad():
        own = model(ids).logits
        assert torch.equal(hm(ids).logits, own)
        logits, cache = hm.run_with_cache(ids, names_filter=names)
        seen: dict[Any, Any] = {}
        handle = _by_hand(hm, layer, {}, seen)
        try:
            model(ids)
        finally:
            handle.remove()
    assert torch.equal(logits, own)
    assert torch.equal(cache[names[0]], seen["weights"].reshape(*ids.shape, -1))
    assert torch.equal(cache[names[1]], seen["indices"].reshape(*ids.shape, -1))
    rows = 0
    for e in range(n):
        for s in STEPS:
            assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.{s}"], seen[(e, s)], f"expert {e} {s}")
        rows += seen[(e, "hook_result")].shape[0]
    assert rows == ids.numel() * TOP_K


def _integer_move(index: torch.Tensor, n: int) -> torch.Tensor:
    """Every token's first slot moved to the next expert it did not select."""
    moved = index.clone()
    for j in range(1, n):
        candidate = (index[..., 0] + j) % n
        free = ~(candidate.unsqueeze(-1) == index).any(-1) & (moved[..., 0] == index[..., 0])
        moved[..., 0] = torch.where(free, candidate, moved[..., 0])
    return moved


def _cases(n: int) -> list[tuple[str, Any]]:
    cases: list[tuple[str, Any]] = [("mlp.hook_expert_weights", "weights"), ("mlp.hook_expert_indices", "indices")]
    return cases + [(f"mlp.experts.{e}.{s}", (e, s)) for e in range(n) for s in STEPS]


@pytest.mark.parametrize("case", range(18))
def test_an_edit_moves_the_logits_as_the_same_edit_in_the_hand_written_moe(wrapped: Any, case: int) -> None:
    model, hm = wrapped
    ids = input_ids()
    layer = 0
    n = hm.mlp_layouts[layer].routing.n_experts
    if case >= len(_cases(n)):
        pytest.skip("the toy config has fewer experts")
    point, key = _cases(n)[case]
    name = f"blocks.{layer}.{point}"
    generator = torch.Generator().manual_seed(case)

    def edit(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return _integer_move(t, n)
        return t + 0.3 * torch.randn(t.shape, generator=generator).to(t.dtype)

    with torch.no_grad():
        own = model(ids).logits
        edited = hm.run_with_hooks(ids, fwd_hooks=[(name, lambda t, hook: edit(t))])
        generator.manual_seed(case)

        def flat_edit(t: torch.Tensor) -> torch.Tensor:  # the same delta, shown [b, p, ...] at the point
            shown = t.reshape(*ids.shape, -1) if key in ("weights", "indices") else t
            return edit(shown).reshape(t.shape)

        handle = _by_hand(hm, layer, {key: flat_edit}, {})
        try:
            expected = model(ids).logits
        finally:
            handle.remove()
        _, cache = hm.run_with_cache(ids, names_filter=name)
    if cache[name].numel():  # an expert no token selects has no rows to edit
        assert (edited - own).abs().max() > 1e-4, f"{name}: the edit did not move the logits"
    else:
        assert torch.equal(edited, own)
    assert_close(edited, expected, f"an edit of {name}")


def test_gradients_through_an_edit_match_finite_differences() -> None:
    """Float64, the last layer (a later router's float32 sigmoid would round the differences): the gradient of the
    final norm's input through an edit of the scores, and of each step of the expert most tokens select, matches
    finite differences, and is not zero."""
    model = llama4_model("llama4_text", torch.float64)
    hm = llama4_wrap(model)
    ids = input_ids()[:1, :5]
    layer = len(hm.block_modules) - 1
    norm = model.get_submodule(hm.layout.ln_final)
    try:
        with torch.no_grad():
            _, cache = hm.run_with_cache(ids, names_filter=f"blocks.{layer}.mlp.hook_expert_indices")
        busiest = int(cache[f"blocks.{layer}.mlp.hook_expert_indices"].flatten().bincount().argmax())
        points = ["mlp.hook_expert_weights"] + [f"mlp.experts.{busiest}.{s}" for s in STEPS]
        for point in points:
            check_gradient_through_an_edit(hm, ids, f"blocks.{layer}.{point}", norm, at_input=True)
    finally:
        hm.unwrap()
