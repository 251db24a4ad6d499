"""Errors that name the problem and the fix."""

from __future__ import annotations

import difflib
from typing import Iterable


class LensAdaptersError(Exception):
    """Base class of lensadapters' errors."""


class UnsupportedModelError(LensAdaptersError, TypeError):
    """No plugin can adapt the model (or the plugin cannot represent its configuration)."""


class PluginConflictError(LensAdaptersError):
    """Two plugins claim the same thing."""


class PluginValidationError(LensAdaptersError):
    """A plugin implements hooks lensadapters does not define, or declares something it cannot use."""


class PluginError(LensAdaptersError):
    """A plugin's hook implementation failed with an error of its own (not a lensadapters refusal).

    ``plugin`` names the plugin and ``hook`` the hook implementation; the original exception is the ``__cause__``.
    """

    def __init__(self, message: str, plugin: str = "", hook: str = "") -> None:
        super().__init__(message)
        self.plugin, self.hook = plugin, hook


class UnknownHookError(LensAdaptersError, KeyError):
    """A hook name that this model does not have."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        known = list(known)
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        hint = f" Closest names: {', '.join(close)}." if close else ""
        self.name = name
        self.message = f"unknown hook point {name!r}.{hint} `hm.hook_names` lists all {len(known)} hook points."
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class NotCausalError(LensAdaptersError, TypeError):
    """An operation of causal language models (the next-token loss, generation) on a model whose attention is
    bidirectional (an encoder, ``cfg.attention_dir == "bidirectional"``)."""


class HookReturnError(LensAdaptersError, ValueError):
    """A user hook returned something that cannot replace the hooked value."""


class WeightUnavailableError(LensAdaptersError, TypeError):
    """A weight is stored in a format lensadapters cannot read as a matrix."""
