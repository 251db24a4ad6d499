"""The Hypothesis profiles of every lensadapters suite (HYPOTHESIS_PROFILE=dev|ci|thorough), loaded before the
contract suite is defined (Hypothesis fixes a test's settings when the test is defined)."""

import pytest
from lensadapters_llama.testing import llama32_3b_like, make

from lensadapters.testing.profiles import load_profile

load_profile()


@pytest.fixture(scope="module")
def llama32():
    model = make(llama32_3b_like(), 7)
    yield model
