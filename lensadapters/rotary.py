"""Old path of :mod:`lensadapters.hooks.rotary`, kept as an alias of that module."""

import sys

from lensadapters.hooks import rotary as _module
from lensadapters.hooks.rotary import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
