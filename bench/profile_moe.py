"""Where a moe graph's time goes, step by step, on the H200 (issue 17's kernel ratio).

For each model and token count of ``bench_moe.py``: the whole moe graph, the two-GEMM
graph it is measured against, and each step of the moe body (``FfnGraphs._moe_body``:
route with gather+quantize, GEMM w13, SiLU*up+fp8, GEMM w2, combine) captured in a graph
of its own, each timed as ``bench_moe`` times (L2 flushed before every replay,
median). The steps' sum against the whole graph shows the cost of the graph's
dependent nodes beyond their kernels.

    python bench/profile_moe.py --out bench/results/moe_steps.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import MODELS, TOKENS, TOP_K, _call, capture, expert_set, replay_median_us, routing

_AROUND = ("_route_kernel", "_gather_quant_kernel", "_silu_mul_quant_kernel", "_combine_kernel")


def kernel_sums_us(graph, flush, reps) -> tuple[float, float, dict]:
    """(all the graph's kernels, its GEMM kernels alone): summed device times per replay
    (the profiler's kernel records, L2 flushed before each replay, the flush not counted),
    median over ``reps`` replays. The issue's measure: "the graph's kernels, summed"."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    totals, gemms, named = [], [], {}
    for _ in range(reps):
        flush.zero_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        total = gemm = 0.0
        for evt in prof.events():
            if evt.device_type != torch.autograd.DeviceType.CUDA or "FillFunctor" in evt.name:
                continue
            t = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            total += t
            if not any(name in evt.name for name in _AROUND):
                gemm += t
            named.setdefault(evt.name[:60], []).append(t)
        totals.append(total)
        gemms.append(gemm)
    per_kernel = {name: round(sorted(ts)[len(ts) // 2], 1) for name, ts in named.items()}
    return sorted(totals)[reps // 2], sorted(gemms)[reps // 2], per_kernel


def steps(executor, es, T, gen, flush, reps) -> dict:
    from moegemm.server._ffn_graphs import FfnFamily

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

    def route():  # the moe body's first step: routing, the gather and quantization
        return graphs._route_gather(bufs, es, T)

    xq, xs = route()
    h = torch.empty((rows, 2 * es.I), dtype=graphs.h_dtype, device="cuda")
    y = torch.empty((rows, es.H), dtype=torch.bfloat16, device="cuda")
    graphs._gemm(xq, xs, bufs.table13(), es.w13, bufs.m_sizes(), h)
    aq, a_s = graphs._act(h, bufs.live_dev)
    parts = {
        "route_quant": route,
        "gemm13": lambda: graphs._gemm(xq, xs, bufs.table13(), es.w13, bufs.m_sizes(), h),
        "act": lambda: graphs._act(h, bufs.live_dev),
        "gemm2": lambda: graphs._gemm(aq, a_s, bufs.table2(), es.w2, bufs.m_sizes(), y),
        "combine": lambda: graphs._combine(y, bufs.pos, bufs.weights, bufs.tokens_word(), k,
                                           bufs.out(T)),
    }
    row = {"tokens": T, "moe_us": round(replay_median_us(whole, flush, reps), 1)}
    for name, fn in parts.items():
        row[f"{name}_us"] = round(replay_median_us(capture(fn), flush, reps), 1)
    row["steps_sum_us"] = round(sum(row[f"{n}_us"] for n in parts), 1)
    try:
        total, gemm, per_kernel = kernel_sums_us(whole, flush, min(reps, 10))
        row["kernels_sum_us"], row["gemm_kernels_us"] = round(total, 1), round(gemm, 1)
        row["per_kernel_us"] = per_kernel
        row["kernels_over_gemm_kernels"] = round(total / gemm, 3) if gemm else None
    except Exception as exc:  # noqa: BLE001  the profiler is a measurement aid, never fatal
        row["kernels_sum_error"] = repr(exc)[:300]
    row["gemms_us"] = round(row["gemm13_us"] + row["gemm2_us"], 1)
    row["moe_over_gemms"] = round(row["moe_us"] / row["gemms_us"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    from moegemm.kernels import get_backend
    from moegemm.server._ffn_executor import ExpertExecutor
    from moegemm.server._ffn_graphs import FfnGraphs
    from moegemm.server._staging import Staging

    dev = torch.device("cuda")
    backend = get_backend(dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model in args.models.split(","):
        G, H, I = MODELS[model]
        es = expert_set(G, H, I, backend.fp8_dtype, dev)
        executor = ExpertExecutor(FfnGraphs(backend, max(TOKENS) * TOP_K), Staging(dev), (TOP_K,))
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            executor.prepare(es)
        for T in TOKENS:
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
