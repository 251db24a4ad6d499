"""Old path of :mod:`lensadapters.api.arguments`, kept as an alias of that module."""

import sys

from lensadapters.api import arguments as _module
from lensadapters.api.arguments import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
