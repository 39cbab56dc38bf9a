"""The decode tiles' group lookup (``_triton_gemm._locate_tile``) against its contract, in
Triton's interpreter on the CPU (a fresh process with ``TRITON_INTERPRET=1``).

For every row tile of the launch grid (``triton_kernel.row_tile_bound``) the lookup gives a
group, the tile's first row, the group's end row and whether the tile is valid. Whatever
``m_sizes`` holds (sums equal to M, past it, short of it, negative sizes, empty groups,
sizes past int32), group g owns rows ``[min(prefix_g, M), min(prefix_g + size_g, M))`` with
each size clamped to ``[0, M]`` first: every row of a group is computed by exactly one valid
tile of that group, and no valid tile reaches past its group's end or before its start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl
from moegemm.kernels._triton_gemm import _locate_tile

# (M, G, BLOCK_M): the table's token tiles, one to 384 groups, G_POW2 up to 512.
SHAPES = [(1, 8, 16), (37, 3, 16), (128, 8, 32), (300, 128, 16), (100, 384, 16), (130, 256, 64), (64, 1, 16)]


def _cases(m: int, g: int, rng) -> list[list[int]]:
    even = [m // g] * g
    even[-1] += m - sum(even)
    cut = sorted(rng.integers(0, m + 1, size=g - 1).tolist())
    routed = [b - a for a, b in zip([0, *cut], [*cut, m], strict=True)]
    past = [s + int(rng.integers(0, 5)) for s in routed]  # sums past M
    short = [max(0, s - int(rng.integers(0, 5))) for s in routed]  # sums short of M
    wild = [int(v) for v in rng.choice([-5, 0, 1, m, 2**40, -(2**40)], size=g)]
    return [even, routed, past, short, wild]


@triton.jit
def _lookup(m_sizes_ptr, out_ptr, M, G, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    t = tl.program_id(0)
    group, first_row, row_stop, valid = _locate_tile(m_sizes_ptr, M, G, t, BLOCK_M, G_POW2)
    tl.store(out_ptr + 4 * t, group.to(tl.int64))
    tl.store(out_ptr + 4 * t + 1, first_row.to(tl.int64))
    tl.store(out_ptr + 4 * t + 2, row_stop.to(tl.int64))
    tl.store(out_ptr + 4 * t + 3, valid.to(tl.int64))


def probe() -> list[dict]:
    """Runs the lookup for every tile of every case; returns the cases and answers."""
    import numpy as np
    import torch
    from moegemm.kernels import triton_kernel as tk

    rng = np.random.default_rng(12)
    found = []
    for m, g, block_m in SHAPES:
        for sizes in _cases(m, g, rng):
            tiles = tk.row_tile_bound(m, g, block_m)
            out = torch.full((tiles, 4), -7, dtype=torch.int64)
            _lookup[(tiles,)](torch.tensor(sizes, dtype=torch.int64), out, m, g, BLOCK_M=block_m,
                             G_POW2=max(16, triton.next_power_of_2(g)))
            found.append({"m": m, "g": g, "block_m": block_m, "sizes": sizes, "tiles": out.tolist()})
    return found


def _owners(m: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Each group's rows ``[start, end)`` by the contract."""
    owned, prefix = [], 0
    for size in sizes:
        size = min(max(size, 0), m)
        owned.append((min(prefix, m), min(prefix + size, m)))
        prefix += size
    return owned


def test_every_row_is_computed_once_in_its_own_group():
    here = str(Path(__file__).parent)
    code = (f"import sys, json; sys.path.insert(0, {here!r}); import test_locate_tile as t; "
            "print(json.dumps(t.probe()))")
    done = subprocess.run([sys.executable, "-P", "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, check=False, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in json.loads(done.stdout.splitlines()[-1]):
        m, g, block_m, sizes = case["m"], case["g"], case["block_m"], case["sizes"]
        owned = _owners(m, sizes)
        covered = [0] * m
        for t, (group, first, stop, valid) in enumerate(case["tiles"]):
            if not valid:
                continue
            where = f"M={m} G={g} BLOCK_M={block_m} sizes={sizes} tile {t}"
            assert 0 <= group < g, where
            start, end = owned[group]
            assert stop == end, where
            rows = range(first, min(first + block_m, stop))
            assert not rows or start <= first, where
            for r in rows:
                covered[r] += 1
        expected = [0] * m
        for start, end in owned:
            for r in range(start, end):
                expected[r] += 1
        assert covered == expected, f"M={m} G={g} BLOCK_M={block_m} sizes={sizes}"
