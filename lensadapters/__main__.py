"""``python -m lensadapters``: the ``lensadapters`` command (launchers run it: ``torchrun -m lensadapters``)."""

import sys

from lensadapters.cli import main

sys.exit(main())
