"""Old path of :mod:`lensadapters.adapters.defaults`, kept as an alias of that module."""

import sys

from lensadapters.adapters import defaults as _module
from lensadapters.adapters.defaults import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
