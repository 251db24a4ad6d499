"""The core without any particular architecture: registry, errors, cache keys, CLI.

Models come from the installed architecture plugins, found through their entry points (each plugin's
``lensadapters_tiny_config``, seed 0): every test that needs a model runs on each of them, or on those with the
capability it needs. No plugin is named here.
"""

import json
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lensadapters import (
    Architecture,
    HookedModel,
    LensAdaptersError,
    PluginConflictError,
    Registry,
    UnsupportedModelError,
    get_act_name,
    hookimpl,
    is_recomputing,
)
from lensadapters import registry as registry_module
from lensadapters.attention import InterfacePatternBackend
from lensadapters.cli import main as cli_main
from lensadapters.demo import tiny_model
from lensadapters.registry import DISABLE_AUTOLOAD_ENV, PluginInfo, PluginLoadWarning
from lensadapters.testing import architecture_plugins, attention_layers, plugin_projects, registry_with

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Tiny:
    """One installed architecture: its plugin, the architecture, and fresh registries and tiny models of it."""

    info: PluginInfo
    arch: Architecture

    def registry(self, *others: Any) -> Registry:
        return registry_with(self.info, *others)

    def model(self, registry: Any = None) -> torch.nn.Module:
        registry = registry or self.registry()
        return tiny_model(registry, registry.infos[self.info.name], self.arch, seed=0)

    def wrap(self, model: Any = None) -> HookedModel:
        registry = self.registry()
        return HookedModel.wrap(model if model is not None else self.model(registry), registry=registry)


ARCHITECTURES = [Tiny(info, arch) for info in architecture_plugins() for arch in info.architectures]


#: those whose attention goes through transformers' attention interface (the core's pattern backend)
_SDPA_PATTERNS: dict[tuple[str, str], bool] = {}


def _sdpa_patterns(tiny: "Tiny") -> bool:
    key = (tiny.info.name, tiny.arch.name)
    if key not in _SDPA_PATTERNS:
        _SDPA_PATTERNS[key] = _decide_sdpa_patterns(tiny)
    return _SDPA_PATTERNS[key]


def _decide_sdpa_patterns(tiny: "Tiny") -> bool:
    """Whether the architecture's tiny model can hook patterns under sdpa-like attention (an attention softcap,
    which sdpa does not apply, refuses them: its plugin's tests check that)."""
    if "sdpa" not in tiny.arch.attn_implementations:
        return False
    hm = tiny.wrap()
    capped = hm.cfg.attn_scores_soft_cap > 0
    # a plugin that serves patterns itself (attention classes that bypass the interface, e.g. OLMoE on 4.57) is
    # not switched by `_attn_implementation`: its own tests cover it
    through_interface = isinstance(hm.wiring.pattern_backend, InterfacePatternBackend)
    hm.unwrap()
    return through_interface and not capped


def _ids(tinies: list) -> list:
    return [f"{t.info.name}:{t.arch.name}" for t in tinies]


@pytest.fixture(params=ARCHITECTURES, ids=_ids(ARCHITECTURES))
def tiny(request: pytest.FixtureRequest) -> Tiny:
    return request.param


@pytest.fixture(params=ARCHITECTURES, ids=_ids(ARCHITECTURES))
def interface_tiny(request: pytest.FixtureRequest) -> Tiny:
    """The architectures whose patterns go through the core's interface backend (decided when a test runs: wrapping
    a model at import would cost every collection)."""
    if not _sdpa_patterns(request.param):
        pytest.skip(f"{request.param.arch.name}: patterns not served through transformers' attention interface")
    return request.param


def _toy_plugin(name: str) -> types.ModuleType:
    """A plugin module that loads and claims nothing."""
    return types.ModuleType(name)


class FakeEntryPoint:
    def __init__(self, name, load, dist_name="fake-dist"):
        self.name = name
        self._load = load
        self.dist = types.SimpleNamespace(metadata={"Name": dist_name}, version="9.9")

    def load(self):
        return self._load()


def test_broken_plugin_warns_and_the_others_load(monkeypatch, tiny):
    def broken():
        raise ImportError("no module named lensadapters_broken")

    name = tiny.info.name
    eps = [FakeEntryPoint("broken", broken, "lensadapters-broken"), FakeEntryPoint(name, lambda: tiny.info.plugin)]
    monkeypatch.setattr(registry_module, "_entry_points", lambda: eps)
    registry = Registry()
    with pytest.warns(PluginLoadWarning, match="broken.*lensadapters-broken"):
        registry.load_entry_points()
    assert name in registry.infos and "broken" in registry.failures
    hm = HookedModel.wrap(tiny.model(), registry=registry)
    assert hm.arch.name == tiny.arch.name
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
    toy = _toy_plugin("toy_plugin")
    eps = [FakeEntryPoint("toy", lambda: toy, "a"), FakeEntryPoint("toy", lambda: toy, "b")]
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


def _claiming_plugin(name, model_type):
    plugin = types.ModuleType(name)

    @hookimpl
    def lensadapters_architectures():
        return [Architecture(name, (model_type,))]

    plugin.lensadapters_architectures = lensadapters_architectures
    return plugin


def test_two_plugins_claiming_one_architecture_conflict_until_one_is_chosen(tiny):
    model_type = tiny.arch.model_types[0]
    other = _claiming_plugin("other_claimant", model_type)
    registry = tiny.registry(other)
    assert registry.conflicts() == {model_type: [tiny.info.name, "other_claimant"]}
    model = tiny.model()
    with pytest.raises(PluginConflictError, match="adapter="):
        HookedModel.wrap(model, registry=registry)
    hm = HookedModel.wrap(model, adapter=tiny.arch.name, registry=registry)
    assert hm.plugin.name == tiny.info.name
    hm.unwrap()


def _bloom(**overrides: Any) -> torch.nn.Module:
    """A model of an architecture no plugin claims (BLOOM is served by no built-in plugin)."""
    from transformers import AutoModelForCausalLM, BloomConfig

    model = AutoModelForCausalLM.from_config(BloomConfig(n_layer=1, hidden_size=8, n_head=2, vocab_size=16))
    for name, value in overrides.items():
        setattr(model.config, name, value)
    return model


def test_architecture_without_plugin_gets_the_generic_adapter_with_a_warning():
    from lensadapters.generic import GenericAdapterWarning

    with pytest.warns(GenericAdapterWarning, match="'bloom'.*generic adapter.*writing-a-plugin"):
        hm = HookedModel.wrap(_bloom(), registry=ARCHITECTURES[0].registry())
    assert hm.arch.name == "generic" and "blocks.0.hook_resid_post" in hm.hook_names
    hm.unwrap()


def test_unsupported_architecture_names_model_type_plugins_and_fix():
    tiny = ARCHITECTURES[0]
    model = _bloom(num_hidden_layers=3)  # no list of 3 decoder layers: the generic adapter cannot find the blocks
    with pytest.raises(UnsupportedModelError) as info:
        HookedModel.wrap(model, registry=tiny.registry())
    message = str(info.value)
    assert "'bloom'" in message and "writing-a-plugin" in message
    assert f"{tiny.info.name} ({', '.join(tiny.arch.model_types)})" in message  # the installed plugins


def test_unknown_hook_lists_closest_names(tiny):
    hm = tiny.wrap()
    first = attention_layers(hm)[0]  # a hybrid's first blocks may have another token mixer (no attn.* points)
    with pytest.raises(KeyError, match=f"blocks.{first}.attn.hook_pattern"):
        hm.add_hook(f"blocks.{first}.attn.hook_patern", lambda t, hook: None)
    hm.unwrap()


def test_wrapping_twice_returns_the_wrapper_and_a_dead_wrapper_refuses_work(tiny):
    registry = tiny.registry()
    model = tiny.model(registry)
    hm = HookedModel.wrap(model, registry=registry)
    assert HookedModel.wrap(model, registry=registry) is hm and HookedModel.wrap(hm) is hm
    hm.unwrap()
    with pytest.raises(Exception, match="unwrapped"):
        hm(torch.zeros(1, 2, dtype=torch.long))
    assert HookedModel.wrap(model, registry=registry) is not hm


def test_has_hooks_follows_hooks_however_they_come_and_go(tiny):
    """``has_hooks`` (what per-forward guards ask instead of scanning every hook point) stays true to the hooks."""
    hm = tiny.wrap()
    last = hm.cfg.n_layers - 1
    ids = torch.zeros(1, 3, dtype=torch.long)
    assert not hm.has_hooks
    hm.add_hook("blocks.0.hook_resid_pre", lambda t, hook: None)
    hm.add_hook(f"blocks.{last}.attn.hook_pattern", lambda t, hook: None, is_permanent=True)
    assert hm.has_hooks
    hm.reset_hooks()
    assert hm.has_hooks  # the permanent one stays
    hm.reset_hooks(including_permanent=True)
    assert not hm.has_hooks

    def fail(t, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.{attention_layers(hm)[0]}.attn.hook_z", fail)])
    assert not hm.has_hooks
    _, cache = hm.run_with_cache(ids)
    assert len(cache) and not hm.has_hooks
    with hm.hooks([("blocks.0.hook_mlp_out", lambda t, hook: None)]):
        assert hm.has_hooks
    assert not hm.has_hooks
    hm.unwrap()


def test_cache_shorthand_and_filters(tiny):
    hm = tiny.wrap()
    last = hm.cfg.n_layers - 1
    if last == 0 or "ln_final.hook_scale" not in hm.hook_names:
        pytest.skip("the tiny model needs two blocks and a final norm")
    ids = torch.arange(6).view(1, 6)
    with torch.no_grad():
        _, cache = hm.run_with_cache(
            ids,
            names_filter=[f"blocks.{last}.hook_resid_pre", "ln_final.hook_scale"],
            remove_batch_dim=True,
            device="cpu",
        )
    assert set(cache) == {f"blocks.{last}.hook_resid_pre", "ln_final.hook_scale"}
    assert cache["resid_pre", last].shape == (6, hm.cfg.d_model) and cache["scale"].shape == (6, 1)
    assert ("resid_pre", -1) in cache and ("resid_pre", 0) not in cache
    assert get_act_name("scale", 2, "ln2") == "blocks.2.ln2.hook_scale"
    assert get_act_name("pattern", 0) == "blocks.0.attn.hook_pattern"
    assert "attn.hook_result" not in " ".join(hm.cache_names())
    assert hm.cache_names(lambda n: n.endswith("attn.hook_result")) == [
        f"blocks.{i}.attn.hook_result" for i in attention_layers(hm)
    ]
    with torch.no_grad(), pytest.raises(ValueError, match="batch of one.*batch of 2"):
        hm.run_with_cache(torch.cat([ids, ids]), remove_batch_dim=True)
    assert not any(p.active for p in hm.hook_dict.values())
    hm.unwrap()


def test_backward_hooks_and_incl_bwd(tiny):
    hm = tiny.wrap()
    last = hm.cfg.n_layers - 1
    ids = torch.arange(6).view(1, 6)
    logits, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=["blocks.0.hook_resid_post"])
    grad = cache["blocks.0.hook_resid_post_grad"]
    assert grad.shape == cache["resid_post", 0].shape and grad.abs().sum() > 0
    seen = []
    logits = hm.run_with_hooks(
        ids, bwd_hooks=[(f"blocks.{last}.hook_resid_pre", lambda g, hook: seen.append(g.clone()))]
    )
    logits.sum().backward()  # the backward hook stays on this forward's graph after the call
    assert len(seen) == 1 and seen[0].shape == (1, 6, hm.cfg.d_model)
    with pytest.raises(ValueError, match="labels"):
        hm.run_with_cache(ids, incl_bwd=True)
    hm.unwrap()


def test_cli_plugins_json_and_hooks(capsys, monkeypatch, tiny):
    monkeypatch.setattr(registry_module, "_DEFAULT", tiny.registry())
    assert cli_main(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed["plugins"]] == [tiny.info.name]
    assert [a["model_types"] for a in listed["plugins"][0]["architectures"]] == [
        list(a.model_types) for a in tiny.info.architectures
    ]
    assert cli_main(["hooks", tiny.arch.name, "--json", "--length", "3"]) == 0
    shapes = json.loads(capsys.readouterr().out)["hook_points"]
    hm = tiny.wrap()  # the model `hooks` showed: the plugin's tiny config, seed 0
    layers, heads = attention_layers(hm), hm.cfg.n_heads
    hm.unwrap()
    assert shapes[f"blocks.{layers[0]}.attn.hook_pattern"] == [1, heads, 3, 3]
    assert shapes[f"blocks.{layers[-1]}.attn.hook_result"][:3] == [1, 3, heads]


def test_cli_hooks_reads_a_checkpoint_directory(tmp_path, capsys, monkeypatch, tiny):
    monkeypatch.setattr(registry_module, "_DEFAULT", tiny.registry())
    model = tiny.model()
    model.save_pretrained(tmp_path)
    assert cli_main(["hooks", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    last = model.config.num_hidden_layers - 1
    assert f"blocks.{last}.hook_resid_post" in out and f"(1, 4, {model.config.hidden_size})" in out


def test_installed_plugins_are_discovered_through_entry_points():
    projects = [project for project in plugin_projects(ROOT) if project.installed]
    if not projects:
        pytest.skip("no plugin of this checkout is installed")
    registry = Registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        registry.load_entry_points()
    for project in projects:
        assert project.entry_points, f"{project.distribution} declares no entry point in the group lensadapters"
        for name in project.entry_points:
            assert registry.infos[name].distribution == project.distribution


def _register_sdpa_alias(name):
    """An attention implementation the GPT-2 plugin does not declare (stands in for flash/flex here)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    AttentionInterface.register(name, ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping["sdpa"])


def _skip_if_refused(model, tiny):
    """Skip for a plugin that refuses attention implementations it does not declare at wrap time (its own
    tests check that); the others must keep every hook point but the pattern ones."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            HookedModel.wrap(model, registry=tiny.registry()).unwrap()
    except UnsupportedModelError as exc:
        if model.config._attn_implementation in str(exc):
            pytest.skip(f"{tiny.info.name} refuses undeclared attention implementations at wrap time")
        raise


def test_undeclared_attention_implementation_keeps_every_hook_but_patterns(interface_tiny):
    _register_sdpa_alias("test_alias_attention")
    model = interface_tiny.model()
    last = model.config.num_hidden_layers - 1
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    model.config._attn_implementation = "test_alias_attention"
    with torch.no_grad():
        reference = model(ids).logits
    _skip_if_refused(model, interface_tiny)
    with pytest.warns(UserWarning, match="test_alias_attention.*hook_pattern"):
        hm = HookedModel.wrap(model, registry=interface_tiny.registry())
    with torch.no_grad():
        logits, cache = hm.run_with_cache(
            ids, names_filter=lambda n: not n.endswith(("hook_pattern", "hook_attn_scores"))
        )
        assert torch.equal(logits, reference) and f"blocks.{last}.attn.hook_z" in cache
        # an edit no norm absorbs (a post-LN block's hook_resid_post is its last norm's input: doubling it is a no-op)
        tilted = hm.run_with_hooks(
            ids, fwd_hooks=[("blocks.0.hook_resid_post", lambda t, hook: t * torch.linspace(0.5, 2.0, t.shape[-1]))]
        )
        assert not torch.allclose(tilted, reference)
        for call in (
            lambda: hm.run_with_cache(ids),
            lambda: hm.add_hook(f"blocks.{last}.attn.hook_pattern", lambda t, hook: None),
        ):
            with pytest.raises(UnsupportedModelError, match="'test_alias_attention'.*set_attn_implementation"):
                call()
        assert not any(p.active for p in hm.hook_dict.values()), "a refused pattern hook stayed attached"
        assert torch.equal(hm(ids).logits, reference)
    hm.unwrap()


def test_switching_attention_implementation_around_pattern_hooks(interface_tiny):
    _register_sdpa_alias("test_alias_attention")
    model = interface_tiny.model()
    ids = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(1))
    hm = interface_tiny.wrap(model)
    pattern = f"blocks.{attention_layers(hm)[0]}.attn.hook_pattern"
    with torch.no_grad():
        model.config._attn_implementation = "test_alias_attention"  # switched after wrapping: refused at hook time
        with pytest.raises(UnsupportedModelError, match="test_alias_attention"):
            hm.add_hook(pattern, lambda t, hook: None)
        model.config._attn_implementation = "sdpa"
        with hm.hooks([(pattern, lambda t, hook: None)]):
            hm(ids)
            model.config._attn_implementation = "eager"  # switched while a pattern hook is attached
            with pytest.raises(LensAdaptersError, match="while a hook_attn_scores/hook_pattern hook was attached"):
                hm(ids)
    assert model.config._attn_implementation == "eager"  # the user's switch stands after the hooks go
    hm.unwrap()


def test_is_recomputing_outside_backward() -> None:
    x = torch.ones(2, requires_grad=True)
    inside: list[bool] = []
    y = x * 2
    y.register_hook(lambda g: inside.append(is_recomputing()))
    assert not is_recomputing()
    y.sum().backward()
    assert inside == [False]  # a backward hook runs with gradients disabled: not a forward recomputation
    with torch.no_grad():
        assert not is_recomputing()
