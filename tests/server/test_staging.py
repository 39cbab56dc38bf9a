"""Host staging: the rows of merged calls side by side in one buffer."""

from __future__ import annotations

import pytest
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


def test_an_acceptor_link_pins_its_request_arena():
    from moegemm.server import _acceptors

    pinned = []
    link = _acceptors._Link(0, pin=pinned.append)
    try:
        if link.requests is None:
            pytest.skip("no /dev/shm here: the arenas fall back to inline bodies")
        assert len(pinned) == 1 and pinned[0] is link.requests
        assert pinned[0].nbytes == _acceptors._ARENA_BYTES
    finally:
        link.unlink()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_host_array_copies_to_the_device_as_pinned_memory():
    import mmap

    import numpy as np
    from moegemm.server._staging import pin_host_array

    size = 4 << 20
    arr = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    arr[:] = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    assert pin_host_array(arr)
    host = torch.frombuffer(arr, dtype=torch.uint8)
    assert host.is_pinned()
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)
