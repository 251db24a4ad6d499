"""One reader for every weight: a plugin's ``lensadapters_weight`` override of ``W_O`` (or ``b_O``, ``W_Q``...)
reaches every value derived from that weight: ``hm.W_O``, the ``attn.hook_result`` point, the cache's head
results and decompositions, ``accumulated_bias`` and the per-head input points."""

from __future__ import annotations

import types
from typing import Any, Optional

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from lensadapters import HookedModel, Registry, get_registry, hookimpl
from lensadapters.testing import reinit
from lensadapters.wiring.weights import stacked_weight

IDS = torch.tensor([[1, 5, 7, 3, 9, 2]])
SCALE = 3.0  # a branch scale the plugin folds into W_O (and b_O), as a family with scaled residual branches would


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=16))
    reinit(model, 0)
    return model.eval()


def _overriding(names: tuple[str, ...]) -> types.ModuleType:
    """A cross-cutting plugin that answers ``lensadapters_weight`` for ``names`` with the core's value times SCALE."""
    plugin = types.ModuleType("branch_scale")

    @hookimpl
    def lensadapters_weight(arch: Any, hooked: Any, name: str) -> Optional[torch.Tensor]:
        return SCALE * stacked_weight(hooked, name) if name in names else None

    plugin.lensadapters_weight = lensadapters_weight  # type: ignore[attr-defined]
    plugin.LENSADAPTERS_LAYERS = ("transformers.",)  # type: ignore[attr-defined]  # the layers it supplies weights for
    return plugin


def _wrapped(*names: str) -> tuple[HookedModel, HookedModel]:
    """The model wrapped plainly and, separately, with the W_O-scaling plugin."""
    owners = get_registry().owners("gpt2")
    if not owners:
        pytest.skip("no installed plugin declares gpt2")
    plain, scaled = Registry(), Registry()
    for registry in (plain, scaled):
        registry.register(get_registry().infos[owners[0]].plugin, owners[0])
    scaled.register(_overriding(names), "branch_scale")
    return HookedModel.wrap(_gpt2(), registry=plain), HookedModel.wrap(_gpt2(), registry=scaled)


def test_a_W_O_override_reaches_hook_result_and_the_cache_decompositions() -> None:
    plain, scaled = _wrapped("W_O", "b_O")
    try:
        torch.testing.assert_close(scaled.W_O, SCALE * plain.W_O)
        _, plain_cache = plain.run_with_cache(IDS, names_filter=lambda n: n.endswith(("hook_z", "hook_result")))
        _, scaled_cache = scaled.run_with_cache(IDS, names_filter=lambda n: n.endswith(("hook_z", "hook_result")))
        for layer in range(2):
            z = scaled_cache[f"blocks.{layer}.attn.hook_z"]
            torch.testing.assert_close(z, plain_cache[f"blocks.{layer}.attn.hook_z"])  # the model is unchanged
            expected = torch.einsum("...hd,hdm->...hm", z, scaled.W_O[layer])
            result = scaled_cache[f"blocks.{layer}.attn.hook_result"]
            torch.testing.assert_close(result, expected)  # the point reads the overridden W_O
            torch.testing.assert_close(result, SCALE * plain_cache[f"blocks.{layer}.attn.hook_result"])
        # the cache computes head results from hook_z and W_O the same way
        _, z_only = scaled.run_with_cache(IDS, names_filter=lambda n: n.endswith("hook_z"))
        z_only.compute_head_results()
        torch.testing.assert_close(z_only["blocks.1.attn.hook_result"], scaled_cache["blocks.1.attn.hook_result"])
        torch.testing.assert_close(scaled.accumulated_bias(2, include_mlp_biases=False), SCALE * plain.b_O.sum(0))
    finally:
        plain.unwrap()
        scaled.unwrap()


def test_a_W_Q_override_reaches_the_per_head_query_inputs() -> None:
    """An edit of ``hook_q_input`` reaches the queries through ``W_Q``: with W_Q overridden, the same edit moves
    the queries by SCALE times as much as the core's reading would say; the point reads the overridden weight."""
    plain, scaled = _wrapped("W_Q")
    try:
        torch.testing.assert_close(scaled.W_Q, SCALE * plain.W_Q)

        def shift(value: torch.Tensor, hook: Any) -> torch.Tensor:
            value = value.clone()
            value[:, -1, 0, 0] += 1.0  # one coordinate (a uniform shift is what the norm removes)
            return value

        moved = []
        for hm in (plain, scaled):
            _, clean = hm.run_with_cache(IDS, names_filter="blocks.0.attn.hook_q")
            with hm.hooks(fwd_hooks=[("blocks.0.hook_q_input", shift)]):
                _, edited = hm.run_with_cache(IDS, names_filter="blocks.0.attn.hook_q")
            moved.append(edited["blocks.0.attn.hook_q"] - clean["blocks.0.attn.hook_q"])
        torch.testing.assert_close(moved[1], SCALE * moved[0], atol=1e-5, rtol=1e-4)
    finally:
        plain.unwrap()
        scaled.unwrap()
