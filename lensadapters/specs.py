"""Old path of :mod:`lensadapters.hooks.specs`, kept as an alias of that module."""

import sys

from lensadapters.hooks import specs as _module
from lensadapters.hooks.specs import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
