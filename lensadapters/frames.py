"""Old path of :mod:`lensadapters.hooks.frames`, kept as an alias of that module."""

import sys

from lensadapters.hooks import frames as _module
from lensadapters.hooks.frames import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
