"""Graceful termination, as the deployments rely on it: SIGTERM lets the call
in flight finish with its full answer, then the process exits by itself.

The Kubernetes preStop pause and terminationGracePeriodSeconds, and Compose's
stop_grace_period, are sized for exactly this behaviour of `moegemm serve`.
"""

from __future__ import annotations

import signal
import threading
import time

import ml_dtypes
import numpy as np
from moegemm.client import Client


def test_sigterm_drains_the_call_in_flight(start_servers):
    rng = np.random.default_rng()
    (server,) = start_servers(1)
    try:
        # Big enough that the call is still running on the CPU backend when
        # the signal comes (about a second on a small machine).
        g, n, k, m = 4, 1024, 2048, 8192
        m_sizes = [m // g] * g
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        with Client(server.url, token=server.token, timeout=120) as client:
            client.load_weights("drain", rng.standard_normal((g, n, k)).astype(ml_dtypes.bfloat16))
            started = time.monotonic()
            expected = client.grouped_gemm("drain", x, m_sizes)
            one_call = time.monotonic() - started
            result: dict = {}

            def call() -> None:
                try:
                    result["out"] = client.grouped_gemm("drain", x, m_sizes)
                except Exception as exc:  # noqa: BLE001 (reported by the assert below)
                    result["error"] = exc

            worker = threading.Thread(target=call)
            worker.start()
            time.sleep(min(0.3, one_call / 4))  # the request is on the server now
            assert worker.is_alive(), "the call ended before the signal: make it bigger"
            server.proc.send_signal(signal.SIGTERM)
            worker.join(timeout=60)
        assert "error" not in result, result.get("error")
        np.testing.assert_array_equal(result["out"], expected)
        # uvicorn ends by re-raising SIGTERM: exit 143 in a container, a clean stop.
        assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        server.stop()
