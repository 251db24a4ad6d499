"""The harvest's kill test hook: ``LENSADAPTERS_HARVEST_TEST_KILL`` makes a run SIGKILL itself at a chosen event,
so that the tests can check that a harvest killed at any point resumes where it stopped."""

from __future__ import annotations

import os
import signal
from typing import Any

#: test hook: ``EVENT:N`` kills the process with SIGKILL at the N-th EVENT of this run (``batch``: a batch
#: written into an unfinished shard; ``shard-file``: a shard file moved into place, its manifest not yet
#: written; ``manifest``: a manifest written); ``EVENT:N@RANK`` only in that rank
KILL_ENV = "LENSADAPTERS_HARVEST_TEST_KILL"


def kill_switch(rank: int) -> Any:
    """The test hook of ``KILL_ENV``: a function of an event name that SIGKILLs this process at the chosen one
    (``EVENT:N@RANK``: only in rank ``RANK`` of a split harvest)."""
    setting = os.environ.get(KILL_ENV)
    if setting and "@" in setting:
        setting, _, only = setting.partition("@")
        if int(only) != rank:
            setting = ""
    if not setting:
        return lambda event: None
    event_wanted, _, count = setting.partition(":")
    seen = {"n": 0}

    def kill(event: str) -> None:
        if event == event_wanted:
            seen["n"] += 1
            if seen["n"] == int(count or 1):
                os.kill(os.getpid(), signal.SIGKILL)

    return kill
