"""Service benchmark: the real server on loopback, measured as a router sees it.

    python bench/bench_service.py --out bench/results/service_h200.json      # on the GPU box
    python bench/bench_service.py --cpu --out /tmp/service_cpu.json          # tiny smoke run

What one run does:

1. writes the weight sets as safetensors files (the main set G=8, N=2048,
   K=7168, a DeepSeek-V3-like set: 256 experts of the gate projection,
   N=2048, K=7168, 3.8 GB, and for the load point a DeepSeek-V3 layer's w13,
   [256, 4096, 7168], 7.5 GB), and starts several ``moegemm serve`` processes on
   loopback that preload them: ``default`` (what ships, at its defaults),
   ``merge_off`` and ``uvicorn`` (the same app on uvicorn, ``uvicorn_peer.py``);
2. times the kernel's own graph replay for every shape in this process (the
   servers idle meanwhile);
3. drives each server from client processes (``moegemm.client.Client``, one
   keep-alive connection each) at M in {1, 32, 128, 1024} rows per call, 1 and
   32 concurrent clients, fp8 and bf16 inputs: p50/p99 latency, calls/s, and
   the overhead (p50 latency minus the kernel's own time);
   Issue 16's points: 32 clients of 1024-row calls, mixed traffic (32 clients,
   rows log-uniform in 1..1024; its calls of up to 256 rows also apart), one
   client's one-row calls beside 31 clients of 1024-row calls ("beside"),
   and the load point (one client's calls
   during the 7.5 GB set's first load, its graphs captured, and while it is
   loaded from its file again and again), each beside the same calls on the
   idle server in the same run;
4. writes everything, with each server's graph-replay/eager and merge-size
   metrics, to one JSON file and prints a table.

Client processes are forked before torch or CUDA are touched here and import
only the client (no torch), as a router would.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shlex
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FP8_MAX = 448.0
# A call of at most this many rows may run on the server's event loop (SPEC 3; the engine's
# SMALL_ROWS): the mixed and beside points report these calls' latencies apart.
SMALL_ROWS = 256


# -- client workers (forked first; no torch) ----------------------------------------


def _inputs(rng: np.random.Generator, m: int, k: int, g: int, kind: str):
    import ml_dtypes

    sizes = rng.multinomial(m, np.full(g, 1.0 / g)).astype(np.int64)
    if kind == "bf16":
        return rng.standard_normal((m, k), dtype=np.float32).astype(ml_dtypes.bfloat16), None, sizes
    x = rng.uniform(-FP8_MAX, FP8_MAX, size=(m, k)).astype(np.float32)
    xq = x.astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-4, 1e-3, size=(m, k // 128)).astype(np.float32)
    return xq, scale, sizes


def _worker(conn, index: int) -> None:
    from moegemm.client import Client

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    clients: dict[str, Client] = {}
    while True:
        job = conn.recv()
        if job is None:
            return
        rng = np.random.default_rng(job["seed"] + index)
        if job["m"] == "mixed":
            # Rows log-uniform in 1..1024, a fresh draw per call from 32 prepared inputs.
            ms = np.exp(rng.uniform(0, np.log(1024), size=32)).round().astype(int)
        elif job["m"] == "beside":
            # One client's one-row calls beside the others' largest calls.
            ms = [1 if index == 0 else job["m_large"]]
        else:
            ms = [job["m"]]
        prepared = [_inputs(rng, int(m), job["k"], job["g"], job["kind"]) for m in ms]
        x, scale, sizes = prepared[0]
        client = clients.get(job["url"])
        if client is None:
            client = clients[job["url"]] = Client(job["url"], timeout=120, retries=0)
        errors, lat, lat_small = 0, [], []
        for _ in range(3):  # warm the connection and the server's path
            client.grouped_gemm(job["name"], x, sizes, x_scale=scale)
        # Paced (open loop) when the job has a total rate: each client sends on its
        # own schedule, staggered, and latency counts from the scheduled send, so
        # a slow answer delays no measurement (no coordinated omission).
        interval = job["clients"] / job["rate"] if job.get("rate") else None
        start = job["start_at"] + (index * interval / job["clients"] if interval else 0)
        while time.time() < start:
            time.sleep(0.0005)
        stop_at = job["start_at"] + job["duration"]
        next_send = time.perf_counter()
        while True:
            if interval is not None:
                wait = next_send - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                t0 = next_send
                next_send += interval
            else:
                t0 = time.perf_counter()
            pick = int(rng.integers(len(prepared))) if len(prepared) > 1 else 0
            x, scale, sizes = prepared[pick]
            try:
                client.grouped_gemm(job["name"], x, sizes, x_scale=scale)
                lat.append(time.perf_counter() - t0)
                if ms[pick] <= SMALL_ROWS:
                    lat_small.append(lat[-1])
            except Exception:  # counted, never hidden
                errors += 1
            if time.time() >= stop_at and len(lat) >= job["min_calls"]:
                break
        conn.send({"lat": lat, "lat_small": lat_small, "errors": errors, "end": time.time()})


class Workers:
    """Client processes, each on its own pipe."""

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("fork")
        self.pipes, self.procs = [], []
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, i), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def run(self, clients: int, job: dict, keep: bool = False) -> dict:
        """One point: the summary, and with ``keep`` the latencies (s) under "lat"."""
        start_at = time.time() + 0.3 + 0.02 * clients
        for pipe in self.pipes[:clients]:
            pipe.send({**job, "start_at": start_at, "clients": clients})
        results = [pipe.recv() for pipe in self.pipes[:clients]]
        lat = sorted(x for r in results for x in r["lat"])
        wall = max(r["end"] for r in results) - start_at
        out = _summary(clients, lat, sum(r["errors"] for r in results), wall)
        if job["m"] in ("mixed", "beside"):
            small = sorted(x for r in results for x in r["lat_small"])
            out["small_calls"] = len(small)
            out["small_p50_us"] = 1e6 * small[len(small) // 2] if small else None
            out["small_p99_us"] = 1e6 * small[min(len(small) - 1, int(len(small) * 0.99))] if small else None
        if keep:
            out["lat"] = lat
        return out

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(5)


def _summary(clients: int, lat: list, errors: int, wall: float) -> dict:
    calls = len(lat)
    lat = sorted(lat)
    return {
        "clients": clients,
        "calls": calls,
        "errors": errors,
        "p50_us": 1e6 * lat[calls // 2] if calls else None,
        "p99_us": 1e6 * lat[min(calls - 1, int(calls * 0.99))] if calls else None,
        "mean_us": 1e6 * statistics.fmean(lat) if calls else None,
        "calls_per_s": calls / wall if wall > 0 else None,
    }


# -- weight files ------------------------------------------------------------------


def write_weights(path: Path, g: int, n: int, k: int, seed: int) -> None:
    """A safetensors file {"w": fp8 [G,N,K], "w_scale": f32 [G,K/128,N/128]}, random."""
    rng = np.random.default_rng(seed)
    w_bytes = g * n * k
    s_shape = (g, k // 128, n // 128)
    s_bytes = 4 * g * (k // 128) * (n // 128)
    header = {
        "w": {"dtype": "F8_E4M3", "shape": [g, n, k], "data_offsets": [0, w_bytes]},
        "w_scale": {"dtype": "F32", "shape": list(s_shape),
                    "data_offsets": [w_bytes, w_bytes + s_bytes]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    # A few distinct random experts, repeated: writing 3.8 GB of fresh randomness
    # would cost more than the benchmark; values still vary within each expert.
    # Bytes 0x00-0x7E and 0x80-0xFE are finite e4m3fn values (0x7F/0xFF are NaN).
    distinct = [rng.integers(0, 0x7F, size=n * k, dtype=np.uint8)
                | (rng.integers(0, 2, size=n * k, dtype=np.uint8) << 7) for _ in range(4)]
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.writelines(distinct[e % len(distinct)].tobytes() for e in range(g))
        f.write(rng.uniform(1e-4, 1e-3, size=s_shape).astype("<f4").tobytes())


# -- servers -----------------------------------------------------------------------


class Server:
    """One ``moegemm serve`` process on loopback."""

    def __init__(self, name: str, port: int, args: list[str], env: dict, log_dir: Path,
                 prefix: list[str] = ()) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_dir / f"server_{name}.log", "w")
        peer = name == "uvicorn"  # the same app on the stock transport
        cmd = [*prefix, sys.executable, *([str(Path(__file__).with_name("uvicorn_peer.py"))] if peer
                                 else ["-m", "moegemm.cli"]),
               "serve", "--host", "127.0.0.1", "--port", str(port), *args]
        self.cmd = cmd
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.ready_s: float | None = None

    def wait_ready(self, timeout: float) -> bool:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/v1/health/ready", timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return True
            except Exception:
                pass
            time.sleep(0.2)
        return False

    def metrics(self) -> dict:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        found = {}
        for key, pattern in (
            ("graph_replays", r'^moegemm_launches_total\{mode="graph"\} (\S+)'),
            ("eager_runs", r'^moegemm_launches_total\{mode="eager"\} (\S+)'),
            ("batches", r"^moegemm_batch_calls_count (\S+)"),
            ("batched_calls", r"^moegemm_batch_calls_sum (\S+)"),
            ("server_s", r'^moegemm_request_seconds_sum\{endpoint="/v1/weights/\{name\}/gemm"\} (\S+)'),
            ("server_calls", r'^moegemm_request_seconds_count\{endpoint="/v1/weights/\{name\}/gemm"\} (\S+)'),
            ("queue_s", r"^moegemm_queue_seconds_sum (\S+)"),
            ("batch_s", r"^moegemm_kernel_seconds_sum (\S+)"),
            ("inline_batches", r"^moegemm_inline_batches_total (\S+)"),
        ):
            match = re.search(pattern, text, re.MULTILINE)
            found[key] = float(match.group(1)) if match else None
        if found["batches"]:
            found["mean_merge_size"] = found["batched_calls"] / found["batches"]
        return found

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -- kernel time -------------------------------------------------------------------


def kernel_times(shapes: list[tuple], device: str) -> dict:
    """The kernels' own time (graph replay median, us) per (set, G, N, K, M, kind): the GEMM for
    fp8 rows; for bf16 rows the kernels the server's graph runs, the fused check-and-quantize
    (``Backend.gather_quantize``) and the GEMM (torch's quantization where the backend has no
    fused kernel)."""
    import torch
    from moegemm.kernels import get_backend, quantize_activations

    out = {}
    dev = torch.device(device)
    backend = get_backend(dev)
    weights = {}
    for set_name, g, n, k, m, kind in shapes:
        if (g, n, k) not in weights:
            wq = torch.randint(0, 0x7F, (g, n, k), dtype=torch.uint8, device=dev)
            weights[(g, n, k)] = (
                wq.view(backend.fp8_dtype),
                torch.rand((g, k // 128, n // 128), device=dev) * 1e-3 + 1e-4,
            )
        wq, ws = weights[(g, n, k)]
        rng = np.random.default_rng(m)
        sizes = torch.tensor(rng.multinomial(m, np.full(g, 1.0 / g)), device=dev)
        x = torch.randn((m, k), device=dev).to(torch.bfloat16)
        xq, xs = quantize_activations(x, backend.fp8_dtype)
        o = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        if kind == "bf16" and backend.gather_quantize is not None:
            # The server's bf16 graph: the rows checked and quantized in one kernel, then the GEMM.
            rows = torch.arange(m, device=dev)
            flags = torch.zeros(m, dtype=torch.int8, device=dev)
            q = torch.empty_like(xq)
            s = torch.empty_like(xs)

            def step(x=x, rows=rows, flags=flags, q=q, s=s, wq=wq, ws=ws, sizes=sizes, o=o):
                backend.gather_quantize(x, rows, flags, (q, s))
                backend.run(q, wq, s, ws, sizes, o)
        elif kind == "bf16":
            def step(x=x, wq=wq, ws=ws, sizes=sizes, o=o):
                q, s = quantize_activations(x, backend.fp8_dtype)
                backend.run(q, wq, s, ws, sizes, o)
        else:
            def step(xq=xq, wq=wq, xs=xs, ws=ws, sizes=sizes, o=o):
                backend.run(xq, wq, xs, ws, sizes, o)
        out[f"{set_name}/M{m}/{kind}"] = _time_us(step, dev)
    return out


def _time_us(step, dev) -> float:
    import torch

    if dev.type != "cuda":
        step()
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        return (time.perf_counter() - t0) / 3 * 1e6
    import triton.testing

    step()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(step, rep=50)


# -- the run -----------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--duration", type=float, default=1.0, help="seconds per point")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--servers", default="default,merge_off,uvicorn")
    ap.add_argument("--merge-window-us", type=int, default=200)
    ap.add_argument("--no-load", action="store_true",
                    help="skip the load point (a 7.5 GB set loaded from a file, repeatedly, "
                         "while another set's calls are timed; beside the same calls idle)")
    ap.add_argument("--load-s", type=float, default=6.0, help="seconds of the load point")
    ap.add_argument("--paced-rate", type=float, default=1300,
                    help="total calls/s of the paced (open-loop) points")
    ap.add_argument("--no-deepseek", action="store_true")
    ap.add_argument("--variants", default="",
                    help="extra copies of the default server with settings from the "
                         "environment, timed on the key points: 'sw20:MOEGEMM_GIL_SWITCH_US=20,...'")
    ap.add_argument("--interleave", action="store_true",
                    help="with --variants: each variant's point right after the default's same point")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="wait this long after the servers are ready (their compile children)")
    ap.add_argument("--quick", action="store_true",
                    help="only the done-criteria's points and the paced ones")
    ap.add_argument("--large", action="store_true",
                    help="with --quick: also the 1024-row calls at 32 clients (default, "
                         "merge_off and the variants)")
    ap.add_argument("--only-m", default="",
                    help="only the points of these M (e.g. 'beside,mixed,1024'), at 1 and --clients "
                         "clients, on every server in turn")
    ap.add_argument("--server-prefix", default="",
                    help="a command each server runs under, e.g. a sampling profiler: "
                         "'py-spy record --gil --subprocesses -f raw -o OUT/{name}.txt --' "
                         "({name}: the server's)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every point this many times, interleaved; medians in 'summary'")
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--budget-s", type=float, default=300, help="stop starting points after this")
    ap.add_argument("--ready-timeout", type=float, default=240)
    ap.add_argument("--after-pid", type=int, help="measure only after this process ended "
                    "(e.g. GPU tests running while the servers start)")
    args = ap.parse_args()
    began = time.monotonic()
    workers = Workers(args.clients)  # before torch/CUDA exist in this process

    if args.cpu:
        main_set, ds_set, ms = (8, 256, 512), (32, 256, 512), [1, 32]
        device, kinds = "cpu", ["fp8", "bf16"]
    else:
        main_set, ds_set, ms = (8, 2048, 7168), (256, 2048, 7168), [1, 32, 128, 1024]
        device, kinds = "cuda", ["fp8", "bf16"]
    sets = {"main": main_set}
    if not args.no_deepseek:
        sets["deepseek"] = ds_set

    work = Path(tempfile.mkdtemp(prefix="moegemm_bench_"))
    wdir = work / "weights"
    wdir.mkdir()
    t0 = time.monotonic()
    for i, (name, (g, n, k)) in enumerate(sets.items()):
        write_weights(wdir / f"{name}.safetensors", g, n, k, seed=i)
    # The load point's set: a DeepSeek-V3 layer's 256 experts' w13 ([256, 4096, 7168]
    # fp8, 7.5 GB), loaded by the default server only (never preloaded).
    big = (8, 256, 512) if args.cpu else (256, 4096, 7168)
    if not args.no_load and "default" in args.servers.split(","):
        write_weights(wdir / "big.safetensors", *big, seed=99)
    files_s = time.monotonic() - t0

    env = dict(os.environ)
    common = ["--device", device, "--weights-dir", str(wdir), "--no-demo",
              "--max-bucket-m", "1024" if args.cpu else "8192"]
    preload_all = [a for name in sets for a in ("--preload", f"{name}={name}.safetensors:w:w_scale")]
    preload_main = ["--preload", "main=main.safetensors:w:w_scale"]
    window = str(args.merge_window_us)
    plans = {
        "default": preload_all + ["--merge-window-us", window],
        "merge_off": preload_main + ["--merge-window-us", "0"],
        "uvicorn": preload_main + ["--merge-window-us", window],
    }
    plans_base = set(plans)
    wanted = [s for s in args.servers.split(",") if s]
    envs = {name: dict(env) for name in wanted}
    for spec in (v for v in args.variants.split(",") if v):
        name, _, assignments = spec.partition(":")
        plans[name] = plans["default"]
        envs[name] = {**env, **dict(a.split("=", 1) for a in assignments.split(";") if a)}
        wanted.append(name)
    # Each server compiles into a Triton cache of its own, empty at its start: the load
    # point's first load then meets a shape whose kernels neither the server nor the cache
    # holds (this process's kernel timing and the other servers compile elsewhere).
    for name in wanted:
        envs[name]["TRITON_CACHE_DIR"] = str(work / f"triton_{name}")
    servers = {}
    for i, name in enumerate(wanted):
        prefix = [w.replace("{name}", name) for w in shlex.split(args.server_prefix)]
        servers[name] = Server(name, args.port + i, common + plans[name], envs[name], work, prefix)

    result: dict = {
        "what": "moegemm service benchmark: real servers on loopback, client processes "
                "(moegemm.client.Client, one keep-alive connection each) on the same machine",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "sets": {k: dict(zip("GNK", v)) for k, v in sets.items()},
        "merge_window_us": args.merge_window_us,
        "weight_files_s": files_s,
        "servers": {}, "kernel_us": {}, "points": [],
    }
    try:
        for name, srv in servers.items():
            ok = srv.wait_ready(args.ready_timeout)
            result["servers"][name] = {"cmd": srv.cmd, "ready": ok, "ready_s": srv.ready_s,
                                       "env": {k: v for k, v in envs[name].items()
                                               if k.startswith("MOEGEMM_")}}
            if not ok:
                print(f"server {name} not ready; see {srv.log.name}", file=sys.stderr)
        if args.after_pid:
            while _alive(args.after_pid):
                time.sleep(0.2)
        # The servers' compile-ahead children (a new shape's kernels, ~25 s on the H200) run
        # after "ready": measuring during them times the compile, not the server.
        time.sleep(args.settle_s)
        result["measuring_from_s"] = time.monotonic() - began
        c = args.clients
        # The done-criteria's points first, so a time budget cut keeps them.
        key_m = ms[2] if len(ms) > 2 else ms[-1]
        first = [("default", "main", ms[0], "fp8", 1), ("default", "main", key_m, "fp8", 1),
                 ("default", "main", key_m, "fp8", c), ("merge_off", "main", key_m, "fp8", c),
                 ("uvicorn", "main", key_m, "fp8", c),
                 # merging's gain where calls are small: many one-row calls at once
                 ("default", "main", ms[0], "fp8", c), ("merge_off", "main", ms[0], "fp8", c)]
        # Issue 16's points, each beside the same calls from one client (the idle server):
        # 32 clients of the largest calls, and mixed traffic (rows log-uniform 1..1024).
        first += [("default", "main", ms[-1], "fp8", 1), ("default", "main", ms[-1], "fp8", c),
                  ("default", "main", "mixed", "fp8", 1), ("default", "main", "mixed", "fp8", c)]
        # A small caller beside large ones (server/engine.py's fair turns: "a large call delays
        # a small one by at most its own batch"): one client's one-row calls while the others
        # send the largest calls, beside the same client alone (c = 1: the idle server).
        first += [("default", "main", "beside", "fp8", 1), ("default", "main", "beside", "fp8", c)]
        if args.large:
            first += [("merge_off", "main", ms[-1], "fp8", c)]
        rest = [("default", "main", m, kind, n) for m in ms for kind in kinds for n in (1, c)]
        if "deepseek" in sets:
            rest += [("default", "deepseek", m, "fp8", n) for m in ms for n in (1, c)]
        rest += [("merge_off", "main", m, "fp8", c) for m in ms] + [("merge_off", "main", 1, "fp8", 1)]
        rest += [("uvicorn", "main", m, "fp8", n) for m in ms[:3] for n in (1, c)]
        points = first + [p for p in rest if p not in first]
        # Paced at the done-criterion's rate: p99 at 1300 calls/s offered by 32 clients.
        paced = [(srv, "main", key_m, "fp8", c, args.paced_rate)
                 for srv in ("default", "merge_off", "uvicorn")]
        variants = [(name, "main", m, "fp8", n) for name in servers if name not in plans_base
                    for (m, n) in ((ms[0], 1), (ms[0], c), (key_m, 1), (key_m, c))
                    + (((ms[-1], c),) if args.large else ())]
        variants += [(name, "main", key_m, "fp8", c, args.paced_rate) for name in servers
                     if name not in plans_base]
        points = (points[:len(first)] + paced + variants
                  + ([] if args.quick else points[len(first):]))
        if args.only_m:
            # Only these points, on every server in turn.
            only = [m if m in ("mixed", "beside") else int(m) for m in args.only_m.split(",")]
            points = [(name, "main", m, "fp8", n) for m in only for n in (1, c) for name in servers]
        if args.interleave:
            # Each variant's point right after the default server's same point, so drift on
            # the shared machine (and anything still running from the start) hits both alike.
            own = [p for p in points if p[0] not in plans_base]
            rest_points = [p for p in points if p[0] in plans_base]
            points = []
            for p in rest_points:
                points.append(p)
                if p[0] == "default":
                    points += [q for q in own if q[1:] == p[1:] and q not in points]
            points += [q for q in own if q not in points]
        points = [p for p in points if p[0] in servers and result["servers"][p[0]]["ready"]]
        shapes = sorted({(p[1], *sets[p[1]], p[2], p[3]) for p in points if p[2] not in ("mixed", "beside")})
        result["kernel_us"] = kernel_times(shapes, device)

        # --rounds: the measured points again, each point's servers in an order rotated by
        # one every round, so a slow spell of the shared machine and a place in the order
        # (session 46: one engine read 2.8x apart first and last) hit every server alike;
        # the summary takes medians.
        points = rotated_rounds(points, args.rounds)
        for rnd, (server, set_name, m, kind, clients, *pace) in points:
            srv = servers[server]
            if time.monotonic() - began > args.budget_s:
                result["stopped_early"] = "time budget"
                break
            g, n, k = sets[set_name]
            job = {"url": srv.url, "name": set_name, "m": m, "k": k, "g": g, "kind": kind,
                   "duration": args.duration, "seed": (m if isinstance(m, int) else 5) * 7 + clients,
                   "m_large": ms[-1],
                   "min_calls": 20 if clients == 1 else 3, "rate": pace[0] if pace else None}
            before = srv.metrics()
            row = {"server": server, "set": set_name, "M": m, "input": kind,
                   "offered_calls_per_s": job["rate"], **workers.run(clients, job)}
            after = srv.metrics()
            # Per point (warm-up calls included): launches and calls per launch.
            delta = {k: (after[k] or 0) - (before[k] or 0)
                     for k in ("graph_replays", "eager_runs", "batches", "batched_calls",
                               "server_s", "server_calls", "queue_s", "batch_s",
                               "inline_batches")}
            # The server's own share: time inside the app per call, queue wait
            # per call, device time per batch (copies, graph, sync).
            calls_in = delta["server_calls"] or None
            row["server_us_per_call"] = 1e6 * delta["server_s"] / calls_in if calls_in else None
            row["queue_us_per_call"] = (1e6 * delta["queue_s"] / delta["batched_calls"]
                                        if delta["batched_calls"] else None)
            row["batch_us"] = 1e6 * delta["batch_s"] / delta["batches"] if delta["batches"] else None
            row["graph_replays"], row["eager_runs"] = delta["graph_replays"], delta["eager_runs"]
            row["inline_batches"] = delta["inline_batches"]
            row["round"] = rnd
            row["mean_merge_size"] = (delta["batched_calls"] / delta["batches"]
                                      if delta["batches"] else None)
            kern = result["kernel_us"].get(f"{set_name}/M{m}/{kind}") if isinstance(m, int) else None
            row["kernel_us"] = kern
            row["overhead_p50_us"] = row["p50_us"] - kern if row["p50_us"] and kern else None
            points_done = result["points"]
            points_done.append(row)
            print(_fmt(row), flush=True)
        if not args.no_load and result["servers"].get("default", {}).get("ready"):
            result["load_point"] = load_point(servers["default"], workers, sets["main"], key_m,
                                              big, args.load_s)
            lp = result["load_point"]
            print("load point", json.dumps({k: v for k, v in lp.items() if k != "loads"}),
                  f"loads: {len(lp['loads'])}", flush=True)
        result["summary"] = summarize(result["points"])
        for line in result["summary"]:
            print("median", _fmt(line), flush=True)
        for name, srv in servers.items():
            if result["servers"][name]["ready"]:
                result["servers"][name]["metrics"] = srv.metrics()
    finally:
        workers.close()
        for srv in servers.values():
            srv.stop()
        result["wall_s"] = time.monotonic() - began
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        for name in servers:
            log = work / f"server_{name}.log"
            if log.exists():
                tail = log.read_text().splitlines()[-30:]
                result["servers"].setdefault(name, {})["log_tail"] = tail
        Path(args.out).write_text(json.dumps(result, indent=1))
        for f in wdir.iterdir():
            f.unlink()
    return 0


def load_point(srv: Server, workers: Workers, main_set, m: int, big, seconds: float) -> dict:
    """One client's M-row calls on the main set: idle; during the first load of the
    7.5 GB set (a shape new to the server: its kernels compiled ahead in a child
    process, into the server's own Triton cache, empty at its start; its graphs
    captured; ``first_load_compiles``: the server's log lines on it -- with the
    deepseek set preloaded, most of the big set's kernels are that set's already,
    so the honest first-load figure comes from a ``--no-deepseek`` run); and while
    it is loaded again and again
    (replacements): the latencies, and each load's seconds and GB/s (SPEC 3,
    issue 16)."""
    import threading

    import httpx
    from moegemm.client._wire import packb

    g, _n, k = main_set
    job = {"url": srv.url, "name": "main", "m": m, "k": k, "g": g, "kind": "fp8",
           "duration": seconds, "seed": 16, "min_calls": 20, "rate": None}
    idle = workers.run(1, job)
    body = packb({"file": "big.safetensors", "w": "w", "w_scale": "w_scale"})
    nbytes = big[0] * big[1] * big[2] + 4 * big[0] * (big[2] // 128) * (big[1] // 128)
    loads, stop = [], threading.Event()

    def load() -> None:
        with httpx.Client(timeout=600) as http:
            t0 = time.monotonic()
            r = http.put(srv.url + "/v1/weights/big", content=body,
                         headers={"content-type": "application/vnd.msgpack"})
            took = time.monotonic() - t0
            loads.append({"s": took, "status": r.status_code, "GB_per_s": nbytes / took / 1e9})

    def loader() -> None:
        while not stop.is_set():
            load()

    # The first load, its calls gathered from short windows while it lasts.
    first = threading.Thread(target=load, daemon=True)
    first.start()
    lat, errors, wall = [], 0, 0.0
    while first.is_alive():
        window = workers.run(1, {**job, "duration": 0.5, "min_calls": 1}, keep=True)
        lat += window["lat"]
        errors += window["errors"]
        wall += window["calls"] / window["calls_per_s"] if window["calls_per_s"] else 0.0
    first.join(600)
    during_first = _summary(1, lat, errors, wall)
    compiled = _compile_lines(Path(srv.log.name))
    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    time.sleep(0.2)  # the first replacement under way before the calls are timed
    busy = workers.run(1, job)
    stop.set()
    thread.join(600)
    done = [x for x in loads[1:] if x["status"] in (200, 201)]
    return {
        "M": m, "set_bytes": nbytes, "idle": idle, "during_first_load": during_first,
        "first_load": loads[0] if loads else None, "during_loads": busy, "loads": loads,
        "first_load_compiles": compiled,
        "p99_ratio": (busy["p99_us"] / idle["p99_us"]) if idle["p99_us"] and busy["p99_us"]
        else None,
        "first_load_p99_ratio": (during_first["p99_us"] / idle["p99_us"])
        if idle["p99_us"] and during_first["p99_us"] else None,
        "load_GB_per_s_median": statistics.median(x["GB_per_s"] for x in done) if done else None,
    }


def _compile_lines(log: Path) -> list[str]:
    """The server log's lines on compiling a new shape's kernels (``server/_ahead.py``: how
    many the child compiled, a child's failure, kernels the captures still compiled)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line.strip()[-300:] for line in text.splitlines()
            if " ahead" in line and ("compiled" in line or "compiling" in line)]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def rotated_rounds(points: list[tuple], rounds: int) -> list[tuple]:
    """``(round, point)`` for every round: the points in their order, where a run of points
    that differ only in their server (``point[0]``) starts one server later each round."""
    runs: list[list[tuple]] = []
    for p in points:
        if runs and runs[-1][0][1:] == p[1:]:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [(r, p) for r in range(rounds) for run in runs
            for p in run[r % len(run):] + run[:r % len(run)]]


def summarize(rows: list[dict]) -> list[dict]:
    """Per point (server, set, M, input, clients, rate): the median of each figure
    over the rounds, and how many rounds there were."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["server"], row["set"], row["M"], row["input"], row["clients"],
               row["offered_calls_per_s"])
        groups.setdefault(key, []).append(row)
    out = []
    for same in groups.values():
        line = dict(same[0])
        for key, value in same[0].items():
            if isinstance(value, (int, float)) and key not in ("M", "clients", "round"):
                values = [r[key] for r in same if r.get(key) is not None]
                line[key] = statistics.median(values) if values else None
        line["rounds"] = len(same)
        line.pop("round", None)
        out.append(line)
    return out


def _fmt(row: dict) -> str:
    def num(v, spec=".0f"):
        return "-" if v is None else format(v, spec)
    paced = f"@{row['offered_calls_per_s']:.0f}/s" if row["offered_calls_per_s"] else ""
    return (f"{row['server']:10s} {row['set']:8s} M={row['M']!s:>5s} {row['input']:4s}{paced} "
            f"c={row['clients']:2d}  p50 {num(row['p50_us']):>7s} us  p99 {num(row['p99_us']):>7s} us  "
            f"{num(row['calls_per_s']):>6s} calls/s  kernel {num(row['kernel_us'], '.1f'):>7s} us  "
            f"overhead {num(row['overhead_p50_us']):>6s} us  merge {num(row['mean_merge_size'], '.1f')}"
            f"  graph/eager {row['graph_replays']:.0f}/{row['eager_runs']:.0f}"
            f"  in-server {num(row['server_us_per_call'])} us  batch {num(row['batch_us'])} us"
            f"  inline {num(row.get('inline_batches'))}  errors {row['errors']}"
            + (f"  small ({num(row.get('small_calls'))}) p50 {num(row.get('small_p50_us'))} us"
               f" p99 {num(row.get('small_p99_us'))} us" if "small_calls" in row else ""))


if __name__ == "__main__":
    raise SystemExit(main())
