"""Old path of :mod:`lensadapters.adapters.plugin_calls`, kept as an alias of that module."""

import sys

from lensadapters.adapters import plugin_calls as _module
from lensadapters.adapters.plugin_calls import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
