"""Old path of :mod:`lensadapters.adapters.layers`, kept as an alias of that module."""

import sys

from lensadapters.adapters import layers as _module
from lensadapters.adapters.layers import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
