"""Several GPUs, one ``moegemm serve`` each: placement, replicas, failover, restart and
throughput through ``MultiClient`` (issue 19).

    python bench/multi_gpu.py --devices 0,1 --out results/multi_gpu_h200x2.json   # two GPUs
    python bench/multi_gpu.py --devices cpu,cpu --small                           # anywhere

Each server is a real ``moegemm serve --device D`` process at its defaults (acceptors
included on a GPU) on its own loopback port. The checks, in order:

1. weight sets (and an expert set, where the client has them) land where rendezvous
   placement says, and only there (each server's ``GET /v1/weights``);
2. every set answers within SPEC 1's bound of the float64 reference;
3. a hot set with ``replicas=2`` is served by both servers (each server's
   ``moegemm_requests_total`` for the gemm route);
4. killing one server (SIGKILL) while calls run: calls on sets with a live replica
   keep answering right, calls on sets it alone held fail with ``TransportError``
   naming it, and nothing answers wrong;
5. restarting it on the same port and loading its sets again brings placement back;
6. throughput of ``--clients`` client processes over all servers against the same
   clients on the first server alone, in the same run.

Prints a table and writes the JSON (``--out``); exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from moegemm.client import Client, MoegemmError, TransportError
from moegemm.client._multi import MultiClient
from moegemm.client._placement import normalize_endpoint

# torch and the kernels' references are imported where the scenario needs them, not
# here: the client processes import this module again and need neither.

TOKEN = "multi-gpu-token"
GEMM_ROUTE = "/v1/weights/{name}/gemm"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """One ``moegemm serve`` process for one device."""

    device: str
    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOEGEMM_")}
        env.update(MOEGEMM_TOKEN=TOKEN, MOEGEMM_DEMO="false", MOEGEMM_LOG_LEVEL="warning")
        device = self.device if self.device == "cpu" else f"cuda:{self.device}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moegemm.cli", "serve", "--device", device,
             "--host", "127.0.0.1", "--port", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        with Client(self.url, token=TOKEN, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"{self.url} exited {self.proc.returncode}: {err}")
                try:
                    client.health()
                    return
                except MoegemmError:
                    time.sleep(0.2)
        raise TimeoutError(f"{self.url} not ready after {timeout} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def _gemm_calls(url: str) -> float:
    """The server's count of answered gemm calls (status 200), from its metrics."""
    import httpx

    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"},
                     timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("moegemm_requests_total{") and f'endpoint="{GEMM_ROUTE}"' in line \
                and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _holders(servers: list[Server], name: str) -> set[str]:
    held = set()
    for server in servers:
        if server.proc is None or server.proc.poll() is not None:
            continue
        with Client(server.url, token=TOKEN) as client:
            if any(entry["name"] == name for entry in client.weights()):
                held.add(normalize_endpoint(server.url))
    return held


class Sets:
    """The weight sets of the run with their host copies and float64 references."""

    def __init__(self, count: int, g: int, n: int, k: int, rows: int) -> None:
        from moegemm.kernels import reference_float64
        from moegemm.kernels.testing import random_problem

        rng = np.random.default_rng()
        self.names = [f"set{i}-{rng.integers(1 << 30)}" for i in range(count)]
        self.hot = self.names[0]
        self.problems = {}
        for name in self.names:
            p = random_problem(rows, n, k, g)
            ref = reference_float64(p.xq, p.wq, p.x_scale, p.w_scale, p.m_sizes)
            self.problems[name] = (p, ref)

    def load(self, multi: MultiClient, only: list[str] | None = None) -> None:
        for name in only or self.names:
            p, _ = self.problems[name]
            multi.load_weights(name, p.wq, p.w_scale)

    def call(self, client, name: str) -> bool:
        """One call on ``name``; True when the answer is within SPEC 1's bound."""
        import torch
        from moegemm.kernels.testing import SPEC_TOLERANCE, rel_error

        p, ref = self.problems[name]
        out = client.grouped_gemm(name, p.xq, p.m_sizes.tolist(), x_scale=p.x_scale)
        return bool(torch.isfinite(out).all()) and rel_error(out, ref) <= SPEC_TOLERANCE


def _traffic(sets: Sets, multi: MultiClient, stop: threading.Event, log: list) -> None:
    """Calls on every set in turn until ``stop``: (name, "ok" | "wrong" | error text)."""
    while not stop.is_set():
        for name in sets.names:
            try:
                log.append((name, "ok" if sets.call(multi, name) else "wrong"))
            except TransportError as exc:
                log.append((name, f"transport: {exc}"))
            except MoegemmError as exc:
                log.append((name, f"{type(exc).__name__}: {exc}"))


def _client_loop(url: str, name: str, rows: int, k: int, g: int, seconds: float, queue) -> None:
    """One client process: closed-loop calls for ``seconds``; its latencies."""
    import ml_dtypes

    rng = np.random.default_rng()
    x = rng.uniform(-4, 4, (rows, k)).astype(ml_dtypes.float8_e4m3fn)
    xs = rng.uniform(0.5, 1.0, (rows, k // 128)).astype(np.float32)
    sizes = np.full(g, rows // g, dtype=np.int64)
    sizes[0] += rows - sizes.sum()
    lat = []
    try:
        with Client(url, token=TOKEN, timeout=60) as client:
            client.grouped_gemm(name, x, sizes, x_scale=xs)
            end = time.monotonic() + seconds
            while (now := time.monotonic()) < end:
                client.grouped_gemm(name, x, sizes, x_scale=xs)
                lat.append(time.monotonic() - now)
    except MoegemmError as exc:
        queue.put(f"{url}: {exc}")
        return
    queue.put(lat)


def _throughput(targets: list[tuple[str, str]], clients: int, rows: int, k: int, g: int,
                seconds: float) -> dict:
    """``clients`` processes, client i calling ``targets[i % len(targets)]`` (url, set)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_client_loop, args=(*targets[i % len(targets)], rows, k, g,
                                                    seconds, queue)) for i in range(clients)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join()
    errors = [e for e in got if isinstance(e, str)]
    if errors:
        raise RuntimeError(f"{len(errors)} client processes failed, first: {errors[0]}")
    lat = [x for one in got for x in one]
    lat.sort()
    pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6) if lat else (lambda q: 0)
    return {"calls_per_s": len(lat) / seconds, "p50_us": pick(0.5), "p99_us": pick(0.99),
            "calls": len(lat)}


def run(devices: list[str], small: bool, clients: int, seconds: float) -> dict:
    import torch

    g, n, k, rows = (4, 256, 512, 24) if small else (8, 2048, 7168, 128)
    servers = [Server(d) for d in devices]
    checks: list[dict] = []

    def check(what: str, ok: bool, detail=None) -> None:
        checks.append({"check": what, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {what}  {'' if detail is None else detail}",
              flush=True)

    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        urls = [s.url for s in servers]
        sets = Sets(6, g, n, k, rows)
        with MultiClient(urls, replicas=1, hot={sets.hot: 2}, token=TOKEN, timeout=60) as multi:
            sets.load(multi)
            placed = {name: multi.placement(name) for name in sets.names}
            check("sets land where placement says",
                  all(_holders(servers, nm) == set(p) for nm, p in placed.items()),
                  {nm: p for nm, p in placed.items()})
            check("every set answers within SPEC 1's bound",
                  all(sets.call(multi, nm) for nm in sets.names))
            before = [_gemm_calls(u) for u in urls]
            for _ in range(20):
                sets.call(multi, sets.hot)
            served = [_gemm_calls(u) - b for u, b in zip(urls, before)]
            hot_on = [urls.index(u) if u in urls else None for u in placed[sets.hot]]
            check("the hot set (replicas=2) is served by both of its servers",
                  all(served[i] > 0 for i in range(len(urls))
                      if normalize_endpoint(urls[i]) in placed[sets.hot]) and len(urls) >= 2,
                  {"gemm calls per server": served, "hot placed on": hot_on})

            victim = servers[0]
            victim_url = normalize_endpoint(victim.url)
            log: list = []
            stop = threading.Event()
            worker = threading.Thread(target=_traffic, args=(sets, multi, stop, log))
            worker.start()
            time.sleep(seconds / 2)
            victim.kill()
            killed_at = len(log)
            time.sleep(seconds)
            stop.set()
            worker.join(120)
            after = log[killed_at:]
            wrong = [e for e in log if e[1] == "wrong"]
            only_victim = {nm for nm, p in placed.items() if p == [victim_url]}
            replicated = {nm for nm, p in placed.items() if victim_url in p and len(p) > 1}
            fine = {nm for nm, r in after if r == "ok"}
            failed_named = all(victim_url in r for nm, r in after
                               if nm in only_victim and r != "ok")
            check("killing a server: nothing answers wrong", not wrong, {"calls": len(log)})
            check("killing a server: replicated sets fail over",
                  replicated <= fine if replicated else True,
                  {"replicated on the victim": sorted(replicated)})
            lone_failures = [r for nm, r in after if nm in only_victim and r != "ok"]
            check("killing a server: its lone sets fail naming it",
                  failed_named and (bool(lone_failures) or not only_victim),
                  {"sets only on the victim": sorted(only_victim),
                   "first failure": lone_failures[0][:200] if lone_failures else None})
            check("killing a server: sets elsewhere keep answering",
                  {nm for nm, p in placed.items() if victim_url not in p} <= fine)

            victim.start()
            victim.wait_ready()
            sets.load(multi, [nm for nm, p in placed.items() if victim_url in p])
            check("a restarted server gets its sets back where placement says",
                  all(_holders(servers, nm) == set(p) for nm, p in placed.items())
                  and all(sets.call(multi, nm) for nm in sets.names))

        # Throughput: one set of the same shape on every server; the clients on the
        # first server alone, then spread over all of them.
        p, _ = sets.problems[sets.names[1]]
        for u in urls:
            with Client(u, token=TOKEN, timeout=120) as client:
                client.load_weights("tput", p.wq, p.w_scale)
        one = _throughput([(urls[0], "tput")], clients, rows, k, g, seconds)
        spread = _throughput([(u, "tput") for u in urls], clients, rows, k, g, seconds)
        throughput = {"one_server": one, "all_servers": spread, "servers": len(urls),
                      "clients": clients, "rows": rows, "shape": {"G": g, "N": n, "K": k}}
        print(f"throughput, {clients} clients, M={rows}: one server {one['calls_per_s']:.0f}/s "
              f"(p99 {one['p99_us']:.0f} us), {len(urls)} servers "
              f"{spread['calls_per_s']:.0f}/s (p99 {spread['p99_us']:.0f} us)", flush=True)
    finally:
        for s in servers:
            s.stop()
    return {"devices": devices, "checks": checks, "throughput": throughput,
            "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(int(d)) for d in devices if d != "cpu"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="0,1", help="comma-separated: GPU indices or cpu")
    parser.add_argument("--small", action="store_true", help="small shapes (CPU runs)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    result = run(args.devices.split(","), args.small, args.clients, args.seconds)
    result["command"] = " ".join(sys.argv)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
