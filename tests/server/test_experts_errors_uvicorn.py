"""The expert-set error suite again, under uvicorn (the benchmarks' peer)."""

from __future__ import annotations

import pytest
from server_support import serve_uvicorn
from test_experts_errors import *  # the suite, re-run here
from test_experts_errors import limited_settings, with_experts


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with serve_uvicorn(limited_settings(tmp_path_factory.mktemp("w"))) as running:
        yield with_experts(running)
