"""The Hypothesis profiles of every lensadapters suite (HYPOTHESIS_PROFILE=dev|ci|thorough), loaded before the
contract suite is defined (Hypothesis fixes a test's settings when the test is defined)."""

import os

import torch

from lensadapters.testing.profiles import load_profile

os.environ.setdefault("LENSADAPTERS_DISABLE_PLUGIN_AUTOLOAD", "")
load_profile()
# One torch thread for the whole run (every suite collected with this one): the models are tiny, two threads beside
# other processes ran tests up to ten times slower here, and CI's measured runs had one thread after
# tests/test_census.py (whose CLI used to leave it set). LENSADAPTERS_TEST_THREADS overrides it.
torch.set_num_threads(int(os.environ.get("LENSADAPTERS_TEST_THREADS", "1")))
