"""Large bodies never travel on an acceptor's link to the owner.

Requests of one acceptor share one Unix socket with the owner. A body that
found the acceptor's request arena full used to travel inline on it, and every
request behind it waited for its megabytes to pass through the owner's event
loop (on the H200, 32 clients of 1024-row calls: p99 ~1 s for ~20 ms of server
time per call; ``bench/cpu_large_tail.py`` reproduces it on the CPU). Such a
body, and such an answer, now goes in a spill: a /dev/shm file of its own.

The acceptor's and the owner's halves of the link run here in one event loop
(no processes), with the real arenas, frames and spills; every frame's inline
size is recorded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys

import numpy as np
import pytest
from moegemm.server import _acceptor, _acceptor_shm, _acceptors
from moegemm.server._acceptor import _Acceptor
from moegemm.server._acceptor_link import _frame
from moegemm.server._http_gate import HttpLimits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="/dev/shm arenas: Linux")

MiB = 1 << 20


class _Echo:
    """The owner's direct route: answers each body's bytes reversed, repeated
    ``times`` (so an answer can be larger than any slot)."""

    times = 1

    def __init__(self) -> None:
        self.seen: list[int] = []

    def match(self, method: str, path: str):
        return "echo"

    async def __call__(self, name, headers, body, arrived):
        data = np.frombuffer(body, dtype=np.uint8)[::-1]
        self.seen.append(len(body))
        parts = [data.tobytes()] * self.times
        return 200, b"content-length: %d\r\n" % (len(body) * self.times), parts


class _Server:
    def __init__(self) -> None:
        self.direct = _Echo()
        self.active = 0


def _spills() -> set[str]:
    return {n for n in os.listdir("/dev/shm")
            if n.startswith(f"moegemm-{os.getpid()}-spill-")}


@pytest.fixture
def frames(monkeypatch) -> list[tuple[str, int]]:
    """Every frame either side writes: (kind, inline bytes)."""
    sent: list[tuple[str, int]] = []

    def recording(meta: dict, size: int) -> bytes:
        sent.append((meta["t"], size))
        return _frame(meta, size)

    monkeypatch.setattr(_acceptor, "_frame", recording)
    monkeypatch.setattr(_acceptors, "_frame", recording)
    return sent


async def _linked(tmp_dir: str):
    """An owner with one link and an acceptor connected to it, in this loop."""
    loop = asyncio.get_running_loop()
    owner = _acceptors.Owner.__new__(_acceptors.Owner)
    owner.server, owner.loop, owner._tasks = _Server(), loop, set()
    owner._copier = concurrent.futures.ThreadPoolExecutor(2)
    link = _acceptors._Link(0)
    owner.links = [link]
    path = os.path.join(tmp_dir, "owner.sock")
    unix = await asyncio.start_unix_server(owner._serve_link, path)
    # The acceptor's owner is this process: its spills carry our pid, as the owner's do.
    acceptor = _Acceptor(0, "127.0.0.1", 0, path, link.request_path, link.answer_path,
                         HttpLimits(max_body_bytes=256 * MiB), 1.0)
    acceptor.owner_pid = os.getpid()
    reader, acceptor.writer = await asyncio.open_unix_connection(path)
    acceptor.writer.write(_frame({"t": "hello", "i": 0}, 0))
    stop = asyncio.Event()
    reading = loop.create_task(acceptor._read_owner(reader, stop))
    return owner, link, acceptor, unix, reading


async def _close(acceptor, unix, reading) -> None:
    acceptor.writer.close()
    reading.cancel()
    unix.close()
    await asyncio.sleep(0.05)


_SCOPE = {"method": "POST", "path": "/echo", "raw_path": b"/echo", "query_string": b"",
          "http_version": "1.1", "headers": [], "client": None, "server": None,
          "state": {"arrived": 0.0}}


def test_a_body_that_finds_the_arena_full_goes_in_a_spill(frames, tmp_path):
    async def scenario():
        owner, _, acceptor, unix, reading = await _linked(str(tmp_path))
        # Requests in flight hold the whole request arena (four of its largest slots).
        held = [acceptor.allocate(_acceptor_shm._SLOT_MAX) for _ in range(4)]
        assert acceptor.slots.take(1) is None
        rng = np.random.default_rng(0)
        payloads = {"in a spill": 8 * MiB, "over a slot's size": _acceptor_shm._SLOT_MAX + 4096}
        for size in payloads.values():
            body = acceptor.allocate(size)
            data = rng.integers(0, 256, size, dtype=np.uint8)
            body[:] = data
            status, _, answer, close = await acceptor.forward(_SCOPE, body)
            assert status == 200 and not close
            assert bytes(answer) == data[::-1].tobytes()
            del body, answer
        # A chunked upload arrives in plain memory: it is moved to a spill too.
        plain = memoryview(rng.integers(0, 256, 3 * MiB, dtype=np.uint8).tobytes())
        status, _, answer, _ = await acceptor.forward(_SCOPE, plain)
        assert bytes(answer) == bytes(plain)[::-1]
        del answer
        assert owner.server.direct.seen == [*payloads.values(), 3 * MiB]
        # Requests carried no body bytes on the link, nor did their answers.
        assert [k for k, _ in frames].count("req") == 3
        assert max(size for _, size in frames) == 0, frames
        del held
        await _close(acceptor, unix, reading)
        assert _spills() == set()  # every spill's name is gone with its exchange

    asyncio.run(scenario())


def test_an_answer_larger_than_a_slot_goes_in_a_spill(frames, tmp_path):
    async def scenario():
        owner, link, acceptor, unix, reading = await _linked(str(tmp_path))
        owner.server.direct.times = 5  # a 20 MiB answer: no slot is that large
        body = acceptor.allocate(4 * MiB)  # the arena has room for this one
        body[:] = np.arange(4 * MiB, dtype=np.uint32).view(np.uint8)[:4 * MiB]
        status, _, answer, _ = await acceptor.forward(_SCOPE, body)
        assert status == 200
        assert bytes(answer) == bytes(body)[::-1] * 5
        assert max(size for _, size in frames) == 0, frames
        assert ("free", 0) in frames  # the acceptor took the spill
        await asyncio.sleep(0.05)
        assert link.spills == set()
        del answer
        await _close(acceptor, unix, reading)
        assert _spills() == set()

    asyncio.run(scenario())


def test_small_bodies_still_travel_inline_when_the_arena_is_full(frames, tmp_path):
    async def scenario():
        _, _, acceptor, unix, reading = await _linked(str(tmp_path))
        held = [acceptor.allocate(_acceptor_shm._SLOT_MAX) for _ in range(4)]
        body = acceptor.allocate(1000)  # a file per small body would cost more than it saves
        body[:] = bytes(range(200)) * 5
        _, _, answer, _ = await acceptor.forward(_SCOPE, body)
        assert bytes(answer) == bytes(body)[::-1]
        assert ("req", 1000) in frames
        del held
        await _close(acceptor, unix, reading)

    asyncio.run(scenario())


def test_without_room_for_a_spill_a_large_body_still_arrives_inline(frames, tmp_path,
                                                                      monkeypatch):
    """A full /dev/shm (Spill.create fails: ENOSPC) costs speed, never an answer."""
    async def scenario():
        _, _, acceptor, unix, reading = await _linked(str(tmp_path))
        held = [acceptor.allocate(_acceptor_shm._SLOT_MAX) for _ in range(4)]
        monkeypatch.setattr(_acceptor_shm.Spill, "create",
                            classmethod(lambda cls, owner_pid, size, lazy=False: None))
        body = acceptor.allocate(2 * MiB)
        body[:] = np.random.default_rng(3).integers(0, 256, 2 * MiB, dtype=np.uint8)
        status, _, answer, _ = await acceptor.forward(_SCOPE, body)
        assert status == 200 and bytes(answer) == bytes(body)[::-1]
        assert ("req", 2 * MiB) in frames  # (the answer found room in its own arena)
        del held, answer
        await _close(acceptor, unix, reading)

    asyncio.run(scenario())


def test_a_lazy_spill_takes_its_pages_as_they_are_reserved():
    """A request body's spill (``lazy``) takes /dev/shm pages only as they are reserved, a
    step ahead of the bytes; the whole reserved, its file is closed."""
    size, step = 64 << 20, _acceptor_shm._RESERVE_STEP
    spill = _acceptor_shm.Spill.create(os.getpid(), size, lazy=True)
    assert spill is not None
    try:
        def taken() -> int:
            return os.stat(spill.path).st_blocks * 512

        assert taken() == 0
        assert spill.reserve(1) == step and step <= taken() < 2 * step
        spill.array[:step] = 7  # the reserved part is writable
        assert spill.reserve(step + 1) == 2 * step
        assert spill.reserve(size) == size and taken() >= size
        assert spill._fd[0] is None
    finally:
        spill.unlink()
