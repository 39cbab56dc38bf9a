"""The head gate's rules (server/_http_gate.py), as routes.py applies them later."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
from moegemm.client._errors import BadField, Overloaded, Unauthorized
from moegemm.client._media import MSGPACK_TYPES
from moegemm.server import Settings
from moegemm.server._http_gate import HttpLimits, error_bytes, judge, media_problem

MSGPACK = (b"content-type", b"application/vnd.msgpack")


def _limits(**settings) -> HttpLimits:
    return HttpLimits.from_settings(Settings(**{"device": "cpu", "max_body_bytes": 1000,
                                                "max_inflight_bytes": 3000, **settings}))


def _code(limits, method="POST", path="/v1/weights/a/gemm", headers=(MSGPACK,), size=10,
          held=0):
    refusal = judge(limits, method, path, list(headers), size, held)
    return None if refusal is None else (refusal.status, refusal.code)


@pytest.mark.parametrize("token,admin,bearer,method,path,expected", [
    (None, None, None, "POST", "/v1/weights/a/gemm", None),
    ("t", None, None, "POST", "/v1/weights/a/gemm", (401, "unauthorized")),
    ("t", None, b"t", "POST", "/v1/weights/a/gemm", None),
    ("t", None, b"x", "POST", "/v1/weights/a/gemm", (401, "unauthorized")),
    ("t", "a", b"a", "POST", "/v1/weights/a/gemm", None),  # the admin token calls too
    ("t", "a", b"t", "PUT", "/v1/weights/a", (401, "unauthorized")),  # changes: admin only
    ("t", "a", b"a", "PUT", "/v1/experts/a", None),
    (None, "a", None, "POST", "/v1/weights/a/gemm", None),  # no call token: open
    (None, "a", b"t", "PUT", "/v1/weights/a", (401, "unauthorized")),
    ("t", None, None, "POST", "/v1/health/live", (401, "unauthorized")),  # any body
])
def test_tokens(token, admin, bearer, method, path, expected):
    headers = [MSGPACK] + ([(b"authorization", b"Bearer " + bearer)] if bearer else [])
    assert _code(_limits(token=token, admin_token=admin), method, path, headers) == expected


def test_media_type_size_and_budget():
    limits = _limits()
    assert _code(limits, headers=[(b"content-type", b"application/json")]) == (
        415, "unsupported_media_type")
    assert _code(limits, headers=[(b"content-type", b"Application/MsgPack; x=1")]) is None
    assert _code(limits, path="/elsewhere", headers=[]) is None  # the app's 404 to give
    assert _code(limits, size=1001) == (413, "too_large")
    assert _code(limits, size=None) is None  # chunked: judged as the body limit
    assert _code(limits, size=1000, held=2000) is None
    assert _code(limits, size=1000, held=2001) == (503, "overloaded")
    assert _code(limits, size=None, held=2001) == (503, "overloaded")
    assert _code(_limits(max_inflight_bytes=10), size=1000, held=0) is None  # a lone body


def test_error_bytes():
    raw = error_bytes(Overloaded("full", retry_after=1), request_id="r1")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    lines = head.split(b"\r\n")[1:]
    assert {b"retry-after: 1", b"connection: close", b"x-request-id: r1",
            b"content-length: %d" % len(body)} <= set(lines)
    assert json.loads(body) == {"error": {"code": "overloaded", "message": "full"}}
    assert error_bytes(Overloaded("full", retry_after=1), head_only=True, request_id="r1") == head + b"\r\n\r\n"


def test_the_415_names_every_type_taken_as_msgpack():
    """SPEC 2: three media types are msgpack; a refusal names each (both transports word it
    through ``media_problem``)."""
    assert all(media_problem(t) is None for t in MSGPACK_TYPES)
    problem = media_problem("application/json")
    assert all(t in problem for t in MSGPACK_TYPES) and "'application/json'" in problem
    assert media_problem("").endswith("got 'none'")


_FIT = """
import resource, sys
from moegemm.server._http_gate import HttpLimits, fit_to_descriptors
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
fitted = fit_to_descriptors(HttpLimits(max_connections=2048))
print(fitted.max_connections, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NOFILE as on Linux")
@pytest.mark.parametrize("soft, hard, cap, raised", [
    (1024, 4096, 2048, 2048 + 256),  # systemd's soft 1024: raised to hold the cap
    (300, 300, 150, 300),            # a hard limit under the cap: the cap fits it, half kept
    (1024, 2100, 2100 - 256, 2100),  # raised to the hard limit, the cap lowered to fit
])
def test_the_connection_cap_fits_the_open_file_limit(soft, hard, cap, raised):
    """A soft open-file limit under the connection cap made new clients meet a closed socket
    instead of the cap's rules (an audit's finding): the soft limit is raised towards the hard
    one, and the cap lowered where that is not enough (in a process of its own: limits are
    per process)."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip("this process's hard open-file limit is lower than the case's")
    done = subprocess.run([sys.executable, "-c", _FIT, str(soft), str(hard)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(cap), str(raised)]
    assert (cap < 2048) == ("MOEGEMM_HTTP_MAX_CONNECTIONS" in done.stderr)


@pytest.mark.parametrize("exc", [Overloaded("busy \u00e9", retry_after=2.4),
                                 Unauthorized("no token"), BadField("x" * 300)])
def test_every_lane_renders_an_error_in_the_same_bytes(exc):
    """The transport's own answers (error_bytes), the app's (error_response) and the direct
    lane's (_direct._error) share one renderer: the same body and the same extra headers."""
    from moegemm.server._direct import _error
    from moegemm.server.app import error_response

    app = error_response(exc)
    raw = error_bytes(exc, close=False)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert body == app.body == b"".join(_error(exc, "rid")[2])
    assert json.loads(body) == {"error": {"code": exc.code, "message": str(exc.args[0])}}
    extra = {k: v for k, v in app.raw_headers if k not in (b"content-length", b"content-type")}
    lines = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    direct = dict(line.split(b": ", 1) for line in _error(exc, "rid")[1].split(b"\r\n")[:-1])
    for got in (lines, direct):
        assert {k: v for k, v in got.items() if k in extra} == extra
        assert got[b"content-length"] == str(len(body)).encode()
        assert got[b"content-type"] == b"application/json"
