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


@triton.jit
def _read_tiles(src, dst, K, per_split, SPLIT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A decode program's read: rows ``[t * 128, t * 128 + 128)`` of a row-major ``[N, K]`` byte
    matrix over its split of K, one ``ROWS x COLS`` piece (ROWS rows of COLS bytes, K bytes apart;
    16 KB) an iteration: 128 x 128 is a decode tile's block; 64 x 256 and 32 x 512 the same bytes
    a piece from fewer, wider rows."""
    pid = tl.program_id(0)
    tile = pid // SPLIT
    k_lo = tl.minimum((pid % SPLIT) * per_split, K)
    k_hi = tl.minimum(k_lo + per_split, K)
    acc = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for r0 in range(0, 128, ROWS):
        rows = (tile * 128 + r0 + tl.arange(0, ROWS)).to(tl.int64)
        for k0 in range(k_lo, k_hi, COLS):
            cols = k0 + tl.arange(0, COLS)
            acc += tl.load(src + rows[:, None] * K + cols[None, :], eviction_policy="evict_first").to(tl.int32)
    tl.store(dst + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def triton_read_tiles(buf: torch.Tensor, k: int, split: int, rows: int = 128, cols: int = 128):
    """``buf`` as ``[N, k]`` bytes: N / 128 row tiles x ``split`` programs each, pieces of
    ``rows`` rows x ``cols`` bytes."""
    n = buf.numel() // k
    out = torch.empty((n // 128) * split, dtype=torch.int32, device=buf.device)
    grid = ((n // 128) * split,)
    per_split = -(-(k // cols) // split) * cols  # whole pieces, as the GEMM's split-K ranges
    return lambda: _read_tiles[grid](buf, out, k, per_split, SPLIT=split, ROWS=rows, COLS=cols, num_warps=4)


def pattern_rows(sms: int) -> list[dict]:
    """84 MB (seed n1280 k8192's weights: 80 row tiles of 128 x 8192 bytes) read two ways at equal
    program counts: contiguous stretches (``_read``) and a decode tile's pieces (``_read_tiles``,
    the split giving the count). Whether the pieces' pattern, or the programs' spread over the SMs
    (320 = 2.4 a SM), is what the decode GEMM's bytes-bound launches lose to."""
    k, tiles = 8192, 80
    buf = torch.randint(0, 1 << 30, (tiles * 128 * k // 4,), dtype=torch.int32, device=DEV).view(torch.uint8)
    found = []
    for split in (2, 3, 4, 5, 6, 8):
        programs = tiles * split
        contiguous = triton_read(buf, programs)
        pieces = triton_read_tiles(buf, k, split)
        contiguous()
        pieces()
        # The same programs and 16 KB pieces from fewer, wider rows: 64 rows of 256 bytes, 32 of 512
        # (is it the 128-byte width, how many DRAM rows a piece opens, or the stride?).
        wide = triton_read_tiles(buf, k, split, rows=64, cols=256)
        wider = triton_read_tiles(buf, k, split, rows=32, cols=512)
        wide()
        wider()
        row = {"programs": programs, "per_sm": programs / sms, "contiguous_us": time_us(contiguous),
               "pieces_us": time_us(pieces), "pieces_256B_us": time_us(wide), "pieces_512B_us": time_us(wider)}
        print(f"84 MB  {programs:4d} programs ({row['per_sm']:.2f} a SM)  contiguous {row['contiguous_us']:6.1f} us  "
              f"decode pieces {row['pieces_us']:6.1f} us  256 B rows {row['pieces_256B_us']:6.1f}  "
              f"512 B rows {row['pieces_512B_us']:6.1f}", flush=True)
        found.append(row)
    return found


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
    pattern = pattern_rows(sms)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(DEV), "rows": rows,
                                         "pattern": pattern}, indent=1))


if __name__ == "__main__":
    main()
