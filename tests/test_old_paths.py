"""Old module paths (kept after the move into layer packages) do not shadow the names the package exports."""

from __future__ import annotations

import subprocess
import sys


def test_importing_an_old_submodule_path_leaves_the_exported_harvest_function() -> None:
    code = (
        "import types, lensadapters.harvest.runner\n"
        "from lensadapters import harvest\n"
        "assert not isinstance(harvest, types.ModuleType), harvest\n"
        "assert callable(harvest)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
