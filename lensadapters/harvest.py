"""Old path of :mod:`lensadapters.integrations.harvest`, kept as an alias of that module."""

import sys

from lensadapters.integrations import harvest as _module
from lensadapters.integrations.harvest import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
