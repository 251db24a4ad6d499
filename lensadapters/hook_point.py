"""Old path of :mod:`lensadapters.hooks.hook_point`, kept as an alias of that module."""

import sys

from lensadapters.hooks import hook_point as _module
from lensadapters.hooks.hook_point import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
