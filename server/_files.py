"""Weights files under the weights directory (SPEC 2.1, 5.3): a client's path opened
strictly beneath the directory, race-free, and a safetensors file's header and small
tensors read from the descriptor opened there.

Errors are the contract's: 400 ``bad_field`` for a path outside the directory, too
long or not openable, or a file that is not safetensors; 404 ``no_such_file`` for one
that is missing. Messages quote at most about 200 characters of what the client sent.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import weakref
from collections import deque
from pathlib import Path

import torch
from moegemm.client._errors import BadDtype, BadField, NoSuchFile

from .config import shown

# safetensors' dtype names for the dtypes a weight file may hold: either fp8 encoding, as over
# the wire (SPEC 1.2: the server converts to its device's).
SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}


_PATH_MAX = 4096  # Linux's PATH_MAX: a longer path never names a file
_NAME_MAX = 255
_SYMLINK_HOPS = 40  # as the kernel's own limit


class OpenedFile(os.PathLike):
    """A weights file opened under the weights directory: its descriptor (closed
    when this object is dropped), named as ``/proc/self/fd/N`` so that what opens
    that path (a checkpoint's shards and index) reads the very file checked here,
    whatever was renamed or swapped in the directory since."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self._close = weakref.finalize(self, os.close, fd)

    def __fspath__(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def __str__(self) -> str:
        return self.__fspath__()

    def __repr__(self) -> str:
        return shown(self.name)

    def close(self) -> None:
        self._close()


def _within(root: Path, file: str) -> str | None:
    """``file`` spelled relative to ``root`` when its spelling starts inside it, else None.

    A relative path that does not begin by climbing is kept as it is. An absolute one that
    begins with the directory's own path (as configured or as resolved), or a relative one whose
    leading ``..`` climb out of it and whose next names lead straight back in (``../weights/x``),
    loses that prefix, name by name. Nothing else is folded: the rest, ``..`` and symlinks
    included, is left to the walk that opens it (:func:`open_beneath`), which judges every
    symlink (SPEC 2.1 refuses only a path that resolves outside)."""
    names = [p for p in file.split("/") if p not in ("", ".")]
    climbs = next((i for i, p in enumerate(names) if p != ".."), len(names))
    if not file.startswith("/") and climbs == 0:
        return file
    for base in dict.fromkeys((os.path.abspath(root), os.path.realpath(root))):
        parts = [p for p in base.split("/") if p]
        if file.startswith("/"):
            prefix = parts
        else:  # climb ``climbs`` levels above the directory, then name the way back down
            prefix = parts[len(parts) - climbs:] if 0 < climbs <= len(parts) else None
            names_after = names[climbs:]
            if prefix is not None and names_after[:len(prefix)] == prefix and len(names_after) > len(prefix):
                return "/".join(names_after[len(prefix):])
            continue
        if names[:len(prefix)] == prefix and len(names) > len(prefix):
            return "/".join(names[len(prefix):])
    return None


def open_beneath(root: Path, file: str) -> int:
    """A descriptor of ``file`` opened strictly under ``root``, race-free.

    ``file`` is first spelled relative to ``root`` (:func:`_within`). Each step
    is then an ``openat`` from the descriptor of the directory above it, with
    O_NOFOLLOW: a symlink is read (``readlinkat``) and its target walked the
    same way, relative to where it lies, so a directory swapped for a symlink
    between two steps is seen as one and judged, never followed blindly. A
    symlink's absolute target is spelled relative to ``root`` the same way and
    walked again from it. A spelling or a ``..`` that leaves ``root`` on the way is not yet
    outside: the path is then resolved by the filesystem (:func:`_resolved_within`), and one
    that resolves inside (``sub/../../weights/x``) is walked again by its resolved spelling.
    """
    outside = BadField(f"file {shown(file)} resolves outside the weights directory")
    try:
        relative = _within(root, file)
        if relative is None:
            raise outside
        return _walk(root, file, relative, outside)
    except BadField as exc:
        if exc is not outside:
            raise
        resolved = _resolved_within(root, file)
        if resolved == os.curdir:
            raise _the_directory(file) from None
        if resolved is None:
            raise
        return _walk(root, file, resolved, outside)


def _the_directory(file: str) -> NoSuchFile:
    return NoSuchFile(f"no file {shown(file)}: it names the weights directory itself")


def _resolved_within(root: Path, file: str) -> str | None:
    """``file``'s path (relative to ``root``, or absolute) resolved by the filesystem, spelled
    relative to ``root``'s own resolved path: ``.`` for the directory itself, None outside it."""
    try:
        base = os.path.realpath(root)
        resolved = os.path.realpath(os.path.join(base, file))
    except (OSError, ValueError):  # a NUL byte, a loop
        return None
    relative = os.path.relpath(resolved, base)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return None
    return relative


def _walk(root: Path, file: str, relative: str, outside: BadField) -> int:
    """:func:`open_beneath`'s walk of ``relative`` (``file`` as spelled: for messages);
    ``outside`` raised where it leaves ``root``."""
    parts = deque(p for p in relative.split("/") if p not in ("", "."))
    if not parts:
        raise _the_directory(file)
    try:
        stack = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    except OSError as exc:  # the configured directory itself is missing or no directory
        raise NoSuchFile(f"no file {shown(file)}: the weights directory {shown(str(root))} cannot be "
                         f"opened ({exc.strerror}; MOEGEMM_WEIGHTS_DIR)") from exc
    hops = 0
    try:
        while True:
            part = parts.popleft()
            if part == "..":
                if len(stack) == 1:
                    raise outside
                os.close(stack.pop())
                if not parts:  # a directory: the weights directory itself, or one in it
                    if len(stack) == 1:
                        raise _the_directory(file)
                    raise NoSuchFile(f"no file {shown(file)} in the weights directory")
                continue
            if len(part.encode(errors="surrogateescape")) > _NAME_MAX:
                raise BadField(f"file {shown(file)} has a name over {_NAME_MAX} bytes")
            last = not parts
            # O_NONBLOCK: a FIFO must not hang the open (it is refused below).
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            if not last:
                flags |= os.O_DIRECTORY
            try:
                fd = os.open(part, flags, dir_fd=stack[-1])
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    # A symlink (O_NOFOLLOW), or a file where a folder was asked.
                    try:
                        target = os.readlink(part, dir_fd=stack[-1])
                    except OSError as again:
                        if not (exc.errno == errno.ELOOP and again.errno == errno.EINVAL):
                            raise NoSuchFile(f"no file {shown(file)} in the weights "
                                             f"directory") from None
                        target = None  # a link when opened, not now: look again
                    hops += 1
                    if hops > _SYMLINK_HOPS:
                        raise BadField(f"file {shown(file)} has too many symlinks "
                                       f"(or keeps changing)") from None
                    if target is None:
                        parts.appendleft(part)
                        continue
                    if target.startswith("/"):  # walked again from the root, if it is under it
                        target = _within(root, target)
                        if target is None:
                            raise outside from None
                        while len(stack) > 1:
                            os.close(stack.pop())
                    parts.extendleft(reversed([p for p in target.split("/")
                                               if p not in ("", ".")]))
                    if not parts:
                        raise outside from None
                    continue
                if exc.errno == errno.ENOENT:
                    raise NoSuchFile(f"no file {shown(file)} in the weights directory") from None
                raise BadField(f"file {shown(file)} cannot be opened: "
                               f"{os.strerror(exc.errno or 0)}") from None
            if last:
                return fd
            stack.append(fd)
    finally:
        for fd in stack:
            os.close(fd)


def safetensors_header(handle, file: str) -> tuple[dict, int]:
    """A safetensors file's tensor entries (dtype, shape, data_offsets checked against
    the file's size) and where its data starts. Read here, not through the safetensors
    library: its readers memory-map the file (a truncated shard then killed the server
    with SIGBUS), and this reads from a descriptor opened beneath the weights directory
    with a bounded header."""
    size = os.fstat(handle.fileno()).st_size
    try:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError(f"the file is {size} bytes, too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if not 0 < n <= min(size - 8, HEADER_LIMIT):
            raise ValueError(f"the header is {n} bytes; this server reads at most "
                             f"{HEADER_LIMIT} (and no more than the file holds)")
        entries = json.loads(handle.read(n))
        if not isinstance(entries, dict):
            raise TypeError("header is not a map")
        entries.pop("__metadata__", None)
        data_start, room = 8 + n, size - 8 - n
        for key, e in entries.items():
            begin, end = e["data_offsets"]
            known = _ST_ITEMSIZE.get(e["dtype"])
            if not (isinstance(e["shape"], list) and all(
                    type(d) is int and d >= 0 for d in e["shape"])):
                raise ValueError(f"tensor {key!r} has a bad shape")
            if math.prod(d for d in e["shape"] if d) >= 1 << 63:
                # Empty (a 0 among them) but past int64 in its other extents: no tensor holds it.
                raise ValueError(f"tensor {key!r} has extents past int64")
            if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= room):
                raise ValueError(f"tensor {key!r} lies outside the file")
            if known is not None and end - begin != math.prod(e["shape"]) * known:
                raise ValueError(f"tensor {key!r} has {end - begin} bytes for its shape")
    except (ValueError, KeyError, TypeError, OSError, RecursionError) as exc:
        # RecursionError: JSON nested deeper than the parser's stack (never a real header).
        raise BadField(f"file {file!r} is not a readable safetensors file: {exc}") from exc
    return entries, data_start


def read_tensor(handle, entry: dict, data_start: int, key: str) -> torch.Tensor:
    """A tensor of the file (a weight set's scales, a checkpoint's expert matrix), on the
    host, read with ``pread`` (never mapped: a file cut short while it is read is a short
    read, not a SIGBUS)."""
    dtype = READABLE_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise BadDtype(f"tensor {key!r:.200} is {entry['dtype']!r:.100}, which this server "
                       "does not read")
    begin, end = entry["data_offsets"]
    if end == begin:
        return torch.empty(entry["shape"], dtype=dtype)
    out = torch.empty(end - begin, dtype=torch.uint8)  # not zero-filled, unlike a bytearray
    if not pread_fully(handle.fileno(), memoryview(out.numpy()), data_start + begin):
        raise BadField(f"tensor {key!r:.200} is cut short in its file")
    return out.view(dtype).view(entry["shape"])


def pread_fully(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``fd`` at ``offset``; False where the file ends first. One read
    returns at most 2 GiB - 4 KiB on Linux, and a file cut short returns less."""
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            return False
        view, offset = view[n:], offset + n
    return True


# A header (or a checkpoint index) is JSON that the loading thread parses holding the GIL:
# 100 MiB (safetensors' own limit) stalled every other call for 8.7 s on the CPU box. Real
# ones are far smaller: a shard's header lists hundreds of tensors (tens of KiB), DeepSeek-V3's
# index 91,000 (about 9 MiB).
HEADER_LIMIT = 16 << 20
INDEX_LIMIT = 32 << 20

# What read_tensor reads: the weights' dtypes, and a few a scale or a wrong key may have.
READABLE_DTYPES = {**SAFETENSORS_DTYPES, "F64": torch.float64, "I32": torch.int32,
                   "I64": torch.int64}
_ST_ITEMSIZE = {"F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "BF16": 2,
                "F16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8, "U8": 1, "I8": 1, "I16": 2,
                "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}


def open_file(root: Path, file: str) -> OpenedFile:
    """``file`` opened strictly under ``root`` (:func:`open_beneath`) and checked to be a
    regular file."""
    if not isinstance(file, str) or not file or "\x00" in file:
        raise BadField("file is a non-empty path under the weights directory "
                       "(relative to it, or absolute)")
    if len(file) > _PATH_MAX:
        raise BadField(f"file is a path of {len(file)} characters; at most {_PATH_MAX}")
    fd = open_beneath(root, file)
    opened = OpenedFile(fd, file)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        opened.close()
        raise NoSuchFile(f"no file {shown(file)} in the weights directory (not a file)")
    return opened
