"""Old path of :mod:`lensadapters.hooks.attention`, kept as an alias of that module."""

import sys

from lensadapters.hooks import attention as _module
from lensadapters.hooks.attention import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
