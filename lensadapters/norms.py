"""Old path of :mod:`lensadapters.hooks.norms`, kept as an alias of that module."""

import sys

from lensadapters.hooks import norms as _module
from lensadapters.hooks.norms import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
