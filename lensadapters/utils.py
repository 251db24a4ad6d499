"""Old path of :mod:`lensadapters.analysis.utils`, kept as an alias of that module."""

import sys

from lensadapters.analysis import utils as _module
from lensadapters.analysis.utils import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
