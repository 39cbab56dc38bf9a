"""Shared memory between the owner and its acceptors (``_acceptors.py``).

Two /dev/shm files per acceptor, one per direction, of ``_ARENA_BYTES`` each:
created (pages reserved with posix_fallocate, so a full tmpfs fails here,
not later with SIGBUS) and mapped by the owner, mapped and unlinked by the
acceptor, swept by the next owner when both died first. ``_Slots`` hands out
byte ranges of one arena; only one process allocates from each.

A body or answer that finds its arena full (or is larger than a slot) gets a
file of its own, a *spill* (:class:`Spill`): created and filled by the writer,
mapped and unlinked by the reader, unlinked by the writer too once the
exchange is over (whichever comes first; a spill left by processes that died
carries the owner's pid and is swept with its arenas). Before spills such
bodies travelled inline on the link, and every request behind one on the same
link waited for its megabytes to pass through the owner's event loop: on the
H200, 32 clients of 1024-row calls (7.5 MB bodies; an acceptor's arena holds
eight) had a p99 of ~1 s where the server's own time per call was ~20 ms
(``bench/cpu_large_tail.py`` reproduces it on a CPU; ``bench/SERVICE_NOTES.md``).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import secrets
import shutil
import stat
import tempfile
import time
from typing import Any

import numpy as np

log = logging.getLogger("moegemm.server.acceptors")

_ARENA_BYTES = 64 << 20  # per direction and acceptor
_SLOT_MAX = _ARENA_BYTES // 4  # larger bodies get a spill
# Smaller bodies and answers travel inline on the link when their arena is full:
# a frame this small delays the ones behind it by microseconds, a spill costs
# a file's creation.
_INLINE_MAX = 64 << 10
_SLOT_ALIGN = 4096
_SHM_DIR = "/dev/shm"
# A lazy spill's pages are reserved this far ahead of the bytes received.
_RESERVE_STEP = 4 << 20


class _Slots:
    """First-fit allocation of one arena's byte ranges (only one process allocates)."""

    def __init__(self, size: int) -> None:
        self.free: list[tuple[int, int]] = [(0, size)]  # sorted, coalesced
        self.used: dict[int, int] = {}

    def take(self, size: int) -> int | None:
        size = -(-max(size, 1) // _SLOT_ALIGN) * _SLOT_ALIGN
        for i, (offset, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, length - size)
                self.used[offset] = size
                return offset
        return None

    def give(self, offset: int) -> None:
        size = self.used.pop(offset)
        i = bisect.bisect(self.free, (offset, 0))
        if i < len(self.free) and offset + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == offset:
            offset, before = self.free.pop(i - 1)
            size += before
            i -= 1
        self.free.insert(i, (offset, size))


# This process's start, as far as its shared-memory files go: none of them is older.
_STARTED = time.time()


def sweep_stale_arenas(directory: str = _SHM_DIR) -> list[str]:
    """Remove arena files whose owner process is gone; return their names.

    An owner killed before its acceptors mapped their arenas (they unlink them
    once mapped) leaves the files behind; the next owner on the machine
    removes them. A file whose pid is alive (or not ours to remove) stays, unless the pid is
    this process's and the file older than it.
    """
    removed = []
    for name, path in _stale(directory, "moegemm-"):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(name)
    if removed:
        log.info("removed %d shared-memory arenas of owners that are gone", len(removed))
    return removed


def sweep_stale_owner_directories(directory: str | None = None) -> list[str]:
    """Remove the private directories (``moegemm-owner-<pid>-*``: the owner's Unix sockets)
    of owners that are gone with their acceptors (a SIGKILL of every process at once: an OOM
    kill, ``docker kill``); return their names. Only directories (not links) of this user."""
    directory = directory or tempfile.gettempdir()
    removed = []
    for name, path in _stale(directory, "moegemm-owner-"):
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
                shutil.rmtree(path)
                removed.append(name)
    if removed:
        log.info("removed %d socket directories of owners that are gone", len(removed))
    return removed


def _stale(directory: str, prefix: str) -> list[tuple[str, str]]:
    """The entries ``<prefix><pid>-...`` of ``directory`` whose process is gone, or is this
    one's pid and older than this process; (name, path) each."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        rest = name[len(prefix):].split("-") if name.startswith(prefix) else []
        # ASCII digits only, few enough for a pid: str.isdigit() also takes '²', which int()
        # refuses, and 20 digits overflow the kill() this leads to (any local user can name
        # a file in /dev/shm or /tmp; a start must not fail on one).
        if (len(rest) < 2 or not rest[0].isascii() or not rest[0].isdigit()
                or len(rest[0]) > 9):
            continue
        pid, path = int(rest[0]), os.path.join(directory, name)
        if pid == os.getpid():
            # A container's server is process 1 at every restart, and its /dev/shm may outlive
            # one (a pod's emptyDir): an entry of this pid older than this process is another's.
            with contextlib.suppress(OSError):
                if os.lstat(path).st_mtime >= _STARTED:
                    continue
        elif _pid_alive(pid):
            continue
        found.append((name, path))
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _create_arena(tag: str) -> str | None:
    """A new /dev/shm file of ``_ARENA_BYTES``, its pages reserved; None when impossible."""
    path = os.path.join(_SHM_DIR, f"moegemm-{os.getpid()}-{tag}-{secrets.token_hex(4)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        log.warning("no shared memory for the acceptors (%s); bodies travel inline", exc)
        return None
    try:
        os.posix_fallocate(fd, 0, _ARENA_BYTES)
    except OSError as exc:
        log.warning("cannot reserve %d bytes of shared memory (%s); bodies travel inline",
                    _ARENA_BYTES, exc)
        os.close(fd)
        _unlink(path)
        return None
    os.close(fd)
    return path


def _map_arena(path: str | None, unlink: bool = False) -> np.ndarray | None:
    """The arena at ``path``, mapped; ``unlink``: its name removed once mapped (the
    acceptor maps last, so no file outlives both processes, whichever dies first)."""
    if path is None:
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, _ARENA_BYTES), dtype=np.uint8)
    finally:
        os.close(fd)
        if unlink:
            _unlink(path)


def _unlink(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class Spill:
    """One body or answer in a /dev/shm file of its own (see the module's docstring).

    Made ``lazy`` (a request body an acceptor receives), its pages are reserved as the bytes
    arrive (:meth:`reserve`, a step ahead of them) instead of at once: a client that
    declares a large body and sends little of it makes the machine commit little.
    """

    def __init__(self, path: str, array: np.ndarray, fd: int | None = None,
                 reserved: int | None = None) -> None:
        self.path = path
        self.array = array  # the mapped bytes
        # The file, open while pages are still to be reserved: in a box, shared with whoever
        # must close it when the memory goes first (``closer``).
        self._fd = [fd]
        self.reserved = len(array) if reserved is None else reserved

    @classmethod
    def create(cls, owner_pid: int, size: int, lazy: bool = False) -> Spill | None:
        """A new spill of ``size`` bytes, its pages reserved (``lazy``: none yet); None when
        /dev/shm cannot hold it (the caller then sends the bytes inline)."""
        path = os.path.join(_SHM_DIR, f"moegemm-{owner_pid}-spill-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            _spill_failed(size, exc)
            return None
        try:
            if lazy:
                os.ftruncate(fd, size)
            else:
                os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size)
        except OSError as exc:
            _spill_failed(size, exc)
            _unlink(path)
            os.close(fd)
            return None
        if not lazy:
            os.close(fd)
            return cls(path, np.frombuffer(mapped, dtype=np.uint8))
        return cls(path, np.frombuffer(mapped, dtype=np.uint8), fd, 0)

    def reserve(self, upto: int, ahead: bool = True) -> int:
        """Reserve the pages through byte ``upto`` at least (``ahead``: ``_RESERVE_STEP`` past
        what was reserved; at most the whole spill), so that writing there cannot fault; the
        end reserved. Raises OSError when /dev/shm has no room for them."""
        size = len(self.array)
        fd = self._fd[0]
        if upto > self.reserved and fd is not None:
            end = min(size, max(upto, self.reserved + _RESERVE_STEP if ahead else 0))
            os.posix_fallocate(fd, self.reserved, end - self.reserved)
            self.reserved = end
            if end == size:
                self.close()
        return self.reserved

    def close(self) -> None:
        """Close the file (its mapping stays); no more pages are reserved."""
        _close_box(self._fd)

    def closer(self):
        """A function that closes the file if still open (for a finalizer of the memory:
        it holds no reference to the spill)."""
        box = self._fd
        return lambda: _close_box(box)

    @staticmethod
    def open(path: str, size: int) -> np.ndarray:
        """The spill at ``path`` (named by the peer), mapped, and its name removed."""
        if os.path.dirname(path) != _SHM_DIR or not os.path.basename(path).startswith("moegemm-"):
            raise ValueError(f"not a spill: {path[:200]!r}")
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise ValueError(f"the spill {path!r} holds fewer than {size} bytes")
            return np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
        finally:
            os.close(fd)
            _unlink(path)

    def unlink(self) -> None:
        _unlink(self.path)


def _close_box(box: list) -> None:
    fd, box[0] = box[0], None
    if fd is not None:
        os.close(fd)


_spill_warned = False


def _spill_failed(size: int, exc: OSError) -> None:
    """Say once per process that /dev/shm is short (then quietly: it may be for a while)."""
    global _spill_warned
    level = logging.DEBUG if _spill_warned else logging.WARNING
    _spill_warned = True
    log.log(level, "no shared memory for a %d-byte body or answer (%s): it travels inline on "
            "the acceptor's link, slower, and delays what follows it there; give /dev/shm "
            "more room", size, exc)


def _address(view: Any) -> int | None:
    obj = getattr(view, "obj", None)
    return obj.ctypes.data if isinstance(obj, np.ndarray) else None
