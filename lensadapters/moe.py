"""Old path of :mod:`lensadapters.adapters.moe`, kept as an alias of that module."""

import sys

from lensadapters.adapters import moe as _module
from lensadapters.adapters.moe import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
