"""Where the server's time goes under load: py-spy on a real ``moegemm serve``.

    python bench/profile_service.py --out DIR [--device cuda] [--clients 1,32] [--m 128]

Starts ``moegemm serve`` under ``py-spy record`` (raw stacks, every thread),
loads a random fp8 weight set (G=8, N=2048, K=7168 by default) over HTTP,
drives it from client processes (``moegemm.client.Client``) for a few seconds
per client count, stops the server, and prints the functions holding the
samples: by thread, by leaf (self time) and inclusive. Idle samples (threads
waiting) are left out by py-spy. Needs ``py-spy`` on PATH.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np


def _drive(url: str, m: int, k: int, g: int, seconds: float, seed: int, out) -> None:
    import ml_dtypes
    from moegemm.client import Client

    rng = np.random.default_rng(seed)
    x = rng.uniform(-400, 400, (m, k)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-4, 1e-3, (m, k // 128)).astype(np.float32)
    sizes = rng.multinomial(m, np.full(g, 1.0 / g)).astype(np.int64)
    calls = 0
    with Client(url, timeout=60) as client:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            client.grouped_gemm("main", x, sizes, x_scale=scale)
            calls += 1
    out.put(calls)


def summarize(raw: Path, top: int = 30) -> str:
    threads, leaf, incl = Counter(), Counter(), Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        if any("importlib" in f for f in frames):
            continue  # start-up imports, not serving
        threads[frames[0].split(":")[-1].strip()] += n
        leaf[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    total = sum(threads.values()) or 1
    lines = ["threads: " + ", ".join(f"{t} {100 * n / total:.0f}%" for t, n in threads.most_common())]
    lines.append("-- self (leaf) --")
    lines += [f"{100 * n / total:5.1f}% {f}" for f, n in leaf.most_common(top)]
    lines.append("-- inclusive --")
    lines += [f"{100 * n / total:5.1f}% {f}" for f, n in incl.most_common(top * 2)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clients", default="1,32")
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--port", type=int, default=18750)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too)")
    ap.add_argument("--serve-args", default="--merge-window-us 200")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g, n, k = (8, 2048, 7168) if args.device != "cpu" else (8, 256, 512)
    raw = out / "pyspy_raw.txt"
    cmd = ["py-spy", "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--threads",
           *(["--native"] if args.native else []), "--", sys.executable, "-m", "moegemm.cli", "serve", "--device", args.device,
           "--port", str(args.port), "--no-demo", "--log-level", "warning",
           *args.serve_args.split()]
    log = open(out / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    report = []
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(url + "/v1/health/ready", timeout=1).status_code == 200:
                    break
            except Exception:  # noqa: BLE001 -- not up yet
                pass
            time.sleep(0.1)
        import ml_dtypes
        from moegemm.client import Client

        rng = np.random.default_rng(0)
        w = rng.integers(0, 0x7E, (g, n, k), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        ws = rng.uniform(1e-4, 1e-3, (g, k // 128, n // 128)).astype(np.float32)
        with Client(url, timeout=300) as client:
            client.load_weights("main", w, ws)
        ctx = mp.get_context("spawn")
        for clients in (int(c) for c in args.clients.split(",")):
            q = ctx.Queue()
            procs = [ctx.Process(target=_drive, args=(url, args.m, k, g, args.seconds, i, q))
                     for i in range(clients)]
            started = time.monotonic()
            for p in procs:
                p.start()
            calls = sum(q.get() for _ in procs)
            for p in procs:
                p.join()
            wall = time.monotonic() - started
            report.append(f"{clients} clients, M={args.m}: {calls} calls, "
                          f"{calls / args.seconds:.0f} calls/s (wall {wall:.1f} s incl. start-up)")
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # py-spy writes its samples, the server drains
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = "\n".join(report) + "\n" + (summarize(raw) if raw.exists() else "no py-spy output")
    (out / "profile.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
