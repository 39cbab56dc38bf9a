"""The expert-set error suite again, behind the fast HTTP transport."""

from __future__ import annotations

import pytest
from test_experts_errors import *  # the suite, re-run here
from test_experts_errors import limited_settings, with_experts
from test_http_transport import fast_serve


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with fast_serve(limited_settings(tmp_path_factory.mktemp("w"))) as running:
        yield with_experts(running)
