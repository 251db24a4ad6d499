"""The core without any particular architecture: registry, errors, cache keys, CLI."""

import json
import types
import warnings
from importlib import metadata

import pytest
import torch
from transformers import GPT2Config

import lensadapters_gpt2
from lensadapters import (
    HookedModel,
    LensAdaptersError,
    PluginConflictError,
    Registry,
    UnsupportedModelError,
    get_act_name,
    hookimpl,
)
from lensadapters import registry as registry_module
from lensadapters.cli import main as cli_main
from lensadapters.registry import DISABLE_AUTOLOAD_ENV, PluginLoadWarning
from lensadapters.specs import Architecture
from lensadapters.testing import reinit


def tiny_gpt2():
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=32, n_positions=16))
    reinit(model, 0)
    return model.eval()


def registry_with(*plugins):
    registry = Registry()
    for plugin in plugins:
        registry.register(plugin, getattr(plugin, "__name__", None))
    return registry


class FakeEntryPoint:
    def __init__(self, name, load, dist_name="fake-dist"):
        self.name = name
        self._load = load
        self.dist = types.SimpleNamespace(metadata={"Name": dist_name}, version="9.9")

    def load(self):
        return self._load()


def test_broken_plugin_warns_and_the_others_load(monkeypatch):
    def broken():
        raise ImportError("no module named lensadapters_broken")

    eps = [FakeEntryPoint("broken", broken, "lensadapters-broken"), FakeEntryPoint("gpt2", lambda: lensadapters_gpt2)]
    monkeypatch.setattr(registry_module, "_entry_points", lambda: eps)
    registry = Registry()
    with pytest.warns(PluginLoadWarning, match="broken.*lensadapters-broken"):
        registry.load_entry_points()
    assert "gpt2" in registry.infos and "broken" in registry.failures
    hm = HookedModel.wrap(tiny_gpt2(), registry=registry)
    assert hm.arch.name == "gpt2"
    hm.unwrap()


def test_plugin_for_another_hookspec_major_is_refused(monkeypatch):
    old = types.ModuleType("lensadapters_old")
    old.LENSADAPTERS_HOOKSPEC = "0"
    monkeypatch.setattr(registry_module, "_entry_points", lambda: [FakeEntryPoint("old", lambda: old)])
    registry = Registry()
    with pytest.warns(PluginLoadWarning, match="hookspec 0.*provides hookspec 1"):
        registry.load_entry_points()
    assert "old" not in registry.infos


def test_same_entry_point_name_from_two_distributions_is_reported(monkeypatch):
    eps = [
        FakeEntryPoint("gpt2", lambda: lensadapters_gpt2, "a"),
        FakeEntryPoint("gpt2", lambda: lensadapters_gpt2, "b"),
    ]
    monkeypatch.setattr(registry_module, "_entry_points", lambda: eps)
    registry = Registry()
    with pytest.warns(PluginLoadWarning, match="provided by both a and b"):
        registry.load_entry_points()


def test_autoload_can_be_disabled(monkeypatch):
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    called = []
    monkeypatch.setattr(registry_module, "_entry_points", lambda: called.append(1) or [])
    registry_module.set_registry(None)
    try:
        assert registry_module.get_registry().infos == {}
        assert not called
    finally:
        registry_module.set_registry(None)


def _claiming_plugin(name):
    plugin = types.ModuleType(name)

    @hookimpl
    def lensadapters_architectures():
        return [Architecture(name, ("gpt2",))]

    plugin.lensadapters_architectures = lensadapters_architectures
    return plugin


def test_two_plugins_claiming_one_architecture_conflict_until_one_is_chosen():
    other = _claiming_plugin("other_gpt2")
    registry = registry_with(lensadapters_gpt2, other)
    assert registry.conflicts() == {"gpt2": ["lensadapters_gpt2", "other_gpt2"]}
    model = tiny_gpt2()
    with pytest.raises(PluginConflictError, match="adapter="):
        HookedModel.wrap(model, registry=registry)
    hm = HookedModel.wrap(model, adapter="gpt2", registry=registry)
    assert hm.plugin.name == "lensadapters_gpt2"
    hm.unwrap()


def test_architecture_without_plugin_gets_the_generic_adapter_with_a_warning():
    from transformers import AutoModelForCausalLM, BloomConfig

    from lensadapters.generic import GenericAdapterWarning

    model = AutoModelForCausalLM.from_config(BloomConfig(n_layer=1, hidden_size=8, n_head=2, vocab_size=16))
    with pytest.warns(GenericAdapterWarning, match="'bloom'.*generic adapter.*writing-a-plugin"):
        hm = HookedModel.wrap(model, registry=registry_with(lensadapters_gpt2))
    assert hm.arch.name == "generic" and "blocks.0.hook_resid_post" in hm.hook_names
    hm.unwrap()


def test_model_the_generic_adapter_cannot_read_names_model_type_plugins_and_fix():
    from transformers import AutoModelForCausalLM, BloomConfig

    model = AutoModelForCausalLM.from_config(BloomConfig(n_layer=1, hidden_size=8, n_head=2, vocab_size=16))
    model.config.num_hidden_layers = 3  # no list of 3 decoder layers: the generic adapter cannot find the blocks
    with pytest.raises(UnsupportedModelError) as info:
        HookedModel.wrap(model, registry=registry_with(lensadapters_gpt2))
    message = str(info.value)
    assert "'bloom'" in message and "gpt2" in message and "writing-a-plugin" in message


def test_unknown_hook_lists_closest_names():
    hm = HookedModel.wrap(tiny_gpt2(), registry=registry_with(lensadapters_gpt2))
    with pytest.raises(KeyError, match="blocks.1.attn.hook_pattern"):
        hm.add_hook("blocks.1.attn.hook_patern", lambda t, hook: None)
    hm.unwrap()


def test_wrapping_twice_returns_the_wrapper_and_a_dead_wrapper_refuses_work():
    model = tiny_gpt2()
    registry = registry_with(lensadapters_gpt2)
    hm = HookedModel.wrap(model, registry=registry)
    assert HookedModel.wrap(model, registry=registry) is hm and HookedModel.wrap(hm) is hm
    hm.unwrap()
    with pytest.raises(Exception, match="unwrapped"):
        hm(torch.zeros(1, 2, dtype=torch.long))
    assert HookedModel.wrap(model, registry=registry) is not hm


def test_has_hooks_follows_hooks_however_they_come_and_go():
    """``has_hooks`` (what per-forward guards ask instead of scanning every hook point) stays true to the hooks."""
    hm = HookedModel.wrap(tiny_gpt2(), registry=registry_with(lensadapters_gpt2))
    ids = torch.zeros(1, 3, dtype=torch.long)
    assert not hm.has_hooks
    hm.add_hook("blocks.0.hook_resid_pre", lambda t, hook: None)
    hm.add_hook("blocks.1.attn.hook_pattern", lambda t, hook: None, is_permanent=True)
    assert hm.has_hooks
    hm.reset_hooks()
    assert hm.has_hooks  # the permanent one stays
    hm.reset_hooks(including_permanent=True)
    assert not hm.has_hooks

    def fail(t, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", fail)])
    assert not hm.has_hooks
    _, cache = hm.run_with_cache(ids)
    assert len(cache) and not hm.has_hooks
    with hm.hooks([("blocks.0.hook_mlp_out", lambda t, hook: None)]):
        assert hm.has_hooks
    assert not hm.has_hooks
    hm.unwrap()


def test_cache_shorthand_and_filters():
    hm = HookedModel.wrap(tiny_gpt2(), registry=registry_with(lensadapters_gpt2))
    ids = torch.arange(6).view(1, 6)
    with torch.no_grad():
        _, cache = hm.run_with_cache(
            ids, names_filter=["blocks.1.hook_resid_pre", "ln_final.hook_scale"], remove_batch_dim=True, device="cpu"
        )
    assert set(cache) == {"blocks.1.hook_resid_pre", "ln_final.hook_scale"}
    assert cache["resid_pre", 1].shape == (6, 8) and cache["scale"].shape == (6, 1)
    assert ("resid_pre", -1) in cache and ("resid_pre", 0) not in cache
    assert get_act_name("scale", 2, "ln2") == "blocks.2.ln2.hook_scale"
    assert get_act_name("pattern", 0) == "blocks.0.attn.hook_pattern"
    assert "attn.hook_result" not in " ".join(hm.cache_names())
    assert hm.cache_names(lambda n: n.endswith("hook_result")) == [
        "blocks.0.attn.hook_result",
        "blocks.1.attn.hook_result",
    ]
    with torch.no_grad(), pytest.raises(ValueError, match="batch of one.*batch of 2"):
        hm.run_with_cache(torch.cat([ids, ids]), remove_batch_dim=True)
    assert not any(p.active for p in hm.hook_dict.values())
    hm.unwrap()


def test_backward_hooks_and_incl_bwd():
    hm = HookedModel.wrap(tiny_gpt2(), registry=registry_with(lensadapters_gpt2))
    ids = torch.arange(6).view(1, 6)
    logits, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=["blocks.0.hook_resid_post"])
    grad = cache["blocks.0.hook_resid_post_grad"]
    assert grad.shape == cache["resid_post", 0].shape and grad.abs().sum() > 0
    seen = []
    logits = hm.run_with_hooks(ids, bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, hook: seen.append(g.clone()))])
    logits.sum().backward()  # the backward hook stays on this forward's graph after the call
    assert len(seen) == 1 and seen[0].shape == (1, 6, 8)
    with pytest.raises(ValueError, match="labels"):
        hm.run_with_cache(ids, incl_bwd=True)
    hm.unwrap()


def test_cli_plugins_json_and_hooks(capsys, monkeypatch):
    monkeypatch.setattr(registry_module, "_DEFAULT", registry_with(lensadapters_gpt2))
    assert cli_main(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed["plugins"]] == ["lensadapters_gpt2"]
    assert listed["plugins"][0]["architectures"][0]["model_types"] == ["gpt2"]
    assert cli_main(["hooks", "gpt2", "--json", "--length", "3"]) == 0
    shapes = json.loads(capsys.readouterr().out)["hook_points"]
    assert shapes["blocks.0.attn.hook_pattern"] == [1, 4, 3, 3]
    assert shapes["blocks.1.attn.hook_result"][:3] == [1, 3, 4]


def test_cli_hooks_reads_a_checkpoint_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(registry_module, "_DEFAULT", registry_with(lensadapters_gpt2))
    tiny_gpt2().save_pretrained(tmp_path)
    assert cli_main(["hooks", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "blocks.1.hook_resid_post" in out and "(1, 4, 8)" in out


def test_installed_plugins_are_discovered_through_entry_points():
    names = {ep.name for ep in metadata.entry_points(group="lensadapters")}
    if "gpt2" not in names:
        pytest.skip("lensadapters-gpt2 is not installed")
    registry = Registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        registry.load_entry_points()
    assert registry.infos["gpt2"].distribution == "lensadapters-gpt2"


def _register_sdpa_alias(name):
    """An attention implementation the GPT-2 plugin does not declare (stands in for flash/flex here)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    AttentionInterface.register(name, ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping["sdpa"])


def test_undeclared_attention_implementation_keeps_every_hook_but_patterns():
    _register_sdpa_alias("test_alias_attention")
    model = tiny_gpt2()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    model.config._attn_implementation = "test_alias_attention"
    with torch.no_grad():
        reference = model(ids).logits
    with pytest.warns(UserWarning, match="test_alias_attention.*hook_pattern"):
        hm = HookedModel.wrap(model, registry=registry_with(lensadapters_gpt2))
    with torch.no_grad():
        logits, cache = hm.run_with_cache(
            ids, names_filter=lambda n: not n.endswith(("hook_pattern", "hook_attn_scores"))
        )
        assert torch.equal(logits, reference) and "blocks.1.attn.hook_z" in cache
        doubled = hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_post", lambda t, hook: t * 2)])
        assert not torch.allclose(doubled, reference)
        for call in (
            lambda: hm.run_with_cache(ids),
            lambda: hm.add_hook("blocks.1.attn.hook_pattern", lambda t, hook: None),
        ):
            with pytest.raises(UnsupportedModelError, match="'test_alias_attention'.*set_attn_implementation"):
                call()
        assert not any(p.active for p in hm.hook_dict.values()), "a refused pattern hook stayed attached"
        assert torch.equal(hm(ids).logits, reference)
    hm.unwrap()


def test_switching_attention_implementation_around_pattern_hooks():
    _register_sdpa_alias("test_alias_attention")
    model = tiny_gpt2()
    ids = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(1))
    hm = HookedModel.wrap(model, registry=registry_with(lensadapters_gpt2))
    with torch.no_grad():
        model.config._attn_implementation = "test_alias_attention"  # switched after wrapping: refused at hook time
        with pytest.raises(UnsupportedModelError, match="test_alias_attention"):
            hm.add_hook("blocks.0.attn.hook_pattern", lambda t, hook: None)
        model.config._attn_implementation = "sdpa"
        with hm.hooks([("blocks.0.attn.hook_pattern", lambda t, hook: None)]):
            hm(ids)
            model.config._attn_implementation = "eager"  # switched while a pattern hook is attached
            with pytest.raises(LensAdaptersError, match="while a hook_attn_scores/hook_pattern hook was attached"):
                hm(ids)
    assert model.config._attn_implementation == "eager"  # the user's switch stands after the hooks go
    hm.unwrap()
