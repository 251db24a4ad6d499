"""Old path of :mod:`lensadapters.analysis.cache`, kept as an alias of that module."""

import sys

from lensadapters.analysis import cache as _module
from lensadapters.analysis.cache import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
