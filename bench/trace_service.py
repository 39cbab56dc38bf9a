"""Where one lone call's time goes, as a timeline across the client and the server.

    python bench/trace_service.py --out trace.json            # on the GPU box
    python bench/trace_service.py --cpu --out /tmp/trace.json  # small shapes, CPU backend

One client, one keep-alive connection, calls one after the other. The client
stamps each call (``time.perf_counter_ns``, CLOCK_MONOTONIC: one clock for every
process on the machine); the server runs with stamps wrapped around its
request path (``--traced-serve``: the transport's first read and dispatch, the
gemm handler, ``Engine.submit``, ``Executor.run`` and its steps) and writes them
at exit. Each segment of the path is then a median over the calls:

    send hop  : client sendall -> the server's first read of the request
    body      : first read -> whole body (dispatch)
    task      : dispatch -> the handler runs
    decode    : handler -> Engine.submit (msgpack, names, checks)
    to batch  : Engine.submit -> Executor.run (validate, queue or inline)
    executor  : Executor.run (staging, uploads, graph, download), with its steps
    from batch: Executor.run returned -> Engine.submit returns
    answer    : Engine.submit returned -> the handler returns (headers, metrics)
    write     : handler returned -> the transport wrote the answer
    back hop  : written -> the client holds the whole answer

Beside it, the floor of the same exchange without moegemm: a uvloop server
that reads the body into a preallocated buffer and writes a canned answer of
the same size (``--echo``), with the same raw-socket client.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

_now = time.perf_counter_ns

# -- the server side: stamps around the request path ------------------------------

_TRACE: list[dict] = []
_current: dict = {}


def _install_stamps() -> None:
    """Wrap the request path of this process (the owner) with stamps."""
    from moegemm.server import _direct, _executor, _graphs, _http_conn, _staging, engine

    conn = _http_conn._Connection
    orig_updated = conn.buffer_updated

    def buffer_updated(self, nbytes):
        if self.task is None and self.body is None and self.head_used == 0 and "recv" not in _current:
            _current["recv"] = _now()
        return orig_updated(self, nbytes)

    conn.buffer_updated = buffer_updated

    orig_dispatch = conn._dispatch

    def dispatch(self):
        _current["dispatch"] = _now()
        return orig_dispatch(self)

    conn._dispatch = dispatch

    orig_finish = conn._finish

    def finish(self):
        _current["finish"] = _now()
        _TRACE.append(dict(_current))
        _current.clear()
        return orig_finish(self)

    conn._finish = finish

    def stamp_async(cls, attr, key):
        orig = getattr(cls, attr)

        @functools.wraps(orig)
        async def wrapped(*a, **kw):
            _current[key + "0"] = _now()
            try:
                return await orig(*a, **kw)
            finally:
                _current[key + "1"] = _now()

        setattr(cls, attr, wrapped)

    def stamp_sync(cls, attr, key):
        setattr(cls, attr, _timed(getattr(cls, attr), key))

    stamp_async(_direct.DirectCalls, "__call__", "handler")
    stamp_async(engine.Engine, "submit", "gemm")
    stamp_sync(_executor.Executor, "run", "executor")
    # The expert calls' path (--experts): the same segments, their own steps.
    from moegemm.server import _ffn_executor, _ffn_graphs, routes_experts
    stamp_sync(_ffn_executor.ExpertExecutor, "run_calls", "executor")
    for cls, attr in ((_ffn_executor.ExpertExecutor, "_graph_moe"),
                      (_ffn_executor.ExpertExecutor, "_rows_up"),
                      (_ffn_executor.ExpertExecutor, "_download"),
                      (_ffn_graphs.FfnGraphs, "fill_tables"), (_ffn_graphs.FfnGraphs, "buffers"),
                      (_ffn_graphs.FfnGraphs, "family"), (_staging.Staging, "begin"),
                      (_staging.Staging, "enter"), (engine.Engine, "_run_batch")):
        stamp_sync(cls, attr, attr)
    routes_experts.decode_moe = _timed(routes_experts.decode_moe, "decode_moe")
    routes_experts.moe_call = _timed(routes_experts.moe_call, "moe_call")
    routes_experts.array_body_parts = _timed(routes_experts.array_body_parts, "array_body_parts")
    _ffn_executor.unpack = _timed(_ffn_executor.unpack, "unpack")
    _ffn_executor._answer = _timed(_ffn_executor._answer, "_answer")
    for cls, attr in ((_staging.Staging, "gather_rows"), (_staging.Staging, "upload"),
                      (_staging.Staging, "download"), (_graphs.GraphPool, "launch"),
                      (_executor.Executor, "_run_graph"), (_executor.Executor, "_run_general"),
                      (_staging.Staging, "htod"), (_staging.Staging, "dtoh"),
                      (_staging.Staging, "wait"), (_graphs.GraphPool, "fill_words")):
        stamp_sync(cls, attr, attr)
    # The request's steps: the one schema and validator, the answer's parts.
    import torch
    from moegemm.server import _body, _request, routes
    stamp_sync(torch.cuda.CUDAGraph, "replay", "replay")
    routes.decode_gemm = _timed(_request.decode_gemm, "decode_gemm")
    routes.gemm_call = _timed(_request.gemm_call, "gemm_call")
    routes.array_body_parts = _timed(_body.array_body_parts, "array_body_parts")


def _timing(fn, record):
    """``fn`` calling ``record(start, end)`` (perf_counter_ns) after each call."""
    @functools.wraps(fn)
    def wrapped(*a, **kw):
        t0 = _now()
        try:
            return fn(*a, **kw)
        finally:
            record(t0, _now())
    return wrapped


def _timed(fn, key):
    """``fn`` adding its time to the current call's step ``key`` (steps may run several
    times per call: their time adds up), with its first start and last end stamped."""
    def record(t0: int, t1: int) -> None:
        spent = _current.setdefault("steps", {})
        spent[key] = spent.get(key, 0) + t1 - t0
        _current.setdefault(key + "0", t0)
        _current[key + "1"] = t1
    return _timing(fn, record)


def traced_serve(argv: list[str], trace_out: str) -> int:
    """``moegemm serve`` with stamps; the stamps go to ``trace_out`` at exit.

    With ``MOEGEMM_TRACE_PROFILE`` set, the event loop's thread also runs under
    cProfile, whose top functions (by own time) go to ``trace_out`` + ".prof.txt".
    """
    _install_stamps()
    profile = None
    if os.environ.get("MOEGEMM_TRACE_PROFILE"):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()

    def dump() -> None:
        Path(trace_out).write_text(json.dumps(_TRACE))
        if profile is not None:
            import io
            import pstats

            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(45)
            Path(trace_out + ".prof.txt").write_text(text.getvalue())

    atexit.register(dump)
    from moegemm.server.cli import main

    return main(argv)


# -- the floor: a uvloop server that answers canned bytes ---------------------------


class _Echo(asyncio.BufferedProtocol):
    def __init__(self, answers: dict[int, bytes]) -> None:
        self.answers = answers
        self.head = bytearray(1 << 16)
        self.view = memoryview(self.head)
        self.used = 0
        self.body: memoryview | None = None
        self.got = 0
        self.want = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint):
        if self.body is not None:
            return self.body[self.got:]
        return self.view[self.used:]

    def buffer_updated(self, n):
        if self.body is not None:
            self.got += n
        else:
            self.used += n
            end = self.head.find(b"\r\n\r\n", 0, self.used)
            if end < 0:
                return
            head = bytes(self.view[:end]).lower()
            self.want = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            self.body = memoryview(np.empty(self.want, dtype=np.uint8))
            have = self.used - end - 4
            self.body[:have] = self.view[end + 4:self.used]
            self.got, self.used = have, 0
        if self.got == self.want:
            self.transport.write(self.answers[self.want])
            self.body = None


def echo_serve(port: int, sizes: list[tuple[int, int]]) -> None:
    """Answer a body of each request size with a canned answer of its answer size."""
    import uvloop

    answers = {}
    for req, ans in sizes:
        answers[req] = (b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\n"
                        b"content-length: %d\r\n\r\n" % ans) + bytes(ans)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Echo(answers), "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


# -- the client ----------------------------------------------------------------------


class RawClient:
    """One keep-alive connection: prebuilt request bytes, whole answer read back."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(16 << 20)
        self.view = memoryview(self.buf)

    def call(self, request: bytes) -> tuple[int, int, int]:
        """(sent, first bytes back, whole answer back) stamps."""
        t0 = _now()
        self.sock.sendall(request)
        got = self.sock.recv_into(self.view)
        t1 = _now()
        while True:
            end = self.buf.find(b"\r\n\r\n", 0, got)
            if end >= 0:
                break
            got += self.sock.recv_into(self.view[got:])
        head = bytes(self.view[:end]).lower()
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        want = end + 4 + length
        while got < want:
            got += self.sock.recv_into(self.view[got:])
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(bytes(self.view[:min(got, 400)]).decode(errors="replace"))
        return t0, t1, _now()


def request_bytes(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/vnd.msgpack\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


_CLIENT_PROFILED = 200


def client_stages(call, n: int) -> dict:
    """Median microseconds of the Client's own steps over ``n`` calls of ``call()``."""
    from moegemm.client import _client, _lane

    spent: dict[str, list[float]] = {}
    saved = []

    def wrap(owner, attr):
        orig = owner.__dict__[attr]
        fn = orig.__func__ if isinstance(orig, staticmethod) else orig
        timed = _timing(fn, lambda t0, t1, attr=attr: spent.setdefault(attr, []).append(
            (t1 - t0) / 1e3))
        setattr(owner, attr, staticmethod(timed) if isinstance(orig, staticmethod) else timed)
        saved.append((owner, attr, orig))

    for owner, attr in ((_client, "gemm_call"), (_client, "read_answer"), (_client._Base, "_request_args"),
                        (_lane.Lane, "_take"), (_lane.Lane, "_send"), (_lane.Lane, "_receive"),
                        (_lane._Heads, "__call__")):
        wrap(owner, attr)
    try:
        for _ in range(n):
            call()
    finally:
        for owner, attr, orig in saved:
            setattr(owner, attr, orig)
    return {k: round(_median(v), 1) for k, v in spent.items()}


def _median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def timeline(client_stamps: list[tuple[int, int, int]], trace: list[dict]) -> dict:
    """Median microseconds of each segment over calls matched by order."""
    pairs = list(zip(client_stamps, trace[-len(client_stamps):]))
    segs: dict[str, list[float]] = {}

    def add(name, a, b):
        if a is not None and b is not None:
            segs.setdefault(name, []).append((b - a) / 1e3)

    for (c0, _c1, c2), s in pairs:
        add("total (client)", c0, c2)
        add("send hop", c0, s.get("recv"))
        add("body", s.get("recv"), s.get("dispatch"))
        add("task", s.get("dispatch"), s.get("handler0"))
        add("decode", s.get("handler0"), s.get("gemm0"))
        add("to batch", s.get("gemm0"), s.get("executor0"))
        add("executor", s.get("executor0"), s.get("executor1"))
        add("from batch", s.get("executor1"), s.get("gemm1"))
        add("answer", s.get("gemm1"), s.get("handler1"))
        add("handler (all)", s.get("handler0"), s.get("handler1"))
        add("write", s.get("handler1"), s.get("finish"))
        add("back hop", s.get("finish"), c2)
        for step, ns in s.get("steps", {}).items():
            segs.setdefault("  step " + step, []).append(ns / 1e3)
    return {name: round(_median(v), 1) for name, v in segs.items()}


def _wait_port(port: int, proc: subprocess.Popen | None, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):  # not up yet
            if httpx.get(f"http://127.0.0.1:{port}/v1/health/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("server not ready")


def _stopped_trace(proc: subprocess.Popen, trace_out: Path, result: dict, name: str) -> list[dict]:
    """Stop a traced server; its records of the calls (not health checks), in call order, and
    its loop's profile (if it ran one) into ``result``."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    trace = json.loads(trace_out.read_text()) if trace_out.exists() else []
    prof = Path(str(trace_out) + ".prof.txt")
    if prof.exists():
        result.setdefault("profiles", {})[name] = prof.read_text()
        print(prof.read_text()[:6000], flush=True)
    return [r for r in trace if "handler0" in r]


def experts_trace(args) -> int:
    """``--experts``: where a lone moe call's time goes, beside gemm calls on the same set.

    One traced server at its defaults (GPU) loads a Qwen3-30B-A3B-shaped expert set (G=128,
    H=2048, I=768, random fp8) from a checkpoint file. Each section sends calls one after
    the other on one raw connection, rotating over 32 prebuilt bodies (fresh routing, so
    the active experts' weights are not all in L2): moe at 1 and 16 tokens (bf16 x, top-8),
    and gemm on the set's w13 at 8 rows (one token's top-8 rows: 8 groups of one row) and 1
    row. Then the Client's p50 for the same calls (numpy arrays).
    """
    import ml_dtypes
    from bench_moe import write_checkpoint
    from moegemm.client import Client
    from moegemm.client._wire import encode_tensor, packb

    G, H, I, top = 128, 2048, 768, 8
    work = Path(tempfile.mkdtemp(prefix="moegemm_trace_"))
    write_checkpoint(work / "qwen", G, H, I)
    rng = np.random.default_rng(0)
    rot = 32

    def moe_body(T):
        x = rng.standard_normal((T, H)).astype(ml_dtypes.bfloat16)
        ids = np.stack([rng.permutation(G)[:top] for _ in range(T)]).astype(np.int64)
        w = rng.uniform(0.1, 1, (T, top)).astype(np.float32)
        return (x, ids, w), packb({"x": encode_tensor(x), "topk_ids": encode_tensor(ids),
                                   "topk_weights": encode_tensor(w)})

    def gemm_body(m):
        sizes = np.zeros(G, np.int64)
        sizes[rng.permutation(G)[:m]] = 1
        xq = rng.uniform(-448, 448, (m, H)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        xs = rng.uniform(1e-4, 1e-3, (m, H // 128)).astype(np.float32)
        return (xq, xs, sizes), packb({"x": encode_tensor(xq), "x_scale": encode_tensor(xs),
                                       "m_sizes": encode_tensor(sizes)})

    sections = [("moe T1", "/v1/experts/qwen/moe", [moe_body(1) for _ in range(rot)]),
                ("gemm w13 M8", "/v1/weights/qwen.w13/gemm", [gemm_body(8) for _ in range(rot)]),
                ("moe T16", "/v1/experts/qwen/moe", [moe_body(16) for _ in range(rot)]),
                ("gemm w13 M1", "/v1/weights/qwen.w13/gemm", [gemm_body(1) for _ in range(rot)])]
    result: dict = {"set": {"G": G, "H": H, "I": I, "top_k": top}, "calls": args.calls,
                    "traced": {}}
    warm, client_calls = 50, args.calls // 2
    variants = {"default": ({}, []), "profile": ({"MOEGEMM_TRACE_PROFILE": "1"}, [])}
    for i, name in enumerate(args.variants.split(",")):
        env_extra, extra = variants[name]
        port = args.port + 20 + i
        trace_out = work / f"trace_{name}.json"
        serve_args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--device",
                      "cpu" if args.cpu else "cuda", "--no-demo", "--weights-dir", str(work),
                      "--log-level", "warning", *extra]
        proc = subprocess.Popen([sys.executable, "-P", __file__, "--trace-out", str(trace_out),
                                 "--traced-serve", *serve_args], env={**os.environ, **env_extra})
        stamps = {}
        try:
            _wait_port(port, proc, 300)
            client = Client(f"http://127.0.0.1:{port}", timeout=600, retries=0)
            t0 = time.perf_counter()
            client.load_experts_checkpoint("qwen", "qwen", 0)
            print(f"{name}: set loaded in {time.perf_counter() - t0:.1f} s", flush=True)
            raw = RawClient(port)
            mine = result["traced"][name] = {}
            for label, path, bodies in sections:
                reqs = [request_bytes(path, b) for _, b in bodies]
                for j in range(warm):
                    raw.call(reqs[j % rot])
                stamps[label] = [raw.call(reqs[j % rot]) for j in range(args.calls)]
                lat = []
                for j in range(client_calls):
                    a, b, c = bodies[j % rot][0]
                    t = _now()
                    if label.startswith("moe"):
                        client.moe("qwen", a, b, c)
                    else:
                        client.grouped_gemm("qwen.w13", a, c, x_scale=b)
                    lat.append((_now() - t) / 1e3)
                mine[label] = {"client_p50_us": round(_median(lat), 1)}
        finally:
            trace = _stopped_trace(proc, trace_out, result, name)
        pos = 0
        for label, _, _ in sections:
            if label not in stamps:
                break
            pos += warm
            line = timeline(stamps[label], trace[pos:pos + args.calls])
            pos += args.calls + client_calls
            result["traced"][name][label]["timeline_us"] = line
            print(f"\n{name} {label}: Client p50 {result['traced'][name][label]['client_p50_us']} us",
                  flush=True)
            for seg, us in line.items():
                print(f"  {seg:24s} {us:8.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--port", type=int, default=18750)
    ap.add_argument("--ms", default="1,128")
    ap.add_argument("--variants", default="default,acceptors0",
                    help="server settings to trace: default, acceptors0, profile")
    ap.add_argument("--traced-serve", nargs=argparse.REMAINDER)
    ap.add_argument("--trace-out")
    ap.add_argument("--echo", type=int, help="(internal) run the floor server on this port")
    ap.add_argument("--echo-sizes")
    ap.add_argument("--experts", action="store_true",
                    help="moe calls on a Qwen3-30B-A3B-shaped expert set beside gemm calls on its w13")
    args = ap.parse_args()
    if args.traced_serve is not None:
        return traced_serve(args.traced_serve, args.trace_out)
    if args.echo:
        echo_serve(args.echo, json.loads(args.echo_sizes))
        return 0
    if args.experts:
        return experts_trace(args)

    import ml_dtypes
    from bench_service import write_weights
    from moegemm.client import Client
    from moegemm.client._wire import encode_tensor, packb

    g, n, k = (8, 256, 512) if args.cpu else (8, 2048, 7168)
    device = "cpu" if args.cpu else "cuda"
    work = Path(tempfile.mkdtemp(prefix="moegemm_trace_"))
    write_weights(work / "main.safetensors", g, n, k, seed=1)
    rng = np.random.default_rng(0)
    requests = {}
    for m in (int(x) for x in args.ms.split(",")):
        sizes = rng.multinomial(m, np.full(g, 1.0 / g)).astype(np.int64)
        xq = rng.uniform(-448, 448, size=(m, k)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        scale = rng.uniform(1e-4, 1e-3, size=(m, k // 128)).astype(np.float32)
        body = packb({"x": encode_tensor(xq), "x_scale": encode_tensor(scale),
                      "m_sizes": encode_tensor(sizes)})
        requests[m] = (xq, scale, sizes, body)
    result: dict = {"shape": {"G": g, "N": n, "K": k}, "calls": args.calls, "floor": {}, "traced": {}}

    # The floor: same bytes in and out, nothing done with them.
    port = args.port
    answer = {m: 2 * m * n + 64 for m in requests}
    echo = subprocess.Popen([sys.executable, "-P", __file__, "--echo", str(port), "--echo-sizes",
                             json.dumps([[len(r[3]), answer[m]] for m, r in requests.items()])])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.05)
        raw = RawClient(port)
        for m, (_, _, _, body) in requests.items():
            req = request_bytes("/x", body)
            for _ in range(50):
                raw.call(req)
            lat = [(c - a) / 1e3 for a, _, c in (raw.call(req) for _ in range(args.calls))]
            result["floor"][f"M{m}"] = {"p50_us": round(_median(lat), 1),
                                        "body_bytes": len(body), "answer_bytes": answer[m]}
            print(f"floor (uvloop echo, raw socket) M={m}: p50 {_median(lat):.1f} us "
                  f"({len(body)} B in, {answer[m]} B out)", flush=True)
    finally:
        echo.terminate()
        echo.wait(10)

    variants = {
        "default": [],
        "acceptors0": ["--acceptors", "0"],
    }
    env_variants = {"profile": {"MOEGEMM_TRACE_PROFILE": "1"}}
    variants["profile"] = ["--acceptors", "0"]
    for i, name in enumerate(args.variants.split(",")):
        port = args.port + 1 + i
        trace_out = work / f"trace_{name}.json"
        serve_args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--device", device,
                      "--no-demo", "--weights-dir", str(work), "--preload", "main=main.safetensors:w:w_scale",
                      "--log-level", "warning", *variants.get(name, [])]
        env = {**os.environ, **env_variants.get(name, {})}
        proc = subprocess.Popen([sys.executable, "-P", __file__, "--trace-out", str(trace_out),
                                 "--traced-serve", *serve_args], env=env)
        try:
            _wait_port(port, proc, 300)
            raw = RawClient(port)
            client = Client(f"http://127.0.0.1:{port}", timeout=60, retries=0)
            stamps = {}
            for m, (xq, scale, sizes, body) in requests.items():
                req = request_bytes("/v1/weights/main/gemm", body)
                for _ in range(50):
                    raw.call(req)
                stamps[m] = [raw.call(req) for _ in range(args.calls)]
                for _ in range(20):
                    client.grouped_gemm("main", xq, sizes, x_scale=scale)
                lat = []
                for _ in range(args.calls // 2):
                    t0 = _now()
                    client.grouped_gemm("main", xq, sizes, x_scale=scale)
                    lat.append((_now() - t0) / 1e3)
                result["traced"].setdefault(name, {})[f"M{m}"] = {
                    "client_p50_us": round(_median(lat), 1),
                    "client_steps_us": client_stages(
                        lambda xq=xq, sizes=sizes, scale=scale, client=client: client.grouped_gemm(
                            "main", xq, sizes, x_scale=scale), 100)}
                if name == "profile":  # the client's own time, by function
                    import cProfile
                    import io
                    import pstats

                    prof_c = cProfile.Profile()
                    prof_c.enable()
                    for _ in range(_CLIENT_PROFILED):
                        client.grouped_gemm("main", xq, sizes, x_scale=scale)
                    prof_c.disable()
                    text = io.StringIO()
                    pstats.Stats(prof_c, stream=text).sort_stats("tottime").print_stats(30)
                    result.setdefault("client_profiles", {})[f"M{m}"] = text.getvalue()
                    print(f"client profile M={m}:\n{text.getvalue()[:4000]}", flush=True)
        finally:
            trace = _stopped_trace(proc, trace_out, result, name)
        # The server's records in call order: per M, warm-up, traced raw calls,
        # then the Client's calls (not matched: their stamps are only the p50).
        pos = 0
        for m in requests:
            pos += 50
            mine = trace[pos:pos + args.calls]
            pos += args.calls + 20 + args.calls // 2 + 100
            pos += _CLIENT_PROFILED if name == "profile" else 0
            line = timeline(stamps[m], mine) if len(mine) == args.calls else {
                "error": f"{len(trace)} server records"}
            result["traced"][name][f"M{m}"]["timeline_us"] = line
            mine_c = result["traced"][name][f"M{m}"]
            print(f"\n{name} M={m}: Client.grouped_gemm p50 {mine_c['client_p50_us']} us; "
                  f"its steps {mine_c['client_steps_us']}", flush=True)
            for seg, us in line.items():
                print(f"  {seg:24s} {us:8.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
