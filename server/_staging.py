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

A call that needs no conversion goes to the graph's static buffers by one copy
per input from where its body lies (``Executor._run_graph``), and its result
comes back into a reused page-locked arena (:meth:`Staging.take`): on NVIDIA
the copies are the CUDA driver's own calls through ``cuda-bindings``
(:class:`_DriverCopies`), elsewhere torch's (:class:`_TorchCopies`) -- one
copy path per device family, chosen once per process.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings
import weakref
from collections import deque
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
# Below this a body's rows reach the device as fast from pageable memory (the
# driver stages them): pinning it would cost a host-allocator round trip on the
# event loop for nothing.
_PIN_BODIES_FROM = 64 << 10

# A load's host-to-device copies (:class:`PacedUpload`) go in pieces of this many
# bytes, at most ``_LOAD_AHEAD`` of them queued on the device at once. Calls'
# copies share the copy engines and PCIe with them, and a call's 0.9 MB waits
# behind whatever load pieces are queued ahead of it: 8 MiB pieces (~0.35 ms each
# at 24 GB/s) took a 128-row call's p99 during replacement loads of a 7.5 GB set
# to 2.14-2.26x its idle p99, 2 MiB to 2.09-2.15x, 1 MiB to 1.49-1.66x (H100
# host, three runs each, session 39), with the loads' median rate unchanged
# (23.6-24.6 GB/s). Two pieces queued keep the load's copies going between the
# loader thread's turns.
_LOAD_PIECE = 1 << 20
_LOAD_AHEAD = 2


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


class _DriverCopies:
    """The CUDA driver's async copies and stream wait, through ``cuda-bindings``.

    A ``torch`` copy between host and device costs ~15-30 us of Python and
    dispatch on the H200's host; a driver call costs a few. A small call makes
    four (rows, scales, the launch's words up; the result down), so with torch
    copies a lone one-row call spent more time in copy bookkeeping than on the
    GPU (``bench/SERVICE_NOTES.md``, v4: executor 342 -> 108 us at M=1). The
    copies are enqueued on the engine's stream, in order with its graph replays.
    """

    def __init__(self, stream: torch.cuda.Stream) -> None:
        from cuda.bindings import driver  # the `cuda` extra; NVIDIA only, imported here

        self._htod = driver.cuMemcpyHtoDAsync
        self._dtoh = driver.cuMemcpyDtoHAsync
        self._sync = driver.cuStreamSynchronize
        self._stream = driver.CUstream(stream.cuda_stream)
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._spare: list = []  # events for mark(), created on first use

    def _check(self, result: tuple, what: str) -> None:
        if result[0] != self._ok:
            raise RuntimeError(f"CUDA driver {what} failed with {result[0]!r}")

    def htod(self, dst: torch.Tensor, at: int, dst_addr: int, src, src_addr: int,
             nbytes: int) -> None:
        self._check(self._htod(dst_addr, src_addr, nbytes, self._stream), "host-to-device copy")

    def dtoh(self, dst: np.ndarray, src_addr: int, src: torch.Tensor, nbytes: int) -> None:
        self._check(self._dtoh(address(dst), src_addr, nbytes, self._stream),
                    "device-to-host copy")

    def wait(self) -> None:
        self._check(self._sync(self._stream), "stream wait")

    def mark(self):
        """A mark of everything queued on the stream so far (an event, reused)."""
        from cuda.bindings import driver

        event = self._spare.pop() if self._spare else None
        if event is None:
            result, event = driver.cuEventCreate(
                int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING))
            self._check((result,), "event creation")
        self._check(driver.cuEventRecord(event, self._stream), "event record")
        return event

    def wait_mark(self, event) -> None:
        """Wait (GIL released) until the work before ``event`` has run; reuse it."""
        from cuda.bindings import driver

        self._check(driver.cuEventSynchronize(event), "event wait")
        self._spare.append(event)

    def close(self) -> None:
        """Destroy the marks' events (none may be pending)."""
        from cuda.bindings import driver

        while self._spare:
            driver.cuEventDestroy(self._spare.pop())


class _TorchCopies:
    """The same copies through torch (ROCm, the CPU, or NVIDIA without cuda-bindings)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._async = stream is not None

    def htod(self, dst: torch.Tensor, at: int, dst_addr: int, src, src_addr: int,
             nbytes: int) -> None:
        # ``dst`` is a flat uint8 device view; the destination starts at byte ``at``.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only body: never written
            host = torch.frombuffer(src, dtype=torch.uint8, count=nbytes)
        dst[at:at + nbytes].copy_(host, non_blocking=self._async)

    def dtoh(self, dst: np.ndarray, src_addr: int, src: torch.Tensor, nbytes: int) -> None:
        torch.from_numpy(dst).copy_(src[:nbytes], non_blocking=self._async)

    def wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def mark(self):
        if self._stream is None:
            return None  # the copies were synchronous
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait_mark(self, event) -> None:
        if event is not None:
            event.synchronize()

    def close(self) -> None:
        pass


def _copies(device: torch.device, stream):
    """The copy path of this device family, chosen once."""
    if device.type == "cuda" and torch.version.hip is None:
        try:
            return _DriverCopies(stream)
        except ImportError as exc:
            log.warning("cuda-bindings is not installed (%s; pip install 'moegemm[cuda]'): "
                        "host-device copies go through torch, ~4x slower per small call", exc)
    return _TorchCopies(stream)


class PacedUpload:
    """A load's host-to-device copies on the current stream (the engine's loader
    stream), in pieces of ``_LOAD_PIECE`` bytes with at most ``_LOAD_AHEAD`` of them
    queued (see ``_LOAD_PIECE``), through the device family's copy path."""

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._copies = _copies(device, stream)
        self._marks: deque = deque()

    def copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Copy host bytes ``src`` (uint8; page-locked, kept until :meth:`wait`) into
        contiguous device tensor ``dst`` of the same size."""
        flat = dst.view(-1).view(torch.uint8)
        dst_addr, src_addr = flat.data_ptr(), src.ctypes.data
        for at in range(0, src.nbytes, _LOAD_PIECE):
            if len(self._marks) >= _LOAD_AHEAD:
                self._copies.wait_mark(self._marks.popleft())
            n = min(_LOAD_PIECE, src.nbytes - at)
            self._copies.htod(flat, at, dst_addr + at, src[at:at + n], src_addr + at, n)
            self._marks.append(self._copies.mark())

    def wait(self) -> None:
        """Wait until every copy made so far has run (their host memory is free again)."""
        while self._marks:
            self._copies.wait_mark(self._marks.popleft())

    def close(self) -> None:
        """Wait for what is queued, then free the marks (also after a failed load)."""
        try:
            self.wait()
        finally:
            self._copies.close()


def address(data) -> int:
    """The host address of a bin's bytes (a bytes object, a byte view on a body, or a
    numpy array)."""
    if type(data) is bytes:
        return _bytes_address(data)  # ~5x cheaper than through numpy
    try:
        # Any writable buffer (the transport's bodies, numpy arrays): ~0.2 us, where
        # numpy's ``frombuffer(...).ctypes.data`` costs ~2.5 us, three times a call.
        return _addressof(_c_char.from_buffer(data))
    except (TypeError, ValueError, BufferError):  # read-only, empty or strided
        if type(data) is np.ndarray:
            return data.ctypes.data
        return np.frombuffer(data, dtype=np.uint8).ctypes.data


_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype = ctypes.c_void_p
_bytes_address.argtypes = [ctypes.py_object]
_addressof, _c_char = ctypes.addressof, ctypes.c_char


class Staging:
    """Pinned host memory, the engine's own CUDA stream and its copies, on one device.

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
        # High priority: the calls' kernels are scheduled before those of a load or a
        # capture on the loader's stream (default priority, the lowest).
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.is_cuda else None
        self._done = torch.cuda.Event() if self.is_cuda else None
        self._copies = _copies(self.device, self.stream)
        # The batch arena: page-locked host memory reused by every batch (one
        # batch at a time, each waited for before the next), where small
        # results land (:meth:`take`, :meth:`begin`).
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

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of page-locked arena for this batch (valid until the next :meth:`begin`;
        grown, never shrunk, when too small)."""
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

    # -- copies by address (the graph path) ------------------------------------------

    def htod(self, dst: torch.Tensor, at: int, dst_addr: int, src, nbytes: int) -> None:
        """Copy ``nbytes`` of host bytes ``src`` (a bytes object, byte view or array) to
        byte ``at`` of flat uint8 device view ``dst`` (whose address there is
        ``dst_addr``), on the stream.

        From pageable memory the bytes are staged before this returns, so ``src``
        may be reused at once; from page-locked memory the copy runs later, in
        stream order: keep ``src`` until :meth:`wait`.
        """
        self._copies.htod(dst, at, dst_addr, src, address(src), nbytes)

    def dtoh(self, dst: np.ndarray, src: torch.Tensor, src_addr: int, nbytes: int) -> None:
        """Copy ``nbytes`` from device address ``src_addr`` (the start of flat uint8
        device view ``src``) to host array ``dst`` on the stream."""
        self._copies.dtoh(dst, src_addr, src, nbytes)

    def wait(self) -> None:
        """Wait (GIL released) until everything queued on the stream has run."""
        self._copies.wait()

    # -- tensors (the general path) ------------------------------------------------

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
