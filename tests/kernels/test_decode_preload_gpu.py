"""The decode tiles with their scale products preloaded (``TileConfig.preload``) give the
plain loop's bits, on an NVIDIA Hopper GPU (bench/decode_sweep.py times them).

Preloading changes only what the loop waits on and how many blocks are in flight, so for
every single-block decode tile the table uses (unsplit and split-K, banded or not;
preloaded or not as the table ships it) the preloaded form at every depth must give the
same bits as the plain loop (scales loaded block by block, 3 stages). The pair tiles take
no preload: they load each pair's scales a pair ahead."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs compute capability 9.0 (Hopper)", allow_module_level=True)

from moegemm.kernels import quantize_activations
from moegemm.kernels import triton_kernel as tk
from moegemm.kernels.testing import random_m_sizes

DEV = torch.device("cuda")
# (m, n, k, g): each single-block decode tile the table gives (key in the comment).
SHAPES = [(8, 7168, 2048, 256),    # decode m16 n128 w8 (16 blocks)
          (1, 5120, 8192, 64),     # decode m16 n128 w8 sk8
          (2, 4096, 14336, 8),     # decode m16 n128 w8 sk4 (112 blocks)
          (2, 1024, 4224, 8),      # decode n128 w8 sk8, 33 blocks: uneven splits, the last empty
          (128, 8192, 1024, 8),    # decode m16 n128, bands of 8
          (2048, 2048, 768, 128),  # decode m32 n128
          (192, 1280, 8192, 8),    # decode m32 n128 sk4, bands of 8
          (32, 1280, 8192, 8)]     # decode m16 n128 w8 s6, unsplit (64 blocks)


# Every depth, and the table's own (None: 6 slots on the unsplit few-expert tile).
@pytest.mark.parametrize("stages", [3, 4, 5, None])
@pytest.mark.parametrize("m,n,k,g", SHAPES)
def test_preloaded_scales_give_the_shipped_bits(m, n, k, g, stages):
    gen = torch.Generator(device=DEV).manual_seed(m * 7 + n + k + g + (stages or 0))
    x = torch.randn((m, k), generator=gen, device=DEV)
    xq, xs = quantize_activations(x, torch.float8_e4m3fn)
    # fp8 weights and block scales made directly (quantizing float32 weights of these sizes
    # would take tens of GB), one expert at a time so the peak stays near the fp8 tensor (the
    # tests share the GPU with other workers); the scales' spread is what the promotion has to
    # get right.
    wq = torch.empty((g, n, k), device=DEV, dtype=torch.float8_e4m3fn)
    for e in range(g):
        wq[e] = (torch.randn((n, k), generator=gen, device=DEV, dtype=torch.float16) * 64).to(wq.dtype)
    ws = torch.exp(torch.randn((g, k // 128, n // 128), generator=gen, device=DEV)) / 256
    sizes = random_m_sizes(g, m, generator=torch.Generator().manual_seed(m + g)).to(DEV)
    shipped = tk.default_config(m, n, k, g)
    assert shipped.schedule == "decode"
    plain = dataclasses.replace(shipped, preload=False, num_stages=3)
    variant = dataclasses.replace(shipped, preload=True, num_stages=stages or shipped.num_stages)
    for out_dtype in (torch.bfloat16, torch.float32):
        want = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEV)
        got = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEV)
        tk.launch(xq, wq, xs, ws, sizes, want, plain)
        tk.launch(xq, wq, xs, ws, sizes, got, variant)
        torch.cuda.synchronize()
        bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits)), (plain.key(), variant.key(), out_dtype)
        assert torch.isfinite(got[: int(sizes.sum())]).all()
