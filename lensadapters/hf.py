"""Old path of :mod:`lensadapters.adapters.hf`, kept as an alias of that module."""

import sys

from lensadapters.adapters import hf as _module
from lensadapters.adapters.hf import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
