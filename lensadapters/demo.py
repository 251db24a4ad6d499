"""Old path of :mod:`lensadapters.cli.demo`, kept as an alias of that module."""

import sys

from lensadapters.cli import demo as _module
from lensadapters.cli.demo import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
