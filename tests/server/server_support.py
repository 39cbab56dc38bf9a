"""Helpers of the server tests: a real server on a free loopback port (in a background
thread; the shipped transport, or uvicorn), raw requests, and the SPEC 1 accuracy check."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch
import uvicorn
import uvloop
from moegemm.client._client import DEFAULT_LOAD_TIMEOUT
from moegemm.client._wire import decode_tensors, encode_tensor, packb
from moegemm.server import Settings, create_app
from prometheus_client.parser import text_string_to_metric_families

MSGPACK = {"content-type": "application/vnd.msgpack"}


@contextmanager
def fast_server_thread(server) -> Iterator[None]:
    """Run a ``FastHttpServer`` on its own thread and event loop until the block ends."""
    loop = uvloop.new_event_loop()  # the loop `moegemm serve` runs (server/cli.py)
    stop = asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(stop)),
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A load answers once the set is compiled and captured (over a minute for an expert set on a
# fresh GPU shared with other test processes, bench/NOTES.md session 16): the tests' loads wait
# as the client library's do; other calls keep 60 s.
LOAD_TIMEOUT = DEFAULT_LOAD_TIMEOUT


class Running:
    """A server the tests talk to: its URL, app, weights directory and an httpx client."""

    def __init__(self, url: str, app, server, begin_shutdown, weights_dir) -> None:
        self.url = url
        self.app = app
        self.server = server
        self.weights_dir = weights_dir  # the settings' (None: none configured)
        # What SIGINT/SIGTERM do: stop accepting, finish what was accepted, then stop.
        self.begin_shutdown = begin_shutdown
        self.http = httpx.Client(base_url=url, timeout=60)

    @property
    def services(self):
        return self.app.state.services

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.http.get("/v1/health/ready").status_code == 200:
                return
            time.sleep(0.02)
        raise TimeoutError("the server did not become ready")

    def put(self, name: str, body: dict, **kw) -> httpx.Response:
        headers = {**MSGPACK, **kw.pop("headers", {})}
        kw.setdefault("timeout", LOAD_TIMEOUT)
        return self.http.put(f"/v1/weights/{name}", content=packb(body), headers=headers, **kw)

    def gemm(self, name: str, body: dict, **kw) -> httpx.Response:
        headers = {**MSGPACK, **kw.pop("headers", {})}
        return self.http.post(f"/v1/weights/{name}/gemm", content=packb(body), headers=headers,
                              **kw)


def demo_settings(root) -> Settings:
    """The settings of the suites' shared CPU server: the demo set, weights directory ``root``."""
    return Settings(device="cpu", weights_dir=root, demo=True, max_body_bytes=8 << 20,
                    max_m=4096, max_bucket_m=256)


@contextmanager
def serve(settings: Settings, wait: bool = True) -> Iterator[Running]:
    """The app behind the transport ``moegemm serve`` runs (``FastHttpServer`` with its direct
    routes) on a free loopback port, its own thread and event loop; stopped on exit."""
    from moegemm.server._direct import DirectCalls
    from moegemm.server._http import FastHttpServer

    port = _free_port()
    app = create_app(settings)
    server = FastHttpServer(app, "127.0.0.1", port, max_body_bytes=settings.max_body_bytes,
                            direct=DirectCalls(app), grace_s=settings.shutdown_grace_s)
    loop = uvloop.new_event_loop()  # the loop `moegemm serve` runs (server/cli.py)
    stop = asyncio.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(server.serve(stop))
        except BaseException as exc:  # noqa: BLE001 -- surfaced below
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    running = Running(f"http://127.0.0.1:{port}", app, server,
                      lambda: loop.call_soon_threadsafe(stop.set), settings.weights_dir)
    try:
        deadline = time.monotonic() + 30
        while not server.listening.is_set():
            if failed or not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {failed}")
            time.sleep(0.01)
        if wait:
            running.wait_ready()
        yield running
    finally:
        running.http.close()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


@contextmanager
def serve_uvicorn(settings: Settings, wait: bool = True) -> Iterator[Running]:
    """The same app under uvicorn (the benchmarks' peer), on a free port in a thread;
    stopped on exit."""
    port = _free_port()
    app = create_app(settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    running = Running(f"http://127.0.0.1:{port}", app, server,
                      lambda: setattr(server, "should_exit", True), settings.weights_dir)
    try:
        if wait:
            running.wait_ready()
        yield running
    finally:
        running.http.close()
        server.should_exit = True
        thread.join(30)


def out_of(response: httpx.Response) -> torch.Tensor:
    """The ``out`` tensor of a gemm answer, as a torch bf16 tensor."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/vnd.msgpack"
    wire = decode_tensors(response.content)["out"]
    assert wire.dtype == "bfloat16"
    return torch.from_numpy(wire.numpy().view("<i2").copy()).view(torch.bfloat16)


def wire(t: torch.Tensor) -> dict:
    return encode_tensor(t)


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    """An SPEC 2 error: status, JSON content type and code."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == code, response.text
    assert response.json()["error"]["message"]


def fp8_problem(m: int, n: int, k: int, g: int, m_sizes=None):
    """Fresh random fp8 inputs (moegemm.kernels.testing) for one weight set."""
    from moegemm.kernels.testing import random_problem

    return random_problem(m, n, k, g, m_sizes=m_sizes)


def reference(xq, x_scale, wq, w_scale, m_sizes) -> torch.Tensor:
    from moegemm.kernels import reference_float64

    return reference_float64(xq, wq, x_scale, w_scale, torch.as_tensor(m_sizes))


def close_to(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """SPEC 1 accuracy: relative Frobenius error <= 5e-3 and nothing non-finite."""
    from moegemm.kernels.testing import SPEC_TOLERANCE, rel_error

    return bool(torch.isfinite(out).all()) and rel_error(out, ref) <= SPEC_TOLERANCE


def gemm_call(ws, x: torch.Tensor, x_scale: torch.Tensor | None, m_sizes, deadline=None):
    """A validated call as the server makes one: the body packed, decoded and checked
    by ``_request`` (the one validator), against weight set ``ws``."""
    from moegemm.server._request import decode_gemm
    from moegemm.server._request import gemm_call as validate

    body = {"x": wire(x), "m_sizes": wire(torch.as_tensor(m_sizes, dtype=torch.int64))}
    if x_scale is not None:
        body["x_scale"] = wire(x_scale)
    call = validate(decode_gemm(packb(body)), lambda: ws, max_m=1 << 20, deadline=deadline)
    call.tensors = (x, x_scale, torch.as_tensor(m_sizes, dtype=torch.int64))  # for checks
    return call


def bf16_rows(out) -> torch.Tensor:
    """An engine or executor answer (bf16 bytes ``[rows, 2N]``) as a bf16 tensor."""
    rows = torch.from_numpy(out.copy())
    if not rows.numel():
        return torch.empty((out.shape[0], out.shape[1] // 2), dtype=torch.bfloat16)
    return rows.view(torch.bfloat16)


def metric_sum(text: str, sample: str, **labels: str) -> float:
    """The sum of the ``sample`` series (e.g. ``moegemm_requests_total``,
    ``moegemm_queue_seconds_count``) in the ``/metrics`` text ``text`` whose labels include
    ``labels``; 0 when there is none (a series appears with its first update)."""
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def device_held() -> int:
    """The device memory this process's allocator holds, its free blocks released first
    (graph pools stay: their graphs hold them); other processes' memory is not counted."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()
