"""Host staging: the rows of merged calls side by side in one buffer."""

from __future__ import annotations

import torch
from moegemm.server._staging import Staging


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
