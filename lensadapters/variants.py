"""Old path of :mod:`lensadapters.adapters.variants`, kept as an alias of that module."""

import sys

from lensadapters.adapters import variants as _module
from lensadapters.adapters.variants import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
