"""Old path of :mod:`lensadapters.adapters.generic`, kept as an alias of that module."""

import sys

from lensadapters.adapters import generic as _module
from lensadapters.adapters.generic import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
