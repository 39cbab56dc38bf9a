"""Where a many-expert prefill launch's time goes beyond its MMA work.

    python bench/profile_tails.py [--match "DeepSeek-V3 w13 prefill t8192,..."]           # timings
    ncu --profile-from-start off --clock-control none --section ... \\
        python bench/profile_tails.py --ncu [--match ...]                                  # counters

For each real-model case (``bench_kernels.real_cases``) the table's tile is launched as the public
function launches it on four sets of group sizes, all with the case's G, N, K and the same tile:

- ``routed``: the case's own sizes (the routing model's skew and its tails);
- ``no_tail``: the same sizes rounded down to whole 128-row tiles (the same skew, no tail tile);
- ``round_up``: rounded up instead (the routed launch's tiles, every one full of rows);
- ``even``: the same rows in equal groups of whole tiles (every weight tile shared alike).

Printed per launch: rows, the rows the tiles compute (a tail of 64 rows or fewer computes 64, a
longer one 128), the groups with rows (whose weights are read), the time (CUDA-graph replay
median, fresh random data), and TFLOP/s on the rows and on the computed rows. With ``--ncu``
each launch runs once, after a warm-up, between ``cudaProfilerStart`` and ``cudaProfilerStop``,
for Nsight Compute's counters (DRAM and L2 bytes and throughput, tensor pipe activity, warp
stalls). Never collected by pytest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk

CASES = "DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,DeepSeek-V3 w2 prefill t8192,Qwen3-30B-A3B w2 prefill t8192"


def variants(sizes: torch.Tensor) -> dict[str, torch.Tensor]:
    g = sizes.numel()
    no_tail = sizes // 128 * 128
    tiles = int(sizes.sum()) // 128
    even = torch.full((g,), tiles // g * 128, dtype=torch.int64)
    even[: tiles % g] += 128
    return {"routed": sizes, "no_tail": no_tail, "round_up": (sizes + 127) // 128 * 128, "even": even}


def computed_rows(sizes: torch.Tensor) -> int:
    tail = sizes % 128
    return int((sizes // 128 * 128 + torch.where(tail == 0, 0, torch.where(tail <= 64, 64, 128))).sum())


def main() -> None:
    import triton
    from moegemm.kernels import triton_kernel as tk

    triton.set_allocator(tk._tma_scratch)  # the device-made TMA descriptors' scratch (as _launch sets it)
    parser = argparse.ArgumentParser()
    parser.add_argument("--match", default=CASES)
    parser.add_argument("--ncu", action="store_true", help="one launch each between cudaProfilerStart/Stop")
    args = parser.parse_args()
    gen = torch.Generator(device=bk.DEV).manual_seed(7)
    for case in bk.matching_cases(args.match):
        g, n, k = case["g"], case["n"], case["k"]
        wq, w_scale = bk.random_weights(g, n, k, gen)
        config = tk.default_config(case["m"], n, k, g)
        for name, sizes in variants(case["sizes"]).items():
            m = int(sizes.sum())
            _, xq, x_scale = bk.random_activations(m, k, gen)
            out = torch.empty((m, n), dtype=torch.bfloat16, device=bk.DEV)
            ops = {"wq": wq, "w_scale": w_scale, "xq": xq, "x_scale": x_scale, "sizes": sizes.to(bk.DEV)}
            launch = bk.bound_launch(bk.form_plan("public", ops, out, config))
            rows, work, active = m, computed_rows(sizes), int((sizes > 0).sum())
            if args.ncu:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                launch()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"profiled {case['name']} {name} rows {rows} computed {work} active {active}", flush=True)
                continue
            us = bk.time_us(launch)
            flops = 2 * n * k / us / 1e6
            print(f"{case['name']:44s} {name:8s} {config.key():34s} rows {rows:6d} computed {work:6d} "
                  f"({work / rows:.3f}x) active {active:3d} {us:8.1f} us  {flops * rows:6.0f} TFLOP/s on rows  "
                  f"{flops * work:6.0f} on computed", flush=True)
        del wq, w_scale
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
