"""What one replay of a service graph costs beside its kernel, on the device (session 44).

For each case matching ``--match`` (``--repeat`` times through them): the server's graph for
the call's bucket (``bench_kernels.service_graph``), then
- back-to-back launches timed as ``bench_kernels.time_replays_us`` through torch's ``replay``,
  the server's launcher (``server._staging.replay``) and a driver ``cuGraphLaunch`` on a cached
  handle, beside the public entry (a graph of ~1 ms of calls) and the public entry as a graph of
  one call, alternated over ``--rounds`` rounds;
- the host's cost of one launch through each, timed while the GPU is held by a sleep kernel;
- the kernels each launch runs (``torch.profiler``: does ``CUDAGraph.replay`` add work of its own?).

    python bench/replay_probe.py --match "seed m1 ,Qwen3-30B-A3B w2 decode t1 g" --json OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk


def driver_launcher(graph: torch.cuda.CUDAGraph):
    """A call of no arguments launching ``graph``'s executable graph on the current stream
    through the driver (cuda-bindings), or None where torch or the bindings cannot."""
    try:
        from cuda.bindings import driver
        exec_handle = graph.raw_cuda_graph_exec()
    except Exception as exc:  # noqa: BLE001  reported, the probe goes on without it
        print("no driver launch:", repr(exc)[:200])
        return None
    stream = torch.cuda.current_stream().cuda_stream
    gexec = driver.CUgraphExec(exec_handle)
    cs = driver.CUstream(stream)

    def launch():
        (err,) = driver.cuGraphLaunch(gexec, cs)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuGraphLaunch: {err}")
    return launch


def host_us(launch, calls: int = 300) -> float:
    """Host microseconds per ``launch()`` while the GPU sleeps (the queue never drains)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s: longer than the loop, which stays under the queue's depth
    t0 = time.perf_counter()
    for _ in range(calls):
        launch()
    us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return us


def replay_kernels(launch, reps: int = 20) -> dict[str, int]:
    """Kernel names and counts over ``reps`` launches, from the profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            launch()
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            counts[ev.name[:60]] = counts.get(ev.name[:60], 0) + 1
    return counts


def loop_us(launch, budget_ms: float = 10.0) -> float:
    """``bench_kernels.time_replays_us`` with any launcher: back-to-back launches of ~1 ms
    between two events, median over such runs, per launch."""
    launch()
    est = min(bk._event_ms(launch, 2))
    calls = max(1, min(200, int(1.0 / max(est, 1e-3))))

    def run():
        for _ in range(calls):
            launch()
    reps = max(3, min(30, int(budget_ms / max(est * calls, 1e-3))))
    times = bk._event_ms(run, reps)
    return 1e3 * sorted(times)[len(times) // 2] / calls


def probe_case(case: dict, gen: torch.Generator, rounds: int) -> dict:
    """One case's row: the alternated timings, each launcher's host cost, the kernels it runs."""
    from moegemm.kernels import triton_kernel as tk
    from moegemm.server import _staging

    wq, w_scale = bk.random_weights(case["g"], case["n"], case["k"], gen)
    _, xq, x_scale = bk.random_activations(case["m"], case["k"], gen)
    problem = (xq, wq, x_scale, w_scale, case["sizes"].to(bk.DEV))
    public = torch.empty((case["m"], case["n"]), dtype=torch.bfloat16, device=bk.DEV)
    tk.run(*problem, public)
    bucket = bk.bucket_of(case["m"])
    _pool, _bufs, graph = bk.service_graph(problem, bucket)
    row = {"name": case["name"], "config": tk.default_config(bucket, case["n"], case["k"], case["g"]).key()}
    drive = driver_launcher(graph)
    shipped = _staging.replay
    one = torch.cuda.CUDAGraph()  # the public entry, one call a graph: the launch form apart
    with torch.cuda.graph(one):
        tk.run(*problem, public)
    launchers = {"replay": graph.replay, "shipped": lambda: shipped(graph)}
    if drive is not None:
        launchers["driver"] = drive
    timers = {"public": lambda: bk.time_us(lambda: tk.run(*problem, public)),
              "public_one": lambda: loop_us(one.replay)}
    timers.update({name: (lambda fn=fn: loop_us(fn)) for name, fn in launchers.items()})
    times = bk.alternating_timers(timers, rounds)
    row["rounds_us"] = {k: [round(t, 2) for t in v] for k, v in times.items()}
    row["us"] = {k: round(statistics.median(v), 2) for k, v in times.items()}
    # After the timings: the first case timed after the profiler's first use read its torch
    # replays 1.7x slow (session 44 call 2), the profiler suspected.
    row["host_us"] = {name: round(host_us(fn), 2) for name, fn in launchers.items()}
    row["kernels"] = {name: replay_kernels(fn) for name, fn in launchers.items()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default="seed m1 ,Qwen3-30B-A3B w2 decode t1 g,DeepSeek-V3 w2 decode t1 g")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="times through the cases")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device=bk.DEV)
    gen.manual_seed(int(time.time()))
    rows = []
    for case in bk.matching_cases(args.match) * args.repeat:
        rows.append(probe_case(case, gen, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
