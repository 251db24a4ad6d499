"""Old path of :mod:`lensadapters.wiring.weights`, kept as an alias of that module."""

import sys

from lensadapters.wiring import weights as _module
from lensadapters.wiring.weights import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
