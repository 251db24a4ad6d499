"""The Hypothesis profiles of every lensadapters suite (HYPOTHESIS_PROFILE=dev|ci|thorough), loaded before the
contract suite is defined (Hypothesis fixes a test's settings when the test is defined)."""

from lensadapters.testing.profiles import load_profile

load_profile()
