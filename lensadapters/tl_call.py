"""Old path of :mod:`lensadapters.api.tl_call`, kept as an alias of that module."""

import sys

from lensadapters.api import tl_call as _module
from lensadapters.api.tl_call import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
