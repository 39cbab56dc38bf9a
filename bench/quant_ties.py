"""How far a client's own SPEC 1.1 quantization lands from the server's (CPU, no GPU needed).

    python bench/quant_ties.py [--m 256 --n 512 --k 2048 --seed 0]

A router (or a test harness) that sends bf16 activations and bf16 weights and checks the answer
against its own quantization of them sees the server's codes where they agree, and a whole fp8
step where they do not. For bf16 data about 0.1 % of SPEC 1.1's exact quotients are fp8 ties,
which each way of computing the quotient may break differently. For each client-side way (plain
float32 torch; float64 with a float64 scale, cast by torch; float64 by the float32-rounded scale,
cast by ml_dtypes straight from float64), this prints the share of x and w codes that differ from
``moegemm.kernels.quantize_activations`` / ``quantize_weights`` and the relative Frobenius error
of the server's bf16 answer (the float64 SPEC 1 formula on the server's codes, rounded to bf16)
against the client's float64 reference on its own codes: SPEC 1's bound is 5e-3.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
import torch
from moegemm.kernels import quantize_activations, quantize_weights


def _blocks_x(t: torch.Tensor) -> torch.Tensor:
    m, k = t.shape
    return t.reshape(m, k // 128, 128)


def _blocks_w(t: torch.Tensor) -> torch.Tensor:
    n, k = t.shape
    return t.reshape(n // 128, 128, k // 128, 128)


def _client(t: torch.Tensor, blocks, dims, way: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's SPEC 1.1 codes (as float64 values) and scales (float64 of float32), by ``way``."""
    b = blocks(t.double() if way != "float32 torch" else t.float())
    amax = b.abs().amax(dim=dims, keepdim=True).clamp(min=1e-12)
    if way in ("float32 torch", "float64, float64 scale"):  # the scale in b's precision
        scale = amax / 448.0
        q = (b / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    else:  # float64 by the float32-rounded scale, rounded straight to fp8 by ml_dtypes
        scale = (amax / 448.0).float().double()
        q = torch.from_numpy(np.clip((b / scale).numpy(), -448, 448).astype(ml_dtypes.float8_e4m3fn)
                             .astype(np.float64))
    return q.reshape(t.shape), scale.float().double()


def _dequant(q: torch.Tensor, scale: torch.Tensor, blocks) -> torch.Tensor:
    return (blocks(q) * scale).reshape(q.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.m, args.k, generator=gen).bfloat16()
    w = torch.randn(args.n, args.k, generator=gen).bfloat16()
    xq, xs = quantize_activations(x)
    wq, ws = quantize_weights(w)
    server_x = _dequant(xq.double(), xs.double()[..., None], _blocks_x)
    server_w = _dequant(wq.double(), ws.double().t()[:, None, :, None], _blocks_w)
    server = (server_x @ server_w.t()).bfloat16().double()
    for way in ("float32 torch", "float64, float64 scale", "float64 by float32 scale, ml_dtypes"):
        cxq, cxs = _client(x, _blocks_x, 2, way)
        cwq, cws = _client(w, _blocks_w, (1, 3), way)
        ref_x = _dequant(cxq, cxs, _blocks_x)
        ref = ref_x @ _dequant(cwq, cws, _blocks_w).t()
        only_x = ref_x @ server_w.t()
        rel = ((server - ref).norm() / ref.norm()).item()
        rel_x = ((server - only_x).norm() / only_x.norm()).item()
        print(f"{way:38s} x codes differ {(cxq != xq.double()).double().mean().item():8.4%}  "
              f"w codes differ {(cwq != wq.double()).double().mean().item():8.4%}  "
              f"rel error: client x {rel_x:.2e}, client x and w {rel:.2e}")


if __name__ == "__main__":
    main()
