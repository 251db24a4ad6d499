"""Old path of :mod:`lensadapters.integrations.training`, kept as an alias of that module."""

import sys

from lensadapters.integrations import training as _module
from lensadapters.integrations.training import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
