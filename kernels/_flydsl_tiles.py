"""Tile choices of the FlyDSL kernel and the checks that run before anything compiles.

No FlyDSL import here: the server, the tests and the autotuner reason about
tiles (LDS budget, divisibility) in processes that must not load FlyDSL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ._backend import BLOCK

SUPPORTED_ARCHS = ("gfx942", "gfx950")

# LDS one workgroup may allocate (CDNA3: 64 KiB per CU; CDNA4: 160 KiB).
LDS_BUDGET = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}

# The fp8 encoding each arch's MFMA reads (SPEC 1.2).
FP8_DTYPE = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}

# The MFMA the kernel must issue on each arch (checked in the ISA by CI).
MFMA_INSTRUCTION = {
    "gfx942": "v_mfma_f32_16x16x32_fp8_fp8",
    "gfx950": "v_mfma_scale_f32_16x16x128_f8f6f4",
}

WEIGHT_LAYOUTS = ("plain", "preshuffled")

# The occupancy each tile's kernel is compiled for (LLVM's amdgpu-waves-per-eu),
# so that the register allocator gets that occupancy's budget (512 / waves
# VGPRs + AGPRs) whatever K is, and occupancy cannot change with K. Each value
# is the highest that compiles without spilling at K = 2048 and 7168 and that
# the tile's LDS allows (LLVM drops a request above the LDS-bound occupancy, as
# if none were made); CI checks the default tiles' occupancy at two K and that
# no candidate spills. gfx942's 64-row default needs ~142 VGPRs (3 waves, as its
# LDS allows); gfx950's 128-row default ~196 (2 waves: 168 registers spill).
# A tile not listed is compiled for 1 wave (no register cap).
WAVES_PER_EU = {
    "gfx942": {
        "32x128x128": 4,
        "64x64x128": 3,
        "64x128x128": 3,
        "64x256x128": 2,
        "128x128x128": 1,
        "64x128x256": 1,
    },
    "gfx950": {
        "32x128x128": 4,
        "64x64x128": 4,
        "64x128x128": 3,
        "128x128x128": 2,
        "64x256x128": 2,
        "64x128x256": 2,
        "128x64x256": 2,
        "128x128x256": 1,
    },
}

_WAVE_N = (16, 32, 64, 128)  # columns per wave: a multiple of 16 that divides 128


class TileTooLarge(ValueError):
    """A tile needs more LDS than the target arch gives one workgroup."""


@dataclass(frozen=True)
class FlyTile:
    """One output tile of a workgroup: ``block_m x block_n``, stepping ``block_k`` along K."""

    block_m: int
    block_n: int
    block_k: int

    @property
    def lds_bytes(self) -> int:
        """LDS the kernel allocates: two stages of the A tile and of its FP32 x scales."""
        x_scales = self.block_m * (self.block_k // BLOCK)
        return 2 * (self.block_m * self.block_k + 4 * x_scales)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}"


# What run() uses when autotuning is off; chosen to fit both LDS budgets without spills.
DEFAULT_TILES = {
    "gfx942": FlyTile(64, 128, 128),
    "gfx950": FlyTile(128, 128, 128),
}

# What the opt-in autotuner tries. Some exceed gfx942's LDS on purpose: the
# budget check, not the compiler, must turn them away there.
AUTOTUNE_TILES = (
    FlyTile(32, 128, 128),
    FlyTile(64, 64, 128),
    FlyTile(64, 128, 128),
    FlyTile(64, 256, 128),
    FlyTile(128, 128, 128),
    FlyTile(64, 128, 256),
    FlyTile(128, 64, 256),
    FlyTile(128, 128, 256),
)


def waves_per_eu(arch: str, tile: FlyTile) -> int:
    """The occupancy ``tile``'s kernel is compiled for on ``arch`` (see :data:`WAVES_PER_EU`)."""
    return WAVES_PER_EU[arch].get(str(tile), 1)


def check_arch(arch: str) -> str:
    """Return ``arch`` if the kernel supports it, else raise ValueError."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"the FlyDSL kernel targets {', '.join(SUPPORTED_ARCHS)}, not {arch!r}")
    return arch


def check_tile(tile: FlyTile, arch: str) -> FlyTile:
    """Raise unless ``tile`` is well formed and fits ``arch``'s LDS; return it.

    Runs before tracing: an oversized LDS allocation would otherwise fail deep in
    the backend (or abort the process), where an autotuner cannot skip it.
    Raises :class:`TileTooLarge` for the LDS budget, ValueError for the shape.
    """
    check_arch(arch)
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    if bm < 32 or bm % 32:
        # 32 rows x 128 bytes: one 16-byte load per thread, the smallest A step.
        raise ValueError(f"tile {tile}: block_m must be a positive multiple of 32")
    if bn % 4 or bn // 4 not in _WAVE_N:
        raise ValueError(
            f"tile {tile}: block_n must be 64, 128, 256 or 512 (4 waves of 16..128 columns)"
        )
    if bk < BLOCK or bk % BLOCK:
        raise ValueError(f"tile {tile}: block_k must be a positive multiple of {BLOCK}")
    budget = LDS_BUDGET[arch]
    if tile.lds_bytes > budget:
        raise TileTooLarge(
            f"tile {tile} needs {tile.lds_bytes} bytes of LDS (two stages of a {bm}x{bk} fp8 A tile "
            f"and its scales); {arch} gives a workgroup {budget}: choose a smaller block_m or block_k"
        )
    return tile


def fit_tile(tile: FlyTile, n: int, k: int) -> FlyTile:
    """Shrink ``tile`` until ``block_n`` divides N and ``block_k`` divides K: ``block_n``
    halved (a power of two), ``block_k`` to the largest multiple of 128 below it that divides
    K (halving 384 would give 192, no tile).

    N and K must be positive multiples of 128 (SPEC 1), so 128 always fits (and
    a ``block_n`` of 64 divides any such N); a smaller tile never needs more
    LDS, so a tile that passed :func:`check_tile` still does. Raises ValueError
    naming N or K when it is not a multiple of 128 (halving would otherwise end
    on a meaningless tile such as ``128x1x128``).
    """
    for what, size in (("N", n), ("K", k)):
        if size <= 0 or size % BLOCK:
            raise ValueError(f"{what} = {size} must be a positive multiple of {BLOCK}")
    bn, bk = tile.block_n, tile.block_k
    while n % bn and bn > BLOCK:
        bn //= 2
    while k % bk and bk > BLOCK:
        bk -= BLOCK
    return replace(tile, block_n=bn, block_k=bk)
