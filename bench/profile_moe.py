"""Where a moe graph's time goes, step by step, on the H200 (issue 17's kernel ratio).

For each model and token count of ``bench_moe.py``: the whole moe graph and the two
grouped GEMMs it is measured against, each captured in a graph of its own and timed as
``bench_moe`` times (L2 flushed before every replay, median).

Issue 17's measure, "the graph's kernels, summed, within 1.15x of the two GEMMs' kernel
time alone": the numerator is every kernel of the moe graph (the profiler's kernel
records of one replay, L2 flushed before it, summed; median over replays); the
denominator is the two grouped GEMMs run alone, the two-call way's kernels: the
``gemm13`` and ``gemm2`` steps (``FfnGraphs._gemm`` on the routed rows of the same
tokens, the tiles the grouped body runs for that bucket), each captured in its own
graph and profiled the same way. (The denominator is no longer "the graph's GEMM
kernels": the one-token graph has none of its own, its two kernels fuse the GEMMs with
the routing, quantization, activation and combine, ``kernels/_triton_moe_token.py``.)

From two tokens the grouped body's other steps (route with gather+quantize, SiLU*up+fp8,
combine) are timed alone too, and their sum against the whole graph shows the cost of
the graph's dependent nodes beyond their kernels.

    python bench/profile_moe.py --models qwen3-30b-a3b,deepseek-v3 --tokens 1,16 \
        --out bench/results/moe_steps.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import MODELS, TOKENS, TOP_K, _call, capture, expert_set, replay_median_us, routing


def kernel_sum_us(graph, flush, reps) -> tuple[float, dict]:
    """(every kernel of ``graph``, summed device time per replay; per kernel name): the
    profiler's kernel records, L2 flushed before each replay (the flush not counted),
    medians over ``reps`` replays."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    totals, named = [], {}
    for _ in range(reps):
        flush.zero_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        total = 0.0
        for evt in prof.events():
            if evt.device_type != torch.autograd.DeviceType.CUDA or "FillFunctor" in evt.name:
                continue
            t = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            total += t
            named.setdefault(evt.name[:60], []).append(t)
        totals.append(total)
    per_kernel = {name: round(sorted(ts)[len(ts) // 2], 1) for name, ts in named.items()}
    return sorted(totals)[reps // 2], per_kernel


def steps(executor, es, T, gen, flush, reps) -> dict:
    from moegemm.server._ffn_graphs import H_DTYPE, FfnFamily

    graphs = executor.graphs
    ids, w = routing(T, es.G, TOP_K, gen)
    x = torch.randn((T, es.H), generator=gen).to(torch.bfloat16)
    executor.staging.enter()
    executor.run_calls(es, [_call("moe", es, {"x": x, "topk_ids": ids, "topk_weights": w})])
    f = FfnFamily(es.G, es.H, es.I, True, TOP_K)
    whole = graphs.graph(f, T, es)
    bufs = graphs.buffers(f)
    rows = T * TOP_K
    k = TOP_K

    def route():  # the grouped body's first step: routing, the gather and quantization
        return graphs._route_gather(bufs, es, T)

    xq, xs = route()  # (also the GEMM steps' rows and sizes, for one token too)
    h = torch.empty((rows, 2 * es.I), dtype=H_DTYPE, device="cuda")
    y = torch.empty((rows, es.H), dtype=torch.bfloat16, device="cuda")
    graphs._gemm(xq, xs, bufs.table13(), es.w13, bufs.m_sizes(), h)
    aq, a_s = graphs._act(h, bufs.live_dev)
    gemms = {
        "gemm13": lambda: graphs._gemm(xq, xs, bufs.table13(), es.w13, bufs.m_sizes(), h),
        "gemm2": lambda: graphs._gemm(aq, a_s, bufs.table2(), es.w2, bufs.m_sizes(), y),
    }
    others = {} if T == 1 else {  # one token: the graph runs none of these
        "route_quant": route,
        "act": lambda: graphs._act(h, bufs.live_dev),
        "combine": lambda: graphs._combine(y, bufs.pos, bufs.weights, bufs.tokens_word(), k,
                                           bufs.out(T)),
    }
    row = {"tokens": T, "moe_us": round(replay_median_us(whole, flush, reps), 1)}
    gemm_kernels = 0.0
    for name, fn in {**gemms, **others}.items():
        graph = capture(fn)
        row[f"{name}_us"] = round(replay_median_us(graph, flush, reps), 1)
        if name in gemms:
            try:
                alone, _ = kernel_sum_us(graph, flush, min(reps, 10))
                row[f"{name}_kernels_us"] = round(alone, 1)
                gemm_kernels += alone
            except Exception as exc:  # noqa: BLE001  the profiler is a measurement aid
                row[f"{name}_kernels_error"] = repr(exc)[:300]
    if others:
        row["steps_sum_us"] = round(sum(row[f"{n}_us"] for n in {**gemms, **others}), 1)
    try:
        total, per_kernel = kernel_sum_us(whole, flush, min(reps, 10))
        row["kernels_sum_us"], row["gemm_kernels_alone_us"] = round(total, 1), round(gemm_kernels, 1)
        row["per_kernel_us"] = per_kernel
        row["kernels_over_gemm_kernels"] = round(total / gemm_kernels, 3) if gemm_kernels else None
    except Exception as exc:  # noqa: BLE001  the profiler is a measurement aid, never fatal
        row["kernels_sum_error"] = repr(exc)[:300]
    row["gemms_us"] = round(row["gemm13_us"] + row["gemm2_us"], 1)
    row["moe_over_gemms"] = round(row["moe_us"] / row["gemms_us"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                        help="token counts, comma-separated (each a bucket of the moe graphs)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",") if t]
    from moegemm.kernels import get_backend
    from moegemm.server._ffn_executor import ExpertExecutor
    from moegemm.server._ffn_graphs import FfnFamily, FfnGraphs
    from moegemm.server._staging import Staging

    dev = torch.device("cuda")
    backend = get_backend(dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model in args.models.split(","):
        G, H, I = MODELS[model]
        es = expert_set(G, H, I, backend.fp8_dtype, dev)
        executor = ExpertExecutor(FfnGraphs(backend, max(tokens) * TOP_K), Staging(dev), (TOP_K,))
        with torch.cuda.stream(torch.cuda.Stream(dev)):  # the moe graphs only (not ffn's)
            executor.graphs._prepare_family(FfnFamily(G, H, I, True, TOP_K), es)
            torch.cuda.synchronize()
        for T in tokens:
            row = {"model": model, **steps(executor, es, T, gen, flush, args.reps)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        del es, executor
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
