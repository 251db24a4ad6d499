"""Old path of :mod:`lensadapters.analysis.patching`, kept as an alias of that module."""

import sys

from lensadapters.analysis import patching as _module
from lensadapters.analysis.patching import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
