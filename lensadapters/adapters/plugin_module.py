"""The declaration of a plugin module that writes its adapter hooks itself: :func:`plugin_module` puts in its
namespace what the registry and ``lensadapters check`` read (the hookspec it was written for, the architectures it
claims, its contract suite). Exported by :mod:`lensadapters.hf`; import it from there.
"""

from __future__ import annotations

from typing import Any, Optional

from lensadapters.adapters.plugin_hooks import claims
from lensadapters.hooks.specs import Architecture

__all__ = ["plugin_module"]


def plugin_module(
    namespace: dict[str, Any], *archs: Architecture, hookspec: str, contract: Optional[str] = None
) -> None:
    """Declares a plugin module (``namespace``: its ``globals()``): ``LENSADAPTERS_HOOKSPEC = hookspec`` (the
    hookspec version its hooks were written for), ``lensadapters_architectures`` claiming ``archs`` and, given
    ``contract`` (a class name), ``LENSADAPTERS_CONTRACT = "<module>.testing:<contract>"``: the contract suite
    ``lensadapters check`` runs, imported only then (it needs ``lensadapters[testing]``).

    ``hf.plugin_module(globals(), ARCH, hookspec="1", contract="GPT2Contract")``."""
    namespace["LENSADAPTERS_HOOKSPEC"] = hookspec
    namespace["lensadapters_architectures"] = claims(*archs)
    if contract is not None:
        namespace["LENSADAPTERS_CONTRACT"] = f"{namespace['__name__']}.testing:{contract}"
