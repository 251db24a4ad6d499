"""Old path of :mod:`lensadapters.api.hook_namespace`, kept as an alias of that module."""

import sys

from lensadapters.api import hook_namespace as _module
from lensadapters.api.hook_namespace import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
