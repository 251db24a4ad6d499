"""``lensadapters check``: the contract suite from the command line.

The runs go through a subprocess (a fresh interpreter, as a user's shell would), with few examples and a
fixed seed. A plugin with a wrong layout must make the command fail.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import textwrap
import types
from dataclasses import replace
from pathlib import Path

import pytest

from lensadapters import ContractVariant, cli, contract_variants, hookimpl
from lensadapters import registry as registry_module
from lensadapters.check import CheckError, contract_class
from lensadapters.registry import PluginInfo
from lensadapters.testing import architecture_plugins, plugin_projects, registry_with

ROOT = Path(__file__).resolve().parents[1]

BROKEN_PLUGIN = textwrap.dedent('''
    """{module} with one wrong path: the MLP's norm is declared to be the attention's norm (ln2 = ln1)."""
    import dataclasses
    import inspect

    import {module} as _real
    from lensadapters import hookimpl

    LENSADAPTERS_HOOKSPEC = getattr(_real, "LENSADAPTERS_HOOKSPEC", "1")
    for _name in dir(_real):  # every other hook implementation of the real plugin
        if _name.startswith("lensadapters_") and _name != "lensadapters_block":
            globals()[_name] = getattr(_real, _name)


    @hookimpl
    def lensadapters_block(arch, model, layer):
        real = _real.lensadapters_block
        given = dict(arch=arch, model=model, layer=layer)
        layout = real(**{{k: v for k, v in given.items() if k in inspect.signature(real).parameters}})
        return dataclasses.replace(layout, ln2=layout.ln1)
''')


@functools.lru_cache(maxsize=None)
def _subject() -> PluginInfo | None:
    """The installed architecture plugin that declares a contract and whose blocks have two pre-norms (so that
    declaring the MLP's norm to be the attention's breaks a weight identity), with the fewest hook points on its
    tiny model (the cheapest to check; by name among equals)."""
    from lensadapters import HookedModel
    from lensadapters.demo import tiny_model

    candidates = []
    for info in architecture_plugins():
        if not getattr(info.plugin, "LENSADAPTERS_CONTRACT", None):
            continue
        registry = registry_with(info)
        hm = HookedModel.wrap(tiny_model(registry, registry.infos[info.name], info.architectures[0]), registry=registry)
        layout, size = hm.block_layouts[0], len(hm.hook_names)
        hm.unwrap()
        if layout.ln2 is not None and layout.ln2 != layout.ln1 and not layout.post_norm and not layout.parallel:
            candidates.append((size, info.name, info))
    return min(candidates, key=lambda c: c[:2])[2] if candidates else None


def subject() -> PluginInfo:
    info = _subject()
    if info is None:
        pytest.skip("no installed architecture plugin with a declared contract and two pre-norms per block")
    return info


def broken_plugin(tmp_path: Path) -> str:
    """A module in ``tmp_path``: the subject plugin with the MLP's norm declared wrong; returns its name."""
    (tmp_path / "broken_plugin.py").write_text(BROKEN_PLUGIN.format(module=subject().plugin.__name__))
    return "broken_plugin"


def run_cli(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "lensadapters.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


def _builtin_architecture_plugins() -> list:
    """``(entry-point name, module)`` of the installed plugins of this checkout's ``plugins/*/`` that claim
    architectures (the built-in architecture plugins)."""
    found = []
    for project in plugin_projects(ROOT):
        if not project.installed:
            continue
        module = importlib.import_module(project.modules[0])
        if hasattr(module, "lensadapters_architectures"):
            found.extend((name, project.modules[0]) for name in project.entry_points)
    return found


BUILTIN = _builtin_architecture_plugins()


def _skip_where_not_declared(plugin: object) -> None:
    """Skip a plugin none of whose architectures is declared for the installed transformers (a family of newer
    releases: its config classes do not exist here)."""
    archs = plugin.lensadapters_architectures()  # type: ignore[attr-defined]
    if not any(arch.declared_for_installed_transformers() for arch in archs):
        pytest.skip(f"declared for transformers {archs[0].transformers}, not the installed one")


@pytest.mark.one_environment
def test_check_passes_for_an_installed_plugin():
    info = subject()
    result = run_cli(
        "check",
        info.name,
        "--examples",
        "2",
        "--seed",
        "0",
        "-k",
        "bitwise or identities or every_hook_point or capabilities",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"declared by LENSADAPTERS_CONTRACT: {info.plugin.LENSADAPTERS_CONTRACT}" in result.stdout
    assert "4 passed" in result.stdout


@pytest.mark.parametrize("name,module", BUILTIN, ids=[name for name, _ in BUILTIN])
def test_builtin_plugins_declare_their_packaged_contract(name, module):
    """`lensadapters check NAME` runs the class the plugin's tests subclass, shipped in its `testing` module, with
    declared capabilities."""
    plugin = importlib.import_module(module)
    _skip_where_not_declared(plugin)
    spec = plugin.LENSADAPTERS_CONTRACT
    assert spec.startswith(f"{module}.testing:"), spec
    testing = importlib.import_module(f"{module}.testing")
    contract_class.cache_clear()
    try:
        cls = contract_class(name)
    finally:
        contract_class.cache_clear()
    assert cls is getattr(testing, spec.split(":")[1]) and cls.plugin is plugin
    assert None not in (cls.learned_positions, cls.rotary, cls.gated_mlp), "capabilities are declared"
    assert cls.config_strategy is not None, "configs are declared (config_strategy)"


@pytest.mark.one_environment
def test_importing_plugins_needs_no_test_kit():
    """hypothesis and pytest are only in the core's `testing` extra: plugins (and the registry loading them) must
    import without them; only their `testing` modules need them."""
    names = sorted(name for project in plugin_projects(ROOT) if project.installed for name in project.entry_points)
    code = (
        "import importlib, sys\n"
        "from lensadapters.registry import get_registry\n"
        "registry = get_registry()\n"
        "assert not registry.failures, registry.failures\n"
        f"assert set({names!r}) <= set(registry.infos), registry.infos\n"
        "leaked = sorted(m for m in ('hypothesis', 'pytest', '_pytest') if m in sys.modules)\n"
        "assert not leaked, leaked\n"
        "for info in registry.infos.values():\n"
        "    spec = getattr(info.plugin, 'LENSADAPTERS_CONTRACT', None)\n"
        "    archs = info.architectures\n"
        "    here = not archs or any(a.declared_for_installed_transformers() for a in archs)\n"
        "    if spec and here:  # a family of newer transformers releases has no config class to test here\n"
        "        importlib.import_module(spec.split(':')[0])\n"
        "        assert 'hypothesis' in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name,module", BUILTIN, ids=[name for name, _ in BUILTIN])
def test_tiny_config_seeds_vary_the_shape(name, module):
    """`lensadapters_tiny_config(arch, seed)`: seed 0 is the demo's model, other seeds vary the shape (what the
    generated `lensadapters check` suite of a plugin without a declared contract draws); every one wraps."""
    import torch

    from lensadapters import HookedModel, Registry
    from lensadapters.testing import seeded_model

    plugin = importlib.import_module(module)
    _skip_where_not_declared(plugin)
    registry = Registry()
    registry.register(plugin, name)
    for arch in plugin.lensadapters_architectures():
        configs = [plugin.lensadapters_tiny_config(arch=arch, seed=seed) for seed in range(8)]
        assert configs[0].to_dict() == plugin.lensadapters_tiny_config(arch=arch, seed=0).to_dict()
        shapes = {
            str(sorted((k, str(v)) for k, v in c.to_dict().items() if k not in ("transformers_version",)))
            for c in configs
        }
        assert len(shapes) >= 4, f"{arch.name}: the seed hardly changes the tiny config"
        for seed, config in enumerate(configs):
            assert config.hidden_size <= 64 and config.vocab_size <= 512
            model = seeded_model(config, seed)
            ids = torch.randint(0, config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(seed))
            decoder = {"decoder_input_ids": ids} if config.is_encoder_decoder else {}  # an encoder-decoder's
            with torch.no_grad():
                reference = model(ids, **decoder).logits
                hm = HookedModel.wrap(model, registry=registry)
                assert torch.equal(hm(ids, **decoder).logits, reference), (arch.name, seed)
            hm.unwrap()


@pytest.mark.one_environment
def test_check_fails_for_a_broken_plugin(tmp_path):
    broken = broken_plugin(tmp_path)
    result = run_cli(
        "check", broken, "--examples", "2", "--seed", "0", "-k", "identities", "--no-shrink", pythonpath=str(tmp_path)
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout
    assert "hook_pre" in result.stdout  # the weight identity that names the wrong norm


def test_check_unknown_plugin_is_a_clear_error(capsys):
    assert cli.main(["check", "no_such_plugin_anywhere"]) == 4
    out = capsys.readouterr().out
    assert "neither an installed lensadapters plugin nor an importable module" in out
    assert "Installed architecture plugins" in out


def test_declared_contract_is_used_and_validated(monkeypatch):
    from hypothesis import strategies as st

    from lensadapters.testing import AdapterContract

    other = subject().plugin  # a real plugin, not the one declaring the contract

    class Declared(AdapterContract):
        plugin = other

        @classmethod
        def configs(cls):
            return st.just(None)

    contracts = types.ModuleType("declared_contracts")
    contracts.Declared = Declared
    contracts.NotAContract = object
    monkeypatch.setitem(sys.modules, "declared_contracts", contracts)
    plugin = types.ModuleType("plugin_with_contract")
    monkeypatch.setitem(sys.modules, "plugin_with_contract", plugin)
    for spec, error in (
        ("declared_contracts:Declared", f"whose `plugin` is '{other.__name__}'"),
        ("declared_contracts:NotAContract", "not an AdapterContract subclass"),
        ("declared_contracts", "expected 'package.module:ClassName'"),
        ("declared_contracts:Missing", "cannot be imported"),
    ):
        contract_class.cache_clear()
        plugin.LENSADAPTERS_CONTRACT = spec
        with pytest.raises(CheckError, match=error):
            contract_class("plugin_with_contract")
    contract_class.cache_clear()
    Declared.plugin = plugin
    plugin.LENSADAPTERS_CONTRACT = "declared_contracts:Declared"
    assert contract_class("plugin_with_contract") is Declared
    contract_class.cache_clear()


def test_cross_cutting_plugin_without_contract_is_refused(monkeypatch):
    plugin = types.ModuleType("cross_cutting_only")
    monkeypatch.setitem(sys.modules, "cross_cutting_only", plugin)
    contract_class.cache_clear()
    with pytest.raises(CheckError, match="claims no architecture"):
        contract_class("cross_cutting_only")
    contract_class.cache_clear()


def _variant_flags() -> list[str]:
    variants = contract_variants()
    if not variants:
        pytest.skip("no installed plugin declares a contract variant")
    return [f"--{name}" for name in variants]


@pytest.mark.one_environment
def test_check_variants_pass_for_an_installed_plugin():
    """Every contract variant installed plugins declare, as its `--NAME` flag, on the subject plugin."""
    flags = _variant_flags()
    result = run_cli("check", subject().name, *flags, "--examples", "2", "--seed", "0", "-k", "weight_and_residual")
    assert result.returncode == 0, result.stdout + result.stderr
    for variant in contract_variants().values():
        assert f"{variant.contract} on {variant.runs_on}" in result.stdout
    assert f"{len(flags)} passed" in result.stdout


@pytest.mark.one_environment
def test_check_variants_fail_for_a_broken_plugin(tmp_path):
    flags = _variant_flags()
    broken = broken_plugin(tmp_path)
    result = run_cli(
        "check",
        broken,
        *flags,
        "--examples",
        "2",
        "--seed",
        "0",
        "-k",
        "weight_and_residual",
        "--no-shrink",
        pythonpath=str(tmp_path),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{len(flags)} failed" in result.stdout
    assert "hook_pre" in result.stdout


def _toy_variant_plugin() -> types.ModuleType:
    """A cross-cutting plugin declaring a contract variant whose mixin is not installed."""
    toy = types.ModuleType("toy_variant_plugin")

    @hookimpl
    def lensadapters_contract_variants():
        return [
            ContractVariant(
                "toy", "no_such_toy_module.testing:ToyContract", "toy-transformed models", "lensadapters-toy"
            )
        ]

    toy.lensadapters_contract_variants = lensadapters_contract_variants
    return toy


def test_check_variant_without_its_plugin_is_a_clear_error(monkeypatch, capsys):
    import warnings

    from lensadapters.check import variant_class

    info = subject()
    monkeypatch.setattr(registry_module, "_DEFAULT", registry_with(info, _toy_variant_plugin()))
    variant_class.cache_clear()
    contract_class.cache_clear()
    try:
        assert list(contract_variants()) == ["toy"]
        with pytest.raises(CheckError, match=r"pip install 'lensadapters-toy\[testing\]'"):
            variant_class(info.name, "toy")
        with pytest.raises(CheckError, match="unknown contract variant 'int4'.*offer: toy"):
            variant_class(info.name, "int4")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the suite may already be imported in this process
            assert cli.main(["check", info.name, "--toy"]) == 4
            assert "pip install 'lensadapters-toy[testing]'" in capsys.readouterr().out
            assert cli.main(["check", info.name, "--int4"]) == 4
        out = capsys.readouterr().out
        assert "no installed plugin declares the contract variant(s) int4" in out and "--toy" in out
    finally:
        variant_class.cache_clear()
        contract_class.cache_clear()


def test_contract_variants_come_from_plugins_in_registration_order():
    """A variant's distribution defaults to the declaring plugin's; a name declared twice keeps the first."""
    first, second = _toy_variant_plugin(), types.ModuleType("second_toy")

    @hookimpl
    def lensadapters_contract_variants():
        return [ContractVariant("toy", "elsewhere:Other", "other models"), ContractVariant("own", "x:Own", "own")]

    second.lensadapters_contract_variants = lensadapters_contract_variants
    registry = registry_with(first)
    registry.register(second, "second_toy", distribution="lensadapters-second")
    with pytest.warns(UserWarning, match="'toy' is declared by both toy_variant_plugin and second_toy"):
        variants = contract_variants(registry)
    assert list(variants) == ["toy", "own"]
    assert variants["toy"].contract == "no_such_toy_module.testing:ToyContract"
    assert variants["own"].distribution == "lensadapters-second"


def test_matrices_leave_out_a_plugin_declared_for_other_transformers(monkeypatch):
    """A plugin whose architectures all need another transformers release (a family that exists in newer releases
    only) is left out of the contract matrices instead of failing to import its contract."""
    import transformers

    from lensadapters import Architecture
    from lensadapters.adapters.registry import PluginInfo
    from lensadapters.testing import plugins as testing_plugins

    newer = types.ModuleType("plugin_for_newer_transformers")
    newer.LENSADAPTERS_CONTRACT = "no_such_module_anywhere:Contract"  # would raise CheckError if imported
    major = int(transformers.__version__.split(".")[0])
    arch = Architecture(name="future", model_types=("future",), transformers=f">={major + 1}")
    info = PluginInfo(name="future", plugin=newer, architectures=(arch,))
    monkeypatch.setattr(testing_plugins, "architecture_plugins", lambda: [info])
    assert testing_plugins.declared_contracts() == []
    info = PluginInfo(name="future", plugin=newer, architectures=(replace(arch, transformers=f"<{major + 1}"),))
    monkeypatch.setattr(testing_plugins, "architecture_plugins", lambda: [info])
    with pytest.raises(CheckError, match="cannot be imported"):
        testing_plugins.declared_contracts()
