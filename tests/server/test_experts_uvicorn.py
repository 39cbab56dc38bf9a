"""The expert-set API suite again, under uvicorn (the benchmarks' peer) instead of
the fast transport: same app, same contract."""

from __future__ import annotations

import pytest
from moegemm.server import Settings
from server_support import serve_uvicorn
from test_experts import *  # the suite, re-run here


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    settings = Settings(device="cpu", weights_dir=tmp_path_factory.mktemp("w"), demo=False,
                        max_body_bytes=32 << 20, max_m=4096, max_bucket_m=256)
    with serve_uvicorn(settings) as running:
        yield running
