"""A Llama-shaped family declared with ``hf.DecoderPlugin``: the hooks it derives register (as an object and
through a module namespace), wrap transformers' model and answer what the declaration says; the test kit's
``config_strategy`` draws what it declares."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from lensadapters import (
    Architecture,
    FusedGateUp,
    HookedModel,
    MLPLayout,
    ProjectionNorm,
    Registry,
    UnsupportedModelError,
    hf,
)
from lensadapters.testing.families import config_strategy, decoder_config

ARCH = Architecture(name="declared_llama_shape", model_types=("llama",), transformers=">=4.57,<6")
FAMILY = hf.DecoderFamily("Llama", model_type="llama", norms=("LlamaRMSNorm",))


def tiny(seed: int = 0) -> LlamaConfig:
    return decoder_config(LlamaConfig, n_heads=4, n_kv=2, hidden=32, layers=2 + seed % 2, head_dim=8)


def model(config: Any = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(config or tiny()).eval()


def test_a_declared_family_registers_as_an_object_and_wraps():
    seen = []
    declared = hf.DecoderPlugin(
        ARCH, FAMILY, tiny, config=lambda m: {"extra": {"declared": True}}, check=lambda m: seen.append(m)
    )
    registry = Registry()
    registry.register(declared, "declared")
    m = model()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        reference = m(ids).logits
    hm = HookedModel.wrap(m, adapter=ARCH.name, registry=registry)
    assert hm.arch is ARCH and seen == [m]
    assert hm.cfg.extra["declared"] is True and hm.cfg.n_layers == 2 and hm.cfg.n_key_value_heads == 2
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, reference)
        logits, cache = hm.run_with_cache(ids)
    assert "blocks.1.ln2.hook_scale" in cache and "blocks.0.mlp.hook_pre_linear" in cache
    assert torch.allclose(logits, reference, atol=1e-5)
    hm.unwrap()
    assert registry.infos["declared"].plugin.lensadapters_tiny_config(arch=ARCH, seed=1).num_hidden_layers == 3


def test_export_puts_the_hooks_in_a_module_namespace():
    module = types.ModuleType("declared_module")
    module.LENSADAPTERS_HOOKSPEC = "1"
    declared = hf.DecoderPlugin(ARCH, FAMILY, tiny).export(vars(module))
    assert module.lensadapters_norm_scale == declared.lensadapters_norm_scale
    registry = Registry()
    registry.register(module, "declared_module")
    assert registry.infos["declared_module"].architectures == (ARCH,)
    # a family that leaves its norms to the core's checked fallback does not answer norm_scale
    bare: dict[str, Any] = {}
    hf.DecoderPlugin(ARCH, hf.DecoderFamily("Llama", model_type="llama"), tiny).export(bare)
    assert "lensadapters_norm_scale" not in bare and "lensadapters_mlp_act" in bare


def test_claims_gives_a_module_the_architectures_hook():
    module = types.ModuleType("claiming_module")
    module.LENSADAPTERS_HOOKSPEC = "1"
    module.lensadapters_architectures = hf.claims(ARCH)
    registry = Registry()
    registry.register(module, "claiming_module")
    assert registry.infos["claiming_module"].architectures == (ARCH,)


def test_named_family_architecture_and_exported_module_attributes(tmp_path, monkeypatch):
    named = hf.DecoderFamily.named("Mistral", "mistral", qk_norms=hf.qk_norms("bpf"), mlp=None)
    assert named == hf.DecoderFamily(
        "Mistral",
        model_type="mistral",
        packages=("mistral",),
        norms=("MistralRMSNorm",),
        qk_norms=(ProjectionNorm("self_attn.q_norm", "bpf"), ProjectionNorm("self_attn.k_norm", "bpf")),
        mlp=None,
    )
    assert hf.DecoderFamily.named("Gemma3", "gemma3_text", packages=("gemma3",)).packages == ("gemma3",)
    assert named.architecture("toy") == Architecture(
        name="mistral", model_types=("mistral",), description="toy", transformers=">=4.57,<6"
    )
    other = named.architecture("toy", name="m", model_types=("a", "b"), transformers=">=5")
    assert (other.name, other.model_types, other.transformers) == ("m", ("a", "b"), ">=5")
    # export: the core's hookspec major; the contract of a package with a testing module, unless declared
    package = tmp_path / "declared_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from lensadapters import hf\n"
        "FAMILY = hf.DecoderFamily.named('Mistral', 'mistral')\n"
        "hf.DecoderPlugin(FAMILY.architecture('toy'), FAMILY, lambda seed: None).export(globals())\n"
    )
    (package / "testing.py").write_text("")
    (tmp_path / "declared_single.py").write_text((package / "__init__.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    import declared_pkg  # type: ignore[import-not-found]
    import declared_single  # type: ignore[import-not-found]

    assert declared_pkg.LENSADAPTERS_HOOKSPEC == "1" == declared_single.LENSADAPTERS_HOOKSPEC
    assert declared_pkg.LENSADAPTERS_CONTRACT == "declared_pkg.testing:MistralContract"
    assert not hasattr(declared_single, "LENSADAPTERS_CONTRACT")  # no testing module: no contract named
    kept = {"__name__": "declared_pkg", "LENSADAPTERS_HOOKSPEC": "1.2", "LENSADAPTERS_CONTRACT": "own:Contract"}
    hf.DecoderPlugin(ARCH, FAMILY, tiny).export(kept)
    assert (kept["LENSADAPTERS_HOOKSPEC"], kept["LENSADAPTERS_CONTRACT"]) == ("1.2", "own:Contract")


def test_layer_mlp_gets_the_decoder_layer_and_the_config():
    m = model()
    seen = []
    declared = hf.DecoderPlugin(ARCH, FAMILY, tiny, layer_mlp=lambda layer, config: seen.append((layer, config)) or 7)
    assert declared.lensadapters_mlp_act(arch=ARCH, model=m, layer=1) == 7
    assert seen == [(m.model.layers[1], m.config)]
    assert hf.DecoderPlugin(ARCH, FAMILY, tiny).lensadapters_mlp_act(arch=ARCH, model=m, layer=1) == FAMILY.mlp


def test_mlp_layouts_name_the_projection_of_each_role():
    gated = MLPLayout(pre="mlp.gate_proj", out="mlp.down_proj", pre_linear="mlp.up_proj")
    assert [gated.projection(r) for r in ("in", "gate", "out")] == ["mlp.up_proj", "mlp.gate_proj", "mlp.down_proj"]
    plain = MLPLayout(pre="mlp.fc1", out="mlp.fc2")
    assert (plain.projection("in"), plain.projection("out")) == ("mlp.fc1", "mlp.fc2")
    with pytest.raises(AttributeError, match="only for gated MLPs"):
        plain.projection("gate")
    fused = FusedGateUp(module="mlp.gate_up_proj", out="mlp.down_proj", split=lambda t: (t, t), merge=lambda a, b: a)
    assert [fused.projection(r) for r in ("in", "gate", "out")] == ["mlp.gate_up_proj"] * 2 + ["mlp.down_proj"]


def test_declared_checks_refuse_at_wrap_time():
    def refuse(m: torch.nn.Module) -> None:
        raise UnsupportedModelError("declared refusal")

    registry = Registry()
    registry.register(hf.DecoderPlugin(ARCH, FAMILY, tiny, check=refuse), "refusing")
    with pytest.raises(UnsupportedModelError, match="declared refusal"):
        HookedModel.wrap(model(), adapter=ARCH.name, registry=registry)
    missing = hf.DecoderPlugin(ARCH, FAMILY, tiny, missing_in_layer=lambda layer: ["mlp.not_there"])
    registry = Registry()
    registry.register(missing, "missing")
    with pytest.raises(UnsupportedModelError, match=r"missing: model\.layers\.0\.mlp\.not_there"):
        HookedModel.wrap(model(), adapter=ARCH.name, registry=registry)


def test_missing_expert_paths_names_what_a_mixture_lacks():
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    assert hf.missing_expert_paths(layer, "mlp", ("w1", "w2")) == ["mlp.gate", "mlp.experts"]
    layer.mlp.gate = torch.nn.Linear(2, 2)
    expert = torch.nn.Module()
    expert.w1 = torch.nn.Linear(2, 2)
    layer.mlp.experts = torch.nn.ModuleList([expert])
    assert hf.missing_expert_paths(layer, "mlp", ("w1", "w2")) == ["mlp.experts.0.w2", "mlp.experts.0.act_fn"]


def built(**kwargs: Any) -> dict[str, Any]:
    return kwargs


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_config_strategy_draws_the_shape_then_every_declared_keyword(data):
    configs = config_strategy(
        built,
        "doc",
        n_kv=st.sampled_from([1, 2]),
        ratio=st.sampled_from([2, 3]),
        n_layers=st.integers(1, 2),
        experts=st.integers(2, 5),
        top_k=lambda drawn: st.integers(1, drawn["experts"]),
        fixed="value",
    )
    assert configs.__doc__ == "doc"
    drawn = data.draw(configs())
    assert drawn["n_heads"] in (2 * drawn["n_kv"], 3 * drawn["n_kv"]) and drawn["hidden"] == 8 * drawn["n_heads"]
    assert 1 <= drawn["top_k"] <= drawn["experts"] and drawn["fixed"] == "value" and drawn["layers"] in (1, 2)
    narrowed = data.draw(configs(n_heads=6, d_model=12, top_k=1))
    assert (narrowed["n_heads"], narrowed["hidden"], narrowed["top_k"]) == (6, 12, 1)
    with pytest.raises(TypeError, match="draws no unknown"):
        data.draw(configs(unknown=1))


def test_the_plugin_guides_declaration_example_wraps():
    """The DecoderFamily section of docs/writing-a-plugin.md declares a whole plugin: it registers and wraps, with
    the model bitwise unchanged and the declared config fields."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md").read_text()
    section = text[text.index("**A family shaped like transformers' Llama**") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("```\n", start)]
    imports = [line for line in code.splitlines() if "import" in line and "lensadapters" in line]
    assert "hf.DecoderPlugin" in code and imports == ["from lensadapters import hf"]  # public names
    module = types.ModuleType("guide_declared_plugin")
    module.LENSADAPTERS_HOOKSPEC = "1"
    exec(compile(code, "writing-a-plugin.md", "exec"), vars(module))
    registry = Registry()
    registry.register(module, "guide_declared_plugin")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(module.tiny_config(0)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        reference = m(ids).logits
    hm = HookedModel.wrap(m, adapter=module.ARCH.name, registry=registry)
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, reference)
    assert hm.cfg.window_size == 4 and hm.cfg.attn_types == ("local", "local")
    hm.unwrap()
