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

The lone-call path (``Executor.run_raw``) uses raw addresses instead: on
NVIDIA its copies go to the CUDA driver directly (:class:`_Driver`) and its
small results land in a reused page-locked arena (:meth:`Staging.take`).
"""

from __future__ import annotations

import ctypes
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

# The lone-call path's results smaller than this are copied out of the batch
# arena; larger ones get their own page-locked buffer (Executor.run_raw).
_COPY_OUT_BELOW = 64 << 10

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


class _Driver:
    """The CUDA driver's async copies and stream wait, called directly (ctypes).

    A ``torch`` copy between host and device costs ~15-30 us of Python and
    dispatch on the H200's host; the same driver call through ctypes costs a
    few. The engine's small calls make four of them (rows, scales, the launch's
    words up; the result down), so a lone one-row call spent more time in
    copy bookkeeping than on the GPU (``bench/SERVICE_NOTES.md``, v4). The
    calls are enqueued on the engine's stream, in order with its graph
    replays, exactly as the torch copies were. The stream wait releases the
    GIL, so the event loop runs meanwhile.
    """

    def __init__(self) -> None:
        # The copies only enqueue (or, from pageable memory, stage a few KB), so
        # they keep the GIL (PyDLL): giving it up and winning it back costs the
        # engine's worker up to a switch interval each time the event loop is
        # busy. Only the stream wait, which can last a batch, releases it (CDLL).
        keep = ctypes.PyDLL("libcuda.so.1")
        self.htod = keep.cuMemcpyHtoDAsync_v2
        self.htod.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.dtoh = keep.cuMemcpyDtoHAsync_v2
        self.dtoh.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.sync = ctypes.CDLL("libcuda.so.1").cuStreamSynchronize
        self.sync.argtypes = [ctypes.c_void_p]
        for fn in (self.htod, self.dtoh, self.sync):
            fn.restype = ctypes.c_int

    @staticmethod
    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"CUDA driver {what} failed with CUresult {result}")


def _load_driver(device: torch.device) -> _Driver | None:
    """The driver binding on an NVIDIA GPU, else None (torch copies are used)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    try:
        return _Driver()
    except (OSError, AttributeError) as exc:
        log.warning("CUDA driver copies unavailable (%s): using torch copies", exc)
        return None


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

    def __init__(self, device: torch.device, *, driver: bool = True) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._done = torch.cuda.Event() if self.is_cuda else None
        self._driver = _load_driver(self.device) if driver else None
        self._handle = self.stream.cuda_stream if self.stream is not None else None
        # The batch arena: page-locked host memory reused by every batch (one
        # batch at a time, each waited for before the next), where the lone-call
        # path's small results land (:meth:`take`, :meth:`begin`).
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._arena_np = self._arena.numpy()
        self._used = 0

    def enter(self) -> None:
        """Make the engine stream current in this thread (a no-op when it already is)."""
        if self.stream is not None and getattr(_current, "stream", None) is not self.stream:
            # The device's primary context becomes current in this thread too:
            # the driver copies below run in the calling thread's context.
            torch.cuda.set_device(self.stream.device)
            torch.cuda.set_stream(self.stream)
            _current.stream = self.stream

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, page-locked when the device is a GPU."""
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.is_cuda)

    def begin(self) -> None:
        """Start a batch: the arena's space is free again (the last batch was waited for)."""
        self._used = 0

    def _take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of the arena for this batch (grown, never shrunk, when too small)."""
        start = -(-self._used // 256) * 256
        if start + nbytes > self._arena_np.size:
            # Growing drops the old block; parts of this batch already staged in it
            # stay alive through their views. Powers of two: few regrowths.
            size = max(1 << 20, 1 << (start + nbytes - 1).bit_length())
            self._arena = torch.empty(size, dtype=torch.uint8, pin_memory=self.is_cuda)
            self._arena_np = self._arena.numpy()
            start = 0
        self._used = start + nbytes
        return self._arena_np[start:start + nbytes]

    # -- raw copies (the executor's lone-call path; only with the driver binding) --------

    @property
    def raw(self) -> bool:
        """Whether the raw-address copies below are available (NVIDIA, driver loaded)."""
        return self._driver is not None

    def htod(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from host address ``src`` to device address ``dst`` on the stream.

        From pageable memory the driver stages the bytes before it returns, so
        ``src`` may be reused at once; from page-locked memory the copy runs
        later, in stream order: keep ``src`` until :meth:`wait`.
        """
        self._driver.check(self._driver.htod(dst, src, nbytes, self._handle),
                           "host-to-device copy")

    def dtoh(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from device address ``src`` to host address ``dst`` on the stream."""
        self._driver.check(self._driver.dtoh(dst, src, nbytes, self._handle),
                           "device-to-host copy")

    def wait(self) -> None:
        """Wait (GIL released) until everything queued on the stream has run."""
        self._driver.check(self._driver.sync(self._handle), "stream wait")

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of page-locked arena for this batch (valid until the next :meth:`begin`)."""
        return self._take(nbytes)

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
