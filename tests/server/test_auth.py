"""Authentication: bearer tokens, the admin token for weight changes, open health
probes, refusal before any other work, constant-time comparison."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from moegemm.client import AsyncClient, Client, Unauthorized
from moegemm.server import Settings
from moegemm.server import _http_gate as gate
from server_support import MSGPACK, assert_error, fp8_problem, out_of, serve, wire

N, K, G = 128, 256, 2
READER, ADMIN = "reader-Zq8w", "admin-Jx4v"


def _bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


def _call(p) -> dict:
    return {"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)}


@pytest.fixture(scope="module")
def problem():
    return fp8_problem(12, N, K, G)


@pytest.fixture(scope="module")
def both(problem):
    """A server with a reader token and an admin token, and one set loaded."""
    with serve(Settings(device="cpu", demo=False, token=READER, admin_token=ADMIN,
                        max_body_bytes=1 << 20)) as srv:
        body = {"w": wire(problem.wq), "w_scale": wire(problem.w_scale)}
        assert srv.put("base", body, headers=_bearer(ADMIN)).status_code == 201
        yield srv


def test_open_endpoints_and_guarded_ones(both, problem):
    for path in ("/v1/health/live", "/v1/health/ready"):
        assert both.http.get(path).status_code == 200
    for path in ("/v1/info", "/v1/weights", "/metrics"):
        assert_error(both.http.get(path), 401, "unauthorized")
        assert both.http.get(path, headers=_bearer(READER)).status_code == 200
        assert both.http.get(path, headers=_bearer(ADMIN)).status_code == 200


@pytest.mark.parametrize("header", [
    None, "Bearer", "Basic " + READER, "bearer-" + READER, READER,
    "Bearer " + READER + "x", "Bearer " + READER[:-1], "Bearer " + READER.upper(),
    "Bearer \u00e9\u00e8",
])
def test_wrong_credentials_get_401_and_no_echo(both, problem, header):
    headers = {} if header is None else {"authorization": header.encode("latin-1")}
    r = both.http.post("/v1/weights/base/gemm", content=b"", headers={**MSGPACK, **headers})
    assert_error(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"
    assert READER not in r.text and ADMIN not in r.text


def test_scheme_is_case_insensitive(both, problem):
    for header in (f"bearer {READER}", f"BEARER {READER}", f"Bearer   {READER}"):
        r = both.gemm("base", _call(problem), headers={"authorization": header})
        assert r.status_code == 200, (header, r.text)


def test_401_comes_before_any_other_answer(both, problem):
    """Without credentials nothing about the request is looked at: not its name, its
    media type, its size, its body, nor whether the set exists."""
    attempts = [
        both.http.post("/v1/weights/bad$name/gemm", content=b"x", headers=MSGPACK),
        both.http.post("/v1/weights/missing/gemm", content=b"\xc1", headers=MSGPACK),
        both.http.post("/v1/weights/base/gemm", content=b"{}",
                       headers={"content-type": "application/json"}),
        both.http.post("/v1/weights/base/gemm", content=b"\0" * (2 << 20), headers=MSGPACK),
        both.http.put("/v1/weights/base", content=b"\xc1", headers=MSGPACK),
        both.http.put("/v1/weights/bad$name", content=b"", headers=MSGPACK),
        both.http.delete("/v1/weights/missing"),
    ]
    for r in attempts:
        assert_error(r, 401, "unauthorized")


def test_an_unauthenticated_body_is_never_read(both):
    """A huge declared body without a token is refused from its head alone."""
    host, port = both.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/weights/base/gemm HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/vnd.msgpack\r\n"
                     b"content-length: 100000000000\r\n\r\n")
        started = time.monotonic()
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head
    assert time.monotonic() - started < 5


def test_weight_changes_need_the_admin_token(both, problem):
    body = {"w": wire(problem.wq), "w_scale": wire(problem.w_scale)}
    base = both.services.store.get("base")
    assert_error(both.put("base", body, headers=_bearer(READER)), 401, "unauthorized")
    assert_error(both.http.delete("/v1/weights/base", headers=_bearer(READER)), 401,
                 "unauthorized")
    assert both.services.store.get("base") is base  # nothing changed
    # The admin token also works for calls.
    out = out_of(both.gemm("base", _call(problem), headers=_bearer(ADMIN)))
    assert out.shape == (12, N)
    assert both.put("other", body, headers=_bearer(ADMIN)).status_code == 201
    assert both.http.delete("/v1/weights/other", headers=_bearer(ADMIN)).status_code == 204


def test_every_secret_is_compared_in_constant_time(both, problem, monkeypatch):
    """hmac.compare_digest against every configured secret, whichever matches, so
    the time taken does not say which token (or how much of one) was right."""
    seen = []
    real = gate.hmac.compare_digest

    def spy(a, b):
        seen.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(gate.hmac, "compare_digest", spy)
    for token in (READER, ADMIN, "nope"):
        seen.clear()
        both.http.get("/v1/info", headers=_bearer(token))
        assert sorted(secret for _, secret in seen) == sorted([READER.encode(), ADMIN.encode()])
        assert all(given == token.encode() for given, _ in seen)


def test_admin_token_alone_guards_only_weight_changes(problem):
    with serve(Settings(device="cpu", demo=False, admin_token=ADMIN)) as srv:
        body = {"w": wire(problem.wq), "w_scale": wire(problem.w_scale)}
        assert_error(srv.put("base", body), 401, "unauthorized")
        assert_error(srv.put("base", body, headers=_bearer("guess")), 401, "unauthorized")
        assert srv.put("base", body, headers=_bearer(ADMIN)).status_code == 201
        assert srv.gemm("base", _call(problem)).status_code == 200  # calls stay open
        assert srv.http.get("/v1/weights").status_code == 200
        assert_error(srv.http.delete("/v1/weights/base"), 401, "unauthorized")


def test_no_tokens_means_open(problem):
    with serve(Settings(device="cpu", demo=False)) as srv:
        body = {"w": wire(problem.wq), "w_scale": wire(problem.w_scale)}
        assert srv.put("base", body).status_code == 201
        assert srv.gemm("base", _call(problem)).status_code == 200
        assert srv.http.delete("/v1/weights/base").status_code == 204


def test_the_client_sends_its_token(both, problem):
    with Client(both.url, token=READER) as c:
        assert c.grouped_gemm("base", problem.xq, problem.m_sizes, problem.x_scale).shape == (
            12, N)
    with Client(both.url, token="wrong") as c, pytest.raises(Unauthorized):
        c.weights()


def test_a_token_outside_ascii_is_its_utf8_bytes_on_every_path(problem):
    """A header carries bytes; a configured token is compared as its UTF-8 bytes, by the gate
    (a body's head) and by the app's dependencies alike (the app read the header as latin-1
    text and re-encoded it as UTF-8, so such a token was refused on calls without a body)."""
    token = "t\u00f6k\u00e9n-7"
    with serve(Settings(device="cpu", demo=False, token=token)) as srv:
        raw = {"authorization": b"Bearer " + token.encode()}
        assert srv.http.get("/v1/info", headers=raw).status_code == 200
        assert srv.http.get("/v1/weights", headers=raw).status_code == 200
        body = {"w": wire(problem.wq), "w_scale": wire(problem.w_scale)}
        assert srv.put("base", body, headers=raw).status_code == 201
        assert srv.gemm("base", _call(problem), headers=raw).status_code == 200
        assert_error(srv.http.get("/v1/info", headers={"authorization": b"Bearer t\xf6k\xe9n-7"}),
                     401, "unauthorized")  # its latin-1 bytes are another token


def test_the_client_presents_a_token_outside_ascii(problem):
    """A probe: the project's own client failed with a bare UnicodeEncodeError on a token the
    server takes (it compares one outside ASCII as its UTF-8 bytes). Both of the client's
    ways (the lane for plain http, httpx for the rest) now send those bytes."""
    import httpx

    token = "t\u00f6k\u00e9n-\u2603"
    with serve(Settings(device="cpu", demo=False, token=token)) as srv:
        body = {"w": wire(problem.wq), "w_scale": wire(problem.w_scale)}
        assert srv.put("base", body, headers={"authorization": b"Bearer " + token.encode()}) \
            .status_code == 201
        with Client(srv.url, token=token) as lane, \
                Client(srv.url, token=token, transport=httpx.HTTPTransport()) as pooled:
            assert lane._lane is not None and pooled._lane is None
            for c in (lane, pooled):
                assert [ws["name"] for ws in c.weights()] == ["base"]
                assert c.grouped_gemm("base", problem.xq, problem.m_sizes,
                                      problem.x_scale).shape == (12, N)
        with Client(srv.url, token="t\u00f6k\u00e9n-") as wrong, pytest.raises(Unauthorized):
            wrong.weights()

        async def listed(**kwargs):
            async with AsyncClient(srv.url, token=token, **kwargs) as c:
                return [ws["name"] for ws in await c.weights()]

        assert asyncio.run(listed()) == ["base"]
        assert asyncio.run(listed(transport=httpx.AsyncHTTPTransport())) == ["base"]
