"""How many 128-wide blocks a row-quantizing program should take at once, on a GPU.

    python bench/row_chunk_sweep.py [--json OUT]

``_gather_quant_kernel`` (``gather_quantize_triton``'s program, one per row, looping over its
row ``BLOCKS`` blocks at a time) launched directly with each ``(BLOCKS, num_warps)``, over rows
from a decode call's to a prefill's, and ``_quantize_scatter_kernel`` (the moe path's: a token
quantized once, stored at its top-8 rows) at DeepSeek-V3's H 7168; CUDA-graph replay medians
(``bench_kernels.time_us``) on fresh random data, alternated over four rounds. Never collected
by pytest.
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
    from moegemm.kernels import _triton_act as ta
    from moegemm.kernels import _triton_route as tr

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dev, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    bias, min_normal, sub_scale = ta._FORMAT[False]
    gen = torch.Generator(device=dev).manual_seed(39)
    found = []
    for k in (7168, 2048):
        whole = 1 << (k // 128 - 1).bit_length()
        variants = {f"b{b}w{w}": (b, w) for b, w in ((8, 4), (16, 4), (whole, 8))}
        for rows in (1, 8, 32, 128, 256, 512, 2048, 16384):
            x = (torch.randn(rows, k, device=dev, generator=gen) * 3).to(torch.bfloat16)
            gather = torch.arange(rows, device=dev)
            flags = torch.zeros(rows, dtype=torch.int8, device=dev)
            out = (torch.empty(rows, k, dtype=fp8, device=dev), torch.empty(rows, k // 128, device=dev))

            def launch(b, w, out=out, x=x, gather=gather, flags=flags, rows=rows, k=k):
                ta._gather_quant_kernel[(rows,)](
                    x, gather, 1, out[0].view(torch.uint8), out[1], flags, 448.0, K=k, BLOCKS=b,
                    FNUZ=False, BIAS=bias, MIN_NORMAL=min_normal, SUB_SCALE=sub_scale,
                    num_warps=w, enable_fp_fusion=False)

            times = bk.alternating_runs({n: (lambda b=b, w=w: launch(b, w)) for n, (b, w) in variants.items()},
                                        rounds=4)
            row = {"kernel": "gather_quantize", "k": k, "rows": rows,
                   "us": {n: round(sorted(t)[len(t) // 2], 2) for n, t in times.items()}}
            found.append(row)
            print(json.dumps(row), flush=True)
    # quantize_scatter: each of ``tokens`` bf16 tokens quantized once, stored at its 8 rows
    for tokens in (1, 16, 32, 128, 512, 2048, 8192):
        k, top = 7168, 8
        whole = 1 << (k // 128 - 1).bit_length()
        variants = {f"b{b}w{w}": (b, w) for b, w in ((8, 4), (16, 4), (whole, 8))}
        x = (torch.randn(tokens, k, device=dev, generator=gen) * 3).to(torch.bfloat16)
        pos = torch.randperm(tokens * top, device=dev, generator=gen)
        flags = torch.zeros(tokens, dtype=torch.int8, device=dev)
        out = (torch.empty(tokens * top, k, dtype=fp8, device=dev),
               torch.empty(tokens * top, k // 128, device=dev))

        def scatter(b, w, out=out, x=x, pos=pos, flags=flags, tokens=tokens, k=k, top=top):
            tr._quantize_scatter_kernel[(tokens,)](
                x, pos, out[0].view(torch.uint8), out[1], flags, 448.0, K=top, H=k, BLOCKS=b,
                FNUZ=False, BIAS=bias, MIN_NORMAL=min_normal, SUB_SCALE=sub_scale,
                num_warps=w, enable_fp_fusion=False)

        times = bk.alternating_runs({n: (lambda b=b, w=w: scatter(b, w)) for n, (b, w) in variants.items()},
                                    rounds=4)
        row = {"kernel": "quantize_scatter", "k": k, "tokens": tokens, "top_k": top,
               "us": {n: round(sorted(t)[len(t) // 2], 2) for n, t in times.items()}}
        found.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": found}, indent=1))


if __name__ == "__main__":
    main()
