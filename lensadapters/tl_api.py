"""Old path of :mod:`lensadapters.api.tl_api`, kept as an alias of that module."""

import sys

from lensadapters.api import tl_api as _module
from lensadapters.api.tl_api import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
