"""The 32-client 1024-row tail on the CPU: the real server, the device part doubled.

    PYTHONPATH=... python bench/cpu_large_tail.py --clients 32 --seconds 8

Issue 16: at 32 clients of 1024-row calls (7.3 MB fp8 bodies, 4 MB answers) the
H200 runs showed a p99 near 1 s in every server variant since v3, while the
server's own time per call was ~20 ms. This reproduces the traffic on a CPU box:
``moegemm serve`` with its acceptors (``--acceptors``, as on a GPU), the fast
transport, a weight set of G=8, N=2048, K=7168 preloaded from a file, and the
executor replaced by a double that answers zeros after a short sleep (the GPU's
copies and kernel; the transport, the acceptors, the engine's queue and the
client are the real ones). Client processes (``moegemm.client.Client``) each send
1024-row calls back to back; every call's start, latency and client are written
to ``--out`` and a latency histogram printed (a mode near 1 s is the stall).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_service import _inputs, write_weights

# The server: the real CLI, with Executor.run answering zeros after ``device_s``.
_SERVER = r"""
import sys, time
import numpy as np
from moegemm.server import _executor

DEVICE_S = float(sys.argv[1])

def run(self, ws, calls):
    launches = _executor.Launches()
    launches.eager += 1
    time.sleep(DEVICE_S)
    return [(np.zeros((c.rows, 2 * ws.N), np.uint8), np.zeros(c.rows, np.int8))
            for c in calls], launches

_executor.Executor.run = run
from moegemm.server.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def _client(index: int, url: str, m: int, seconds: float, ready, queue) -> None:
    from moegemm.client import Client

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rng = np.random.default_rng(index)
    x, scale, sizes = _inputs(rng, m, 7168, 8, "fp8")
    client = Client(url, timeout=120, retries=0)
    for _ in range(2):
        client.grouped_gemm("main", x, sizes, x_scale=scale)
    lane = client._lane
    port = lane._idle[0].getsockname()[1] if lane is not None and lane._idle else 0
    queue.put(index)
    start_at = ready.recv()  # every client warmed up: the start, in time.time()
    while time.time() < start_at:
        time.sleep(0.001)
    stop_at = start_at + seconds
    calls = []
    while time.time() < stop_at:
        t0 = time.time()
        try:
            client.grouped_gemm("main", x, sizes, x_scale=scale)
            calls.append((t0, time.time() - t0, None))
        except Exception as exc:  # noqa: BLE001 -- counted, never hidden
            calls.append((t0, time.time() - t0, repr(exc)[:200]))
    queue.put((index, calls, port))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--acceptors", type=int, default=4)
    ap.add_argument("--device-ms", type=float, default=2.0,
                    help="the doubled device time of one batch")
    ap.add_argument("--port", type=int, default=18650)
    ap.add_argument("--env", default="", help="extra server settings: 'A=1;B=2'")
    ap.add_argument("--out", default="/tmp/cpu_large_tail.json")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="moegemm_tail_"))
    write_weights(work / "main.safetensors", 8, 2048, 7168, seed=0)
    env = {**os.environ, **dict(a.split("=", 1) for a in args.env.split(";") if a)}
    log = open(work / "server.log", "w")  # noqa: SIM115 -- the server's, closed below
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(args.device_ms / 1e3), "serve", "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(args.port), "--weights-dir", str(work),
         "--no-demo", "--preload", "main=main.safetensors:w:w_scale",
         "--acceptors", str(args.acceptors)],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(url + "/v1/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit(f"the server did not start; see {log.name}")
        time.sleep(1.0)  # the acceptors up
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        pipes = [ctx.Pipe() for _ in range(args.clients)]
        procs = [ctx.Process(target=_client, args=(i, url, args.rows, args.seconds, pipes[i][1],
                                                   queue))
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        for _ in procs:  # every client warmed up
            queue.get(timeout=600)
        start_at = time.time() + 0.5
        for parent, _ in pipes:
            parent.send(start_at)
        got = [queue.get(timeout=args.seconds + 300) for _ in procs]
        results = {i: calls for i, calls, _ in got}
        ports = {i: port for i, _, port in got}
        for p in procs:
            p.join(10)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    calls = [(t0 - start_at, lat, err, i) for i, cs in results.items() for t0, lat, err in cs]
    lat = np.sort([c[1] for c in calls if c[2] is None])
    errors = [c for c in calls if c[2] is not None]
    if not len(lat):
        raise SystemExit(f"no call answered: {sorted({c[2] for c in errors})[:5]} "
                         f"{(work / 'server.log').read_text()[-3000:]}")
    report = {
        "args": vars(args), "ports": ports, "start_at": start_at, "calls": len(lat), "errors": len(errors),
        "calls_per_s": len(lat) / args.seconds,
        "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(len(lat) * 0.99)],
        "max_ms": 1e3 * lat[-1],
        "over_500ms": int((lat > 0.5).sum()), "over_900ms": int((lat > 0.9).sum()),
        "slowest": sorted(calls, key=lambda c: -c[1])[:20],
        "error_kinds": sorted({c[2] for c in errors}),
        "server_log_tail": (work / "server.log").read_text().splitlines()[-20:],
    }
    Path(args.out).write_text(json.dumps({**report, "all": calls}))
    edges = [0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 0.9, 1.1, 1.5, 3, 1e9]
    counts, _ = np.histogram(lat, bins=edges)
    print(json.dumps({k: v for k, v in report.items() if k not in ("slowest", "server_log_tail")}))
    for lo, hi, n in zip(edges, edges[1:], counts):
        print(f"  {1e3 * lo:7.0f} - {1e3 * hi:7.0f} ms: {n}")
    for c in report["slowest"][:10]:
        print(f"  slow: start {c[0]:7.3f} s  {1e3 * c[1]:7.1f} ms  client {c[3]}  {c[2] or ''}")
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
