"""Host staging: the rows of merged calls side by side in one buffer."""

from __future__ import annotations

import contextlib

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


def test_the_batch_arena_is_reused_and_growing_keeps_what_was_taken():
    staging = Staging(torch.device("cpu"))
    staging.begin()
    first = staging.take(100)
    first[:] = 7
    # More than the arena holds: it grows, and what was taken before stays as it was.
    second = staging.take(3 << 20)
    second[:] = 9
    assert (first == 7).all() and (second == 9).all()
    # The next batch takes the same memory again.
    staging.begin()
    assert staging.take(100).ctypes.data == second.ctypes.data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("nbytes", [1, 4096 + 3, 64 << 10, (1 << 20) + 5])
def test_address_copies_equal_torch_copies(nbytes):
    """The graph path's copies (the CUDA driver through cuda-bindings on NVIDIA, torch
    elsewhere) move exactly the bytes, from pageable and page-locked memory, bytes
    objects and views, to and from an offset."""
    import numpy as np
    from moegemm.server import _staging

    staging = Staging(torch.device("cuda"))
    if torch.version.hip is None:
        assert isinstance(staging._copies, _staging._DriverCopies)  # what ships on NVIDIA
    staging.enter()
    gen = torch.Generator().manual_seed(nbytes)
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    dev = torch.full((nbytes + 64,), 7, dtype=torch.uint8, device="cuda")
    staging.begin()
    src = memoryview(host.numpy())
    staging.htod(dev, 64, dev.data_ptr() + 64, src, nbytes)  # pageable, at an offset
    back = staging.take(nbytes)
    staging.dtoh(back, dev[64:], dev.data_ptr() + 64, nbytes)
    staging.wait()
    assert torch.equal(dev[64:].cpu(), host) and np.array_equal(back, host.numpy())
    assert (dev[:64].cpu() == 7).all()
    pinned = host.flip(0).pin_memory()
    staging.htod(dev, 0, dev.data_ptr(), memoryview(pinned.numpy()), nbytes)  # page-locked
    staging.wait()
    assert torch.equal(dev[:nbytes].cpu(), pinned)
    staging.htod(dev, 0, dev.data_ptr(), bytes(host.numpy()), nbytes)  # a bytes object
    staging.wait()
    assert torch.equal(dev[:nbytes].cpu(), host)


def test_torch_copies_on_the_cpu_move_the_bytes():
    import numpy as np

    staging = Staging(torch.device("cpu"))
    staging.enter()
    host = np.arange(300, dtype=np.uint8)
    dev = torch.zeros(310, dtype=torch.uint8)
    staging.htod(dev, 10, dev.data_ptr() + 10, memoryview(host), 300)
    back = np.zeros(300, dtype=np.uint8)
    staging.dtoh(back, dev[10:], dev.data_ptr() + 10, 300)
    staging.wait()
    assert np.array_equal(back, host) and not dev[:10].any()


def test_gather_rows_with_an_empty_first_part():
    # A merged batch whose first call has no rows (M=0 is a valid call).
    staging = Staging(torch.device("cpu"))
    staging.begin()
    parts = [torch.empty((0, 8)), torch.arange(16.0).view(2, 8)]
    assert torch.equal(staging.gather_rows(parts), parts[1])


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a GPU")),
])
def test_a_paced_upload_moves_every_piece(device):
    """A load's copies go in pieces (``_LOAD_PIECE``) with a bounded number queued,
    on the current stream (the engine's loader stream on a GPU): every byte lands,
    a size that is not a multiple of the piece included, and after ``wait`` the host
    buffer is free to refill for the next chunk."""
    import numpy as np
    from moegemm.server import _staging

    nbytes = 3 * _staging._LOAD_PIECE + 12345
    on_gpu = device == "cuda"
    side = torch.cuda.Stream() if on_gpu else None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu).numpy()
    rng = np.random.default_rng(2)
    with torch.cuda.stream(side) if on_gpu else contextlib.nullcontext():
        upload = _staging.PacedUpload(torch.device(device))
        if on_gpu and torch.version.hip is None:
            assert isinstance(upload._copies, _staging._DriverCopies)  # what ships on NVIDIA
        dst = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        want = []
        for d in dst:
            host[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
            want.append(host.copy())
            upload.copy(d, host)
            assert len(upload._marks) <= _staging._LOAD_AHEAD
            upload.wait()  # before the buffer is refilled
        upload.close()
    for d, w in zip(dst, want):
        assert np.array_equal(d.cpu().numpy(), w)


def test_address_is_where_the_bytes_are_for_every_kind_of_source():
    """The driver copies read and write the host by ``address``: for every source the
    graph path hands it (a body slice, writable or read-only, a numpy array or a slice of
    the batch arena, a bytes object) it is the first byte's, as numpy reads it."""
    import ctypes

    import numpy as np
    from moegemm.server._staging import address

    arena = np.arange(4096, dtype=np.uint8)
    body = memoryview(arena)
    frozen = bytes(arena)
    sources = [
        (body[100:300], arena[100:300]),  # a writable body's bin
        (body[100:300].cast("B"), arena[100:300]),
        (memoryview(frozen)[7:70], np.frombuffer(frozen, np.uint8)[7:70]),  # read-only
        (arena[256:512], arena[256:512]),  # an arena slice
        (arena.view(np.int64)[3:9], arena.view(np.int64)[3:9]),  # the launch words
        (arena[::2], arena[::2]),  # strided (never a copy source, still an address)
    ]
    for src, same in sources:
        assert address(src) == same.ctypes.data
    address(body[5:5])  # empty: an address (never copied from), not an error
    assert ctypes.string_at(address(frozen), 5) == frozen[:5]
    assert ctypes.string_at(address(body[100:300]), 200) == bytes(arena[100:300])
