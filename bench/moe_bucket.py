"""What session 56's default bucket changed for an expert set: a long moe call, the load, and
the device memory, at the default largest bucket (65536 rows) against the old one (8192).

    python -P bench/moe_bucket.py [--models deepseek-v3,qwen3-30b-a3b] [--tokens 2048,8192]

Per bucket, the server's expert executor as the engine builds it (``FfnGraphs`` with the
engine's captured top-ks, the engine's staging), its set's graphs captured by
``ExpertExecutor.prepare`` on a side stream as the loader does (timed: the load's captures,
Triton's compiles included on the first bucket of a fresh process); the device memory the
allocator holds beside the weights after it and at its peak, against what a load's room check
counts for the shape (``FfnGraphs.shape_bytes``); then moe calls at top-8 through
``ExpertExecutor.run_calls`` (what a batch of one call runs: the upload, one graph replay, or
at the old bucket the eager token chunks, and the download), wall-clock medians of fresh
random inputs with uniform random routing. Each model and bucket runs in a process of its own.
Never collected by pytest.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import MODELS, TOP_K, _call, expert_set, routing


def one_bucket(model: str, bucket: int, tokens: list[int], reps: int) -> None:
    from moegemm.kernels import get_backend
    from moegemm.server._ffn_executor import ExpertExecutor
    from moegemm.server._ffn_graphs import FfnGraphs
    from moegemm.server._staging import Staging
    from moegemm.server.engine import MOE_TOP_K

    dev = torch.device("cuda")
    backend = get_backend(dev)
    G, H, I = MODELS[model]
    torch.cuda.empty_cache()
    es = expert_set(G, H, I, backend.fp8_dtype, dev)
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    gc.collect()
    torch.cuda.empty_cache()  # the set's making leaves blocks cached: not the load's
    torch.cuda.reset_peak_memory_stats()
    executor = ExpertExecutor(FfnGraphs(backend, bucket), Staging(dev), MOE_TOP_K)
    estimate = executor.graphs.shape_bytes(es, MOE_TOP_K)  # what a load's room check counts
    held = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    with torch.cuda.stream(torch.cuda.Stream(dev)):
        captured = executor.prepare(es)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_reserved() - held
    gc.collect()
    torch.cuda.empty_cache()
    gib = 1 << 30
    print(f"{model} bucket {bucket}: {captured} graphs in {load_s:.1f} s; weights "
          f"{weights / gib:.2f} GiB; beside them: allocated "
          f"{(torch.cuda.memory_allocated() - weights) / gib:.2f} GiB, held after the load "
          f"{(torch.cuda.memory_reserved() - held) / gib:.2f} GiB, at its peak {peak / gib:.2f} GiB, "
          f"the room check's estimate {estimate / gib:.2f} GiB", flush=True)
    gen = torch.Generator().manual_seed(0)
    executor.staging.enter()
    for T in tokens:
        times = []
        for _ in range(reps + 1):
            ids, w = routing(T, G, TOP_K, gen)
            x = torch.randn((T, H), generator=gen).to(torch.bfloat16)
            call = _call("moe", es, {"x": x, "topk_ids": ids, "topk_weights": w})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out, launches = executor.run_calls(es, [call])
            times.append(time.perf_counter() - t0)
        assert not isinstance(out[0], Exception), out[0]
        print(f"  {model} bucket {bucket} moe t{T} top-{TOP_K}: {statistics.median(times[1:]) * 1e3:8.2f} ms"
              f" (graph launches {launches.graph}, eager {launches.eager}; {reps} calls)",
              flush=True)
    del es, executor
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deepseek-v3,qwen3-30b-a3b")
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--buckets", default="65536,8192")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--one", action="store_true", help="one model and bucket, in this process")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.one:
        one_bucket(args.models, int(args.buckets), tokens, args.reps)
        return
    print(torch.cuda.get_device_name(), flush=True)
    for model in args.models.split(","):
        for bucket in args.buckets.split(","):
            # Each in a process of its own: nothing of the one before stays on the device (its
            # graphs' pool); Triton's disk cache makes the later ones' compiles hits.
            subprocess.run([sys.executable, "-P", __file__, "--one", "--models", model, "--buckets",
                            bucket, "--tokens", args.tokens, "--reps", str(args.reps)], check=True)


if __name__ == "__main__":
    main()
