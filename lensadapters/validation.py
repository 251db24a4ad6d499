"""Old path of :mod:`lensadapters.adapters.validation`, kept as an alias of that module."""

import sys

from lensadapters.adapters import validation as _module
from lensadapters.adapters.validation import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
