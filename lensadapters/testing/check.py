"""``lensadapters check PLUGIN``: run the contract suite against a plugin from the command line.

Which suite runs:

* A plugin that declares ``LENSADAPTERS_CONTRACT = "package.module:ClassName"`` (a module attribute, like
  ``LENSADAPTERS_HOOKSPEC``) gets that :class:`~lensadapters.testing.AdapterContract` subclass: its own
  config strategy, declared capabilities, config strata and settings, the very class its test file
  subclasses. The built-in plugins declare theirs (in their ``testing`` modules).
* Otherwise the suite is generated from the plugin's ``lensadapters_tiny_config`` hook: configs are
  ``lensadapters_tiny_config(arch, seed)`` for drawn seeds (one strategy per architecture the plugin
  claims), and the attention implementations are those transformers accepts for that config
  (``sdpa`` and/or ``eager``); no capability is declared. This is a smoke-level check: a declared contract
  explores far more.

``--NAME`` runs a variant of that class instead: the contract variants installed cross-cutting plugins
declare (``lensadapters_contract_variants``, e.g. ``--lora`` for LoRA-adapted models), whose mixin is put in
front of it, exactly what a plugin's tests get from ``class TestX(VariantMixin, XContract)``.

``PLUGIN`` is an installed plugin's entry-point name, one of its architecture names or model types, or
an importable module (a plugin under development, not installed yet). The suite runs through
``pytest.main`` on a generated test module in a temporary directory, with its own ``pytest.ini`` (the
current directory's configuration does not apply) and no example database.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
import tempfile
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

from lensadapters.adapters.variants import ContractVariant, contract_variants
from lensadapters.errors import LensAdaptersError

CONTRACT_ATTRIBUTE = "LENSADAPTERS_CONTRACT"
PROFILE = "lensadapters-check"


class CheckError(LensAdaptersError):
    """The plugin to check cannot be found, or no contract suite can be made for it."""


def find_plugin(target: str) -> tuple[str, ModuleType | Any]:
    """``(name, plugin)`` for an installed plugin (by name, architecture or model type) or a module name."""
    from lensadapters.adapters.registry import get_registry

    registry = get_registry()
    for info in registry.infos.values():
        if target == info.name or any(target == a.name or target in a.model_types for a in info.architectures):
            return info.name, info.plugin
    if target in registry.failures:
        raise CheckError(registry.failures[target])
    try:
        module = importlib.import_module(target)
    except ImportError as exc:
        if getattr(exc, "name", None) not in (None, target) and not target.startswith(f"{exc.name}."):
            raise  # the module exists but one of its imports fails: show that
        raise CheckError(
            f"{target!r} is neither an installed lensadapters plugin nor an importable module. "
            f"{registry.describe_installed()}"
        ) from None
    return target, module


def _import(spec: str) -> Any:
    """The object named ``"package.module:Name"``."""
    module_name, _, attr = spec.partition(":")
    return functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))


def declared_contract(name: str, plugin: Any) -> Optional[type]:
    """The contract class ``plugin`` declares with ``LENSADAPTERS_CONTRACT`` (checked), or ``None``."""
    spec = getattr(plugin, CONTRACT_ATTRIBUTE, None)
    return _declared(name, plugin, spec) if spec else None


def _declared(name: str, plugin: Any, spec: str) -> type:
    from lensadapters.testing.contract import AdapterContract

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CheckError(f"{CONTRACT_ATTRIBUTE} of plugin {name!r} is {spec!r}; expected 'package.module:ClassName'")
    try:
        cls = _import(spec)
    except (ImportError, AttributeError) as exc:
        raise CheckError(
            f"plugin {name!r} declares {CONTRACT_ATTRIBUTE} = {spec!r}, which cannot be imported: {exc}. "
            f"Is the plugin installed with its testing extra?"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, AdapterContract)):
        raise CheckError(
            f"{CONTRACT_ATTRIBUTE} of plugin {name!r} names {spec!r}, which is not an AdapterContract subclass"
        )
    if cls.plugin is not plugin:
        raise CheckError(
            f"{CONTRACT_ATTRIBUTE} of plugin {name!r} names {spec!r}, whose `plugin` is "
            f"{getattr(cls.plugin, '__name__', cls.plugin)!r}, not this plugin"
        )
    return cls


def _working_implementations(config: Any) -> tuple[str, ...]:
    from transformers import AutoModelForCausalLM

    working = []
    for impl in ("sdpa", "eager"):
        try:
            AutoModelForCausalLM.from_config(config, attn_implementation=impl)
        except (ValueError, ImportError):  # transformers refuses implementations a model does not support
            continue
        working.append(impl)
    return tuple(working) or ("eager",)


def _generated(name: str, plugin: Any) -> type:
    from hypothesis import strategies as st

    from lensadapters.adapters.registry import Registry
    from lensadapters.testing.contract import AdapterContract

    registry = Registry()
    info = registry.register(plugin, name)
    if not info.architectures:
        raise CheckError(
            f"plugin {name!r} claims no architecture (a cross-cutting plugin) and declares no {CONTRACT_ATTRIBUTE}: "
            f"there is nothing to generate a contract suite from. Declare {CONTRACT_ATTRIBUTE} = "
            f"'your_module:YourContract' (an AdapterContract subclass) in the plugin module."
        )
    hooks = registry.hooks_for(info)
    strategies = []
    implementations: list[str] = []
    for arch in info.architectures:
        config = hooks.lensadapters_tiny_config(arch=arch, seed=0)
        if config is None:
            raise CheckError(
                f"plugin {name!r} implements no lensadapters_tiny_config for {arch.name!r} and declares no "
                f"{CONTRACT_ATTRIBUTE}: implement one of them (see docs/writing-a-plugin.md)"
            )
        implementations += [i for i in _working_implementations(config) if i not in implementations]

        def tiny(seed: int, arch: Any = arch) -> Any:
            return hooks.lensadapters_tiny_config(arch=arch, seed=seed)

        strategies.append(st.integers(0, 2**16).map(tiny))
    strategy = st.one_of(strategies)

    def configs(cls: type) -> Any:
        return strategy

    class_name = "Test" + "".join(part.capitalize() for part in re.split(r"[^0-9A-Za-z]+", name) if part) + "Contract"
    return type(
        class_name,
        (AdapterContract,),
        {
            "__module__": __name__,
            "plugin": plugin,
            "configs": classmethod(configs),
            "attn_implementations": tuple(implementations),
            "__doc__": f"Contract suite for plugin {name!r}, generated from lensadapters_tiny_config.",
        },
    )


@functools.lru_cache(maxsize=None)
def contract_class(target: str) -> type:
    """The :class:`AdapterContract` subclass that ``lensadapters check TARGET`` runs."""
    name, plugin = find_plugin(target)
    return declared_contract(name, plugin) or _generated(name, plugin)


def find_variant(name: str) -> ContractVariant:
    """The contract variant ``name`` an installed plugin declares (``CheckError`` naming the others if none)."""
    variants = contract_variants()
    if name not in variants:
        offered = ", ".join(sorted(variants)) or "none"
        raise CheckError(
            f"unknown contract variant {name!r}: no installed plugin declares it (installed plugins "
            f"offer: {offered}). Variants come from cross-cutting plugins "
            f"(lensadapters_contract_variants)."
        )
    return variants[name]


@functools.lru_cache(maxsize=None)
def variant_class(target: str, variant: Optional[str] = None) -> type:
    """The class ``lensadapters check TARGET --VARIANT`` runs: the mixin of the contract variant ``variant``
    (declared by an installed plugin, :func:`find_variant`) in front of :func:`contract_class`;
    ``variant=None`` is the contract class itself."""
    cls = contract_class(target)
    if variant is None:
        return cls
    declared = find_variant(variant)
    distribution = declared.distribution or "the plugin that declares it"
    try:
        mixin = _import(declared.contract)
    except (ImportError, AttributeError) as exc:
        raise CheckError(
            f"`lensadapters check --{variant}` runs the contract suite on {declared.runs_on} and needs "
            f"{distribution} with its test kit: pip install '{distribution}[testing]' ({exc})"
        ) from None
    if issubclass(cls, mixin):
        return cls
    return type(
        f"{cls.__name__}{variant.title()}",
        (mixin, cls),
        {
            "__module__": cls.__module__,
            "__qualname__": f"{cls.__qualname__}{variant.title()}",
            "_lensadapters_variant": (declared, cls),
            "__doc__": f"{cls.__name__} on {declared.runs_on} ({declared.contract}).",
        },
    )


def describe(cls: type) -> str:
    variant = cls.__dict__.get("_lensadapters_variant")
    if variant is not None:
        declared, base = variant
        return f"{declared.contract} on {declared.runs_on}, over {describe(base)}"
    origin = (
        "generated from lensadapters_tiny_config"
        if cls.__module__ == __name__
        else f"declared by {CONTRACT_ATTRIBUTE}: {cls.__module__}:{cls.__qualname__}"
    )
    capabilities = [
        f"{name}={getattr(cls, name)}"
        for name in ("learned_positions", "rotary", "gated_mlp", "parallel_blocks")
        if getattr(cls, name, None) is not None
    ]
    strata = ", ".join(dict(getattr(cls, "config_strata", {})))
    return (
        f"{cls.__name__} ({origin}; attention implementations {', '.join(cls.attn_implementations)}"
        + (f"; declared {', '.join(capabilities)}" if capabilities else "")
        + (f"; config strata {strata}" if strata else "")
        + ")"
    )


_TEST_MODULE = '''\
"""Generated by `lensadapters check`: the contract suite for {target!r}."""
from lensadapters.check import variant_class

'''

_INI = """\
[pytest]
python_files = test_*.py
python_classes = Test*
python_functions = test_*
filterwarnings =
    ignore::DeprecationWarning
    ignore::FutureWarning
    ignore::pytest.PytestAssertRewriteWarning
"""


def load_profile(examples: int, shrink: bool = True) -> None:
    """Select ``examples`` per property. Must run before ``lensadapters.testing.contract`` is imported:
    Hypothesis fixes a test's settings when the test is defined (this module therefore imports the suite
    only inside functions)."""
    from hypothesis import HealthCheck, Phase, settings

    if "lensadapters.testing.contract" in sys.modules:
        import warnings

        warnings.warn(
            "the contract suite was imported before `lensadapters check` chose its number of examples; "
            "the current Hypothesis profile applies",
            stacklevel=2,
        )
    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p not in (Phase.shrink, Phase.explain))
    settings.register_profile(
        PROFILE,
        max_examples=examples,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile(PROFILE)


def run(
    target: str,
    examples: int = 10,
    keyword: Optional[str] = None,
    seed: Optional[int] = None,
    exitfirst: bool = False,
    verbose: bool = False,
    shrink: bool = True,
    pytest_args: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    variants: Sequence[str] = (),
) -> int:
    """Run the contract suite for ``target``; returns pytest's exit code (0: every property holds).

    ``shrink=False`` reports the first failing example as found, instead of searching for a minimal one
    (which can take minutes). ``variants`` (names of installed contract variants, e.g. ``"lora"``) run those
    variants of the suite instead of the float one (see :func:`variant_class`).
    """
    try:
        import hypothesis  # noqa: F401
        import pytest  # noqa: F401
    except ImportError as exc:
        echo(f"lensadapters check needs the test kit: pip install 'lensadapters[testing]' ({exc})")
        return 4
    from hypothesis import settings

    try:
        find_plugin(target)  # unknown targets fail here, before the Hypothesis profile changes
    except CheckError as exc:
        echo(f"lensadapters check: {exc}")
        return 4
    previous = getattr(settings, "_current_profile", None)
    load_profile(examples, shrink)
    try:
        return _run(target, examples, keyword, seed, exitfirst, verbose, pytest_args, echo, tuple(variants))
    finally:
        if previous is not None:  # leave the caller's profile as it was (in-process use)
            settings.load_profile(previous)


def _run(
    target: str,
    examples: int,
    keyword: Optional[str],
    seed: Optional[int],
    exitfirst: bool,
    verbose: bool,
    pytest_args: Sequence[str],
    echo: Callable[[str], None],
    variants: tuple[str, ...] = (),
) -> int:
    import pytest

    try:
        classes = {variant: variant_class(target, variant) for variant in (variants or (None,))}
    except CheckError as exc:
        echo(f"lensadapters check: {exc}")
        return 4
    import transformers

    for cls in classes.values():
        echo(
            f"lensadapters check {target}: {describe(cls)}, {examples} examples per property, "
            f"transformers {transformers.__version__}"
        )
    class_name = "Test" + re.sub(r"\W", "_", target).strip("_").title().replace("_", "")
    with tempfile.TemporaryDirectory(prefix="lensadapters-check-") as tmp:
        test_file = os.path.join(tmp, "test_lensadapters_check.py")
        ini = os.path.join(tmp, "pytest.ini")
        with open(test_file, "w") as f:
            f.write(_TEST_MODULE.format(target=target))
            for variant in classes:
                f.write(f"{class_name}{(variant or '').title()} = variant_class({target!r}, {variant!r})\n")
        with open(ini, "w") as f:
            f.write(_INI)
        args = [
            test_file,
            "-c",
            ini,
            "--rootdir",
            tmp,
            "--confcutdir",
            tmp,
            "-p",
            "no:cacheprovider",
            "-v" if verbose else "-q",
        ]
        if keyword:
            args += ["-k", keyword]
        if seed is not None:
            args += [f"--hypothesis-seed={seed}"]
        if exitfirst:
            args.append("-x")
        args += list(pytest_args)
        return int(pytest.main(args))


__all__ = [
    "CheckError",
    "contract_class",
    "declared_contract",
    "variant_class",
    "find_variant",
    "find_plugin",
    "run",
    "describe",
    "load_profile",
]
