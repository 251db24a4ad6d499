"""``python -m lensadapters.cli``: the ``lensadapters`` command (as ``python -m lensadapters``)."""

import sys

from lensadapters.cli import main

sys.exit(main())
