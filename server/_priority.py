"""The CPU priority of the threads that load weight sets."""

from __future__ import annotations

import os
import sys
import threading

# The nice value of the engine's loader thread and of the file readers (``store``). A set's host
# work (reading, converting, quantizing: all of it on the CPU backend) and its graph captures then
# take the CPU only when the calls leave it free, so other sets' calls keep their latency while it
# loads (SPEC 3: p99 within 2x of idle). The OpenMP workers their torch ops start are their own
# and inherit it (Linux nice is per thread).
LOADER_NICE = 10


def yield_cpu() -> None:
    """Lower the calling thread's scheduling priority to LOADER_NICE (Linux: nice is per thread,
    set by thread id; elsewhere a thread id is no process id, so nothing is done). Best effort:
    a process already at a lower priority keeps it."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < LOADER_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, LOADER_NICE)
    except OSError:
        pass
