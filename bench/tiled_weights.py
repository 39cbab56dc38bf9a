"""Does the decode GEMM's bytes-bound class lose to its weight layout? The table's decode tile on
plain ``[G, N, K]`` weights against the same kernel reading ``[G, N/128, K/128, 128, 128]`` (each
128 x 128 block contiguous, 16 KB), on the same data; the same bits asserted.

    patch -p1 < bench/prepared/tiled_weights.patch   # the kernels' W_TILED (an experiment only)
    python bench/tiled_weights.py [--json OUT.json] [--match a,b]

Why: ``read_ceiling.py``'s second table (session 15) read 84 MB at 320 programs in 28.9 us as
contiguous stretches and in 44.6 us as a decode tile's pieces (128 rows of 128 bytes, K bytes
apart); the public decode launch of seed m32 n1280 k8192 takes 28.6 us for those bytes against
a 19.7 us floor. Public launches timed as ``bench_kernels.time_us`` (a graph of back-to-back
launches, median over replays), plain and tiled alternating, two rounds. Never collected by
pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk

CASES = ("seed m32 n1280 ,seed m128 n1280 ,seed m1 ,seed m128 n8192 k1024,seed m32 n8192 k3584,"
         "seed m32 n7168 ,Llama-4-Maverick w13 decode t1 ,Llama-4-Maverick w2 decode t1 ,"
         "Mixtral-8x7B w2 decode t1 ,Mixtral-8x22B w2 decode t1 ,GLM-4.5 w2 decode t1 ,"
         "DeepSeek-V3 w2 decode t1 ,Qwen3-30B-A3B w2 decode t16 ")


def tiled(wq: torch.Tensor) -> torch.Tensor:
    g, n, k = wq.shape
    return wq.view(g, n // 128, 128, k // 128, 128).permute(0, 1, 3, 2, 4).contiguous()


def main() -> None:
    from moegemm.kernels import triton_kernel as tk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--match", default=CASES)
    args = parser.parse_args()
    cases = bk.matching_cases(args.match)
    gen = torch.Generator(device=bk.DEV).manual_seed(15)
    rows = []
    for case in cases:
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        table = tk.default_config(m, n, k, g)
        if not table.swap_ab:
            continue
        ops = bk.case_operands(case, gen)
        wt = tiled(ops["wq"])
        configs = [table] + ([replace(table, split_k=3)] if table.split_k > 1 else [])
        for config in configs:
            outs, fns = {}, {}
            for layout, w in (("plain", ops["wq"]), ("tiled", wt)):
                outs[layout] = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
                kernel, grid, largs, consts = bk.form_plan("public", ops, outs[layout], config)
                plan = (kernel, grid, (largs[0], w) + tuple(largs[2:]), consts)
                fns[layout] = bk.bound_launch(plan, W_TILED=layout == "tiled")
            same = bool(torch.equal(outs["plain"].view(torch.int16), outs["tiled"].view(torch.int16)))
            times = bk.alternating_runs(fns)
            row = {"name": case["name"], "config": config.key(), "floor_us": bk.floor_us(m, n, k, case["sizes"]),
                   "plain_us": statistics.median(times["plain"]), "tiled_us": statistics.median(times["tiled"]),
                   "runs": times, "same_bits": same}
            row["plain_over_tiled"] = row["plain_us"] / row["tiled_us"]
            rows.append(row)
            print(f"{case['name'][:44]:44s} {config.key():38s} floor {row['floor_us']:7.1f}  plain "
                  f"{row['plain_us']:7.1f}  tiled {row['tiled_us']:7.1f}  {row['plain_over_tiled']:.2f}x  "
                  f"bits {'=' if same else 'DIFFER'}", flush=True)
        del ops, wt
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
