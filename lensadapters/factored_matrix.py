"""Old path of :mod:`lensadapters.analysis.factored_matrix`, kept as an alias of that module."""

import sys

from lensadapters.analysis import factored_matrix as _module
from lensadapters.analysis.factored_matrix import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
