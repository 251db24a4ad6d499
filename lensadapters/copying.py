"""Old path of :mod:`lensadapters.hooks.copying`, kept as an alias of that module."""

import sys

from lensadapters.hooks import copying as _module
from lensadapters.hooks.copying import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
