"""The API and error suites again, under uvicorn (the benchmarks' peer) instead of the fast
transport: same app, same contract."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from moegemm.server import Settings
from server_support import Running, serve_uvicorn
from test_api import *  # the suites, re-run here
from test_errors import *


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Running]:
    """The same CPU server as conftest's, under uvicorn."""
    root = tmp_path_factory.mktemp("weights")
    settings = Settings(device="cpu", weights_dir=root, demo=True, max_body_bytes=8 << 20,
                        max_m=4096, max_bucket_m=256)
    with serve_uvicorn(settings) as running:
        running.weights_dir = root
        yield running
