"""Old path of :mod:`lensadapters.hooks.distributed`, kept as an alias of that module."""

import sys

from lensadapters.hooks import distributed as _module
from lensadapters.hooks.distributed import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
