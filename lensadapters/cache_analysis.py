"""Old path of :mod:`lensadapters.analysis.cache_analysis`, kept as an alias of that module."""

import sys

from lensadapters.analysis import cache_analysis as _module
from lensadapters.analysis.cache_analysis import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
