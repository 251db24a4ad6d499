"""``lensadapters check``: the contract suite from the command line.

The runs go through a subprocess (a fresh interpreter, as a user's shell would), with few examples and a
fixed seed. A plugin with a wrong layout must make the command fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest

from lensadapters import cli
from lensadapters.check import CheckError, contract_class

BROKEN_PLUGIN = textwrap.dedent('''
    """GPT-2 with one wrong path: the MLP's norm is declared to be ln_1 (the attention's norm)."""
    from lensadapters import BlockLayout, hookimpl
    from lensadapters_gpt2 import (LENSADAPTERS_HOOKSPEC, lensadapters_architectures, lensadapters_attn_qkv,
                                   lensadapters_attn_scores, lensadapters_config, lensadapters_embed,
                                   lensadapters_linear_weight, lensadapters_mlp_act, lensadapters_tiny_config)

    @hookimpl
    def lensadapters_block(arch, model, layer):
        return BlockLayout(ln1="ln_1", attn="attn", o_proj="attn.c_proj", ln2="ln_1", mlp="mlp")
''')


def run_cli(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "lensadapters.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)


BUILTIN = {"gpt2": "GPT2Contract", "gpt_neox": "GPTNeoXContract", "opt": "OPTContract", "llama": "LlamaContract"}


def test_check_gpt2_passes():
    result = run_cli("check", "gpt2", "--examples", "2", "--seed", "0",
                     "-k", "bitwise or identities or every_hook_point or capabilities")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "declared by LENSADAPTERS_CONTRACT: lensadapters_gpt2.testing:GPT2Contract" in result.stdout
    assert "4 passed" in result.stdout


@pytest.mark.parametrize("arch", sorted(BUILTIN))
def test_builtin_plugins_declare_their_packaged_contract(arch):
    """`lensadapters check ARCH` runs the very class tests/test_ARCH.py subclasses, with declared capabilities."""
    import importlib

    testing = importlib.import_module(f"lensadapters_{arch}.testing")
    plugin = importlib.import_module(f"lensadapters_{arch}")
    assert plugin.LENSADAPTERS_CONTRACT == f"lensadapters_{arch}.testing:{BUILTIN[arch]}"
    contract_class.cache_clear()
    try:
        cls = contract_class(arch)
    finally:
        contract_class.cache_clear()
    assert cls is getattr(testing, BUILTIN[arch]) and cls.plugin is plugin
    assert None not in (cls.learned_positions, cls.rotary, cls.gated_mlp), "capabilities are declared"


def test_importing_plugins_needs_no_test_kit():
    """hypothesis and pytest are only in the core's `testing` extra: plugins (and the registry loading them) must
    import without them; only their `testing` modules need them."""
    code = ("import sys, lensadapters_gpt2, lensadapters_gpt_neox, lensadapters_opt, lensadapters_llama\n"
            "from lensadapters.registry import get_registry\n"
            "assert {'gpt2', 'gpt_neox', 'opt', 'llama'} <= set(get_registry().infos), get_registry().infos\n"
            "leaked = sorted(m for m in ('hypothesis', 'pytest', '_pytest') if m in sys.modules)\n"
            "assert not leaked, leaked\n"
            "import lensadapters_llama.testing\n"
            "assert 'hypothesis' in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("arch", sorted(BUILTIN))
def test_tiny_config_seeds_vary_the_shape(arch):
    """`lensadapters_tiny_config(arch, seed)`: seed 0 is the demo's model, other seeds vary the shape (what the
    generated `lensadapters check` suite of a plugin without a declared contract draws); every one wraps."""
    import importlib

    import torch

    from lensadapters import HookedModel, Registry
    from lensadapters.demo import reinit
    from transformers import AutoModelForCausalLM

    plugin = importlib.import_module(f"lensadapters_{arch}")
    configs = [plugin.lensadapters_tiny_config(arch=plugin.ARCH, seed=seed) for seed in range(8)]
    assert configs[0].to_dict() == plugin.lensadapters_tiny_config(arch=plugin.ARCH, seed=0).to_dict()
    shapes = {str(sorted((k, str(v)) for k, v in c.to_dict().items() if k not in ("transformers_version",)))
              for c in configs}
    assert len(shapes) >= 4, f"{arch}: the seed hardly changes the tiny config"
    registry = Registry()
    registry.register(plugin, arch)
    for seed, config in enumerate(configs):
        assert config.hidden_size <= 64 and config.vocab_size <= 512
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        reinit(model, seed)
        ids = torch.randint(0, config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            reference = model(ids).logits
            hm = HookedModel.wrap(model, registry=registry)
            assert torch.equal(hm(ids).logits, reference), (arch, seed)
        hm.unwrap()


def test_check_fails_for_a_broken_plugin(tmp_path):
    (tmp_path / "broken_gpt2_plugin.py").write_text(BROKEN_PLUGIN)
    result = run_cli("check", "broken_gpt2_plugin", "--examples", "2", "--seed", "0", "-k", "identities",
                     "--no-shrink", pythonpath=str(tmp_path))
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

    import lensadapters_gpt2
    from lensadapters.testing import AdapterContract

    class Declared(AdapterContract):
        plugin = lensadapters_gpt2

        @classmethod
        def configs(cls):
            return st.just(None)

    contracts = types.ModuleType("declared_contracts")
    contracts.Declared = Declared
    contracts.NotAContract = object
    monkeypatch.setitem(sys.modules, "declared_contracts", contracts)
    plugin = types.ModuleType("plugin_with_contract")
    monkeypatch.setitem(sys.modules, "plugin_with_contract", plugin)
    for spec, error in (("declared_contracts:Declared", "whose `plugin` is 'lensadapters_gpt2'"),
                        ("declared_contracts:NotAContract", "not an AdapterContract subclass"),
                        ("declared_contracts", "expected 'package.module:ClassName'"),
                        ("declared_contracts:Missing", "cannot be imported")):
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


def test_check_lora_and_int8_variants_pass_for_gpt2():
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    result = run_cli("check", "gpt2", "--lora", "--int8", "--examples", "2", "--seed", "0", "-k", "weight_and_residual")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lensadapters_peft.testing:LoraContract" in result.stdout
    assert "lensadapters_bnb.testing:Int8Contract" in result.stdout
    assert "2 passed" in result.stdout


def test_check_variants_fail_for_a_broken_plugin(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    (tmp_path / "broken_gpt2_plugin.py").write_text(BROKEN_PLUGIN)
    result = run_cli("check", "broken_gpt2_plugin", "--lora", "--int8", "--examples", "2", "--seed", "0",
                     "-k", "weight_and_residual", "--no-shrink", pythonpath=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 failed" in result.stdout
    assert "hook_pre" in result.stdout


def test_check_variant_without_its_plugin_is_a_clear_error(monkeypatch, capsys):
    import warnings

    from lensadapters.check import variant_class

    monkeypatch.setitem(sys.modules, "lensadapters_peft.testing", None)  # as if lensadapters-peft were missing
    monkeypatch.setitem(sys.modules, "lensadapters_bnb.testing", None)
    variant_class.cache_clear()
    with pytest.raises(CheckError, match="pip install lensadapters-peft"):
        variant_class("gpt2", "lora")
    with pytest.raises(CheckError, match="unknown contract variant"):
        variant_class("gpt2", "int4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the suite may already be imported in this process
        assert cli.main(["check", "gpt2", "--int8"]) == 4
    assert "pip install lensadapters-bnb" in capsys.readouterr().out
    variant_class.cache_clear()
    contract_class.cache_clear()
