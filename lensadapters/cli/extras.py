"""The core distribution's extras that each install one built-in plugin (``pip install lensadapters[gpt2]``)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["plugin_extras"]


def plugin_extras(distribution: str = "lensadapters") -> dict[str, str]:
    """``{plugin distribution: extra}`` for the extras of the installed ``distribution`` that each install one
    ``lensadapters-*`` distribution (the built-in plugins: ``pip install lensadapters[gpt2]``), in the order
    they are declared; empty when ``distribution`` is not installed (a checkout on ``sys.path``)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return {}
    requirements = []
    for line in dist.requires or ():
        try:
            requirements.append(Requirement(line))
        except InvalidRequirement:
            continue
    found: dict[str, str] = {}
    for extra in dist.metadata.get_all("Provides-Extra") or ():
        wanted = [r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})]
        if len(wanted) == 1 and canonicalize_name(wanted[0].name).startswith("lensadapters-"):
            found.setdefault(canonicalize_name(wanted[0].name), extra)
    return found
