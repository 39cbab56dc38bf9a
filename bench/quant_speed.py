"""The Triton quantizers' speed on a GPU: against an earlier commit's, or by chunk size.

    git show <rev>:kernels/_triton_act.py > kernels/_triton_act_base.py   # never commit it
    python bench/quant_speed.py [--json OUT]
    python bench/quant_speed.py --chunks [--json OUT]

``gather_quantize_triton`` (bf16 rows, the server's quantization of a call's x) and
``silu_mul_quant_triton`` (the FFN's activation and its quantization) of this checkout against
the same kernels from ``kernels/_triton_act_base.py`` (session 26: the exact-quotient rounding
against 9635f7b~1; session 38: the rounding of the real quotient against 66d90b0), each a
CUDA-graph replay median (``bench_kernels.time_us``) on fresh random data, alternated over four
rounds with the order reversed every other round (the median round reported); GB/s of bytes
read and written, and how many codes differ.

``--chunks``: how many 128-wide blocks a row-quantizing program should take at once
(``_triton_act.row_chunk``). ``_gather_quant_kernel`` (one program a row, looping over it
``BLOCKS`` blocks at a time) over rows from a decode call's to a prefill's at K 7168 and 2048,
and ``_quantize_scatter_kernel`` (the moe path's: a token quantized once, stored at its top-8
rows) at DeepSeek-V3's H 7168, each launched directly with each ``(BLOCKS, num_warps)``: 8 or 16
blocks with 4 warps, the whole row with 8. The same medians, alternated over four rounds.

Never collected by pytest.
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--chunks", action="store_true", help="time row_chunk's choices")
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows_out = chunk_sizes(dev) if args.chunks else against_base(dev)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows_out}, indent=1))


def against_base(dev: torch.device) -> list[dict]:
    from moegemm.kernels import _triton_act as new
    from moegemm.kernels import _triton_act_base as old

    fp8 = torch.float8_e4m3fn
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
    return rows_out


def chunk_sizes(dev: torch.device) -> list[dict]:
    import triton
    from moegemm.kernels import _triton_act as ta
    from moegemm.kernels import _triton_route as tr

    fp8 = torch.float8_e4m3fn
    formats = dict(zip(("BIAS", "MIN_NORMAL", "SUB_SCALE"), ta._FORMAT[False], strict=True))
    gen = torch.Generator(device=dev).manual_seed(39)
    rows_out = []

    def timed(row: dict, k: int, launch) -> None:
        """``launch(blocks, warps)`` timed with each choice; ``row`` with the medians."""
        choices = ((8, 4), (16, 4), (triton.next_power_of_2(k // 128), 8))
        times = bk.alternating_runs({f"b{b}w{w}": (lambda b=b, w=w: launch(b, w)) for b, w in choices},
                                    rounds=4)
        row["us"] = {n: round(sorted(t)[len(t) // 2], 2) for n, t in times.items()}
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    def codes(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(rows, k, dtype=fp8, device=dev).view(torch.uint8),
                torch.empty(rows, k // 128, device=dev))

    for k in (7168, 2048):
        for rows in (1, 8, 32, 128, 256, 512, 2048, 16384):
            x = (torch.randn(rows, k, device=dev, generator=gen) * 3).to(torch.bfloat16)
            gather = torch.arange(rows, device=dev)
            flags = torch.zeros(rows, dtype=torch.int8, device=dev)
            out = codes(rows, k)
            timed({"kernel": "gather_quantize", "k": k, "rows": rows}, k,
                  lambda b, w, x=x, gather=gather, flags=flags, out=out, rows=rows, k=k:
                  ta._gather_quant_kernel[(rows,)](x, gather, 1, *out, flags, 448.0, K=k, BLOCKS=b,
                                                   FNUZ=False, **formats, num_warps=w,
                                                   enable_fp_fusion=False))
    k, top = 7168, 8
    for tokens in (1, 16, 32, 128, 512, 2048, 8192):
        x = (torch.randn(tokens, k, device=dev, generator=gen) * 3).to(torch.bfloat16)
        pos = torch.randperm(tokens * top, device=dev, generator=gen)
        flags = torch.zeros(tokens, dtype=torch.int8, device=dev)
        out = codes(tokens * top, k)
        timed({"kernel": "quantize_scatter", "k": k, "tokens": tokens, "top_k": top}, k,
              lambda b, w, x=x, pos=pos, flags=flags, out=out, tokens=tokens:
              tr._quantize_scatter_kernel[(tokens,)](x, pos, out[0], out[1], flags, 448.0, K=top, H=k,
                                                     BLOCKS=b, FNUZ=False, **formats, num_warps=w,
                                                     enable_fp_fusion=False))
    return rows_out


if __name__ == "__main__":
    main()
