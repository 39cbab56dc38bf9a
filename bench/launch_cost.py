"""What a lone call's graph launch costs: ``CUDAGraph.replay`` against the driver's ``cuGraphLaunch``.

    python bench/launch_cost.py [--match "seed m1 ,Qwen3-30B-A3B w2 decode t1 "] [--json OUT]

For each matching bench case, the server's captured graph for the call's bucket
(``bench_kernels.service_graph``) replayed back to back as ``bench_kernels.time_replays_us`` times
it (``torch.cuda.CUDAGraph.replay``, what the executor calls), the same graph launched through
``cuda.bindings.driver.cuGraphLaunch`` on its executable, and the public kernel in a graph of many
calls (the GPU's own time): microseconds a call, medians of alternated rounds, and the host's
microseconds a launch (the loop's wall time). Where the replay loop is host-bound, a cheaper
launch shows in the first two. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk


def loop_us(launch, calls: int = 400, reps: int = 15) -> tuple[float, float]:
    """(GPU us a call from events, host us a launch) over ``reps`` loops of ``calls`` launches."""
    gpu, host = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            launch()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(gpu)[reps // 2], sorted(host)[reps // 2]


def main() -> None:
    from cuda.bindings import driver
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default="seed m1 ,Qwen3-30B-A3B w2 decode t1 ,Qwen3-30B-A3B w13 decode t1 ,"
                                           "seed m128 n8192 k1024,Llama-4-Maverick w2 decode t1 ")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device=bk.DEV).manual_seed(40)
    rows = []
    for case in bk.matching_cases(args.match):
        wq, w_scale = bk.random_weights(case["g"], case["n"], case["k"], gen)
        _, xq, x_scale = bk.random_activations(case["m"], case["k"], gen)
        problem = (xq, wq, x_scale, w_scale, case["sizes"].to(bk.DEV))
        pool, bufs, graph = bk.service_graph(problem, bk.bucket_of(case["m"]))
        exec_handle = driver.CUgraphExec(graph.raw_cuda_graph_exec())
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        out = torch.empty(case["m"], case["n"], dtype=torch.bfloat16, device=bk.DEV)

        def driver_launch(exec_handle=exec_handle, stream=stream):
            (err,) = driver.cuGraphLaunch(exec_handle, stream)
            assert err == driver.CUresult.CUDA_SUCCESS, err

        forms = {"replay": graph.replay, "cuGraphLaunch": driver_launch}
        runs = bk.alternating_timers({name: (lambda f=f: loop_us(f)) for name, f in forms.items()}, rounds=4)
        row = {"name": case["name"], "config": tk.default_config(bk.bucket_of(case["m"]), case["n"], case["k"],
                                                                 case["g"]).key(),
               "public_graph_us": round(bk.time_us(lambda problem=problem, out=out: tk.run(*problem, out)), 2)}
        for name, got in runs.items():
            got.sort()
            row[name] = {"gpu_us": round(got[len(got) // 2][0], 2),
                         "host_us": round(sorted(h for _, h in got)[len(got) // 2], 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del pool, bufs, graph
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
