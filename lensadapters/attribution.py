"""The public path of :mod:`lensadapters.analysis.attribution`, an alias of that module."""

import sys

from lensadapters.analysis import attribution as _module
from lensadapters.analysis.attribution import *  # noqa: F401,F403  (the names, for type checkers)

sys.modules[__name__] = _module
