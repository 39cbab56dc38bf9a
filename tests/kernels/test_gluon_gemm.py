"""The Gluon prefill kernel on an NVIDIA Hopper GPU: SPEC 1 on ragged groups.

``kernels/_gluon_gemm.launch`` against the float64 oracle, with empty groups,
a group of one row, M not a multiple of the 128-row tile, an odd number of K
blocks (the paired loop's tail), G up to 384, a float32 output, and a CUDA
graph replay equal to eager bit for bit. Outputs are NaN-poisoned first, so a
row the kernel skips fails.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.version.hip:
    pytest.skip("needs an NVIDIA CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs compute capability 9.0 (Hopper)", allow_module_level=True)
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from moegemm.kernels import _gluon_gemm as gg  # noqa: E402
from moegemm.kernels import reference_float64  # noqa: E402
from moegemm.kernels.testing import SPEC_TOLERANCE, random_problem, rel_error  # noqa: E402

DEV = torch.device("cuda")
VARIANTS = [{"stages": 4, "pair": True}, {"stages": 6, "pair": True}, {"stages": 5, "pair": False},
            {"stages": 4, "pair": False, "block_n": 256}]


def _poisoned(m, n, dtype=torch.bfloat16):
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("variant", VARIANTS,
                         ids=lambda v: f"s{v['stages']}{'p' if v['pair'] else ''}n{v.get('block_n', 128)}")
@pytest.mark.parametrize("m,n,k,g", [(1000, 256, 1152, 8), (3000, 768, 1024, 8), (16384, 512, 2048, 128),
                                     (8191, 256, 7168, 256), (5000, 512, 1536, 384)])
def test_matches_float64_on_ragged_groups(variant, m, n, k, g):
    gen = torch.Generator(device=DEV).manual_seed(m + g)
    torch.manual_seed(m * g)
    p = random_problem(m, n, k, g, device=DEV, generator=gen)
    assert int((p.m_sizes == 0).sum()) >= 1  # empty groups in the split
    out = gg.launch(*p.args(), _poisoned(m, n), **variant)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


def test_one_live_group_of_one_row():
    m, n, k, g = 1, 256, 512, 128
    sizes = torch.zeros(g, dtype=torch.int64)
    sizes[77] = 1
    gen = torch.Generator(device=DEV).manual_seed(5)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    out = gg.launch(*p.args(), _poisoned(m, n))
    torch.cuda.synchronize()
    assert rel_error(out, reference_float64(*p.args())) <= SPEC_TOLERANCE


def test_float32_out_is_the_sum_unrounded():
    """Rounded to bf16 it is the bf16 output bit for bit; closer to the oracle than that."""
    sizes = torch.tensor([0, 301, 1, 0, 77, 500, 17, 128])
    m, n, k, g = int(sizes.sum()), 384, 1152, 8
    gen = torch.Generator(device=DEV).manual_seed(6)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    narrow = gg.launch(*p.args(), _poisoned(m, n))
    wide = gg.launch(*p.args(), _poisoned(m, n, torch.float32))
    torch.cuda.synchronize()
    assert torch.isfinite(wide).all()
    assert torch.equal(wide.to(torch.bfloat16), narrow)
    assert not torch.equal(wide, narrow.float())
    ref = reference_float64(*p.args())
    assert rel_error(wide, ref) < rel_error(narrow, ref)


def test_rows_outside_every_group_are_not_written():
    # Sizes summing to less than M: the rows past them belong to no group and stay as they were.
    m, n, k, g = 700, 256, 1024, 8
    sizes = torch.tensor([100, 0, 250, 0, 0, 50, 0, 0], dtype=torch.int64)
    gen = torch.Generator(device=DEV).manual_seed(9)
    p = random_problem(m, n, k, g, device=DEV, m_sizes=sizes, generator=gen)
    out = gg.launch(*p.args(), _poisoned(m, n))
    torch.cuda.synchronize()
    assert out[400:].isnan().all()
    ref = reference_float64(p.xq[:400], p.wq, p.x_scale[:400], p.w_scale, p.m_sizes)
    assert rel_error(out[:400], ref) <= SPEC_TOLERANCE


def test_graph_replay_equals_eager():
    m, n, k, g = 6000, 384, 2048, 160
    gen = torch.Generator(device=DEV).manual_seed(11)
    torch.manual_seed(11)
    p = random_problem(m, n, k, g, device=DEV, generator=gen)
    eager = gg.launch(*p.args(), _poisoned(m, n)).clone()
    out = _poisoned(m, n)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gg.launch(*p.args(), out)
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
