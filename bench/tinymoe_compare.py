"""The one-token moe kernels against another version of them on the H200: time and bits.

For Qwen3-30B-A3B and DeepSeek-V3 (top-8, one token, bf16): this checkout's
``kernels/_triton_moe_token.py`` and the one at ``--base`` (the shipped file, e.g. the device
run's root checkout when this one is a carried copy), each ``moe_token`` captured in a
graph and profiled as ``profile_moe.py`` profiles (L2 flushed before each replay, kernel
times from the profiler, medians). Beside this checkout's own stages rule, its kernels
with ``pipeline_stages`` forced to each of ``--stages`` (the same arithmetic: only the
copies in flight change). Every variant must answer the base's bits (``h``, the output,
both flags) on the timed bf16 token, and this checkout's kernels the base's on an fp8
token too (SPEC 5.1 rests on them both being the grouped path's bits).

    python bench/tinymoe_compare.py --base ../../kernels/_triton_moe_token.py --out compare.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import MODELS, TOP_K, capture
from profile_moe import kernel_sum_us
from tinymoe_tiles import token_case


def load_base(path: str):
    """The module at ``path`` as a sibling of this checkout's ``moegemm.kernels._triton_moe_token``
    (its relative imports resolve to this checkout's package)."""
    spec = importlib.util.spec_from_file_location("moegemm.kernels._triton_moe_token_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(module, token, scale, case: dict, capture_it: bool):
    """``module.moe_token`` on ``case``'s buffers and a fresh ``h``, output and flags (captured
    in a graph and replayed once when ``capture_it``): (the graph or None, (h, out, flags))."""
    G, H, I, bufs, dev = case["G"], case["H"], case["I"], case["bufs"], case["dev"]
    h = torch.empty((TOP_K, 2 * I), device=dev)
    out = torch.empty((1, H), dtype=torch.bfloat16, device=dev)
    flags = torch.full((2,), 9, dtype=torch.int8, device=dev)
    launch = (token, scale, bufs["ids"], bufs["wide"], bufs["w"], bufs["tokens"], bufs["t13"],
              bufs["t2"], G, I, h, bufs["parts"], bufs["counts"], out, flags[:1], flags[1:])
    graph = None
    if capture_it:
        graph = capture(lambda: module.moe_token(*launch))
        graph.replay()
    else:
        module.moe_token(*launch)
    torch.cuda.synchronize()
    return graph, (h, out, flags)


def _bits(got) -> list[torch.Tensor]:
    h, out, flags = got
    return [h.view(torch.int32), out.view(torch.int16), flags]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the _moe_token.py to compare against")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--stages", default="3,5", help="pipeline_stages forced, beside the rule's")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    from moegemm.kernels import _triton_moe_token as mine
    from moegemm.kernels import get_backend, quantize_activations

    base = load_base(args.base)
    dev = torch.device("cuda")
    backend = get_backend(dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gen = torch.Generator().manual_seed(0)
    rule = mine.pipeline_stages
    rows = []
    for model in args.models.split(","):
        G, H, I, es, x, bufs = token_case(model, backend, dev, gen)
        xq, xs = quantize_activations(x.float(), backend.fp8_dtype)
        case = {"G": G, "H": H, "I": I, "bufs": bufs, "dev": dev}

        want = None
        variants = [("base", base, None), ("this", mine, None)]
        variants += [(f"this_stages{s}", mine, int(s)) for s in args.stages.split(",")]
        for name, module, stages in variants:
            mine.pipeline_stages = rule if stages is None else (lambda *a, s=stages: s)
            graph, got = _run(module, x, None, case, True)
            if want is None:
                want = [t.clone() for t in _bits(got)]
            _, per_kernel = kernel_sum_us(graph, flush, args.reps)
            row = {"model": model, "variant": name,
                   "stages": [rule(*a) for a in _stage_args(mine, G, H, I)] if stages is None
                   and module is mine else stages,
                   "up_us": per_kernel.get("_up_kernel"), "down_us": per_kernel.get("_down_kernel"),
                   "same_bits": all(torch.equal(a, b) for a, b in zip(_bits(got), want)),
                   "flags": got[2].tolist()}
            row["sum_us"] = round((row["up_us"] or 0) + (row["down_us"] or 0), 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del graph
        mine.pipeline_stages = rule
        # fp8 tokens: this checkout's bits against the base's (not timed).
        _, a = _run(base, xq, xs, case, False)
        a = [t.clone() for t in _bits(a)]
        _, b = _run(mine, xq, xs, case, False)
        row = {"model": model, "variant": "this_fp8_token_bits",
               "same_bits": all(torch.equal(p, q) for p, q in zip(_bits(b), a)),
               "flags": b[2].tolist()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        del es
        torch.cuda.empty_cache()


def _stage_args(mt, G: int, H: int, I: int) -> list[tuple]:
    """``pipeline_stages``' arguments for the up and the down kernel at top-8 (as
    ``moe_token`` passes them)."""
    bm = mt._gemm_tile(TOP_K, 2 * I, H, G, None)[0]
    up_rows = mt.weight_tile(TOP_K, 2 * I)[0]
    down_rows = mt.weight_tile(TOP_K, H)[0]
    return [(TOP_K * (2 * I // up_rows) + 1, up_rows, bm, H // 128),
            (TOP_K * (H // down_rows), down_rows, mt._gemm_tile(TOP_K, H, I, G, None)[0], I // 128)]


if __name__ == "__main__":
    main()
