"""The expert-set API suite again, behind the fast HTTP transport (the default of
``moegemm serve``) instead of uvicorn: same app, same contract."""

from __future__ import annotations

import pytest
from moegemm.server import Settings
from test_experts import *  # the suite, re-run here
from test_http_transport import fast_serve


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    settings = Settings(device="cpu", weights_dir=tmp_path_factory.mktemp("w"), demo=False,
                        max_body_bytes=32 << 20, max_m=4096, max_bucket_m=256)
    with fast_serve(settings) as running:
        yield running
