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


def test_the_batch_arena_is_reused_and_growing_keeps_staged_rows():
    staging = Staging(torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    small = [torch.randn((2, 64), generator=gen) for _ in range(2)]
    staging.begin()
    first = staging.gather_rows(small)
    # A part larger than the arena: it grows, and rows staged before stay as they were.
    big = [torch.randn((3000, 128), generator=gen) for _ in range(2)]
    second = staging.gather_rows(big)
    assert torch.equal(first, torch.cat(small)) and torch.equal(second, torch.cat(big))
    # The next batch takes the same memory again.
    staging.begin()
    again = staging.gather_rows(small)
    assert again.data_ptr() == staging._arena_np.ctypes.data
    assert torch.equal(again, torch.cat(small))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                    reason="needs an NVIDIA CUDA device")
@pytest.mark.parametrize("nbytes", [1, 4096 + 3, 64 << 10, (1 << 20) + 5])
def test_driver_copies_equal_torch_copies_and_results_outlive_the_batch(nbytes):
    staging = Staging(torch.device("cuda"))
    assert staging._driver is not None
    staging.enter()
    gen = torch.Generator().manual_seed(nbytes)
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    staging.begin()
    staged = staging.gather_rows([host[: nbytes // 2], host[nbytes // 2:]])
    dev = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    staging.upload(dev, staged)
    (back,) = staging.download(dev)
    assert torch.equal(back, host)
    # The next batch overwrites the arena: a result handed out before is its own copy.
    staging.begin()
    other = torch.zeros(nbytes, dtype=torch.uint8)
    staging.upload(dev, staging.gather_rows([other[:1], other[1:]]))
    (zeros,) = staging.download(dev)
    assert torch.equal(back, host) and not zeros.any()


def test_gather_rows_with_an_empty_first_part():
    # A merged batch whose first call has no rows (M=0 is a valid call).
    staging = Staging(torch.device("cpu"))
    staging.begin()
    parts = [torch.empty((0, 8)), torch.arange(16.0).view(2, 8)]
    assert torch.equal(staging.gather_rows(parts), parts[1])
