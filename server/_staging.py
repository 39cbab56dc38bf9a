"""Host staging for the engine: pinned buffers and the engine's own stream.

Host -> device copies only overlap with other work, and only run at full PCIe
speed, from page-locked memory. A call's rows are copied once from the request
body into a pinned buffer (merged calls side by side), sent to the device on
the engine's stream, and the output comes back into another pinned buffer whose
bytes the HTTP layer writes out as they are.

Pinned buffers come from torch's caching host allocator (``pin_memory=True``):
it keeps freed page-locked blocks for reuse and does not hand a block out again
while a copy recorded against it may still be running, so a buffer released by
a response is recycled without a fresh ``cudaHostAlloc``. On a CPU device there
is nothing to pin or overlap: the same calls fall back to plain memory and
synchronous copies, so the engine has one code path.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

log = logging.getLogger("moegemm.server.staging")

# The stream each thread last made current through Staging.enter (torch's own
# lookup costs more than the switch it would save).
_current = threading.local()

# Bodies above this are weight uploads, not calls: pinning them would hold page-
# locked memory the size of a weight set for one request.
_PIN_BODIES_UP_TO = 64 << 20
# Below this a body is decoded by copying (``_body._COPY_BELOW``): pinning it
# would cost a host-allocator round trip on the event loop for nothing.
_PIN_BODIES_FROM = 64 << 10


def pinned_body_allocator() -> Callable[[int], memoryview]:
    """Request-body buffers in page-locked memory (for the HTTP transport).

    The engine then uploads a call's rows straight from the body, with no host
    copy. Blocks come from torch's caching host allocator and return to it when
    the last view of the body is gone.
    """

    def allocate(size: int) -> memoryview:
        if size > _PIN_BODIES_UP_TO or size < _PIN_BODIES_FROM:
            return memoryview(np.empty(size, dtype=np.uint8))
        return memoryview(torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy())

    return allocate


def pin_host_array(arr: np.ndarray) -> bool:
    """Page-lock ``arr``'s memory in place (``cudaHostRegister``) until it is freed.

    For memory the server did not allocate, such as the acceptors' shared
    request arenas (``_acceptors.py``): copies from it then run as DMA at full
    speed instead of through the driver's bounce buffer (on the H200 a lone
    M=128 call's batch took ~675 us from an unregistered arena, ~425 us from a
    pinned body). Unregistered when ``arr`` is collected (its views keep it).
    Returns whether it worked; a failure is logged and leaves the memory as it was.
    """
    if not torch.cuda.is_available() or arr.nbytes == 0:
        return False
    ptr = arr.ctypes.data
    try:
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(ptr, arr.nbytes, 0)
        err = int(getattr(err, "value", err))
    except Exception as exc:  # noqa: BLE001 -- e.g. a runtime without it: stay pageable
        err = repr(exc)
    if err != 0:
        log.warning("cannot page-lock %d bytes of host memory (%s); copies from it run at "
                    "pageable speed", arr.nbytes, err)
        return False
    weakref.finalize(arr, rt.cudaHostUnregister, ptr)
    return True


class Staging:
    """Pinned host memory and the engine's own CUDA stream on one device.

    Every copy and every graph replay of the engine runs in order on one
    dedicated stream (never the legacy default stream, which would serialise
    with everything else on the device). The stream is made current once per
    thread, not per call: measured on the H200, each ``torch.cuda`` stream
    lookup or switch costs ~15-25 us of Python, and a small call needed nine.
    A batch is uploaded, computed and downloaded in stream order, then waited
    on once; one batch runs at a time, so the host buffers of a finished batch
    are free to reuse.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._done = torch.cuda.Event() if self.is_cuda else None

    def enter(self) -> None:
        """Make the engine stream current in this thread (a no-op when it already is)."""
        if self.stream is not None and getattr(_current, "stream", None) is not self.stream:
            torch.cuda.set_stream(self.stream)
            _current.stream = self.stream

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, page-locked when the device is a GPU."""
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.is_cuda)

    def gather_rows(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parts stacked along dim 0 in one pinned buffer: the only host copy of the rows."""
        if len(parts) == 1 and parts[0].is_pinned() == self.is_cuda and parts[0].is_contiguous():
            return parts[0]  # already staged (e.g. a body read straight into pinned memory)
        rows = sum(p.shape[0] for p in parts)
        staged = self.host_empty((rows, *parts[0].shape[1:]), parts[0].dtype)
        dst = _flat_bytes(staged)
        start = 0
        for part in parts:
            src = _flat_bytes(part)
            # numpy: one memcpy, with the GIL released. Keeping it (copy_bytes) was
            # slower on the H200 at 32 clients (1066 vs ~1260 calls/s, M=128): the
            # loop's work overlaps these copies, which matters more than the
            # worker's wait to get the GIL back.
            dst[start:start + len(src)] = src
            start += len(src)
        return staged

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host ``src`` into device ``dst``, in order on the engine stream."""
        dst.copy_(src, non_blocking=self.is_cuda)

    def settle(self) -> None:
        """Wait for everything queued on the engine stream (after a failed batch)."""
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except Exception as exc:  # noqa: BLE001 -- a broken device: already reported
                log.debug("engine stream did not settle: %r", exc)

    def download(self, *srcs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device tensors into fresh pinned host tensors, waiting once until all are there.

        The wait (``cudaEventSynchronize``) releases the GIL, so the event loop
        keeps serving meanwhile.
        """
        if self.stream is None:
            return tuple(s.clone() if s.device.type == "cpu" else s.cpu() for s in srcs)
        hosts = []
        for src in srcs:
            host = self.host_empty(src.shape, src.dtype)
            host.copy_(src, non_blocking=True)
            hosts.append(host)
        self._done.record(self.stream)
        self._done.synchronize()
        return tuple(hosts)


def _flat_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as a flat numpy uint8 view."""
    return t.reshape(-1).view(torch.uint8).numpy()
