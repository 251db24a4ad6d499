"""Old path of :mod:`lensadapters.api.saes`, kept as an alias of that module."""

import sys

from lensadapters.api import saes as _module
from lensadapters.api.saes import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
