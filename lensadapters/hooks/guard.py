"""A guard against modules replaced after wrapping.

Sites put PyTorch hooks on module *objects*. When a module is replaced after ``HookedModel.wrap`` — a user's own
surgery (``model.model.layers[0].mlp = MyMLP()``), PEFT injecting LoRA layers later (``get_peft_model`` on a wrapped
model, ``add_adapter``/``load_adapter`` targeting new modules, ``merge_and_unload()``/``unload()``),
``resize_token_embeddings`` — the hooks stay on the old object: they no longer run, or run on a module that is no
longer the one whose output the model uses, and the hook point silently reads or edits the wrong thing.

:class:`ModuleGuard` records, at wrap time, the path of every module a site hooks (the core's sites and the sites
plugins add alike: every ``nn.Module`` a site holds). Before each hooked forward it checks that each parent ->
child link on the paths of the *installed* sites still holds (one dict lookup per link, only for what is hooked)
and otherwise raises an error naming the module, before any hook runs.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch import nn

from lensadapters.errors import LensAdaptersError

Link = tuple[nn.Module, str, nn.Module]  # (parent, name in parent._modules, expected child)


class ModuleReplacedError(LensAdaptersError):
    """A module a hook point depends on was replaced after the model was wrapped."""


def site_modules(site: Any) -> list[nn.Module]:
    """The modules a site hooks: every ``nn.Module`` among its attributes (also inside lists and tuples)."""
    found: list[nn.Module] = []
    for value in vars(site).values():
        items = value if isinstance(value, (list, tuple)) else (value,)
        found += [item for item in items if isinstance(item, nn.Module)]
    return found


class ModuleGuard:
    """Refuses to run hooks on modules replaced after wrapping (see the module docstring)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        # every module's path and the links leading to it, as they are now (at wrap time)
        self._links_to: dict[int, tuple[str, tuple[Link, ...]]] = {}
        self._walk(root, "", ())
        self._site_links: dict[Any, tuple[Link, ...]] = {}
        self._extra: dict[Any, list[nn.Module]] = {}
        self.links: tuple[Link, ...] = ()

    def _walk(self, module: nn.Module, path: str, links: tuple[Link, ...]) -> None:
        for name, child in module._modules.items():
            if child is None or id(child) in self._links_to:
                continue
            child_path = f"{path}.{name}" if path else name
            child_links = links + ((module, name, child),)
            self._links_to[id(child)] = (child_path, child_links)
            self._walk(child, child_path, child_links)

    def also(self, site: Any, modules: Iterable[nn.Module]) -> None:
        """Modules a site depends on without holding them as attributes (a pattern backend's attention module)."""
        self._extra.setdefault(site, []).extend(modules)

    def links_of(self, site: Any) -> tuple[Link, ...]:
        links = self._site_links.get(site)
        if links is None:
            seen: dict[tuple[int, str], Link] = {}
            for module in site_modules(site) + self._extra.get(site, []):
                entry = self._links_to.get(id(module))
                for link in entry[1] if entry is not None else ():
                    seen[(id(link[0]), link[1])] = link
            links = self._site_links[site] = tuple(seen.values())
        return links

    def watch(self, sites: Iterable[Any]) -> None:
        """Check the links of these sites (the installed ones) from now on."""
        seen: dict[tuple[int, str], Link] = {}
        for site in sites:
            for link in self.links_of(site):
                seen[(id(link[0]), link[1])] = link
        self.links = tuple(seen.values())

    def check(self) -> None:
        """Raise :class:`ModuleReplacedError` if a watched module is no longer where it was."""
        for parent, name, child in self.links:
            if parent._modules.get(name) is not child:
                self._raise(parent, name, child)

    def path_of(self, module: nn.Module) -> Optional[str]:
        entry = self._links_to.get(id(module))
        return entry[0] if entry is not None else None

    def _raise(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        path = self.path_of(child) or name
        current = parent._modules.get(name)
        now = "is gone" if current is None else f"is now {type(current).__module__}.{type(current).__qualname__}"
        raise ModuleReplacedError(
            f"module {path!r} of the wrapped {type(self.root).__name__} was replaced after HookedModel.wrap (it was "
            f"{type(child).__module__}.{type(child).__qualname__}, it {now}): the hooks attached there are on the "
            f"old module and would silently not run or see the wrong values. PEFT does this when an adapter "
            f"targeting new modules is added (get_peft_model, add_adapter, load_adapter) and on "
            f"merge_and_unload()/unload(); so does resize_token_embeddings or swapping a layer by hand. Call "
            f"hm.unwrap() and HookedModel.wrap(model) again after changing the model's modules."
        )
