"""Old import paths of modules inside the subpackages that moved (``lensadapters.harvest.runner``,
``lensadapters.sites.base``...): an import finder serves each as the moved module itself (one module object, not
a copy). The old paths of the top-level modules are files (``lensadapters/hf.py``...) that alias theirs."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional, Sequence

#: old subpackage -> where it lives now
MOVED_PACKAGES = {
    "lensadapters.sites": "lensadapters.hooks.sites",
    "lensadapters.generic": "lensadapters.adapters.generic",
    "lensadapters.moe": "lensadapters.adapters.moe",
    "lensadapters.harvest": "lensadapters.integrations.harvest",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the moved module ran when it was imported under its own name


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``lensadapters.<old subpackage>.<module>`` as ``<new subpackage>.<module>``."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        for old, new in MOVED_PACKAGES.items():
            if fullname.startswith(old + "."):
                return importlib.machinery.ModuleSpec(fullname, _Alias(new + fullname[len(old) :]))
        return None


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
