"""Old path of :mod:`lensadapters.testing.check`, kept as an alias of that module."""

import sys

from lensadapters.testing import check as _module
from lensadapters.testing.check import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
