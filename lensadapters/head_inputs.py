"""Old path of :mod:`lensadapters.wiring.head_inputs`, kept as an alias of that module."""

import sys

from lensadapters.wiring import head_inputs as _module
from lensadapters.wiring.head_inputs import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
