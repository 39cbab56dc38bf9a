"""One client's per-call server overhead on the CPU box, A/B between two checkouts.

    python bench/overhead_cpu.py --pkg A=/tmp/pkg-base --pkg B=/tmp/pkg-new [--rounds 6]
    python bench/overhead_cpu.py --pkg B=/tmp/pkg-new --profile OUT.txt   # cProfile the loop
    python bench/overhead_cpu.py --pkg B=/tmp/pkg-new --stamps   # the lone call's segments
    python bench/overhead_cpu.py --in-process --pkg A=... --pkg B=...     # no sockets
    python bench/overhead_cpu.py --pkg B=/tmp/pkg-new --peer old=client:/tmp/pkg-base \
        --peer new=client:/tmp/pkg-new --peer raw=raw    # callers A/B against one server

Each ``--pkg NAME=DIR`` starts a real ``moegemm serve`` (the fast transport,
``MOEGEMM_ACCEPTORS=4`` as on a GPU: the lone connection is handed to the
owner) importing ``moegemm`` from DIR, on the reference backend with a tiny
weight set (G=8, N=256, K=256) so that compute is a few microseconds. One
``moegemm.client.Client`` (of this process's ``moegemm``) calls each server in
turn, blocks of calls alternating between the servers every round so drift on
this shared box hits both alike, at M=1 and M=128 (fp8 with scales, the bench's
calls).

The executor is a stub answering zeros (``--real-executor``: the reference
kernel, ~0.6 ms a call here, CPU only): the batch time left is the engine's
bookkeeping around it. The servers run small calls as the GPU does: on the
event loop's thread, inline when alone (``Engine._loop_rows = SMALL_ROWS``; on
the CPU the engine sends every call to its worker thread because the reference
kernel of a real shape takes milliseconds). Everything else is the shipped
code, so the figures are the transport, decode, validation, engine and answer
costs shared with the GPU path. (This box runs Python 3.11: a request's task
starts in the loop's next turn, where the H200's 3.12 starts it eagerly.)

``--in-process`` times the same code without sockets, each checkout in its own
process, rounds alternating: the gemm handler (``DirectCalls``, inline, stub
executor), the transport (``_Connection`` with a canned direct route) and the
executor's graph path (the GPU's; driver copies and replay stubbed). Far less
noise than the loopback figures on this shared 2-core box.

Callers (``--peer NAME=KIND[:DIR]``, default one ``client``), each a process of
its own holding one keep-alive connection to each server, blocks alternating:
``client`` is ``Client.grouped_gemm`` of the ``moegemm`` in DIR (default: this
process's); ``raw`` sends the same request bytes, prebuilt, with ``sendall`` and
reads the answer with blocking ``recv_into`` (the floor of a Python caller);
``rawpoll`` is ``raw`` polling the socket for the answer instead of sleeping in
``recv`` (what a wake-up costs). ``client - raw`` is the client's own share,
``raw - in-server`` the loopback and the transport around the handler.

Per server, caller and M: the median over rounds of the caller's p50, the
in-server time per call (``moegemm_request_seconds``: the handler, as
bench_service's "in-server") and the batch time (``moegemm_kernel_seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

G, N, K = 8, 256, 256
_HERE = Path(__file__).resolve()


_STAMPS: list[list[tuple[str, int]]] = []  # per call: (point, perf_counter_ns)


def _install_stamps(out: str) -> None:
    """Stamp the points a lone call passes, in order, and write each segment's median
    (us) to ``out`` at exit: where the server's time goes, without a profiler's cost."""
    import atexit
    import functools

    from moegemm.server import _direct, _executor, _http_conn, engine, routes

    now = time.perf_counter_ns
    current: list = []

    def sync(cls, attr, enter, leave=None, first=False):
        orig = getattr(cls, attr)

        @functools.wraps(orig)
        def wrapped(*a, **kw):
            if not first or not current:
                current.append((enter, now()))
            try:
                return orig(*a, **kw)
            finally:
                if leave:
                    current.append((leave, now()))
        setattr(cls, attr, wrapped)

    def coro(cls, attr, enter, leave):
        orig = getattr(cls, attr)

        @functools.wraps(orig)
        async def wrapped(*a, **kw):
            current.append((enter, now()))
            try:
                return await orig(*a, **kw)
            finally:
                current.append((leave, now()))
        setattr(cls, attr, wrapped)

    conn = _http_conn._Connection
    sync(conn, "buffer_updated", "read", first=True)
    sync(conn, "_begin_request", "head parsed")
    sync(conn, "_dispatch", "body in")
    coro(_direct.DirectCalls, "__call__", "handler", "handler done")
    routes_run = routes.run_gemm

    async def run_gemm(*a, **kw):
        current.append(("admitted", now()))
        try:
            return await routes_run(*a, **kw)
        finally:
            current.append(("gemm done", now()))
    _direct.routes.run_gemm = run_gemm
    coro(engine.Engine, "submit", "decoded", "submitted")
    sync(_executor.Executor, "run_calls", "batch", "batch done")
    orig_finish = conn._finish

    def finish(self):
        current.append(("written", now()))
        orig_finish(self)
        current.append(("next", now()))
        _STAMPS.append(list(current))
        current.clear()
    conn._finish = finish

    def dump() -> None:
        segs: dict[str, list[float]] = {}
        for call in _STAMPS[50:]:
            for (a, t0), (b, t1) in itertools.pairwise(call):
                segs.setdefault(f"{a} -> {b}", []).append((t1 - t0) / 1e3)
            segs.setdefault("total", []).append((call[-1][1] - call[0][1]) / 1e3)
        Path(out).write_text(json.dumps(
            {k: round(statistics.median(v), 2) for k, v in segs.items() if len(v) > 10},
            indent=1))
    atexit.register(dump)


def _as_on_gpu(stub: bool) -> None:
    """Small calls on the loop's thread (the GPU's path); the executor a stub when ``stub``."""
    from moegemm.server import engine

    init = engine.Engine.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        self._loop_rows = engine.SMALL_ROWS

    engine.Engine.__init__ = patched
    if stub:
        from moegemm.server import _executor

        def run_calls(self, ws, calls):
            # Zeros in the answer's shape: what the engine and the answer path get back
            # from a GPU batch, without the reference kernel's ~0.6 ms per call here.
            self.staging.begin()
            return ([np.zeros((c.rows, 2 * ws.N), dtype=np.uint8) for c in calls],
                    _executor.Launches(graph=1))

        _executor.Executor.run_calls = run_calls


def serve_inline(argv: list[str], profile_out: str | None, stub: bool,
                 stamps_out: str | None = None) -> int:
    """``moegemm serve`` with small calls on the loop's thread (the GPU's path), the
    executor a stub when ``stub``."""
    _as_on_gpu(stub)
    if stamps_out:
        _install_stamps(stamps_out)
    profile = None
    if profile_out:
        import atexit
        import cProfile

        profile = cProfile.Profile()

        def dump() -> None:
            import io
            import pstats

            profile.disable()
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats("tottime").print_stats(60)
            stats.sort_stats("cumulative").print_stats(60)
            Path(profile_out).write_text(text.getvalue())

        atexit.register(dump)
        # Enabled once serving (after start-up): the first call to /v1/health/ready
        # happens before it, so the profile holds the calls and little else.
        from moegemm.server import _direct

        call = _direct.DirectCalls.__call__

        async def first(self, *a, **kw):
            if not getattr(profile, "on", False):
                profile.on = True
                profile.enable()
            return await call(self, *a, **kw)

        _direct.DirectCalls.__call__ = first
    from moegemm.server.cli import main

    return main(argv)


def _write_weights(path: Path) -> None:
    sys.path.insert(0, str(_HERE.parent))
    from bench_service import write_weights

    write_weights(path, G, N, K, seed=1)


class _Server:
    def __init__(self, name: str, pkg: str, port: int, work: Path, profile: str | None,
                 stub: bool, stamps: bool = False) -> None:
        self.stamps = work / f"stamps_{name}.json" if stamps else None
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        # The owner takes every caller's connection (as it takes a lone client's), so
        # that each caller is served the way one client is: 4 callers exceed the
        # default of 2 handed-over connections, and the rest would be forwarded.
        env = {**os.environ, "PYTHONPATH": pkg, "PYTHONSAFEPATH": "1", "MOEGEMM_ACCEPTORS": "4",
               "MOEGEMM_OWNER_CONNECTIONS": "16"}
        cmd = [sys.executable, str(_HERE), "--serve-inline", *(["--profile", profile] if profile
                                                               else []),
               *(["--stub"] if stub else []),
               *(["--stamps", str(work / f"stamps_{name}.json")] if stamps else []), "--",
               "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
               "--no-demo", "--weights-dir", str(work),
               "--preload", "main=main.safetensors:w:w_scale", "--log-level", "warning"]
        self.log = open(work / f"server_{name}.log", "w")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited ({self.proc.returncode})")
            try:
                if httpx.get(self.url + "/v1/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server {self.name} not ready")

    def metrics(self) -> dict:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for key, pattern in (
            ("server_s", r'^moegemm_request_seconds_sum\{endpoint="/v1/weights/\{name\}/gemm"\} (\S+)'),
            ("calls", r'^moegemm_request_seconds_count\{endpoint="/v1/weights/\{name\}/gemm"\} (\S+)'),
            ("batch_s", r"^moegemm_kernel_seconds_sum (\S+)"),
            ("batches", r"^moegemm_kernel_seconds_count (\S+)"),
        ):
            found = re.search(pattern, text, re.MULTILINE)
            out[key] = float(found.group(1)) if found else 0.0
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _request_bytes(port: int, m: int) -> bytes:
    """What ``Client.grouped_gemm`` sends for M rows (``_calls``' inputs), spelled out."""
    from moegemm.client._wire import encode_tensor, packb

    x, sizes, scale = _calls(m, np.random.default_rng(m))
    body = packb({"x": encode_tensor(x), "m_sizes": encode_tensor(sizes),
                  "x_scale": encode_tensor(scale)})
    head = (f"POST /v1/weights/main/gemm HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "User-Agent: moegemm-client\r\nAccept: application/vnd.msgpack, application/json\r\n"
            f"X-Request-Id: {os.urandom(16).hex()}\r\nContent-Type: application/vnd.msgpack\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class _RawCaller:
    """One keep-alive socket: prebuilt request bytes, the whole answer read back; with
    ``poll`` the answer is polled for (a busy wait) instead of slept on."""

    def __init__(self, url: str, poll: bool) -> None:
        import select
        import socket

        host, port = url.rsplit("/", 1)[-1].split(":")
        self.port = int(port)
        self.sock = socket.create_connection((host, self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(4 << 20)
        self.view = memoryview(self.buf)
        self.poller = None
        if poll:
            self.poller = select.poll()
            self.poller.register(self.sock, select.POLLIN)
        self.requests: dict[int, bytes] = {}

    def __call__(self, m: int) -> None:
        request = self.requests.get(m)
        if request is None:
            request = self.requests[m] = _request_bytes(self.port, m)
        sock, buf, view, poller = self.sock, self.buf, self.view, self.poller
        sock.sendall(request)
        if poller is not None:
            while not poller.poll(0):
                pass
        got = sock.recv_into(view)
        while (end := buf.find(b"\r\n\r\n", 0, got)) < 0:
            got += sock.recv_into(view[got:])
        at = buf.find(b"content-length: ", 0, end) + 16
        want = end + 4 + int(buf[at:buf.find(b"\r\n", at)])
        while got < want:
            if poller is not None:
                while not poller.poll(0):
                    pass
            got += sock.recv_into(view[got:want])


def peer(kind: str) -> None:
    """(internal) A caller process: per line ``URL M CALLS`` on stdin, one line of JSON
    on stdout: the calls' latencies (us), after a few untimed ones."""
    callers: dict = {}
    inputs: dict = {}
    for line in sys.stdin:
        url, m, calls = line.split()
        m, calls = int(m), int(calls)
        if m not in inputs:
            inputs[m] = _calls(m, np.random.default_rng(m))
        call = callers.get(url)
        if call is None:
            if kind == "client":
                from moegemm.client import Client

                client = Client(url, timeout=60, retries=0)

                def call(m, client=client):
                    x, sizes, scale = inputs[m]
                    client.grouped_gemm("main", x, sizes, x_scale=scale)
            else:
                call = _RawCaller(url, poll=kind == "rawpoll")
            callers[url] = call
        for _ in range(30):
            call(m)
        lat = []
        clock = time.perf_counter_ns
        for _ in range(calls):
            t0 = clock()
            call(m)
            lat.append((clock() - t0) / 1e3)
        print(json.dumps(lat), flush=True)


class _Peer:
    def __init__(self, spec: str) -> None:
        self.name, _, rest = spec.partition("=")
        kind, _, pkg = rest.partition(":")
        if kind not in ("client", "raw", "rawpoll"):
            raise SystemExit(f"--peer {spec}: the kind is client, raw or rawpoll")
        env = dict(os.environ)
        if pkg:
            env.update(PYTHONPATH=pkg, PYTHONSAFEPATH="1")
        self.proc = subprocess.Popen([sys.executable, str(_HERE), "--as-peer", kind], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, url: str, m: int, calls: int) -> list[float]:
        self.proc.stdin.write(f"{url} {m} {calls}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"caller {self.name} exited")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a server's acceptors), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _calls(m: int, rng):
    import ml_dtypes

    x = rng.uniform(-448, 448, (m, K)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-4, 1e-3, (m, K // 128)).astype(np.float32)
    sizes = rng.multinomial(m, np.full(G, 1.0 / G)).astype(np.int64)
    return x, sizes, scale


# -- in process: the handler and the transport alone, without sockets ------------------


async def _handler_us(m: int, calls: int) -> float:
    """Microseconds per ``DirectCalls`` call (the gemm handler: headers, budget, admission,
    decode, validation, ``Engine.submit`` inline, the answer's parts, metrics), stub
    executor, in this process's ``moegemm``."""
    from moegemm.client._wire import encode_tensor, packb
    from moegemm.server._direct import DirectCalls
    from moegemm.server.app import create_app
    from moegemm.server.config import Settings

    work = Path(tempfile.mkdtemp(prefix="moegemm_overhead_"))
    _write_weights(work / "main.safetensors")
    app = create_app(Settings(device="cpu", weights_dir=work, demo=False,
                              preload=["main=main.safetensors:w:w_scale"]))
    async with app.router.lifespan_context(app):
        svc = app.state.services
        while not svc.ready:
            await asyncio.sleep(0.05)
        direct = DirectCalls(app)
        direct.in_progress = lambda: 1  # the lone request: inline, as on a GPU
        x, sizes, scale = _calls(m, np.random.default_rng(0))
        body = memoryview(packb({"x": encode_tensor(x), "x_scale": encode_tensor(scale),
                                 "m_sizes": encode_tensor(sizes)}))
        headers = [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"moegemm-client"),
                   (b"content-type", b"application/vnd.msgpack"),
                   (b"x-request-id", b"0123456789abcdef0123456789abcdef"),
                   (b"content-length", str(len(body)).encode())]
        route = direct.match("POST", "/v1/weights/main/gemm")
        for _ in range(500):
            status, _, _ = await direct(route, headers, body, time.monotonic())
            assert status == 200, status
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            await direct(route, headers, body, time.monotonic())
        return (time.perf_counter_ns() - t0) / calls / 1e3


class _FakeTransport:
    """What ``_Connection`` asks of a transport, writing nowhere."""

    def get_extra_info(self, key, default=None):
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(key,
                                                                                     default)

    def set_write_buffer_limits(self, high=None):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def writelines(self, parts):
        pass

    def write(self, data):
        pass

    def is_closing(self):
        return False

    def close(self):
        pass


async def _transport_us(calls: int) -> float:
    """Microseconds per request through the fast transport's ``_Connection`` (head parse,
    gate, body, dispatch to a direct route answering canned bytes, answer, next),
    in this process's ``moegemm``."""
    from moegemm.server._direct import DirectCalls
    from moegemm.server._http import FastHttpServer
    from moegemm.server._http_conn import _Connection

    class Canned:
        match = staticmethod(DirectCalls.match)

        async def __call__(self, route, headers, body, arrived):
            return 200, (b"content-type: application/vnd.msgpack\r\ncontent-length: 10\r\n"
                         b"x-request-id: 0123456789abcdef0123456789abcdef\r\n"), [b"0" * 10]

    async def app(scope, receive, send):
        raise AssertionError("not the direct route")

    body = bytes(600)
    request = (b"POST /v1/weights/main/gemm HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
               b"User-Agent: moegemm-client\r\nContent-Type: application/vnd.msgpack\r\n"
               b"X-Request-Id: 0123456789abcdef0123456789abcdef\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    server = FastHttpServer(app, "127.0.0.1", 0, max_body_bytes=1 << 28, direct=Canned())
    server._budget = False  # a bare app: no BodyBudget to find
    conn = _Connection(server)
    conn.connection_made(_FakeTransport())

    async def one() -> None:
        conn.get_buffer(65536)[:len(request)] = request
        conn.buffer_updated(len(request))
        if conn.task is not None:  # Python < 3.12: the task runs in the loop's next turn
            await conn.task

    for _ in range(1000):
        await one()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        await one()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def _graph_path_us(m: int, calls: int) -> float:
    """Microseconds of host Python per lone call in ``Executor.run_calls``'s graph path
    (the GPU's), here on the CPU: the family's buffers, the launch words, the result
    slicing and checks, with the driver's copies and the graph replay stubbed out (on
    the H200 each of those six driver calls costs a few us more, and the device's
    own time comes on top). G=8, N=2048, K=7168 as the device bench."""
    import torch
    from moegemm.kernels import get_backend
    from moegemm.server._executor import Executor
    from moegemm.server._graphs import GraphPool
    from moegemm.server._request import GemmCall
    from moegemm.server._staging import Staging

    g, n, k = 8, 2048, 7168
    pool = GraphPool(get_backend(torch.device("cpu")), 8192, graphs=False)
    pool.pad_to_bucket = True  # as on a GPU: launches cover a bucket
    pool.run_table = lambda *a, **kw: None  # as on a GPU: graphs by family, weights by address

    class Replay:
        def replay(self):
            pass

    replay = Replay()
    pool.graph = lambda *a, **kw: replay

    class NoCopies:
        def htod(self, *a):
            pass

        def dtoh(self, *a):
            pass

        def wait(self):
            pass

    staging = Staging(torch.device("cpu"))
    staging._copies = NoCopies()
    executor = Executor(pool, staging)

    class Set:
        G, N, K = g, n, k
        wq = torch.zeros(g, n, k, dtype=torch.float8_e4m3fn)
        w_scale = torch.ones(g, k // 128, n // 128)

    x = np.zeros((m, k), np.uint8)
    scale = np.ones((m, k // 128), np.float32)
    sizes = np.random.default_rng(0).multinomial(m, np.full(g, 1.0 / g)).astype(np.int64)
    call = GemmCall(Set, m, "float8_e4m3fn", memoryview(x).cast("B"),
                    memoryview(scale).cast("B"), sizes)
    for _ in range(200):
        staging.begin()
        executor.run_calls(Set, [call])
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        staging.begin()
        executor.run_calls(Set, [call])
    return (time.perf_counter_ns() - t0) / calls / 1e3


def harness(calls: int) -> None:
    """(internal) One line of JSON: the in-process figures of this ``moegemm``."""
    import uvloop

    graph = {"graph path M=1": _graph_path_us(1, calls),
             "graph path M=128": _graph_path_us(128, calls)}  # before the stub goes in
    _as_on_gpu(stub=True)

    async def main() -> dict:
        return {"handler M=1": await _handler_us(1, calls),
                "handler M=128": await _handler_us(128, calls),
                "transport": await _transport_us(2 * calls), **graph}

    print(json.dumps(uvloop.run(main())))


def in_process(pkgs: list[str], rounds: int, calls: int) -> dict:
    """The in-process figures of each checkout, rounds alternating; medians."""
    got: dict = {}
    for r in range(rounds):
        for spec in pkgs if r % 2 == 0 else pkgs[::-1]:
            name, _, pkg = spec.partition("=")
            env = {**os.environ, "PYTHONPATH": pkg, "PYTHONSAFEPATH": "1"}
            out = subprocess.run([sys.executable, str(_HERE), "--harness", "--calls", str(calls)],
                                 env=env, capture_output=True, text=True, check=True).stdout
            for key, us in json.loads(out.strip().splitlines()[-1]).items():
                got.setdefault(f"{name} {key}", []).append(us)
    print(f"in process, us per call (median of {rounds} rounds, min-max):")
    summary = {}
    for key in sorted(got):
        v = got[key]
        summary[key] = round(statistics.median(v), 2)
        print(f"{key:>20} | {summary[key]:7.2f} ({min(v):.2f}-{max(v):.2f})")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pkg", action="append", default=[], help="NAME=DIR (repeatable)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=300, help="timed calls per block")
    ap.add_argument("--ms", default="1,128")
    ap.add_argument("--port", type=int, default=18900)
    ap.add_argument("--profile", help="cProfile the (single) server's loop into this file")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--real-executor", action="store_true",
                    help="run the reference kernel (else a stub answers zeros)")
    ap.add_argument("--stamps", nargs="?", const="1",
                    help="stamp the lone call's path in each server and print the segments")
    ap.add_argument("--in-process", action="store_true",
                    help="time the handler and the transport in process (no sockets) instead")
    ap.add_argument("--peer", action="append", default=[],
                    help="NAME=KIND[:DIR] (repeatable): a caller, KIND client|raw|rawpoll, "
                         "client from the moegemm in DIR")
    ap.add_argument("--pin", action="store_true",
                    help="callers on the first CPU, servers on the last (always across CPUs)")
    ap.add_argument("--harness", action="store_true", help="(internal)")
    ap.add_argument("--as-peer", help="(internal)")
    ap.add_argument("--stub", action="store_true", help="(internal)")
    ap.add_argument("--serve-inline", action="store_true", help="(internal)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.harness:
        harness(args.calls)
        return 0
    if args.as_peer:
        peer(args.as_peer)
        return 0
    if args.in_process:
        summary = in_process(args.pkg, args.rounds, args.calls)
        if args.json:
            Path(args.json).write_text(json.dumps({"in_process": summary}, indent=1))
        return 0
    if args.serve_inline:
        return serve_inline([a for a in args.rest if a != "--"], args.profile, args.stub,
                            args.stamps)

    work = Path(tempfile.mkdtemp(prefix="moegemm_overhead_"))
    _write_weights(work / "main.safetensors")
    servers, peers = [], []
    try:
        for i, spec in enumerate(args.pkg):
            name, _, pkg = spec.partition("=")
            servers.append(_Server(name, pkg, args.port + i, work, args.profile,
                                   not args.real_executor, bool(args.stamps)))
        peers = [_Peer(spec) for spec in args.peer or ["client=client"]]
        for s in servers:
            s.wait_ready()
        if args.pin:
            # Callers on the first CPU, each server (owner and acceptors) on the last: a
            # round trip then always crosses CPUs, as between the H200 host's cores.
            cpus = sorted(os.sched_getaffinity(0))
            for s in servers:
                for pid in _tree(s.proc.pid):
                    os.sched_setaffinity(pid, {cpus[-1]})
            for p in peers:
                os.sched_setaffinity(p.proc.pid, {cpus[0]})
        ms = [int(m) for m in args.ms.split(",")]
        rows: dict = {}
        for r in range(args.rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                for p in peers if r % 2 == 0 else peers[::-1]:
                    for m in ms:
                        before = s.metrics()
                        lat = p.run(s.url, m, args.calls)
                        after = s.metrics()
                        calls = after["calls"] - before["calls"] or 1
                        batches = after["batches"] - before["batches"] or 1
                        key = f"{s.name} {p.name} M={m}" if len(peers) > 1 else f"{s.name} M={m}"
                        row = rows.setdefault(key, {"p50": [], "server": [], "batch": []})
                        row["p50"].append(statistics.median(lat))
                        row["server"].append(1e6 * (after["server_s"] - before["server_s"]) / calls)
                        row["batch"].append(1e6 * (after["batch_s"] - before["batch_s"]) / batches)
    finally:
        for p in peers:
            p.close()
        for s in servers:
            s.stop()
    summary = {}
    print(f"{'server caller M':>18} | p50 us (median of {args.rounds} rounds, min-max) | "
          f"in-server us | batch us")
    for key, row in rows.items():
        summary[key] = {k: round(statistics.median(v), 1) for k, v in row.items()}
        summary[key]["p50_range"] = [round(min(row["p50"]), 1), round(max(row["p50"]), 1)]
        print(f"{key:>18} | {summary[key]['p50']:8.1f} ({min(row['p50']):.0f}-"
              f"{max(row['p50']):.0f}) | {summary[key]['server']:8.1f} | "
              f"{summary[key]['batch']:7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": [G, N, K], "rounds": args.rounds,
                                               "calls": args.calls, "peers": args.peer,
                                               "results": summary, "per_round": rows}, indent=1))
    for s in servers:
        if s.stamps is not None and s.stamps.exists():
            stamps = json.loads(s.stamps.read_text())
            print(f"-- {s.name}: the lone call's segments, median us --")
            for k, v in stamps.items():
                print(f"{v:8.2f}  {k}")
    if args.profile and Path(args.profile).exists():
        print(Path(args.profile).read_text()[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
