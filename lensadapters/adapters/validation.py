"""Checks on what plugins declare and return, so that a broken plugin is refused by name instead of breaking
every wrap or silently changing results.

At registration (:func:`architectures_of`, :func:`check_required_hooks`): every ``Architecture`` a plugin
declares is well formed (``model_types`` a tuple of strings: a bare string would be matched as a substring), and
an architecture plugin implements the hooks every architecture needs. At wrap time (:func:`check_description`):
every description object has the right type and every module path it names exists in the model, so a wrong
path is reported with the plugin, the field and the closest existing names, before any hook is installed.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable, Optional, Sequence

from torch import nn

from lensadapters.adapters.moe.specs import MoELayout
from lensadapters.errors import PluginValidationError, UnsupportedModelError
from lensadapters.hooks import specs
from lensadapters.hooks.specs import Architecture

#: the hooks an architecture plugin must implement (the description the core builds hook points from)
REQUIRED_ARCHITECTURE_HOOKS = (
    "lensadapters_config",
    "lensadapters_embed",
    "lensadapters_block",
    "lensadapters_attn_qkv",
    "lensadapters_mlp_act",
)

# the fields of each description object that name modules (relative to the model, or to one block)
_PATH_FIELDS: dict[type, tuple[str, ...]] = {
    specs.ModelLayout: ("blocks", "embed", "unembed", "ln_final", "pos_embed", "rotary"),
    specs.BlockLayout: ("ln1", "attn", "o_proj", "ln2", "mlp", "mlp_residual", "ln1_post", "ln2_post"),
    specs.SeparateQKV: ("q", "k", "v"),
    specs.FusedQKV: ("module",),
    specs.MLPLayout: ("pre", "out", "pre_linear"),
    specs.FusedGateUp: ("module", "out"),
    MoELayout: ("router",),
}


def _type_name(value: Any) -> str:
    return type(value).__name__


def check_architecture(plugin_name: str, arch: Any) -> Architecture:
    """One declared architecture, refused with a message naming the plugin and the field when malformed."""
    where = f"plugin {plugin_name!r}: lensadapters_architectures()"
    if not isinstance(arch, Architecture):
        raise PluginValidationError(
            f"{where} returned a {_type_name(arch)} ({arch!r:.80}) among its architectures; "
            f"return a list of lensadapters.Architecture"
        )
    if not isinstance(arch.name, str) or not arch.name:
        raise PluginValidationError(f"{where}: Architecture.name must be a non-empty string, not {arch.name!r}")
    types = arch.model_types
    if isinstance(types, str):
        raise PluginValidationError(
            f"{where}: Architecture {arch.name!r} declares model_types={types!r}, a string: it would be matched "
            f"as a substring of every model type. Write a tuple: model_types=({types!r},)"
        )
    if not isinstance(types, (tuple, list)) or not types or not all(isinstance(t, str) and t for t in types):
        raise PluginValidationError(
            f"{where}: Architecture {arch.name!r} must declare model_types as a non-empty "
            f"tuple of strings (config.model_type values), not {types!r}"
        )
    impls = arch.attn_implementations
    if isinstance(impls, str) or not isinstance(impls, (tuple, list)) or not all(isinstance(i, str) for i in impls):
        raise PluginValidationError(
            f"{where}: Architecture {arch.name!r} must declare attn_implementations as a "
            f"tuple of strings (like ('eager', 'sdpa')), not {impls!r}"
        )
    if not isinstance(arch.transformers, str):
        raise PluginValidationError(
            f"{where}: Architecture {arch.name!r}: transformers must be a version "
            f"specifier string (like '>=4.57,<6'), not {arch.transformers!r}"
        )
    if isinstance(types, list) or isinstance(impls, list):
        arch = dataclasses.replace(arch, model_types=tuple(types), attn_implementations=tuple(impls))
    return arch


def architectures_of(plugin: Any, plugin_name: str) -> tuple[Architecture, ...]:
    """The architectures ``plugin`` declares, each checked; ``()`` for a cross-cutting plugin."""
    impl = getattr(plugin, "lensadapters_architectures", None)
    if impl is None:
        return ()
    try:
        declared = impl()
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - a plugin's failure is reported, whatever it raised
        raise PluginValidationError(
            f"plugin {plugin_name!r}: lensadapters_architectures() raised {_type_name(exc)}: {exc}"
        ) from exc
    if isinstance(declared, (Architecture, str, bytes)) or not isinstance(declared, Iterable):
        raise PluginValidationError(
            f"plugin {plugin_name!r}: lensadapters_architectures() must return a list of "
            f"lensadapters.Architecture, not a {_type_name(declared)} ({declared!r:.80})"
        )
    archs = tuple(check_architecture(plugin_name, a) for a in declared)
    names = [a.name for a in archs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PluginValidationError(f"plugin {plugin_name!r} declares the architecture name(s) {twice} twice")
    return archs


def check_required_hooks(plugin: Any, plugin_name: str, marker: str) -> None:
    """An architecture plugin implements every hook the core builds hook points from."""
    missing = [h for h in REQUIRED_ARCHITECTURE_HOOKS if not hasattr(getattr(plugin, h, None), marker)]
    if missing:
        raise PluginValidationError(
            f"plugin {plugin_name!r} declares architectures but does not implement {', '.join(missing)}: an "
            f"architecture plugin describes the model with all of {', '.join(REQUIRED_ARCHITECTURE_HOOKS)} "
            f"(see docs/writing-a-plugin.md)"
        )


# --- wrap time: the description -------------------------------------------------------------------


def check_result(plugin_name: str, hook: str, value: Any, expected: Sequence[type], what: str) -> None:
    """A description hook returned an object of the expected type (``None``: missing, or it returned nothing)."""
    if isinstance(value, tuple(expected)):
        return
    names = " or ".join(t.__name__ for t in expected)
    got = "nothing (None)" if value is None else f"a {_type_name(value)}"
    raise UnsupportedModelError(f"plugin {plugin_name!r}: {hook} returned {got} {what}; it must return a {names}")


def _closest(owner: nn.Module, path: str) -> str:
    """The part of ``path`` that exists, and the closest names where it stops."""
    module: nn.Module = owner
    done: list[str] = []
    for part in path.split("."):
        child = module._modules.get(part)
        if child is None and not isinstance(getattr(module, part, None), nn.Module):
            options = difflib.get_close_matches(part, list(module._modules), n=3, cutoff=0.4)
            at = ".".join(done) or "the top level"
            hint = (
                f"; closest names there: {', '.join(options)}"
                if options
                else (f"; it has {', '.join(list(module._modules)[:8]) or 'no submodules'}")
            )
            return f"there is no {part!r} under {at} ({type(module).__name__}){hint}"
        module = child if child is not None else getattr(module, part)
        done.append(part)
    return ""


def check_paths(plugin_name: str, owner: nn.Module, layout: Any, where: str, hint: str = "") -> None:
    """Every module path of ``layout`` resolves in ``owner`` (the model, or one block)."""
    for field in _PATH_FIELDS.get(type(layout), ()):
        path = getattr(layout, field, None)
        if path is None or path == "":
            continue
        if field in ("k", "v") and getattr(layout, "kv_from", None) is not None:
            continue  # keys and values from another layer: the paths are unused
        if not isinstance(path, str):
            raise UnsupportedModelError(
                f"plugin {plugin_name!r}: {type(layout).__name__}.{field} must be a dotted "
                f"module path (a string), not {path!r}"
            )
        try:
            found = owner.get_submodule(path)
        except AttributeError:
            found = None
        if not isinstance(found, nn.Module):
            raise UnsupportedModelError(
                f"plugin {plugin_name!r} describes {type(layout).__name__}.{field}={path!r} ({where}), but this "
                f"{type(owner).__name__} has no such module: {_closest(owner, path)}.{hint}"
            )


def check_config(plugin_name: str, cfg: Any) -> None:
    check_result(plugin_name, "lensadapters_config", cfg, (specs.HookedConfig,), "for the model")


def describe_forced(adapter: Optional[str], model_type: str, arch: Architecture, owners: Sequence[str]) -> str:
    """The sentence added to a description error when the user forced a plugin the model's type is not declared by."""
    if adapter is None or model_type in arch.model_types:
        return ""
    text = (
        f" The plugin was chosen with adapter={adapter!r}, but this model's model_type is {model_type!r}, "
        f"which it does not declare ({', '.join(arch.model_types)})"
    )
    if owners:
        text += f"; the installed plugin for {model_type!r} is {', '.join(repr(o) for o in owners)}"
    return text + "."
