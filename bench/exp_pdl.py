"""Experiment (not what ships): a lone prefill call's graph, the check kernel and the persistent
GEMM, with programmatic dependent launch (PDL) between them, against the shipped serial order.

A lone fp8 call's graph on a persistent tile is two nodes: the rows' check (``check_and_gather``
with the regroup word at 0: it reads the scales and writes the flags) and then the GEMM, which
reads nothing the check writes. v31 shows the graph 2-5 us over the GEMM alone on mid-size
prefill (seed m1024 n7168 k2304 55.1 against 50.8 us; Qwen3-30B w2 t2048 98.4 / 93.7). Forms,
each a one-call graph replayed back to back (``bench_kernels.time_replays_us``, as the bench
times the service), rounds alternated and reversed:

- ``serial``: check, GEMM (what ships);
- ``pdl_gemm``: check, GEMM launched with ``launch_pdl`` (it may start before the check ends);
- ``pdl_gemm_trig``: the same with a check that triggers its dependents first
  (``gdc_launch_dependents``);
- ``pdl_check``: GEMM, then the check launched with ``launch_pdl`` (its programs may start as the
  GEMM's programs leave);
- ``after``: GEMM, then the check, plain;
- ``gemm``: the GEMM alone (the service form's kernel, no check);
- ``inside``: the GEMM with the rows' check inside (``FLAGS``, session 31: what ships since).
- ``branch``: the check on a stream forked beside the GEMM and joined after it (two parallel
  nodes in the graph; for ``persistent_ws``, which keeps its check kernel).

Same output bits and flags asserted for every form (a NaN row scale planted, so a flag is set).

    python bench/exp_pdl.py [--match ...] [--rounds 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from moegemm.kernels._triton_gemm import scale_flags

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk
from bench_moe import capture

CASES = ("seed m1024 ,seed m16384 n7168,Qwen3-30B-A3B w2 prefill,Qwen3-30B-A3B w13 prefill t2048,"
         "Qwen3-235B-A22B w2 prefill t2048,GLM-4.5 w13 prefill t8192,DeepSeek-V3 w2 prefill t2048,"
         "Mixtral-8x7B w2 prefill t2048,Llama-4-Maverick w13 prefill t2048,Mixtral-8x22B w13 prefill t8192")


@triton.jit
def _scale_check_first_trigger(xs_ptr, flags_ptr, rows, KB: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_S: tl.constexpr):
    """The lone call's check (scales only: regroup 0, fp8 rows), its dependents triggered first."""
    tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = row < rows
    offs = tl.arange(0, BLOCK_S)
    inside = live[:, None] & (offs < KB)[None, :]
    scale = tl.load(xs_ptr + row[:, None] * KB + offs[None, :], mask=inside, other=1.0)
    tl.store(flags_ptr + row, scale_flags(scale).to(tl.int8), mask=live)


def main() -> None:
    from moegemm.kernels import _triton_prologue as pro
    from moegemm.kernels import triton_kernel as tk
    from moegemm.kernels._backend import weight_addresses
    from moegemm.server._checks import bad_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default=CASES)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--forms", default="serial,pdl_gemm,pdl_gemm_trig,pdl_check,after,gemm,inside,branch")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    triton.set_allocator(tk._tma_scratch)
    gen = torch.Generator(device=bk.DEV)
    gen.manual_seed(7)
    rows_out, ratios = [], {}
    for case in bk.matching_cases(args.match):
        m, n, k, g = case["m"], case["n"], case["k"], case["g"]
        config = tk.default_config(bk.bucket_of(m), n, k, g)
        if config.swap_ab:
            continue
        ops = bk.case_operands(case, gen)
        ops["x_scale"][m // 2, 0] = float("nan")  # one flagged row
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=bk.DEV)
        kernel, grid, gargs, consts = bk.form_plan("svc", ops, out, config)
        xq, xs = ops["xq"], ops["x_scale"]
        gather = torch.arange(m, dtype=torch.int64, device=bk.DEV)
        regroup = torch.zeros(1, dtype=torch.int64, device=bk.DEV)
        spare_x, spare_s = torch.empty_like(xq[:1]), torch.empty_like(xs[:1])
        flags = torch.full((m,), 7, dtype=torch.int8, device=bk.DEV)
        kb = xs.shape[1]
        br, bkk, bs = pro.block_sizes(m, k, kb)

        def gemm(pdl=False):
            kernel[grid](*gargs, **consts, launch_pdl=pdl)

        planned = {}

        def inside():
            # Planned at the first call (capture's warm-up, outside the capture: the plan copies
            # words to the device), only when the form is asked for: every tile but persistent_ws
            # takes flags (TileConfig.checks_rows).
            if not planned:
                words = torch.tensor([xq.data_ptr(), xs.data_ptr()], dtype=torch.int64, device=bk.DEV)
                table = torch.tensor(weight_addresses(ops["wq"], ops["w_scale"]), device=bk.DEV)
                planned["plan"] = tk.launch_plan(xq, table, xs, ops["w_scale"], ops["sizes"], out, n, g, config,
                                                 addrs=True, x_words=words, flags=flags)
            ikernel, igrid, iargs, iconsts = planned["plan"]
            ikernel[igrid](*iargs, **iconsts)

        def check(pdl=False):
            pro._check_gather[(triton.cdiv(m, br),)](
                xq.view(torch.uint8), xs, gather, spare_x.view(torch.uint8), spare_s, flags, regroup, 1, m,
                K=k, KB=kb, FLOAT16=False, EXPONENT=0, HAS_SCALE=True, BLOCK_R=br, BLOCK_K=bkk, BLOCK_S=bs,
                HAS_REGROUP=True, num_warps=4, launch_pdl=pdl)

        def check_trig():
            _scale_check_first_trigger[(triton.cdiv(m, br),)](xs, flags, m, KB=kb, BLOCK_R=br, BLOCK_S=bs,
                                                              num_warps=4)

        side = torch.cuda.Stream()

        def branch():
            # The GEMM reads nothing the check writes: fork the check, join it after the GEMM.
            here = torch.cuda.current_stream()
            side.wait_stream(here)
            with torch.cuda.stream(side):
                check()
            gemm()
            here.wait_stream(side)

        bodies = {"serial": lambda: (check(), gemm()), "pdl_gemm": lambda: (check(), gemm(True)),
                  "pdl_gemm_trig": lambda: (check_trig(), gemm(True)),
                  "pdl_check": lambda: (gemm(), check(True)), "after": lambda: (gemm(), check()),
                  "gemm": lambda: gemm(), "inside": inside, "branch": branch}
        bodies = {name: body for name, body in bodies.items() if name in args.forms.split(",")}
        want_flags = bad_rows(xq, xs)
        row = {"name": case["name"], "config": config.key(), "errors": {}, "us": {}}
        graphs, want = {}, None
        for name, body in bodies.items():
            try:
                graph = capture(body)
                out.fill_(float("nan"))
                flags.fill_(7)
                graph.replay()
                torch.cuda.synchronize()
                if want is None:
                    want = out.clone()
                elif not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                    raise AssertionError("output bits differ from the serial form's")
                if name != "gemm" and not torch.equal(flags, want_flags):
                    raise AssertionError("flags differ from bad_rows")
                graphs[name] = graph
            except Exception as exc:  # record and go on: one form's failure is a result
                row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        order = list(graphs)
        runs = {name: [] for name in order}
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                runs[name].append(bk.time_replays_us(graphs[name]))
        row["us"] = {name: round(statistics.median(v), 2) for name, v in runs.items()}
        base = row["us"].get("serial")
        for name, us in row["us"].items():
            if base and name != "serial":
                ratios.setdefault(name, []).append(base / us)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        del graphs, ops, out
        torch.cuda.empty_cache()
    for name, rs in ratios.items():
        print(f"geomean serial/{name}: {bk.ratio_summary(rs)}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows_out, "geomean": {
            name: statistics.geometric_mean(rs) for name, rs in ratios.items()}}, indent=1))


if __name__ == "__main__":
    main()
