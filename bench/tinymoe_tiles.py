"""The one-token moe kernels' weight tiles on the H200: time and bits per variant.

For Qwen3-30B-A3B and DeepSeek-V3 (top-8, one token, bf16): ``_moe_token.moe_token``
captured in a graph with each kernel's weight tile forced to a variant (``weight_tile``
replaced for the run: rows 64 with 4 warps, 128 with 8, 128 with 4), profiled as
``profile_moe.py`` profiles (L2 flushed before each replay, kernel times from the
profiler, medians). The shipped rule's choice is marked. Every variant must answer the
shipped variant's bits (``h`` and the output): the weight tile's height is the MMA's M
side, which must not change an element -- the assumption the bit-identity with the
grouped GEMMs (128-row tiles) rests on.

    python bench/tinymoe_tiles.py --out bench/results/tinymoe_tiles.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import MODELS, TOP_K, capture, expert_set, routing
from profile_moe import kernel_sum_us

VARIANTS = ((64, 4), (128, 8), (128, 4))


def token_buffers(es, ids, w, H: int, dev) -> dict:
    """The one-token kernels' device inputs for expert set ``es``: the routing as int64 words,
    the weights, the token count, the two address tables, the combine's parts and counters."""
    from moegemm.kernels._backend import weight_addresses
    from moegemm.kernels._triton_moe_token import counts_words

    return {"ids": ids.reshape(-1).to(torch.int64).view(torch.int32).to(dev),
            "wide": torch.tensor(1, device=dev), "w": w.reshape(-1).to(dev),
            "tokens": torch.tensor(1, device=dev),
            "t13": torch.tensor(weight_addresses(es.w13.wq, es.w13.w_scale), device=dev),
            "t2": torch.tensor(weight_addresses(es.w2.wq, es.w2.w_scale), device=dev),
            "parts": torch.zeros((TOP_K, H), device=dev),
            "counts": torch.zeros(counts_words(H), dtype=torch.int32, device=dev)}


def token_case(model: str, backend, dev, gen: torch.Generator):
    """(G, H, I, expert set, the bf16 token [1, H], its ``token_buffers``) for ``model``: the
    one-token benches' common set-up (fresh weights, top-k routing and token from ``gen``)."""
    G, H, I = MODELS[model]
    es = expert_set(G, H, I, backend.fp8_dtype, dev)
    ids, w = routing(1, G, TOP_K, gen)
    x = torch.randn((1, H), generator=gen).to(torch.bfloat16).to(dev)
    return G, H, I, es, x, token_buffers(es, ids, w, H, dev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    from moegemm.kernels import _triton_moe_token as mt
    from moegemm.kernels import get_backend

    dev = torch.device("cuda")
    backend = get_backend(dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gen = torch.Generator().manual_seed(0)
    shipped = mt.weight_tile
    rows = []
    for model in args.models.split(","):
        G, H, I, es, x, bufs = token_case(model, backend, dev, gen)
        want = None
        for up, down in zip(VARIANTS, VARIANTS):
            mt.weight_tile = lambda k, n, up=up, down=down, I=I: up if n == 2 * I else down
            h = torch.empty((TOP_K, 2 * I), device=dev)
            out = torch.empty((1, H), dtype=torch.bfloat16, device=dev)
            flags = torch.zeros(2, dtype=torch.int8, device=dev)

            launch = (x, None, bufs["ids"], bufs["wide"], bufs["w"], bufs["tokens"], bufs["t13"],
                      bufs["t2"], G, I, h, bufs["parts"], bufs["counts"], out, flags[:1], flags[1:])
            graph = capture(lambda launch=launch: mt.moe_token(*launch))
            graph.replay()
            torch.cuda.synchronize()
            got = (h.clone(), out.clone())
            if want is None:
                want = got
            _, per_kernel = kernel_sum_us(graph, flush, args.reps)
            row = {"model": model, "up_tile": up, "down_tile": down,
                   "up_shipped": up == shipped(TOP_K, 2 * I),
                   "down_shipped": down == shipped(TOP_K, H),
                   "up_us": per_kernel.get("_up_kernel"), "down_us": per_kernel.get("_down_kernel"),
                   "same_bits": bool(torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
                                     and torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))),
                   "flags": flags.tolist()}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        mt.weight_tile = shipped
        del es
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
