"""Old path of :mod:`lensadapters.analysis.head_detector`, kept as an alias of that module."""

import sys

from lensadapters.analysis import head_detector as _module
from lensadapters.analysis.head_detector import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
