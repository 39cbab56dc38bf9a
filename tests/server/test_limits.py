"""Limits and their answers: body size before the body is read, M/G/N/K and total
weight bytes, the bounded queue (503 + Retry-After, and the client that retries
it), deadlines (504), device memory (507 leaving every set and every call in
flight untouched), graceful shutdown, and names that cannot reach a log."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time

import httpx
import pytest
import torch
from moegemm.client import Client, DeadlineExceeded, OutOfMemory, Overloaded, TooLarge
from moegemm.client._wire import packb
from moegemm.server import Settings
from server_support import (
    MSGPACK,
    assert_error,
    close_to,
    fp8_problem,
    out_of,
    reference,
    serve,
    serve_uvicorn,
    wire,
)

N, K, G = 128, 256, 3


def _call(p) -> dict:
    return {"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)}


def _weights(p) -> dict:
    return {"w": wire(p.wq), "w_scale": wire(p.w_scale)}


def _correct(response, p) -> bool:
    return close_to(out_of(response), reference(p.xq, p.x_scale, p.wq, p.w_scale, p.m_sizes))


class Gate:
    """Holds the engine's next batches until opened (the worker is then 'busy')."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.open_ = threading.Event()
        self.entered = threading.Event()
        executor = engine._executor
        real = executor.run

        def run(*args):
            self.entered.set()
            self.open_.wait(30)
            return real(*args)

        executor.run = run

    def open(self) -> None:
        del self.engine._executor.run
        self.open_.set()


def _in_threads(*calls):
    """Start each zero-argument call in a thread; return (threads, results by index)."""
    results: dict[int, object] = {}

    def run(i, fn):
        try:
            results[i] = fn()
        except Exception as exc:  # noqa: BLE001 -- the test inspects it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, results


def _wait_queued(engine, n: int) -> None:
    deadline = time.monotonic() + 30
    while engine.queued() < n:
        assert time.monotonic() < deadline, "calls did not reach the queue"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def problem():
    return fp8_problem(16, N, K, G)


@pytest.fixture(scope="module")
def small(problem):
    """A server with small limits and one set loaded."""
    config = Settings(device="cpu", demo=False, max_body_bytes=512 << 10, max_m=64,
                      max_g=4, max_n=256, max_k=512, max_weight_bytes=600_000, queue_size=2)
    with serve(config) as srv:
        assert srv.put("base", _weights(problem)).status_code == 201
        yield srv


# -- body size -------------------------------------------------------------------------


def _raw(url: str, head: bytes, body: bytes = b"", read_timeout: float = 10) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(head + body)
        return sock.recv(65536)


@pytest.mark.parametrize("path", ["/v1/weights/base/gemm", "/v1/weights/base"])
def test_a_declared_oversize_body_is_refused_before_it_is_sent(small, path):
    method = b"POST" if path.endswith("gemm") else b"PUT"
    started = time.monotonic()
    answer = _raw(small.url, method + b" " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n"
                  b"content-type: application/vnd.msgpack\r\n"
                  b"content-length: 50000000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"too_large"' in answer
    assert time.monotonic() - started < 5


def test_a_streamed_oversize_body_stops_at_the_limit(small):
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(64):  # 4 MiB offered against a 512 KiB limit
            sent += 64 << 10
            yield b"\0" * (64 << 10)

    r = small.http.post("/v1/weights/base/gemm", content=chunks(), headers=MSGPACK)
    assert_error(r, 413, "too_large")
    assert small.services.store.get("base") is not None


def test_bodies_held_at_once_are_bounded(problem):
    """With the engine busy, bodies wait in memory: past the in-flight budget the
    next one is 503 overloaded at once, and a small one still gets in."""
    big = fp8_problem(700, N, K, G)  # ~190 KB on the wire
    config = Settings(device="cpu", demo=False, max_body_bytes=256 << 10,
                      max_inflight_bytes=300 << 10, max_m=1024)
    with serve(config) as srv:
        assert srv.put("base", _weights(problem)).status_code == 201
        gate = Gate(srv.services.engine)
        threads, results = _in_threads(lambda: srv.gemm("base", _call(big)))
        assert gate.entered.wait(30)
        r = srv.gemm("base", _call(big))
        assert_error(r, 503, "overloaded")
        assert int(r.headers["retry-after"]) >= 1
        threads2, results2 = _in_threads(lambda: srv.gemm("base", _call(problem)))
        _wait_queued(srv.services.engine, 1)
        gate.open()
        for t in threads + threads2:
            t.join(30)
        expected = reference(big.xq, big.x_scale, problem.wq, problem.w_scale, big.m_sizes)
        assert close_to(out_of(results[0]), expected)
        assert _correct(results2[0], problem)
        # The budget was given back.
        assert close_to(out_of(srv.gemm("base", _call(big))), expected)


def test_a_client_that_leaves_mid_body_is_not_an_error(small, problem, caplog):
    """A router that gives up (its deadline passed) while sending: the server logs
    it, answers nobody, and goes on."""
    host, port = small.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO, logger="moegemm"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/weights/base/gemm HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/vnd.msgpack\r\n"
                         b"content-length: 100000\r\n\r\n" + b"\x83" * 1000)
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while not any("disconnected" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert _correct(small.gemm("base", _call(problem)), problem)
    metrics = small.http.get("/metrics").text
    assert 'status="499"' in metrics and 'status="500"' not in metrics


# -- shapes and weight bytes ---------------------------------------------------------------


def test_rows_over_max_m(small, problem):
    big = fp8_problem(65, N, K, G)
    assert_error(small.gemm("base", _call(big)), 413, "too_large")
    assert small.gemm("base", _call(problem)).status_code == 200


def test_an_answer_no_msgpack_bin_holds_is_refused_before_it_runs():
    """[M, N] bf16 of 4 GiB or more cannot be one msgpack bin (a 32-bit length): 413 up front,
    not a 500 after the work (a body of 4 MiB asked for 4 GiB: M 32768, N 65536, K 128)."""
    m, n, k = 32768, 65536, 128
    config = Settings(device="cpu", demo=False, max_body_bytes=64 << 20)
    with serve(config) as srv:
        w = torch.zeros((1, n, k), dtype=torch.float8_e4m3fn)
        assert srv.put("wide", {"w": wire(w), "w_scale": wire(torch.ones(1, 1, n // 128))}
                       ).status_code == 201
        x = torch.zeros((m, k), dtype=torch.float8_e4m3fn)
        body = {"x": wire(x), "x_scale": wire(torch.ones(m, 1)),
                "m_sizes": wire(torch.tensor([m]))}
        r = srv.gemm("wide", body)
        assert_error(r, 413, "too_large")
        assert "4 GiB" in r.json()["error"]["message"]
        small = {"x": wire(x[:2]), "x_scale": wire(torch.ones(2, 1)),
                 "m_sizes": wire(torch.tensor([2]))}
        assert srv.gemm("wide", small).status_code == 200  # the set still answers


@pytest.mark.parametrize(("g", "n", "k"), [(5, 128, 128), (1, 384, 128), (1, 128, 640)])
def test_weight_shapes_over_the_limits(small, g, n, k):
    w = torch.randn(g, n, k).to(torch.bfloat16)
    before = small.services.store.list()
    r = small.put("toobig", {"w": wire(w)})
    assert_error(r, 413, "too_large")
    assert small.services.store.list() == before


def test_total_weight_bytes(small, problem):
    """Sets up to the total fit; the next one is 507 and changes nothing. A
    replacement counts the bytes it frees."""
    store = small.services.store
    base = store.get("base")
    second = fp8_problem(1, 256, 256, 4)  # 262,208 bytes on the device; base: 98,328
    assert small.put("second", _weights(second)).status_code == 201
    before = {ws.name: ws for ws in store.list()}
    r = small.put("third", _weights(second))
    assert_error(r, 507, "out_of_memory")
    assert {ws.name: ws for ws in store.list()} == before
    # Replacing 'second' by a set of the same size fits: its old bytes are freed.
    again = fp8_problem(1, 256, 256, 4)
    assert small.put("second", _weights(again)).status_code == 200
    assert store.get("base") is base
    assert _correct(small.gemm("second", _call(again)), again)
    assert small.http.delete("/v1/weights/second").status_code == 204
    assert _correct(small.gemm("base", _call(problem)), problem)


@pytest.mark.parametrize(("layout", "copies"), [("plain", 1), ("preshuffled", 2)])
def test_a_set_that_would_not_leave_the_headroom_is_refused_unread(monkeypatch, layout, copies):
    """On a GPU, free memory is checked from the shape alone, before anything is
    allocated: the set (twice for the preshuffle's copy) plus the headroom must fit."""
    from moegemm.kernels import get_backend
    from moegemm.server.store import WeightLimits, WeightStore, set_bytes

    cpu = get_backend(torch.device("cpu"))
    backend = dataclasses.replace(cpu, device=torch.device("cuda", 0), weight_layout=layout,
                                  run_plain=cpu.run if layout == "preshuffled" else None)
    headroom = 1 << 20
    store = WeightStore(backend, limits=WeightLimits(headroom_bytes=headroom))
    nbytes = set_bytes(8, 1024, 2048)
    free = copies * nbytes + headroom  # exactly enough
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free - 4096, 1 << 40))

    def segments(used):  # the allocator's pool holds 8192 bytes (used in use); a graph pool 1 MiB
        return [{"device": 0, "segment_pool_id": (0, 0), "total_size": 8192, "active_size": used},
                {"device": 0, "segment_pool_id": (1, 0), "total_size": 1 << 20, "active_size": 0},
                {"device": 1, "segment_pool_id": (0, 0), "total_size": 1 << 20, "active_size": 0}]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments(4096))
    store.check_room("fits", 8, 1024, 2048)  # the allocator's free blocks count as free
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments(4097))
    with pytest.raises(OutOfMemory):  # a graph pool's or another device's free blocks do not
        store.check_room("one-byte-short", 8, 1024, 2048)
    with pytest.raises(TooLarge):
        store.check_room("too-wide", 1025, 128, 128)


def test_an_expert_set_whose_two_matrices_do_not_fit_together_is_refused_unread(monkeypatch):
    """An expert set's w13 and w2 are checked against the free memory together: each fitting
    alone is not enough (w2 was read after all of w13 was uploaded, then refused)."""
    from moegemm.kernels import get_backend
    from moegemm.server.experts import ExpertStore
    from moegemm.server.store import WeightLimits, WeightStore, set_bytes

    backend = dataclasses.replace(get_backend(torch.device("cpu")),
                                  device=torch.device("cuda", 0), weight_layout="plain")
    experts = ExpertStore(WeightStore(backend, limits=WeightLimits(headroom_bytes=0)))
    G, H, I = 8, 1024, 512
    both = set_bytes(G, 2 * I, H) + set_bytes(G, H, I)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", list)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (both, 1 << 40))
    experts.check_room("fits", G, H, I)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (both - 1, 1 << 40))
    with pytest.raises(OutOfMemory):  # each matrix alone would fit
        experts.check_room("one-byte-short", G, H, I)


def test_a_new_shapes_graphs_count_with_its_weights(monkeypatch):
    """The graphs a new shape captures when its first set loads (static buffers of up to
    ``max_bucket_m`` rows: gigabytes at the default) are counted with the weights before
    anything is read, for a weight set and for an expert set (its matrices' gemm graphs and
    its own ffn and moe graphs); a shape already served counts nothing (the engine answers
    0)."""
    from moegemm.kernels import get_backend
    from moegemm.server.experts import ExpertStore
    from moegemm.server.store import WeightLimits, WeightStore, set_bytes

    backend = dataclasses.replace(get_backend(torch.device("cpu")),
                                  device=torch.device("cuda", 0), weight_layout="plain")
    G, H, I = 8, 1024, 512
    gemm_graphs = {(G, 2 * I, H): 3000, (G, H, I): 2000}
    store = WeightStore(backend, limits=WeightLimits(headroom_bytes=0),
                        graph_bytes=lambda *shape: gemm_graphs.get(shape, 0))
    experts = ExpertStore(store, graph_bytes=lambda *shape: 700 if shape == (G, H, I) else 0)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", list)

    def free(nbytes):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (nbytes, 1 << 40))

    one = set_bytes(G, 2 * I, H)
    free(one + 3000)
    store.check_room("fits", G, 2 * I, H)
    free(one + 2999)
    with pytest.raises(OutOfMemory, match="3000 bytes for its new shape's graphs"):
        store.check_room("one-byte-short", G, 2 * I, H)
    both = one + set_bytes(G, H, I) + 3000 + 2000 + 700
    free(both)
    experts.check_room("fits", G, H, I)
    free(both - 1)
    with pytest.raises(OutOfMemory):
        experts.check_room("one-byte-short", G, H, I)
    gemm_graphs.clear()  # the shapes are served: their sets' bytes alone
    free(one)
    store.check_room("served", G, 2 * I, H)
    # The server's stores ask its engine (which answers 0 on the CPU: no graphs).
    with serve(Settings(device="cpu", demo=False)) as srv:
        engine = srv.services.engine
        assert srv.services.store.graph_bytes == engine.weight_graph_bytes
        assert srv.app.state.experts.store.graph_bytes == engine.expert_graph_bytes
        assert engine.weight_graph_bytes(G, 2 * I, H) == engine.expert_graph_bytes(G, H, I) == 0


# -- the queue, deadlines, device memory ------------------------------------------------------


def test_a_full_queue_answers_503_and_a_retrying_client_gets_through(problem):
    with serve(Settings(device="cpu", demo=False, queue_size=1)) as srv:
        assert srv.put("base", _weights(problem)).status_code == 201
        engine = srv.services.engine
        gate = Gate(engine)
        threads, results = _in_threads(lambda: srv.gemm("base", _call(problem)))
        assert gate.entered.wait(30)
        threads2, results2 = _in_threads(lambda: srv.gemm("base", _call(problem)))
        _wait_queued(engine, 1)
        r = srv.gemm("base", _call(problem))
        assert_error(r, 503, "overloaded")
        assert int(r.headers["retry-after"]) >= 1
        with Client(srv.url, retries=0) as c, pytest.raises(Overloaded):
            c.grouped_gemm("base", problem.xq, problem.m_sizes, problem.x_scale)
        # A client that retries waits out the Retry-After and is served.
        with Client(srv.url, retries=5, backoff=0.05) as c:
            threading.Timer(0.3, gate.open).start()
            out = c.grouped_gemm("base", problem.xq, problem.m_sizes, problem.x_scale)
        assert close_to(out, reference(problem.xq, problem.x_scale, problem.wq, problem.w_scale,
                                  problem.m_sizes))
        for t in threads + threads2:
            t.join(30)
        assert _correct(results[0], problem) and _correct(results2[0], problem)


def test_a_deadline_that_passes_in_the_queue_is_504(problem):
    with serve(Settings(device="cpu", demo=False)) as srv:
        assert srv.put("base", _weights(problem)).status_code == 201
        gate = Gate(srv.services.engine)
        threads, results = _in_threads(
            lambda: srv.gemm("base", _call(problem)),
        )
        assert gate.entered.wait(30)
        with Client(srv.url) as c:
            threads2, results2 = _in_threads(
                lambda: c.grouped_gemm("base", problem.xq, problem.m_sizes, problem.x_scale,
                                       deadline=5.0),
                lambda: srv.gemm("base", _call(problem), headers={"x-deadline-ms": "100"}),
            )
            _wait_queued(srv.services.engine, 2)
            time.sleep(0.2)  # the 100 ms pass while the worker is busy
            gate.open()
            for t in threads + threads2:
                t.join(30)
        assert _correct(results[0], problem)
        assert close_to(results2[0], reference(problem.xq, problem.x_scale, problem.wq,
                                               problem.w_scale, problem.m_sizes))  # 5 s was enough
        assert_error(results2[1], 504, "timeout")
        # The client's own deadline turns the server's 504 into DeadlineExceeded.
        gate = Gate(srv.services.engine)
        threads, _ = _in_threads(lambda: srv.gemm("base", _call(problem)))
        assert gate.entered.wait(30)
        with Client(srv.url) as c:
            threading.Timer(0.5, gate.open).start()
            with pytest.raises(DeadlineExceeded):
                c.grouped_gemm("base", problem.xq, problem.m_sizes, problem.x_scale,
                               deadline=0.2)
        for t in threads:
            t.join(30)


@pytest.mark.parametrize("serving", [serve, serve_uvicorn], ids=["shipped", "uvicorn"])
def test_a_deadline_counts_from_the_calls_arrival_under_either_transport(problem, serving):
    """Both transports count ``X-Deadline-Ms`` from the head's arrival: a call whose body came
    after its deadline answers 504, not 200 late (the shipped transport counted from the body's
    end before; uvicorn, whose route reads the header before the body, already did)."""
    body = packb(_call(problem))
    with serving(Settings(device="cpu", demo=False)) as srv:
        assert srv.put("base", _weights(problem)).status_code == 201
        host, port = srv.url.removeprefix("http://").split(":")
        for deadline_ms, status in ((300, b"504"), (30000, b"200")):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /v1/weights/base/gemm HTTP/1.1\r\nhost: x\r\n"
                             b"content-type: application/vnd.msgpack\r\n"
                             b"x-deadline-ms: %d\r\ncontent-length: %d\r\n\r\n"
                             % (deadline_ms, len(body)) + body[:-10])
                time.sleep(0.6)
                sock.sendall(body[-10:])
                answer = sock.recv(1 << 16)
            assert answer.startswith(b"HTTP/1.1 " + status), answer[:300]
            assert (b'"timeout"' in answer) == (status == b"504")


def test_507_leaves_every_set_and_every_call_in_flight_untouched(problem):
    other = fp8_problem(8, 256, 128, 2)
    with serve(Settings(device="cpu", demo=False)) as srv:
        assert srv.put("base", _weights(problem)).status_code == 201
        assert srv.put("other", _weights(other)).status_code == 201
        store = srv.services.store
        before = {ws.name: ws for ws in store.list()}
        real = store.backend

        def no_memory(wq, w_scale):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        gate = Gate(srv.services.engine)
        threads, results = _in_threads(lambda: srv.gemm("base", _call(problem)))
        assert gate.entered.wait(30)
        # Calls queued behind the running one, then loads that cannot fit.
        store.backend = dataclasses.replace(real, prepare_weights=no_memory)
        try:
            threads2, results2 = _in_threads(
                lambda: srv.gemm("other", _call(other)),
                lambda: srv.gemm("base", _call(problem)),
                lambda: srv.put("base", {"w": wire(torch.randn(G, N, K).bfloat16())}),
                lambda: srv.put("new", _weights(other)),
            )
            _wait_queued(srv.services.engine, 2)
            time.sleep(0.1)
            gate.open()
            for t in threads + threads2:
                t.join(30)
        finally:
            store.backend = real
        assert _correct(results[0], problem)
        assert close_to(out_of(results2[0]),
                        reference(other.xq, other.x_scale, other.wq, other.w_scale,
                                  other.m_sizes))
        assert _correct(results2[1], problem)
        assert_error(results2[2], 507, "out_of_memory")
        assert_error(results2[3], 507, "out_of_memory")
        assert {ws.name: ws for ws in store.list()} == before
        assert _correct(srv.gemm("base", _call(problem)), problem)


# -- shutdown ----------------------------------------------------------------------------------


def test_graceful_shutdown_finishes_what_was_accepted(problem):
    # No merging: the first call alone holds the gate, the other four wait in the queue
    # (with the default window a second call arriving within it joins the first batch).
    with serve(Settings(device="cpu", demo=False, merge_window_us=0)) as srv:
        assert srv.put("base", _weights(problem)).status_code == 201
        engine = srv.services.engine
        gate = Gate(engine)

        def one_call():
            with httpx.Client(base_url=srv.url, timeout=60) as http:
                return http.post("/v1/weights/base/gemm", content=packb(_call(problem)),
                                 headers=MSGPACK)

        threads, results = _in_threads(*[one_call] * 5)
        assert gate.entered.wait(30)
        _wait_queued(engine, 4)
        srv.begin_shutdown()
        time.sleep(0.3)
        # No new connection is accepted...
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/v1/health/live", timeout=2)
        # ... and everything accepted is answered in full.
        gate.open()
        for t in threads:
            t.join(30)
        assert len(results) == 5
        assert all(_correct(r, problem) for r in results.values())


# -- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a%0D%0AINFO%20forged", "..%2F..%2Fetc%2Fpasswd", "%00",
                                  "a%2Fb", "%2E%2E%2F", "x" * 129])
def test_names_never_reach_a_path_or_a_log(small, problem, caplog, name):
    with caplog.at_level(logging.DEBUG, logger="moegemm"):
        answers = [small.put(name, _weights(problem)), small.gemm(name, _call(problem)),
                   small.http.delete(f"/v1/weights/{name}")]
    for response in answers:
        assert_error(response, 400, "bad_name")
    for record in caplog.records:
        message = record.getMessage()
        assert "forged" not in message and "passwd" not in message and "\x00" not in message


def test_dot_names_are_refused(small, problem):
    """'.' and '..' match the name pattern but are path steps, not names (issue 14):
    400 bad_name, as for any other name outside the contract's."""
    for spelled in ("%2E", "%2E%2E"):
        for r in (small.put(spelled, _weights(problem)), small.gemm(spelled, _call(problem)),
                  small.http.delete(f"/v1/weights/{spelled}")):
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_name", r.text
    assert all(ws["name"] not in (".", "..")
               for ws in small.http.get("/v1/weights").json()["weights"])
