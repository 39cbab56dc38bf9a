"""The multi-GPU scenario (bench/multi_gpu.py, issue 19) on two CPU servers.

The same script runs on a two-GPU machine (``--devices 0,1``); here every check of
it -- placement, exact answers, a hot set served by both replicas (counted from
each server's metrics), failover on SIGKILL with nothing answered wrong, a
restart bringing placement back -- runs against two real CPU server processes.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

_BENCH = str(Path(__file__).parents[2] / "bench")


def _scenario():
    # By name from the bench folder: its client processes (spawned) import it again.
    if _BENCH not in sys.path:
        sys.path.insert(0, _BENCH)
    return importlib.import_module("multi_gpu")


def test_every_check_of_the_two_server_scenario_passes_on_cpu_servers():
    result = _scenario().run(["cpu", "cpu"], small=True, clients=2, seconds=1.0)
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed, failed
    assert len(result["checks"]) == 8
    assert result["throughput"]["one_server"]["calls"] > 0
    assert result["throughput"]["all_servers"]["calls"] > 0
