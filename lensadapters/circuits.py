"""Old path of :mod:`lensadapters.analysis.circuits`, kept as an alias of that module."""

import sys

from lensadapters.analysis import circuits as _module
from lensadapters.analysis.circuits import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
