"""The same app under uvicorn: the benchmarks' peer for the transport that ships.

    python bench/uvicorn_peer.py serve <the flags of `moegemm serve`>

`moegemm serve` runs only our transport (``server/_http.py``) with its
acceptors; uvicorn (httptools, uvloop) serving the very same app is what it is
measured against (``bench_service.py``'s ``uvicorn`` server). The tests reach
uvicorn the same way, through the app (``tests/server/server_support.py``,
``tests/server/test_hostile.py``).
"""

from __future__ import annotations

import sys

import uvicorn
from moegemm.server.app import create_app
from moegemm.server.cli import parse_settings


def main(argv: list[str]) -> int:
    settings = parse_settings(argv)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, workers=1,
                loop="uvloop", http="httptools", log_level=settings.log_level,
                timeout_keep_alive=30, timeout_graceful_shutdown=settings.shutdown_grace_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
