"""Old path of :mod:`lensadapters.hooks.offload`, kept as an alias of that module."""

import sys

from lensadapters.hooks import offload as _module
from lensadapters.hooks.offload import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
