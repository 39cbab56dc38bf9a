"""Fixtures of the server tests; the helpers live in server_support.py."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# --import-mode=importlib puts no test folder on sys.path; the tests import
# their helpers by this (unique) module name.
sys.path.insert(0, str(Path(__file__).parent))

from server_support import Running, demo_settings, serve


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Running]:
    """A CPU server with the demo set and a weights directory."""
    with serve(demo_settings(tmp_path_factory.mktemp("weights"))) as running:
        yield running

