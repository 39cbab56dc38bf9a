"""The soak, bounded for CI: a real ``moegemm serve`` process on loopback, many
concurrent clients mixing valid and invalid calls while weight sets are
replaced and deleted; every call answered once with exactly its own rows, no
500s, nothing lost, the server's memory stable, a clean exit on SIGINT.

Mid-run the server is filled with weight sets until it answers 507 (here a
total weight limit stands for device memory), under the same traffic.

The driver is ``bench/soak.py`` (the same one runs at scale on the GPU box).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SOAK_SECONDS = 20


def _load_soak():
    path = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    spec = importlib.util.spec_from_file_location("moegemm_bench_soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def soak():
    return _load_soak()


def test_soak(soak, tmp_path):
    env = {"MOEGEMM_TOKEN": "soak-reader", "MOEGEMM_ADMIN_TOKEN": "soak-admin"}
    # A short queue, so that some calls meet a full one (503) under this load.
    # A total weight limit, so that filling the "device" mid-run meets 507.
    server = soak.SpawnedServer(["--device", "cpu", "--queue-size", "6",
                                 "--max-weight-bytes", str(14 << 20)], env,
                                tmp_path / "server.log")
    try:
        server.wait_live()
        config = soak.Config(url=server.url, token="soak-reader", admin_token="soak-admin",
                             duration=SOAK_SECONDS, clients=12, G=4, N=256, K=256,
                             max_rows=40, churn_every=0.4, server_pid=server.proc.pid,
                             fill_memory=True, fill_G=64,
                             seed=int.from_bytes(os.urandom(4), "little"))
        report = soak.run(config)
    finally:
        exit_status = server.stop()
    log = (tmp_path / "server.log").read_text()
    assert report.failures == [], report
    assert report.lost == 0
    # It did real work: calls served and checked row by row, every invalid kind
    # answered, weights replaced and deleted under traffic.
    assert report.served >= 40, report
    assert report.rows_checked >= 200, report
    assert len(report.invalid_answered) >= 8, report.invalid_answered
    assert report.weight_puts >= 6 and report.weight_deletes >= 1, report
    assert report.fill["reached_507"] and report.fill["sets_loaded"] >= 3, report.fill
    assert report.rss_mib_last_quarter is not None
    assert exit_status == 0, log[-2000:]
    at = log.find("Traceback")
    assert at < 0, log[max(0, at - 300):at + 4000]


def test_reference_rows_tell_versions_apart(soak):
    """The soak's own check: the right version matches, another version or mixed rows do not."""
    import numpy as np

    rng = np.random.default_rng()
    g, n, k, m = 3, 128, 256, 30
    versions = [soak.Version("v", soak._fp8(rng, (g, n, k)), soak._scales(rng, (g, 2, 1)), 0.0)
                for _ in range(2)]
    x, x_scale = soak._fp8(rng, (m, k)), soak._scales(rng, (m, 2))
    m_sizes = np.array([10, 0, 20])
    rows = np.arange(m)
    weights = soak.Dequantized()
    exact = np.einsum(
        "mk,mnk->mn",
        x.astype(np.float64) * np.repeat(x_scale, 128, 1),
        (versions[0].wq.astype(np.float64)
         * np.repeat(np.repeat(versions[0].w_scale.transpose(0, 2, 1), 128, 1), 128, 2))[
            np.repeat(np.arange(g), m_sizes)],
    )
    got = exact.astype(np.float32)
    assert soak.matching(weights, versions, got, x, x_scale, m_sizes, rows) is versions[0]
    assert soak.matching(weights, versions[1:], got, x, x_scale, m_sizes, rows) is None
    swapped = got.copy()
    swapped[[0, 15]] = got[[15, 0]]  # two rows of different groups trade places
    assert soak.matching(weights, versions, swapped, x, x_scale, m_sizes, rows) is None
