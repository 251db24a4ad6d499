"""The public path of :mod:`lensadapters.analysis.edge_attribution`, an alias of that module."""

import sys

from lensadapters.analysis import edge_attribution as _module
from lensadapters.analysis.edge_attribution import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
