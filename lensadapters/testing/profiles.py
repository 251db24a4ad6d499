"""The Hypothesis profiles every lensadapters test suite uses (the core's, each plugin's, third parties').

Call :func:`load_profile` from a ``conftest.py``, before anything imports the contract suite: Hypothesis fixes a
test's settings when the test is defined. ``HYPOTHESIS_PROFILE`` picks the profile:

* ``dev`` (the default): 4 examples per property, new ones on every run, to keep exploring;
* ``ci``: 6 examples, derandomized and without an example database, so that every CI run checks the same
  examples and a red run is reproducible;
* ``ci-short``: 3 examples, derandomized like ``ci`` (CI's second transformers version, whose job is to catch what
  differs between versions, not to explore);
* ``thorough``: 100 examples.
"""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["PROFILES", "register_profiles", "load_profile"]

#: profile name -> examples per property
PROFILES = {"dev": 4, "ci": 6, "ci-short": 3, "thorough": 100}


def register_profiles() -> None:
    """Register ``dev``, ``ci`` and ``thorough`` with Hypothesis (idempotent)."""
    from hypothesis import HealthCheck, settings

    slow = [HealthCheck.too_slow]
    reproducible: dict[str, Any] = dict(derandomize=True, database=None, print_blob=True)  # CI's profiles
    for name, examples in PROFILES.items():
        extra = reproducible if name.startswith("ci") else {}
        settings.register_profile(name, max_examples=examples, deadline=None, suppress_health_check=slow, **extra)


def load_profile(name: Optional[str] = None) -> str:
    """Register the profiles and load ``name`` (default: ``$HYPOTHESIS_PROFILE``, else ``dev``); returns its name."""
    from hypothesis import settings

    register_profiles()
    name = name or os.environ.get("HYPOTHESIS_PROFILE", "dev")
    settings.load_profile(name)
    return name
