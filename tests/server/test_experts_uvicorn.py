"""The expert-set API suite again, under uvicorn (the benchmarks' peer) instead of
the fast transport: same app, same contract."""

from __future__ import annotations

import pytest
from server_support import serve_uvicorn
from test_experts import *  # the suite, re-run here
from test_experts import expert_settings


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with serve_uvicorn(expert_settings(tmp_path_factory.mktemp("w"))) as running:
        yield running
