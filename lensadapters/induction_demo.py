"""Old path of :mod:`lensadapters.cli.induction_demo`, kept as an alias of that module."""

import sys

from lensadapters.cli import induction_demo as _module
from lensadapters.cli.induction_demo import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
