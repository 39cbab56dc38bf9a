"""The decode tiles, launched through the tables as a server graph launches them, load the
operands' addresses before a program can leave: in the SASS for sm_90 (compiled on the CPU with
the ptxas and cuobjdump Triton ships), every 64-bit load of the address words is issued ahead of
the first ``EXIT`` (the branch of a program with no tile). Left under that branch, the compiler
had put them after ``m_sizes``'s load and scan, and the first weight load of every one-token
launch waited on two round trips to memory instead of one (bench/NOTES.md, session 30).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from moegemm.kernels import triton_kernel as tk
from sm90_compile import CUOBJDUMP, PTXAS, compile_config, sass

if not (PTXAS.exists() and CUOBJDUMP.exists()):
    pytest.skip("Triton's ptxas or cuobjdump is not installed", allow_module_level=True)

# (m, n, k, g): the table's decode_pair (seed m1) and decode (DeepSeek-V3 w2, one token) tiles.
SHAPES = [(1, 8192, 1024, 8), (8, 7168, 2048, 256)]


def _wide_loads_before_exit(kernel) -> tuple[int, int]:
    """(64-bit global loads before the first EXIT, 64-bit global loads in all)."""
    code = [op for _, op in sass(kernel)]
    first_exit = next(i for i, op in enumerate(code) if op.split()[-1] == "EXIT")
    wide = [i for i, op in enumerate(code) if "LDG.E.64" in op]
    return sum(i < first_exit for i in wide), len(wide)


@pytest.mark.parametrize("m,n,k,g", SHAPES)
@pytest.mark.parametrize("flags", [False, True], ids=["merged", "lone"])
def test_the_address_words_are_loaded_before_a_program_can_leave(m, n, k, g, flags):
    cfg = tk.default_config(m, n, k, g)
    assert cfg.swap_ab, cfg.key()  # a decode tile
    # A server graph keeps the row map on a decode tile, merged calls or a lone call.
    kernel = compile_config(cfg, m, n, k, g, service=True, row_map=True, flags=flags)
    before, total = _wide_loads_before_exit(kernel)
    # m_sizes (int64) and the four words: weights, weight scales, activations, their scales.
    assert before >= 5, (cfg.key(), before, total)


def test_plain_pointers_load_only_m_sizes_before_a_program_can_leave():
    # The check's own control: with no tables, the one wide load before the exit is m_sizes's.
    m, n, k, g = SHAPES[0]
    kernel = compile_config(tk.default_config(m, n, k, g), m, n, k, g)
    assert _wide_loads_before_exit(kernel)[0] == 1


@pytest.mark.parametrize("m,n,k,g", [(8, 7168, 2048, 256), (1, 2048, 768, 128), (8, 7168, 2048, 384)])
def test_the_group_lookup_crosses_the_warps_in_few_steps(m, n, k, g):
    """At G >= 128 the sizes' vector spans the warps, and each cross-warp step of the group
    lookup (``_locate_tile``) is a barrier round before the tile's first weight load. One scan
    of rows and tiles together and one sum of the tile's group (a one-hot) make 4 ``BAR.SYNC``;
    two cumsums and five separate sums made 18, paid by every one-token launch of a
    many-expert model (A/B on the H200: bench/NOTES.md, session 31)."""
    cfg = tk.default_config(m, n, k, g)
    assert cfg.swap_ab, cfg.key()
    code = [op for _, op in sass(compile_config(cfg, m, n, k, g, service=True, row_map=True))]
    first_weight_load = next(i for i, op in enumerate(code) if "LDGSTS" in op)
    barriers = sum("BAR.SYNC" in op for op in code[:first_weight_load])
    assert barriers <= 4, (cfg.key(), barriers)
