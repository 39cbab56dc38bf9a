"""The hand-over of a connection from an acceptor to the owner never leaves it
served by both (each side's half of the protocol, with a SEQPACKET pair)."""

from __future__ import annotations

import asyncio
import collections
import socket
import sys

import pytest
from moegemm.server import _acceptor_shm, _acceptors
from moegemm.server._acceptor import _Acceptor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SCM_RIGHTS over SOCK_SEQPACKET: Linux")


class _FakeServer:
    def __init__(self) -> None:
        self.connections: set = set()
        self.active = 0


def _acceptor(channel: socket.socket, served_here: list) -> _Acceptor:
    acceptor = _Acceptor.__new__(_Acceptor)
    acceptor.fd_channel, acceptor.offers, acceptor.index = channel, collections.deque(), 0
    acceptor._serve_here = served_here.append
    return acceptor


def _tcp_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    return server, client, conn


def test_an_answer_the_owner_cannot_send_leaves_the_connection_to_the_acceptor():
    async def scenario():
        loop = asyncio.get_running_loop()
        owner = _acceptors.Owner.__new__(_acceptors.Owner)
        owner.server, owner.direct_limit, owner._taking = _FakeServer(), 2, 0
        owner.stopping, owner.loop, owner._tasks, owner._fd_channels = False, loop, set(), set()
        handed = []

        async def serve_handed(sock):
            handed.append(sock)
            owner._taking -= 1
        owner._serve_handed = serve_handed
        acceptor_side, owner_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        owner_side.setblocking(False)
        acceptor_side.setblocking(False)
        owner._fd_channels.add(owner_side)
        loop.add_reader(owner_side, lambda: None)
        served_here: list = []
        acceptor = _acceptor(acceptor_side, served_here)
        # The acceptor is behind: the owner's answers fill the channel.
        while True:
            try:
                owner_side.send(b"K")
            except BlockingIOError:
                break
            acceptor.offers.append(socket.socket())
        server, client, conn = _tcp_pair()
        socket.send_fds(acceptor_side, [b"o"], [conn.fileno()])
        acceptor.offers.append(conn)
        owner._take_offers(owner_side)  # it would take it, but cannot say so
        await asyncio.sleep(0)
        assert handed == []  # so it does not serve it
        assert owner_side.fileno() == -1  # and drops the channel
        loop.add_reader(acceptor_side, lambda: None)
        for _ in range(10_000):
            if acceptor.fd_channel is None:
                break
            acceptor._answers()
        assert acceptor.fd_channel is None
        assert served_here.count(conn) == 1  # the acceptor serves it, once
        for s in (server, client, conn):
            s.close()

    asyncio.run(scenario())


def test_answers_sent_before_the_owner_dropped_the_channel_are_honoured():
    async def scenario():
        acceptor_side, owner_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        acceptor_side.setblocking(False)
        served_here: list = []
        acceptor = _acceptor(acceptor_side, served_here)
        first, second = socket.socket(), socket.socket()
        for sock in (first, second):
            socket.send_fds(acceptor_side, [b"o"], [sock.fileno()])
            acceptor.offers.append(sock)
        _, fds, _, _ = socket.recv_fds(owner_side, 16, 4)  # the owner takes the first...
        owner_side.send(b"T")
        owner_side.close()  # ...then goes, the second offer unread (a reset comes first)
        asyncio.get_running_loop().add_reader(acceptor_side, lambda: None)
        for _ in range(10):
            if acceptor.fd_channel is None:
                break
            acceptor._answers()
        assert first not in served_here  # the owner has it
        assert second in served_here  # nobody else does
        for fd in fds:
            socket.socket(fileno=fd).close()

    asyncio.run(scenario())


def test_socket_directories_of_owners_that_are_gone_are_swept(tmp_path):
    """Every process of a server killed at once leaves its private directory (the owner's
    Unix sockets): the next owner removes those of owners that are gone, directories only."""
    import os
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"moegemm-owner-{gone.pid}-q5w8cc_v"
    alive = tmp_path / f"moegemm-owner-{os.getppid()}-abc"
    unnamed = tmp_path / "moegemm-owner-x1y2z3"  # an older server's name, without a pid
    for path in (stale, alive, unnamed):
        path.mkdir()
        (path / "owner.sock").write_bytes(b"")
    link = tmp_path / f"moegemm-owner-{gone.pid}-link"
    link.symlink_to(alive)
    assert _acceptor_shm.sweep_stale_owner_directories(str(tmp_path)) == [stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (alive, unnamed, link))
    assert (alive / "owner.sock").exists()


def test_arenas_of_owners_that_are_gone_are_swept(tmp_path):
    """An owner killed before its acceptors mapped their arenas leaves the files;
    the next owner removes those whose process is gone, and nothing else."""
    import os
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"moegemm-{gone.pid}-a0-req-0123abcd"
    alive = tmp_path / f"moegemm-{os.getppid()}-a0-req-4567cdef"
    mine = tmp_path / f"moegemm-{os.getpid()}-a1-ans-89abcdef"
    # This pid's file from before this process: a container's server is process 1 at every
    # restart, and a pod's /dev/shm outlives the container (a review).
    earlier = tmp_path / f"moegemm-{os.getpid()}-a0-req-00ff00ff"
    other = tmp_path / "moegemm-notapid-x"
    # Names any local user can make that int() or kill() refuse (a start failed on them).
    odd = [tmp_path / "moegemm-\u00b2-x", tmp_path / f"moegemm-{'9' * 20}-x"]
    for path in (stale, alive, mine, earlier, other, *odd):
        path.write_bytes(b"x")
    an_hour_ago = _acceptor_shm._STARTED - 3600
    os.utime(earlier, (an_hour_ago, an_hour_ago))
    assert sorted(_acceptor_shm.sweep_stale_arenas(str(tmp_path))) == sorted(
        [stale.name, earlier.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (alive, mine, other, *odd))
