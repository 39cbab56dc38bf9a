"""How fast one kernel reads N bytes from HBM on this GPU, by size: the floor a bytes-bound
launch of that size could reach, beside the 4.27 TB/s the kernel bench's floor assumes.

    python bench/read_ceiling.py [--json OUT.json]

For weight sets of 10-940 MB (the decode launches' weights: one token of Qwen3-30B to
Mixtral-8x22B at 64 tokens) a Triton kernel reads a buffer of that size once, each program a
contiguous stretch in 16 KB pieces (the loads a decode tile issues are 128-byte pieces of
64-128 rows: its own figure is in bench_kernels.py), and ``torch.sum`` (cub) reads it too.
Timed as the kernel bench times: a CUDA graph of back-to-back launches, median over replays,
a fresh buffer per size (nothing of it in L2 from a previous size). Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import DEV, time_us

SIZES_MB = (10, 21, 42, 84, 117, 201, 470, 940)


@triton.jit
def _read(src, dst, n_elems, per_program, BLOCK: tl.constexpr):
    """Program p sums ``src[p * per_program : (p + 1) * per_program]`` (int32 words) into
    ``dst[p]``: every byte read once, nothing but the sum written."""
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(0, per_program, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc += tl.load(src + idx, mask=idx < n_elems, other=0, eviction_policy="evict_first")
    tl.store(dst + tl.program_id(0), tl.sum(acc, axis=0))


def triton_read(buf: torch.Tensor, programs: int, block: int = 4096):
    words = buf.view(torch.int32)
    n = words.numel()
    per = -(-n // programs)
    per = -(-per // block) * block
    out = torch.empty(programs, dtype=torch.int32, device=buf.device)
    grid = (triton.cdiv(n, per),)
    return lambda: _read[grid](words, out, n, per, BLOCK=block, num_warps=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    rows = []
    for mb in SIZES_MB:
        buf = torch.randint(0, 1 << 30, ((mb << 20) // 4,), dtype=torch.int32, device=DEV).view(torch.uint8)
        row = {"MB": mb, "floor_4_27_us": (mb << 20) / 4.27e6, "us": {}}
        for programs in (sms, 2 * sms, 4 * sms, 8 * sms):
            fn = triton_read(buf, programs)
            fn()
            row["us"][f"triton_{programs}"] = time_us(fn)
        words = buf.view(torch.int32)
        row["us"]["torch_sum"] = time_us(lambda words=words: words.sum(dtype=torch.int64))
        best = min(row["us"].values())
        row["best_TBps"] = (mb << 20) / best / 1e6
        print(f"{mb:5d} MB  floor {row['floor_4_27_us']:7.1f} us  best {best:7.1f} us ({row['best_TBps']:.2f} TB/s)  "
              + "  ".join(f"{k} {v:.1f}" for k, v in row["us"].items()), flush=True)
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(DEV), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
