"""What session 56's default bucket changed for a long call, kernels only: one launch over the
call's rows (the server at its defaults since then) against the 8192-row chunks the server ran
before (``Executor._run_general``: each chunk its own launch and tile, from its row count and
G; a chunk of a grouped call holds a run of consecutive groups).

    python bench/chunked_calls.py [--match a,b] [--chunk 8192]

The public ``grouped_gemm`` for each launch (the server's kernel and tile for that many rows),
timed as ``bench_kernels.time_us`` (median over CUDA-graph replays; the chunks back to back in
one graph, so the old path's eager launches and copies are not counted); bench_kernels' real
cases (their routing, fresh random data). Never collected by pytest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk


def chunked(xq, wq, xs, ws, sizes, out, chunk: int):
    """The call as chunks of ``chunk`` rows (the general path's split of a grouped call)."""
    from moegemm.kernels import grouped_gemm
    from moegemm.server._executor import chunk_sizes

    host = sizes.cpu().numpy()
    parts = [(a, min(a + chunk, xq.shape[0])) for a in range(0, xq.shape[0], chunk)]
    part_sizes = [torch.from_numpy(chunk_sizes(host, a, b).astype(np.int64)).to(xq.device) for a, b in parts]

    def run():
        for (a, b), s in zip(parts, part_sizes):
            grouped_gemm(xq[a:b], wq, xs[a:b], ws, s, out=out[a:b])
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default="DeepSeek-V3 w13 prefill t8192,Kimi-K2 w13 prefill t8192,"
                        "Qwen3-30B-A3B w2 prefill t8192")
    parser.add_argument("--chunk", type=int, default=8192)
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    for case in bk.matching_cases(args.match):
        print(one_case(case, args.chunk), flush=True)
        torch.cuda.empty_cache()


def one_case(case: dict, chunk: int) -> str:
    from moegemm.kernels import grouped_gemm
    from moegemm.kernels import triton_kernel as tk

    m, n, k, g = case["m"], case["n"], case["k"], case["g"]
    gen = torch.Generator(device=bk.DEV).manual_seed(1)
    wq, ws = bk.random_weights(g, n, k, gen)
    _x, xq, xs = bk.random_activations(m, k, gen)
    sizes = case["sizes"].to(bk.DEV)
    one_out = torch.empty((m, n), dtype=torch.bfloat16, device=bk.DEV)
    split_out = torch.empty_like(one_out)
    one = bk.time_us(lambda: grouped_gemm(xq, wq, xs, ws, sizes, out=one_out))
    split = bk.time_us(chunked(xq, wq, xs, ws, sizes, split_out, chunk))
    diff = (one_out.float() - split_out.float()).abs().max().item()
    return (f"{case['name']:44s} one launch ({tk.default_config(m, n, k, g).key()}) {one:9.1f} us; "
            f"{-(-m // chunk)} chunks ({tk.default_config(chunk, n, k, g).key()}) {split:9.1f} us: "
            f"{split / one:.2f}x; max |diff| {diff:.3g}")

if __name__ == "__main__":
    main()
