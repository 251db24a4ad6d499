"""Old path of :mod:`lensadapters.adapters.registry`, kept as an alias of that module."""

import sys

from lensadapters.adapters import registry as _module
from lensadapters.adapters.registry import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
