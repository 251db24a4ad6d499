"""Old path of :mod:`lensadapters.hooks.guard`, kept as an alias of that module."""

import sys

from lensadapters.hooks import guard as _module
from lensadapters.hooks.guard import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
