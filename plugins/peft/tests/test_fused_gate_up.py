"""LoRA on a fused gate/up projection (``FusedGateUp``: Phi-3's ``gate_up_proj``): one delta point per half, factors
and effective weights split like the projection. Runs on every installed architecture whose contract draws models
with a fused gate/up MLP (found by discovery)."""

from __future__ import annotations

import functools

import lensadapters_peft as lp
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from lensadapters_peft.testing import init_lora

from lensadapters import FusedGateUp, HookedModel
from lensadapters.testing import assert_close, declared_contracts, registry_with

peft = pytest.importorskip("peft")


@functools.lru_cache(maxsize=None)
def _fused(contract: type) -> bool:
    """Whether the architecture's plugin describes its MLPs as a fused gate/up projection (one model drawn, when the
    test runs: never at import)."""
    found = []

    @settings(max_examples=1, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def probe(data: st.DataObject) -> None:
        instance = contract()
        hm = HookedModel.wrap(
            instance.make_model(data.draw(contract.configs()), 0), registry=registry_with(contract.plugin)
        )
        found.append(isinstance(hm.mlp_layouts[0], FusedGateUp))
        hm.unwrap()

    probe()
    return found[0]


CONTRACTS = declared_contracts()


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c.__name__ for c in CONTRACTS])
def test_lora_on_a_fused_gate_up_projection_has_a_delta_point_per_half(contract: type) -> None:
    if not _fused(contract):
        pytest.skip(f"{contract.__name__}: its plugin does not describe a fused gate/up projection")
    _delta_point_per_half(contract)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
@given(data=st.data())
def _delta_point_per_half(contract: type, data: st.DataObject) -> None:
    instance = contract()
    base = instance.make_model(data.draw(contract.configs(), label="config"), data.draw(st.integers(0, 9)))
    probe = HookedModel.wrap(base, registry=registry_with(contract.plugin))
    layout = probe.mlp_layouts[0]
    assume(isinstance(layout, FusedGateUp))
    d_mlp = probe.cfg.d_mlp
    probe.unwrap()
    name = layout.module.split(".")[-1]
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[name], init_lora_weights=False))
    init_lora(pm, 0)
    hm = HookedModel.wrap(pm.eval(), registry=registry_with(contract.plugin, lp))
    names = [n for n in lp.lora_hook_names(hm) if n.startswith("blocks.0.")]
    assert names == ["blocks.0.mlp.hook_pre_lora", "blocks.0.mlp.hook_pre_linear_lora"]
    layer = hm.block_modules[0].get_submodule(layout.module)
    seen = {}
    handle = layer.register_forward_hook(lambda m, a, o: seen.__setitem__("x", a[0]))
    ids = torch.randint(3, hm.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=names + ["blocks.0.mlp.hook_pre"])
    handle.remove()
    delta = layer.lora_B["default"](layer.lora_A["default"](seen["x"])) * layer.scaling["default"]
    gate, up = layout.split(delta)
    assert torch.equal(cache["blocks.0.mlp.hook_pre_lora"], gate)
    assert torch.equal(cache["blocks.0.mlp.hook_pre_linear_lora"], up)
    base_gate, base_up = layout.split(layer.base_layer.weight.T)
    for which, half, base_W in (("gate", gate, base_gate), ("in", up, base_up)):
        f = lp.lora_factors(hm, 0, which)
        assert_close(seen["x"] @ f.A @ f.B * f.scaling, half, f"lora_factors {which!r}")
        effective = hm.W_gate[0] if which == "gate" else hm.W_in[0]
        assert effective.shape[-1] == d_mlp
        assert_close(effective, base_W + f.W, f"effective W_{which} == base + A @ B * s")
    # zeroing the gate half's delta gives the gate the base projection, the up half keeps its delta
    with torch.no_grad(), hm.hooks([("blocks.0.mlp.hook_pre_lora", lambda t, hook: torch.zeros_like(t))]):
        _, zeroed = hm.run_with_cache(ids, names_filter=["blocks.0.mlp.hook_pre"])
    bias = layer.base_layer.bias  # a biased projection (ModernBERT's Wi may be): the gate half's bias too
    gate_bias = layout.split(bias)[0] if bias is not None else 0.0
    assert_close(zeroed["blocks.0.mlp.hook_pre"], seen["x"] @ base_gate + gate_bias, "gate without its delta")
    hm.unwrap()
