"""The Triton quantizers of this checkout against an earlier commit's, on a GPU.

    git show <rev>:kernels/_triton_act.py > kernels/_triton_act_base.py   # never commit it
    python bench/quant_speed.py [--json OUT]

``gather_quantize_triton`` (bf16 rows, the server's quantization of a call's x) and
``silu_mul_quant_triton`` (the FFN's activation and its quantization) of this checkout against
the same kernels from ``kernels/_triton_act_base.py`` (session 26: the exact-quotient rounding
against 9635f7b~1; session 38: the rounding of the real quotient against 66d90b0), each a
CUDA-graph replay median (``bench_kernels.time_us``) on fresh random data, alternated over four
rounds with the order reversed every other round (the median round reported); GB/s of bytes
read and written, and how many codes differ. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk


def main() -> None:
    from moegemm.kernels import _triton_act as new
    from moegemm.kernels import _triton_act_base as old

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dev, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    gen = torch.Generator(device=dev).manual_seed(26)
    rows_out = []
    for kind, rows, k in [("gather", 8, 7168), ("gather", 2048, 7168), ("gather", 65536, 7168),
                          ("gather", 65536, 2048), ("silu", 2048, 2048), ("silu", 65536, 2048),
                          ("silu", 65536, 768)]:
        if kind == "gather":
            x = (torch.randn(rows, k, device=dev, generator=gen) * 3).to(torch.bfloat16)
            gather = torch.arange(rows, device=dev)
            flags = torch.zeros(rows, dtype=torch.int8, device=dev)
            outs = {m: (torch.empty(rows, k, dtype=fp8, device=dev),
                        torch.empty(rows, k // 128, device=dev)) for m in ("new", "old")}
            fns = {name: (lambda m=m, o=outs[name]: m.gather_quantize_triton(x, gather, flags, o))
                   for name, m in (("new", new), ("old", old))}
            moved = rows * k * 2 + rows * k + rows * k // 128 * 4
        else:
            x = torch.randn(rows, 2 * k, device=dev, generator=gen) * 3
            outs = {m: (torch.empty(rows, k, dtype=fp8, device=dev),
                        torch.empty(rows, k // 128, device=dev)) for m in ("new", "old")}
            fns = {name: (lambda m=m, o=outs[name]: m.silu_mul_quant_triton(x, fp8, out=o))
                   for name, m in (("new", new), ("old", old))}
            moved = rows * 2 * k * 4 + rows * k + rows * k // 128 * 4
        times = bk.alternating_runs(fns, rounds=4)
        torch.cuda.synchronize()
        differ = int((outs["new"][0].view(torch.uint8) != outs["old"][0].view(torch.uint8)).sum())
        med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        row = {"kind": kind, "rows": rows, "k": k, "us": med, "new_over_old": med["new"] / med["old"],
               "GBps_new": moved / med["new"] / 1e3, "codes_differ": differ, "codes": rows * k}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
