"""Weight sets resident on the device, and the atomic name -> set table.

A :class:`WeightSet` is immutable: replacing one swaps a dict entry under a
lock, and a call that already holds the old set finishes on it. Building a
set (validation, fn/fnuz conversion, quantization, the backend's layout) is
device work: the engine runs the ``build*`` methods on its loader thread and
stream (``Engine.load``), off the calls' path, in chunks read into page-locked
buffers while the previous chunk is copied (SPEC 3).

Decision (SPEC 2.1 leaves it open): bf16/fp16/fp32 weights are quantized by
the server, so a ``w_scale`` sent with them is refused as ``bad_field`` rather
than silently ignored.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from moegemm.client._errors import (
    BadDtype,
    BadField,
    BadName,
    BadShape,
    NoSuchFile,
    NoSuchWeights,
    NotFinite,
    OutOfMemory,
    TooLarge,
)
from moegemm.client._names import name_problem
from moegemm.kernels import BLOCK, quantize_weights
from moegemm.kernels._backend import Backend

from ._files import (
    READABLE_DTYPES,
    SAFETENSORS_DTYPES,
    OpenedFile,
    open_file,
    pread_fully,
    read_tensor,
    safetensors_header,
)
from ._priority import yield_cpu
from ._staging import PacedUpload
from ._tensors import (
    FLOATS,
    FP8,
    WIRE_NAMES,
    require_dtype,
    require_positive_finite_scales,
    require_shape,
    to_backend_fp8,
)
from .config import shown

log = logging.getLogger("moegemm.server.store")

def check_name(name: str) -> str:
    """Return ``name`` if it is a valid weight-set name, else raise BadName."""
    problem = name_problem(name)
    if problem is not None:
        raise BadName(problem)
    return name


@dataclass(frozen=True, eq=False)
class WeightSet:
    """One loaded weight set, in the backend's layout on the device. Never mutated."""

    name: str
    G: int
    N: int
    K: int
    layout: str
    wq: torch.Tensor
    w_scale: torch.Tensor
    bytes: int
    created: str

    def describe(self) -> dict:
        """The JSON description of SPEC 2.1 (``GET /v1/weights``)."""
        return {
            "name": self.name,
            "G": self.G,
            "N": self.N,
            "K": self.K,
            "layout": self.layout,
            "bytes": self.bytes,
            "created": self.created,
        }


@dataclass(frozen=True)
class WeightLimits:
    """What one server takes: G, N, K of a set (413 beyond), the bytes of all sets
    together (507 beyond), and device memory a load must leave free for calls."""

    max_g: int = 1024
    max_n: int = 65536
    max_k: int = 65536
    max_total_bytes: int | None = None
    headroom_bytes: int = 0


def set_bytes(G: int, N: int, K: int) -> int:
    """Device bytes of a set: fp8 weights plus float32 block scales."""
    return G * N * K + G * (K // BLOCK) * (N // BLOCK) * 4


class WeightStore:
    """Name -> WeightSet, with builders that validate and place sets on the device."""

    def __init__(
        self,
        backend: Backend,
        weights_dir: Path | None = None,
        limits: WeightLimits | None = None,
        graph_bytes: Callable[[int, int, int], int] | None = None,
    ) -> None:
        self.backend = backend
        self.device = backend.device
        self.weights_dir = weights_dir
        self.limits = limits or WeightLimits()
        # The device memory a new shape's graphs take when its first set loads
        # (Engine.weight_graph_bytes), counted with the set's own bytes.
        self.graph_bytes = graph_bytes or (lambda G, N, K: 0)
        self._sets: dict[str, WeightSet] = {}
        # Names held by an expert set's matrices (server/experts.py): name -> its owner.
        self._owners: dict[str, str] = {}
        self._lock = threading.Lock()

    # -- the table -----------------------------------------------------------

    def get(self, name: str) -> WeightSet:
        """The set called ``name``; NoSuchWeights if there is none."""
        with self._lock:
            ws = self._sets.get(name)
        if ws is None:
            raise NoSuchWeights(f"no weight set named {name!r} is loaded")
        return ws

    def find(self, name: str) -> WeightSet | None:
        """The set called ``name``, or None."""
        with self._lock:
            return self._sets.get(name)

    def list(self) -> list[WeightSet]:
        """All loaded sets, by name."""
        with self._lock:
            return sorted(self._sets.values(), key=lambda ws: ws.name)

    def put(self, ws: WeightSet) -> WeightSet | None:
        """Install ``ws`` under its name, atomically; return the set it replaced, if any.

        OutOfMemory, changing nothing, when the sets would then hold more than
        ``max_total_bytes`` (the builders check first; this settles races between
        two loads built at the same time).
        """
        with self._lock:
            self._check_unowned(ws.name)
            old = self._sets.get(ws.name)
            self._check_total(f"weight set {ws.name!r}", ws.bytes, old.bytes if old else 0)
            self._sets[ws.name] = ws
        return old

    def delete(self, name: str) -> WeightSet:
        """Unload ``name`` and return it; its memory returns to the allocator once the
        calls still holding it end."""
        with self._lock:
            self._check_unowned(name)
            ws = self._sets.pop(name, None)
        if ws is None:
            raise NoSuchWeights(f"no weight set named {name!r} is loaded")
        return ws

    def register(self, owner: str, sets: list[WeightSet]) -> list[WeightSet]:
        """Install ``sets`` together, atomically, as the matrices of expert set ``owner``;
        return the sets they replaced.

        BadName, changing nothing, when a name is held by a plain weight set or by
        another owner (an expert set never clobbers a set loaded on its own);
        OutOfMemory when the total would pass ``max_total_bytes``. The sets stay
        readable (``get``, ``list``) but only ``unregister`` removes or replaces them.
        """
        with self._lock:
            for ws in sets:
                holder = self._owners.get(ws.name)
                if holder != owner and (holder is not None or ws.name in self._sets):
                    what = f"expert set {holder!r}" if holder else "a plain weight set"
                    raise BadName(f"the name {ws.name!r} is taken by {what}; delete it first")
            old = [self._sets[ws.name] for ws in sets if ws.name in self._sets]
            self._check_total(f"expert set {owner!r}", sum(ws.bytes for ws in sets),
                              sum(w.bytes for w in old))
            for ws in sets:
                self._sets[ws.name] = ws
                self._owners[ws.name] = owner
        return old

    def unregister(self, owner: str, names: list[str]) -> list[WeightSet]:
        """Remove the sets ``names`` that expert set ``owner`` holds; return them."""
        with self._lock:
            mine = [n for n in names if self._owners.get(n) == owner]
            for n in mine:
                del self._owners[n]
            return [self._sets.pop(n) for n in mine]

    def refuse_owned(self, name: str) -> None:
        """BadName if ``name`` is an expert set's matrix (checked before a build reads)."""
        with self._lock:
            self._check_unowned(name)

    def _check_unowned(self, name: str) -> None:
        # Called under the lock: an expert set's matrices change only with it.
        owner = self._owners.get(name)
        if owner is not None:
            raise BadName(
                f"weight set {name!r} belongs to expert set {owner!r}; change or delete it "
                f"through /v1/experts/{owner}"
            )

    def check_total(self, what: str, nbytes: int, freed: int = 0) -> None:
        """OutOfMemory if ``what`` (``nbytes``, replacing sets of ``freed`` bytes) would take
        the loaded sets past ``max_total_bytes`` (``MOEGEMM_MAX_WEIGHT_BYTES``)."""
        with self._lock:
            self._check_total(what, nbytes, freed)

    def _check_total(self, what: str, nbytes: int, freed: int) -> None:
        # Called under the lock. A replacement frees its predecessors' bytes.
        limit = self.limits.max_total_bytes
        if limit is None:
            return
        others = sum(ws.bytes for ws in self._sets.values()) - freed
        if others + nbytes > limit:
            raise OutOfMemory(
                f"{what} needs {nbytes} bytes; the loaded sets hold {others} "
                f"of this server's {limit} (MOEGEMM_MAX_WEIGHT_BYTES)"
            )

    def check_room(self, name: str, G: int, N: int, K: int, alongside: int = 0) -> None:
        """Refuse a set before any of it is read: G/N/K over the limits (TooLarge),
        or more bytes than the total limit or the device's free memory allow
        (OutOfMemory); ``alongside``: device bytes another set loaded with this one
        will need too (an expert set's other matrix). Loaded sets and calls in flight
        are not touched."""
        lim = self.limits
        if G > lim.max_g or N > lim.max_n or K > lim.max_k:
            raise TooLarge(
                f"w is [G={G}, N={N}, K={K}]; this server takes at most G={lim.max_g}, "
                f"N={lim.max_n}, K={lim.max_k}"
            )
        nbytes = set_bytes(G, N, K)
        with self._lock:
            old = self._sets.get(name)
            self._check_total(f"weight set {name!r}", nbytes, old.bytes if old else 0)
        if self.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = reusable_cache(self.device)
        # The preshuffle holds a second copy while it works; the headroom stays free
        # for the calls in flight and their buffers.
        copies = 2 if self.backend.weight_layout == "preshuffled" else 1
        graphs = self.graph_bytes(G, N, K)
        need = copies * nbytes + alongside + graphs + lim.headroom_bytes
        if need > free + cached:
            beside = f" with the {alongside} bytes loaded beside it" if alongside else ""
            new = f" and {graphs} bytes for its new shape's graphs" if graphs else ""
            raise OutOfMemory(
                f"weight set {name!r} ([{G}, {N}, {K}], {nbytes} bytes){beside}{new} does not "
                f"fit: {free + cached} bytes of device memory are free, {lim.headroom_bytes} "
                f"of them kept for calls"
            )

    def total_bytes(self) -> int:
        """Device bytes held by all loaded sets."""
        with self._lock:
            return sum(ws.bytes for ws in self._sets.values())

    # -- builders (device work: run them on the engine's thread) ---------------

    def build(self, name: str, w: torch.Tensor, w_scale: torch.Tensor | None) -> WeightSet:
        """Build a set from host tensors: fp8 ``w`` with ``w_scale``, or float ``w``."""
        check_name(name)
        self.refuse_owned(name)
        require_dtype(w, FP8 + FLOATS, "w")
        if w.dim() != 3:
            raise BadShape(f"w has shape {list(w.shape)}; expected 3-D [G, N, K]")
        check_matrix(tuple(w.shape), w.dtype, w_scale)
        return self._assemble(name, tuple(w.shape), w.dtype, _MemoryGroups(w), w_scale)

    def build_from_file(
        self, name: str, file: str, w_key: str, w_scale_key: str | None
    ) -> WeightSet:
        """Build a set from a safetensors file under ``weights_dir``, read in chunks
        straight into page-locked buffers (host memory holds two chunks, never the set)."""
        check_name(name)
        self.refuse_owned(name)
        path = self.resolve(file)
        try:
            handle = open(path, "rb")  # noqa: SIM115 -- closed below, after the read
        except OSError as exc:
            raise NoSuchFile(f"cannot open {file!r} in the weights directory: {exc}") from exc
        with handle:
            entries, data_start = safetensors_header(handle, file)
            for key in (w_key, w_scale_key):
                if key is not None and key not in entries:
                    raise NoSuchFile(f"file {file!r:.200} holds no tensor {key!r:.200}")
            w_entry = entries[w_key]
            dtype = SAFETENSORS_DTYPES.get(w_entry["dtype"])
            if dtype is None:
                raise BadDtype(
                    f"tensor {w_key!r:.200} is {w_entry['dtype']!r:.100}; expected one of "
                    f"{sorted(SAFETENSORS_DTYPES)}"
                )
            shape = tuple(w_entry["shape"])
            if len(shape) != 3:
                raise BadShape(f"tensor {w_key!r:.200} has shape {shown(list(shape))}; "
                               "expected [G, N, K]")
            w_scale = None
            if w_scale_key is not None:
                w_scale = _scale_from_file(handle, entries[w_scale_key], data_start, w_scale_key,
                                           shape)
            check_matrix(shape, dtype, w_scale)
            log.info("loading %r from %r (%s %s)", name, path, WIRE_NAMES[dtype], list(shape))
            source = _FileGroups(handle.fileno(), data_start + w_entry["data_offsets"][0])
            return self._assemble(name, shape, dtype, source, w_scale)

    def build_demo(self, name: str = "demo", G: int = 8, N: int = 256, K: int = 512) -> WeightSet:
        """A random bf16 set quantized by the server, so a fresh server answers calls."""
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn((G, N, K), generator=gen) * 0.05).to(torch.bfloat16)
        return self.build(name, w, None)

    def resolve(self, file: str | OpenedFile) -> OpenedFile:
        """``file`` opened (symlinks followed) strictly under ``weights_dir``, race-free
        (``_files.open_beneath``), and checked to be a regular file; an ``OpenedFile``
        as it is (``routes.put_weights`` opens files before the engine's thread
        builds from them, so a slow path never holds up calls).

        Errors are the contract's: 400 ``bad_field`` for a path outside the
        directory, too long or not openable, 404 ``no_such_file`` for one that
        is missing or not a file; messages quote at most 200 characters of it.
        """
        if isinstance(file, OpenedFile):
            return file
        if self.weights_dir is None:
            raise BadField("this server has no weights directory (MOEGEMM_WEIGHTS_DIR)")
        return open_file(self.weights_dir, file)

    def _assemble(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        source: _Groups | Callable[[int], torch.Tensor],
        w_scale: torch.Tensor | None,
        label: str = "w",
    ) -> WeightSet:
        """The matrix on the device in the backend's layout; ``shape``, ``dtype`` and
        ``w_scale`` passed :func:`check_matrix` (its caller's one check, before any
        reading). ``label``: the matrix as the client named it, in messages (``w``,
        ``w13``, ...)."""
        if not isinstance(source, _Groups):
            source = _CallableGroups(source)
        G, N, K = shape
        self.check_room(name, G, N, K)
        try:
            wq, scales = self._upload(name, shape, dtype, source, w_scale, label)
            wq, scales = self.backend.prepare_weights(wq, scales)
        except torch.OutOfMemoryError as exc:
            # Everything built so far is local: dropping it leaves other sets intact.
            raise OutOfMemory(
                f"the device cannot hold weight set {name!r} ([{G}, {N}, {K}]): {exc}"
            ) from exc
        nbytes = wq.numel() * wq.element_size() + scales.numel() * scales.element_size()
        log.info("weight set %r ready: G=%d N=%d K=%d, %d bytes", name, G, N, K, nbytes)
        return WeightSet(
            name=name,
            G=G,
            N=N,
            K=K,
            layout=self.backend.weight_layout,
            wq=wq,
            w_scale=scales,
            bytes=nbytes,
            created=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        )

    def _upload(self, name, shape, dtype, source: _Groups, w_scale, label: str = "w"):
        """The groups to the device in chunks on the current stream (the engine's loader
        stream): chunk ``i + 1`` is read into one page-locked buffer while chunk ``i``
        goes to the device from the other, in paced pieces (``_staging.PacedUpload``:
        the calls' copies never wait behind a whole chunk); the contents are checked on
        the device and judged once, at the end (NotFinite naming the first bad group)."""
        G, N, K = shape
        fp8 = self.backend.fp8_dtype
        dev = self.device
        on_gpu = dev.type == "cuda"
        wq = torch.empty(shape, dtype=fp8, device=dev)
        scales = torch.empty((G, K // BLOCK, N // BLOCK), dtype=torch.float32, device=dev)
        item = torch.empty((), dtype=dtype).element_size()
        group_bytes = N * K * item
        per_chunk = max(1, min(G, _CHUNK_BYTES // group_bytes))
        chunks = [(g0, min(G, g0 + per_chunk)) for g0 in range(0, G, per_chunk)]
        staging = [torch.empty(per_chunk * group_bytes, dtype=torch.uint8, pin_memory=on_gpu)
                   .numpy() for _ in range(min(2, len(chunks)))]

        def host(i: int) -> np.ndarray:
            """Chunk ``i``'s bytes in its staging buffer (the last chunk may hold fewer
            groups than the buffer)."""
            g0, g1 = chunks[i]
            return staging[i % 2][: (g1 - g0) * group_bytes]

        bad = torch.zeros(G, dtype=torch.bool, device=dev)
        as_is = dtype == fp8
        if dtype in FP8:
            scale_dev = w_scale.to(dev, non_blocking=on_gpu)
            if as_is:
                scales.copy_(scale_dev)
        progress = _Progress(name, G, dev, large=G * N * K >= 1 << 30)
        upload = PacedUpload(dev)
        try:
            reading = source.start(*chunks[0], group_bytes, host(0))
            for i, (g0, g1) in enumerate(chunks):
                reading.result()  # chunk i is in staging[i % 2]
                if i + 1 < len(chunks):
                    # The other buffer's copies (chunk i - 1) have left it: read on into it.
                    upload.wait()
                    reading = source.start(*chunks[i + 1], group_bytes, host(i + 1))
                chunk = wq[g0:g1] if as_is else torch.empty((g1 - g0, N, K), dtype=dtype,
                                                              device=dev)
                upload.copy(chunk, host(i))
                if dtype in FP8:
                    bad[g0:g1] = _fp8_nan(chunk).flatten(1).any(1)
                    if not as_is:
                        q, s = to_backend_fp8(chunk, scale_dev[g0:g1], fp8)
                        wq[g0:g1].copy_(q)
                        scales[g0:g1].copy_(s)
                else:
                    bad[g0:g1] = ~torch.isfinite(chunk).flatten(1).all(1)
                    q, s = quantize_weights(chunk, fp8)
                    wq[g0:g1].copy_(q)
                    scales[g0:g1].copy_(s)
                progress.sent(g0, g1)
        finally:
            upload.close()
        first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else None  # the one sync
        if first is not None:
            what = "fp8 NaN encodings" if dtype in FP8 else "NaN or Inf"
            error = NotFinite(f"{label}[{first}] holds {what}")
            # The checkpoint reader names the group's tensors from these.
            error.matrix, error.group, error.found = label, first, what
            raise error
        return wq, scales


class _Progress:
    """A load's progress in the log (SPEC 2.1): each tenth of the groups at INFO for a set
    of 2^30 elements or more (DEBUG below), and at INFO whenever ``_PROGRESS_S`` passed
    since the load's last line, so a slow load of any size is never silent."""

    def __init__(self, name: str, G: int, device, large: bool) -> None:
        self.name, self.G, self.device = name, G, device
        self.step = max(1, G // 10)
        self.level = logging.INFO if large else logging.DEBUG
        self.last = time.monotonic()

    def sent(self, g0: int, g1: int) -> None:
        """Groups ``g0:g1`` are on their way to the device."""
        now = time.monotonic()
        tenth = (g1 // self.step) != (g0 // self.step) or g1 == self.G
        level = logging.INFO if now - self.last >= _PROGRESS_S else self.level if tenth else None
        if level is not None and log.isEnabledFor(level):
            log.log(level, "%r: %d/%d groups on %s", self.name, g1, self.G, self.device)
            if level == logging.INFO:
                self.last = now


# Seconds a load may go without a progress line in the log.
_PROGRESS_S = 2.0
# Bytes read and copied per step of a load (two such page-locked buffers per load).
_CHUNK_BYTES = 64 << 20
# Threads reading one chunk of a file at once (each a slice; page-cache copies
# scale with them up to the memory bandwidth).
_READERS = 4


class _Groups:
    """Where a weight set's groups come from: ``read(g0, g1, group_bytes, dst)`` fills
    ``dst`` (uint8) with groups ``g0:g1``'s raw bytes; ``start`` does it in the
    background where it can (a file), ``.result()`` of what it returns waits."""

    def read(self, g0: int, g1: int, group_bytes: int, dst: np.ndarray) -> None:
        raise NotImplementedError

    def start(self, g0: int, g1: int, group_bytes: int, dst: np.ndarray):
        done = concurrent.futures.Future()
        try:
            self.read(g0, g1, group_bytes, dst)
        except BaseException as exc:  # noqa: BLE001 -- raised by .result(), as a background read's is
            done.set_exception(exc)
        else:
            done.set_result(None)
        return done


class _MemoryGroups(_Groups):
    """Groups of a host tensor (a body's ``w``)."""

    def __init__(self, w: torch.Tensor) -> None:
        self._bytes = w.contiguous().view(-1).view(torch.uint8).numpy()

    def read(self, g0, g1, group_bytes, dst) -> None:
        np.copyto(dst, self._bytes[g0 * group_bytes: g1 * group_bytes])


class _CallableGroups(_Groups):
    """Groups given one at a time as host tensors (``g -> [N, K]``): an expert set's
    matrices from a checkpoint, one expert's tensors per call."""

    def __init__(self, group: Callable[[int], torch.Tensor]) -> None:
        self._group = group

    def read(self, g0, g1, group_bytes, dst) -> None:
        for g in range(g0, g1):
            one = self._group(g).contiguous().view(-1).view(torch.uint8).numpy()
            if len(one) != group_bytes:
                raise BadShape(f"group {g} holds {len(one)} bytes; expected {group_bytes}")
            dst[(g - g0) * group_bytes:(g - g0 + 1) * group_bytes] = one


def check_matrix(shape: tuple[int, ...], dtype: torch.dtype, w_scale: torch.Tensor | None,
                 label: str = "w", scale_text: str = "[G, K/128, N/128]") -> None:
    """The one check of a matrix ``shape`` ``(G, N, K)`` of ``dtype`` and its scales (fp8
    needs float32 ``[G, K/128, N/128]``, finite and > 0; other dtypes take none), before
    any of it is read: ``label`` and ``scale_text`` name them as the client did (an expert
    set's ``w13`` scales are ``[G, H/128, 2I/128]``)."""
    G, N, K = shape
    if G < 1 or N < 1 or K < 1 or N % BLOCK or K % BLOCK:
        raise BadShape(
            f"{label} has shape [G={G}, N={N}, K={K}]; need G >= 1 and N, K positive "
            f"multiples of {BLOCK}"
        )
    if dtype in FP8:
        if w_scale is None:
            raise BadField(f"fp8 {label} needs {label}_scale (float32 {scale_text})")
        require_dtype(w_scale, (torch.float32,), f"{label}_scale")
        require_shape(w_scale, (G, K // BLOCK, N // BLOCK), f"{label}_scale", scale_text)
        require_positive_finite_scales(w_scale, f"{label}_scale")
    elif w_scale is not None:
        raise BadField(
            f"{label}_scale is only for fp8 {label}; bf16/fp16/fp32 weights are quantized "
            f"by the server"
        )


def _scale_from_file(handle, entry: dict, data_start: int, key: str,
                     w_shape: tuple[int, ...]) -> torch.Tensor:
    """A file's ``w_scale`` tensor, read only if it has the one dtype and shape a set of
    ``w_shape`` takes (float32 ``[G, K/128, N/128]``); else a tensor of its header's dtype
    and shape without data, which :func:`check_matrix` refuses as it refuses an upload. A key
    naming another large tensor (a swapped key: a layer's w2 is gigabytes) is never read
    into host memory to be refused."""
    dtype = READABLE_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise BadDtype(f"tensor {key!r:.200} is {entry['dtype']!r:.100}; w_scale is float32")
    G, N, K = w_shape
    if dtype == torch.float32 and list(entry["shape"]) == [G, K // BLOCK, N // BLOCK]:
        return read_tensor(handle, entry, data_start, key)
    return torch.empty(entry["shape"], dtype=dtype, device="meta")


class _FileGroups(_Groups):
    """Groups of a tensor at byte ``start`` of an open file: positioned reads straight
    into the page-locked buffer (no memory map, no intermediate copy), ``_READERS`` at
    once, in the background (``start``) while the loader thread sends the last chunk."""

    def __init__(self, fd: int, start: int) -> None:
        self._fd = fd
        self._start = start
        self._pool = None

    def read(self, g0, g1, group_bytes, dst) -> None:
        self.start(g0, g1, group_bytes, dst).result()

    def start(self, g0, g1, group_bytes, dst):
        total = len(dst)
        at = self._start + g0 * group_bytes
        piece = -(-total // _READERS)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(_READERS, initializer=yield_cpu)
        view = memoryview(dst)
        spans = [self._pool.submit(self._pread, view[a:min(total, a + piece)], at + a)
                 for a in range(0, total, piece)]
        return _AllDone(spans)

    def _pread(self, view: memoryview, offset: int) -> None:
        if not pread_fully(self._fd, view, offset):
            raise BadField("the weights file ends before its tensor's data")

    def __del__(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class _AllDone:
    """``.result()`` of several futures: waits for all, then raises the first failure."""

    def __init__(self, futures: list) -> None:
        self._futures = futures

    def result(self) -> None:
        concurrent.futures.wait(self._futures)
        for future in self._futures:
            future.result()


def _fp8_nan(q: torch.Tensor) -> torch.Tensor:
    """Where fp8 data holds a NaN encoding (fn: 0x7F/0xFF, fnuz: 0x80)."""
    bits = q.view(torch.uint8)
    if q.dtype == torch.float8_e4m3fn:
        return (bits & 0x7F) == 0x7F
    return bits == 0x80


def reusable_cache(device: torch.device) -> int:
    """Device memory the caching allocator holds free for any new tensor: the free blocks of
    its own pool. A CUDA graph pool's free blocks (the graphs' temporaries between
    replays) serve only its graphs, so they are not counted."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return sum(s["total_size"] - s["active_size"]
               for s in torch.cuda.memory_snapshot()
               if s["device"] == index and tuple(s.get("segment_pool_id", (0, 0))) == (0, 0))
