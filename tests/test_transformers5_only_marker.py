"""The ``transformers5_only`` marker skips its test on transformers 4.x however the suite is run (the rootdir's
conftest.py), not only where scripts/test.sh deselects it with ``-m``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest() -> Any:
    spec = importlib.util.spec_from_file_location("lensadapters_root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None, "the repository's root conftest.py is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Item:
    """What the hook reads of a collected test: its markers; what it writes: a marker added."""

    def __init__(self, *markers: str) -> None:
        self.markers = [getattr(pytest.mark, m) for m in markers]

    def get_closest_marker(self, name: str) -> Optional[Any]:
        return next((m.mark for m in self.markers if m.name == name), None)

    def add_marker(self, marker: Any) -> None:
        self.markers.append(marker)


@pytest.mark.parametrize("version, skipped", [("4.57.6", True), ("4.46.0", True), ("5.0.0", False), ("5.24.1", False)])
def test_a_transformers5_only_test_is_skipped_exactly_on_transformers_4(version: str, skipped: bool) -> None:
    only5, anywhere = _Item("transformers5_only"), _Item("one_environment")
    _root_conftest().skip_transformers5_only([only5, anywhere], version)
    skip = only5.get_closest_marker("skip")
    assert (skip is not None) == skipped
    if skipped:
        assert "needs transformers 5.x" in skip.kwargs["reason"] and version in skip.kwargs["reason"]
    assert anywhere.get_closest_marker("skip") is None  # other tests are left as they are


def test_the_collection_hook_skips_by_the_installed_transformers(request: pytest.FixtureRequest) -> None:
    """This run's own collection: a test of this repository marked ``transformers5_only`` carries the skip exactly
    where the installed transformers is a 4.x one."""
    from importlib.metadata import version

    item = _Item("transformers5_only")
    _root_conftest().pytest_collection_modifyitems(request.config, [item])
    assert (item.get_closest_marker("skip") is not None) == version("transformers").startswith("4.")
