"""The served processes die with the test process: a pytest killed by SIGTERM or
SIGKILL runs no teardown, and a server in a session of its own would otherwise
live on, orphaned, holding its port and its database connections.

On Linux each served process asks the kernel for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``): the server's main process when the test process
does, each gunicorn worker when the main process does. The kernel sends it when
the parent *thread* that started the process ends, so the kit starts servers
from the test's own thread. Elsewhere this does nothing (the fixtures' teardown
still stops the servers on an ordinary end). Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: From <linux/prctl.h>.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> bool:
    """Ask for SIGKILL when this process's parent dies; whether it could (Linux).

    ``parent`` is the pid the parent must have: if it died before the request
    took effect (this process was reparented already), exit now.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    now = os.getppid()
    if now == 1 or (parent is not None and now != parent):
        sys.stderr.write("idempotency kit: the test process is gone; exiting\n")
        os._exit(1)
    return True
