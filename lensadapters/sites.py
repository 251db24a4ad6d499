"""Old path of :mod:`lensadapters.hooks.sites`, kept as an alias of that module."""

import sys

from lensadapters.hooks import sites as _module
from lensadapters.hooks.sites import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
