"""Experiment (not what ships): a persistent prefill tile with the lone call's check beside it,
launched after the GEMM, against the shipped serial check and the public function alone.

v13 measured the check beside the GEMM, launched first, 3-19 % slower than serial at prefill
(its programs held SMs the persistent GEMM waited for). This times the other order: the GEMM's
node created first, the check's branch after it, so the persistent programs are resident first.

    python bench/exp_check_order.py --json bench/results/exp_check_order.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk
from bench_moe import capture

CASES = ("seed m16384 n2048 k7168 g8", "seed m16384 n7168 k2304 g8", "real DeepSeek-V3 w13 prefill t2048 g256",
         "real Qwen3-30B-A3B w2 prefill t8192 g128", "real Mixtral-8x7B w13 prefill t2048 g8",
         "real GLM-4.5 w13 prefill t8192 g160")


def gemm_first_graph(pool, bufs, family, bucket, wq, w_scale):
    side = torch.cuda.Stream()

    def body():
        main = torch.cuda.current_stream()
        gather, _ = bufs.order(bucket)
        side.wait_stream(main)
        pool.run_gemm(bufs.xg[:bucket], bufs.xsg[:bucket], bufs.m_sizes, bufs.out(bucket),
                      addresses=bufs.addresses, wq=wq, w_scale=w_scale, inputs=bufs.inputs,
                      out_rows=gather)
        with torch.cuda.stream(side):
            pool.check_and_gather(bufs.x[:bucket], bufs.x_scale[:bucket], gather, bufs.xg[:bucket],
                                  bufs.xsg[:bucket], bufs.flags(bucket), regroup=bufs.regroup)
        main.wait_stream(side)

    return capture(body)


def main() -> None:
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = [c for c in bk.seed_cases() + bk.real_cases() if c["name"] in CASES]
    gen = torch.Generator(device=bk.DEV)
    gen.manual_seed(1)
    rows = []
    for case in cases:
        wq, w_scale = bk.random_weights(case["g"], case["n"], case["k"], gen)
        _x, xq, x_scale = bk.random_activations(case["m"], case["k"], gen)
        problem = (xq, wq, x_scale, w_scale, case["sizes"].to(bk.DEV))
        bucket = bk.bucket_of(case["m"])
        pool, bufs, graph = bk.service_graph(problem, bucket)
        family = next(iter(pool._buffers))
        shipped = bk.time_replays_us(graph)
        first = gemm_first_graph(pool, bufs, family, bucket, wq, w_scale)
        out = bufs.out(bucket)[: case["m"]].clone()
        first.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(bufs.out(bucket)[: case["m"]], out))
        gemm_first = bk.time_replays_us(first)
        public_out = torch.empty((case["m"], case["n"]), dtype=torch.bfloat16, device=bk.DEV)
        public = bk.time_us(lambda problem=problem, out=public_out: tk.run(*problem, out))
        row = {"name": case["name"], "config": tk.default_config(bucket, case["n"], case["k"], case["g"]).key(),
               "shipped_serial_us": round(shipped, 1), "gemm_first_beside_us": round(gemm_first, 1),
               "public_us": round(public, 1), "same_bits": same}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
