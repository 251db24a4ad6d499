"""Old path of :mod:`lensadapters.adapters.protocol`, kept as an alias of that module."""

import sys

from lensadapters.adapters import protocol as _module
from lensadapters.adapters.protocol import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
