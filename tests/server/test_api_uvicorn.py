"""The API and error suites again, under uvicorn (the benchmarks' peer) instead of the fast
transport: same app, same contract."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_support import Running, demo_settings, serve_uvicorn
from test_api import *  # the suites, re-run here
from test_errors import *


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Running]:
    """The same CPU server as conftest's, under uvicorn."""
    with serve_uvicorn(demo_settings(tmp_path_factory.mktemp("weights"))) as running:
        yield running
