"""Host staging: the rows of merged calls side by side, copied without numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moegemm.server._staging import Staging, copy_bytes


def test_copy_bytes_copies_exactly_and_refuses_mismatches():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size=3 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    copy_bytes(dst, src)
    assert np.array_equal(dst, src)
    copy_bytes(dst[:0], src[:0])  # nothing to copy
    with pytest.raises(ValueError):
        copy_bytes(dst[:10], src[:11])
    with pytest.raises(ValueError):
        copy_bytes(dst[: 2 * 10 : 2], src[:10])  # not contiguous


def test_gather_rows_stacks_the_parts():
    staging = Staging(torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn((rows, 40), generator=gen).to(torch.bfloat16) for rows in (3, 0, 17, 1)]
    got = staging.gather_rows(parts)
    assert torch.equal(got, torch.cat(parts))
    scales = [torch.rand((rows, 2), generator=gen) for rows in (2, 5)]
    assert torch.equal(staging.gather_rows(scales), torch.cat(scales))
    fp8 = [torch.randn((4, 32), generator=gen).to(torch.float8_e4m3fn) for _ in range(2)]
    assert torch.equal(staging.gather_rows(fp8).view(torch.uint8),
                       torch.cat(fp8).view(torch.uint8))
