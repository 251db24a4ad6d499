"""The Hypothesis profiles of every lensadapters suite (HYPOTHESIS_PROFILE=dev|ci|thorough), loaded before the
contract suite is defined; bitsandbytes' and transformers' per-call chatter silenced."""

import logging
import warnings

from lensadapters.testing.profiles import load_profile

load_profile()

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16" on every call
warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")


def pytest_configure(config):
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
