"""Old path of :mod:`lensadapters.api.hooked_model`, kept as an alias of that module."""

import sys

from lensadapters.api import hooked_model as _module
from lensadapters.api.hooked_model import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
