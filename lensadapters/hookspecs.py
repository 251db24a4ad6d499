"""Old path of :mod:`lensadapters.adapters.hookspecs`, kept as an alias of that module."""

import sys

from lensadapters.adapters import hookspecs as _module
from lensadapters.adapters.hookspecs import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
