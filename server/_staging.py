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

import math
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ._merge import MergePlan

# The stream each thread last made current through Staging.enter (torch's own
# lookup costs more than the switch it would save).
_current = threading.local()

# Bodies above this are weight uploads, not calls: pinning them would hold page-
# locked memory the size of a weight set for one request.
_PIN_BODIES_UP_TO = 64 << 20


def pinned_body_allocator() -> Callable[[int], memoryview]:
    """Request-body buffers in page-locked memory (for the HTTP transport).

    The engine then uploads a call's rows straight from the body, with no host
    copy. Blocks come from torch's caching host allocator and return to it when
    the last view of the body is gone.
    """

    def allocate(size: int) -> memoryview:
        if size > _PIN_BODIES_UP_TO:
            return memoryview(bytearray(size))
        return memoryview(torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy())

    return allocate


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

    def gather_rows(self, parts: Sequence[torch.Tensor], plan: MergePlan) -> torch.Tensor:
        """The parts' rows in one pinned buffer, in ``plan``'s launch order: the only
        host copy of the rows. A merged plan regroups them per expert as they are
        copied (concatenated row ``c`` lands on row ``plan.scatter[c]``)."""
        if len(parts) == 1 and parts[0].is_pinned() == self.is_cuda and parts[0].is_contiguous():
            return parts[0]  # already staged (e.g. a body read straight into pinned memory)
        staged = self.host_empty((plan.total, *parts[0].shape[1:]), parts[0].dtype)
        if plan.is_identity:
            start = 0
            for part in parts:
                stop = start + part.shape[0]
                staged[start:stop].copy_(part)
                start = stop
            return staged
        dst = _rows(staged)
        for part, a, b in zip(parts, plan.offsets[:-1], plan.offsets[1:]):
            dst[plan.scatter[a:b]] = _rows(part)  # one memcpy per row, in C
        return staged

    def split_rows(self, out: torch.Tensor, plan: MergePlan) -> list[torch.Tensor]:
        """Each call's rows of a launch's host output ``out``, in the call's own order."""
        if plan.is_identity:
            return [out[a:b] for a, b in zip(plan.offsets[:-1], plan.offsets[1:])]
        src = _rows(out)
        row_bytes = src.dtype.itemsize
        parts = []
        for a, b in zip(plan.offsets[:-1], plan.offsets[1:]):
            if a == b:  # numpy gives an empty take zero strides, which torch cannot view
                parts.append(out[:0].clone())
            else:
                taken = src[plan.scatter[a:b]].view(np.uint8).reshape(b - a, row_bytes)
                parts.append(torch.from_numpy(taken).view(out.dtype).view(b - a, *out.shape[1:]))
        return parts

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host ``src`` into device ``dst``, in order on the engine stream."""
        dst.copy_(src, non_blocking=self.is_cuda)

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


def _rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's rows as a 1-D numpy array of opaque row-sized items.

    Fancy indexing then moves whole rows with one memcpy each; on uint8 ``[rows,
    bytes]`` it copied byte by byte (~2 ms for a merged batch of 768 rows of
    7168 on the H200's host).
    """
    row = math.prod(t.shape[1:]) * t.element_size()
    flat = t.reshape(-1).view(torch.uint8).numpy()
    return flat.view(np.dtype((np.void, row))) if row else flat.reshape(t.shape[0], 0)
