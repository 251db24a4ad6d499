"""Old path of :mod:`lensadapters.api.tokens`, kept as an alias of that module."""

import sys

from lensadapters.api import tokens as _module
from lensadapters.api.tokens import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
