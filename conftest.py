"""What every suite of the repository shares (the core's, each plugin's, each example's: this is the rootdir's
conftest): a test marked ``transformers5_only`` is skipped on transformers 4.x, however it is run.

scripts/test.sh deselects those tests in its 4.57 run (``-m "not transformers5_only"``); a plain
``pytest tests/...`` under transformers 4.57 used to run them, and those whose subject only exists in 5.x failed
(tests/test_generic_scan_heads.py's mixer whose scan activation differs from its convolution's: 4.57 applies one
activation to both)."""

from __future__ import annotations

from typing import Any

import pytest


def transformers_major(version: str) -> int:
    """The major version of a transformers version string (``"4.57.6"`` -> 4, ``"5.0.0.dev0"`` -> 5)."""
    return int(version.split(".", 1)[0])


def skip_transformers5_only(items: list[Any], version: str) -> None:
    """Mark each of ``items`` (collected tests) marked ``transformers5_only`` skipped, where ``version`` (of
    transformers) is a 4.x one."""
    if transformers_major(version) >= 5:
        return
    skip = pytest.mark.skip(reason=f"transformers5_only: needs transformers 5.x (this is transformers {version})")
    for item in items:
        if item.get_closest_marker("transformers5_only") is not None:
            item.add_marker(skip)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    from importlib.metadata import version

    skip_transformers5_only(items, version("transformers"))
