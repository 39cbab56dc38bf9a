"""``moegemm serve --acceptors 2``: requests read by acceptor processes answer
exactly what the server alone answers.

Two real ``moegemm serve`` processes on the CPU, same settings and the same
seeded demo weights: one with two acceptor processes on its port
(SO_REUSEPORT), one without. Which process accepted a connection is read from
/proc (the socket's inode among each process's file descriptors), so every
comparison below is made on a connection an acceptor served.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from moegemm.client import Client
from moegemm.kernels import quantize_activations, quantize_weights, reference_float64
from moegemm.kernels.testing import SPEC_TOLERANCE, rel_error
from moegemm.server._acceptor_shm import _SLOT_MAX, _Slots
from moegemm.server.cli import EXIT_CANNOT_LISTEN
from server_support import _free_port
from test_direct import CASES, TOKEN, _request

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SO_REUSEPORT and /proc: Linux only")

ARGS = ["--device", "cpu", "--demo", "--max-body-bytes", str(1 << 20), "--max-m", "64",
        "--log-level", "warning"]


class _Server:
    def __init__(self, acceptors: int, args: tuple[str, ...] = (), **env_extra: str) -> None:
        self.port = _free_port()
        env = {**os.environ, "MOEGEMM_TOKEN": TOKEN, **env_extra}
        command = [sys.executable, "-m", "moegemm.cli", "serve", *ARGS, *args,
                   "--port", str(self.port)]
        if acceptors:
            command += ["--acceptors", str(acceptors)]
        self.process = subprocess.Popen(command, env=env)
        self.acceptors = acceptors

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "the server exited"
            try:
                status, _ = _exchange(self.port, _request("GET", "/v1/health/ready", b""))
                if (status.startswith(b"HTTP/1.1 200") and len(self.children()) == self.acceptors
                        and _listeners(self.port) == self.acceptors + 1):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the server did not become ready")

    def children(self) -> list[int]:
        """The acceptor processes (spawned children; not multiprocessing's tracker)."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if ppid == self.process.pid and b"spawn_main" in cmdline:
                out.append(int(entry))
        return out

    def owner_of(self, sock: socket.socket) -> int:
        """The pid of the process holding the server side of ``sock``."""
        client_port = sock.getsockname()[1]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            inode = _server_inode(self.port, client_port)
            if inode is not None:
                for pid in [self.process.pid, *self.children()]:
                    try:
                        fds = os.listdir(f"/proc/{pid}/fd")
                    except OSError:
                        continue
                    for fd in fds:
                        try:
                            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                                return pid
                        except OSError:
                            pass
            time.sleep(0.01)
        raise TimeoutError("no process holds the connection")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def _listeners(port: int) -> int:
    """Sockets listening on ``port`` (the owner's and each acceptor's, SO_REUSEPORT)."""
    local = f":{port:04X}"
    with open("/proc/net/tcp") as f:
        return sum(1 for line in f.readlines()[1:]
                   if line.split()[1].endswith(local) and line.split()[3] == "0A")


def _server_inode(port: int, client_port: int) -> str | None:
    local, remote = f":{port:04X}", f":{client_port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1].endswith(local) and fields[2].endswith(remote) and fields[9] != "0":
                return fields[9]
    return None


def _read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One raw answer: (head including the status line, body)."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed before an answer")
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        body += chunk
    return head, body


def _exchange(port: int, data: bytes) -> tuple[bytes, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        return _read_answer(sock)


@pytest.fixture(scope="module")
def servers():
    # No hand-over to the owner here: these tests need connections an acceptor keeps.
    with_acceptors, alone = _Server(2, MOEGEMM_OWNER_CONNECTIONS="0"), _Server(0)
    try:
        with_acceptors.wait_ready()
        alone.wait_ready()
        yield with_acceptors, alone
    finally:
        for server in (with_acceptors, alone):
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait(10)


def _send(sock: socket.socket, data: bytes | list[bytes], pause: float) -> None:
    """``data``, or its parts with ``pause`` seconds between them (a slow upload)."""
    for i, part in enumerate([data] if isinstance(data, bytes) else data):
        if i:
            time.sleep(pause)
        sock.sendall(part)


def _via_acceptor(server: _Server, data: bytes | list[bytes],
                  pause: float = 0) -> tuple[int, bytes, bytes]:
    """Send ``data`` on fresh connections until an acceptor served one; its answer."""
    acceptors = set(server.children())
    for _ in range(60):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            pid = server.owner_of(sock)
            if pid not in acceptors:
                continue
            _send(sock, data, pause)
            return pid, *_read_answer(sock)
    raise AssertionError("no connection reached an acceptor")


@pytest.mark.parametrize(("deadline_ms", "status"), [(b"300", b"504"), (b"30000", b"200")])
def test_a_calls_deadline_counts_from_its_arrival(servers, deadline_ms, status):
    """``X-Deadline-Ms`` counts from the request's arrival (README), through an acceptor and on
    the server alone: a call whose body took longer to come than its deadline answers 504
    ``timeout`` instead of running late (it ran, 200, before)."""
    data = dict(CASES)["good deadline"].replace(b"x-deadline-ms: 60000",
                                                b"x-deadline-ms: " + deadline_ms)
    parts = [data[:-100], data[-100:]]  # the head and most of the body, then the rest
    server, alone = servers
    _, via_head, via_body = _via_acceptor(server, parts, pause=0.6)
    with socket.create_connection(("127.0.0.1", alone.port), timeout=30) as sock:
        _send(sock, parts, 0.6)
        alone_head, alone_body = _read_answer(sock)
    for head, body in ((via_head, via_body), (alone_head, alone_body)):
        assert head.startswith(b"HTTP/1.1 " + status), head[:200]
        assert (b'"timeout"' in body) == (status == b"504")


def test_acceptors_do_not_load_torch(servers):
    server, _ = servers
    pids = server.children()
    assert len(pids) == 2
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read()


@pytest.mark.parametrize("name,data", CASES, ids=[c[0] for c in CASES])
def test_an_acceptor_answers_as_the_server_alone(servers, name, data):
    server, alone = servers
    _, head, body = _via_acceptor(server, data)
    want_head, want_body = _exchange(alone.port, data)
    if name == "junk request id":  # both made a fresh id: compare its form only
        lines, want_lines = head.split(b"\r\n"), want_head.split(b"\r\n")
        ids = [i for i, line in enumerate(lines) if line.startswith(b"x-request-id: ")]
        assert len(ids) == 1 and len(lines[ids[0]]) == len(want_lines[ids[0]])
        lines[ids[0]] = want_lines[ids[0]]
        head = b"\r\n".join(lines)
    assert head == want_head
    assert body == want_body


def test_other_routes_and_keep_alive(servers):
    server, alone = servers
    requests = [
        _request("GET", "/v1/info", b"", {"authorization": f"Bearer {TOKEN}"}),
        _request("GET", "/v1/weights/demo/gemm", b""),
        _request("GET", "/nowhere?x=1", b""),
        _request("GET", "/v1/weights", b"", {"authorization": "Bearer wrong"}),
        CASES[0][1],
        CASES[1][1],
    ]
    acceptors = set(server.children())
    for _ in range(60):  # one keep-alive connection, served by an acceptor
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        if server.owner_of(sock) in acceptors:
            break
        sock.close()
    else:
        raise AssertionError("no connection reached an acceptor")
    with sock, socket.create_connection(("127.0.0.1", alone.port), timeout=30) as ref:
        for data in requests:
            sock.sendall(data)
            ref.sendall(data)
            assert _read_answer(sock) == _read_answer(ref)


def test_an_acceptors_own_answers_count_as_bytes_out(servers):
    """A request an acceptor refuses from its head (415 here) is counted by the owner, its
    answer's body in ``moegemm_bytes_out_total`` too (the owner's metrics tell the whole
    server's traffic)."""
    server, _ = servers

    def bytes_out() -> tuple[float, int]:
        head, body = _exchange(server.port, _request(
            "GET", "/metrics", b"", {"authorization": f"Bearer {TOKEN}"}))
        assert head.startswith(b"HTTP/1.1 200 OK")
        line = next(r for r in body.split(b"\n") if r.startswith(b"moegemm_bytes_out_total "))
        return float(line.split()[-1]), len(body)

    before, told = bytes_out()
    _, head, body = _via_acceptor(server, _request(
        "POST", "/v1/weights/demo/gemm", b"\x80",
        {"authorization": f"Bearer {TOKEN}", "content-type": "text/plain"}))
    assert head.startswith(b"HTTP/1.1 415") and body
    sent = told + len(body)
    deadline = time.monotonic() + 10
    while True:  # the acceptor's report reaches the owner over its link, soon after
        now, told = bytes_out()
        if now - before == sent or time.monotonic() > deadline:
            break
        sent += told
    assert now - before == sent


def _problem(gen: torch.Generator, g: int, n: int, k: int):
    w = torch.randn(g, n, k, generator=gen)
    wq, w_scale = quantize_weights(w)
    return wq, w_scale


def test_concurrent_calls_match_the_reference(servers):
    server, _ = servers
    url = f"http://127.0.0.1:{server.port}"
    gen = torch.Generator().manual_seed(3)
    g, n, k = 4, 256, 512
    wq, w_scale = _problem(gen, g, n, k)
    with Client(url, token=TOKEN) as client:
        client.load_weights("mine", wq, w_scale)
    problems = []
    for i in range(48):
        m = [int(v) for v in torch.randint(0, 17, (g,), generator=gen)]
        if i % 3 == 0:
            m = [16, 16, 16, 16]  # 64 rows: a 32 KiB answer, through the answer arena
        x = torch.randn(sum(m), k, generator=gen)
        if i % 3 == 1:
            # bf16, 64 rows: a body over 64 KiB, decoded in place in the shared slot
            x = torch.randn(64, k, generator=gen).to(torch.bfloat16)
            m = [20, 0, 40, 4]
            problems.append((x, None, torch.tensor(m)))
            continue
        xq, x_scale = quantize_activations(x)
        problems.append((xq, x_scale, torch.tensor(m)))
    errors: list = []

    def worker(part: list) -> None:
        try:
            for start in range(0, len(part), 2):  # a new client (connection) per 2 calls
                with Client(url, token=TOKEN) as client:
                    for xq, x_scale, m in part[start:start + 2]:
                        out = client.grouped_gemm("mine", xq, m, x_scale)
                        got = torch.as_tensor(out).float()
                        if x_scale is None:  # the server quantized it (SPEC 1.1)
                            xq, x_scale = quantize_activations(xq.float())
                        ref = reference_float64(xq, wq, x_scale, w_scale, m)
                        assert got.shape == (len(xq), n)
                        assert rel_error(got, ref) <= SPEC_TOLERANCE
        except Exception as exc:  # noqa: BLE001 -- reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(problems[i::6],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[0]

    # The owner counted every call, whichever process read it.
    head, body = _exchange(server.port, _request(
        "GET", "/metrics", b"", {"authorization": f"Bearer {TOKEN}"}))
    assert head.startswith(b"HTTP/1.1 200 OK")
    line = b'moegemm_requests_total{endpoint="/v1/weights/{name}/gemm",status="200"} '
    count = [r for r in body.split(b"\n") if r.startswith(line)]
    assert count and float(count[0][len(line):]) >= len(problems)


def test_a_body_larger_than_a_slot_answers_as_on_the_owner():
    """A 17 MiB body (over a quarter of the arena) read by an acceptor reaches the
    owner in a spill (tests/server/test_acceptor_spills.py) and is answered with
    exactly the bytes the owner answers when it reads the same request itself."""
    from moegemm.client._wire import encode_tensor, packb

    server = _Server(1, ("--max-body-bytes", str(64 << 20), "--max-m", "32768"),
                     MOEGEMM_OWNER_CONNECTIONS="0")
    try:
        server.wait_ready()
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(17000, 512, generator=gen).to(torch.bfloat16)  # the demo set's K
        m = torch.tensor([3000, 0, 4000, 2000, 1000, 5000, 1500, 500])
        body = packb({"x": encode_tensor(x), "m_sizes": encode_tensor(m)})
        assert len(body) > _SLOT_MAX
        data = _request("POST", "/v1/weights/demo/gemm", body,
                        {"authorization": f"Bearer {TOKEN}",
                         "content-type": "application/vnd.msgpack"})
        answers = {}
        acceptors = set(server.children())
        for _ in range(60):
            with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
                by = "acceptor" if server.owner_of(sock) in acceptors else "owner"
                if by in answers:
                    continue
                sock.sendall(data)
                answers[by] = _read_answer(sock)
            if len(answers) == 2:
                break
        assert set(answers) == {"acceptor", "owner"}
        head, answer = answers["acceptor"]
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert len(answer) > 17000 * 256 * 2
        assert answers["acceptor"] == answers["owner"]
    finally:
        server.stop()


def test_heads_alone_commit_no_shared_memory():
    """A large body an acceptor receives goes in a spill whose pages are reserved as its bytes
    arrive: heads that declare 60 MiB bodies and send none take almost none of /dev/shm (an
    audit's finding: 30 such heads committed 4 GB), and a body sent whole is still answered."""
    server = _Server(1, ("--max-body-bytes", str(64 << 20)), MOEGEMM_OWNER_CONNECTIONS="0")
    socks = []
    try:
        server.wait_ready()
        acceptors = set(server.children())
        head = _request("POST", "/v1/weights/demo/gemm", b"",
                        {"authorization": f"Bearer {TOKEN}",
                         "content-type": "application/vnd.msgpack"}).replace(
            b"content-length: 0", b"content-length: %d" % (60 << 20))
        assert b"content-length: %d" % (60 << 20) in head
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            if server.owner_of(sock) in acceptors:
                sock.sendall(head)
                socks.append(sock)
                if len(socks) == 8:
                    break
            else:
                sock.close()
        time.sleep(0.5)
        spills = [n for n in _arenas(server.process.pid) if "-spill-" in n]
        assert len(spills) == 8
        taken = sum(os.stat(f"/dev/shm/{n}").st_blocks * 512 for n in spills)
        assert taken <= 8 << 20, taken  # 480 MiB declared
        socks[0].sendall(b"\x80" * (60 << 20))  # the whole body: a bad gemm body, answered
        status, _ = _read_answer(socks[0])
        assert status.startswith(b"HTTP/1.1 400"), status
    finally:
        for sock in socks:
            sock.close()
        server.stop()


def test_a_killed_acceptor_is_replaced(servers):
    server, _ = servers
    before = server.children()
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = server.children()
        if len(now) == 2 and before[0] not in now:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the acceptor was not replaced")
    server.wait_ready()
    _, head, _ = _via_acceptor(server, CASES[0][1])
    assert head.startswith(b"HTTP/1.1 200 OK")


def test_a_lone_connection_is_handed_to_the_owner():
    """While the owner serves fewer than MOEGEMM_OWNER_CONNECTIONS connections, a
    connection an acceptor accepts is handed over (the socket itself): a lone
    client's calls skip the forwarding hop. Beyond that, acceptors keep them."""
    server = _Server(2, MOEGEMM_OWNER_CONNECTIONS="1")
    try:
        server.wait_ready()
        time.sleep(0.3)  # wait_ready's connections are closed and seen closed
        request = CASES[0][1]
        for _ in range(8):  # 2 of 3 would land on an acceptor without the hand-over
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(request)
                head, _ = _read_answer(sock)
                assert head.startswith(b"HTTP/1.1 200 OK")
                assert server.owner_of(sock) == server.process.pid
                sock.sendall(request)  # keep-alive: the next call on the same connection
                assert _read_answer(sock)[0].startswith(b"HTTP/1.1 200 OK")
            time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as held:
            held.sendall(request)
            assert _read_answer(held)[0].startswith(b"HTTP/1.1 200 OK")
            assert server.owner_of(held) == server.process.pid
            # The owner is at its limit: an acceptor keeps the next ones.
            pid, head, _ = _via_acceptor(server, request)
            assert pid in server.children()
            assert head.startswith(b"HTTP/1.1 200 OK")
    finally:
        assert server.stop() == 0


def test_a_second_server_on_the_port_fails_instead_of_sharing_it():
    """SO_REUSEPORT would let a second server bind the same port and take half the
    clients (to another GPU, other weights): it must fail as without acceptors."""
    first = _Server(1)
    try:
        first.wait_ready()
        command = [sys.executable, "-m", "moegemm.cli", "serve", *ARGS, "--port",
                   str(first.port), "--acceptors", "1"]
        second = subprocess.run(command, env={**os.environ, "MOEGEMM_TOKEN": TOKEN},
                                capture_output=True, text=True, timeout=120, check=False)
        assert second.returncode == EXIT_CANNOT_LISTEN
        assert f"cannot listen on 127.0.0.1:{first.port}" in second.stderr
        assert "in use" in second.stderr.lower() and "Traceback" not in second.stderr
        first.wait_ready()  # still serving
    finally:
        assert first.stop() == 0


def _arenas_mapped(pid: int) -> set[str]:
    """The shared-memory arenas process ``pid`` has mapped (their files, removed or not)."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                for line in maps if "/moegemm-" in line and ("-req-" in line or "-ans-" in line)}


def test_a_hung_acceptor_is_killed_and_replaced():
    """An acceptor that stops answering the owner's heartbeat (here: stopped with
    SIGSTOP) is killed and another takes its place; the port keeps answering."""
    server = _Server(1, MOEGEMM_ACCEPTOR_TIMEOUT_S="1.5", MOEGEMM_OWNER_CONNECTIONS="0")
    try:
        server.wait_ready()
        [hung] = server.children()
        os.kill(hung, signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = server.children()
            if len(now) == 1 and hung not in now:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the hung acceptor was not replaced")
        assert _gone(hung)
        server.wait_ready()
        _, head, _ = _via_acceptor(server, CASES[0][1])
        assert head.startswith(b"HTTP/1.1 200 OK")
        # The owner maps the new acceptor's two arenas only: the dead one's are let go at
        # once, not when the collector gets to them (minutes; /dev/shm filled meanwhile).
        deadline = time.monotonic() + 5
        while len(mapped := _arenas_mapped(server.process.pid)) != 2 \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(mapped) == 2, mapped
        # A live acceptor answers its pings: it is not killed in the meantime.
        [fresh] = server.children()
        time.sleep(3)
        assert server.children() == [fresh]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
        assert server.stop() == 0


def test_sigterm_stops_everything(servers):
    server, alone = servers
    children = server.children()
    assert server.stop() == 0
    assert alone.stop() == 0
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in children):
        assert time.monotonic() < deadline, "an acceptor outlived its owner"
        time.sleep(0.05)
    assert not _arenas(server.process.pid)


def _arenas(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"moegemm-{pid}-")]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # exited, not yet reaped
    except OSError:
        return True


def _owner_directory(pid: int) -> str:
    """The private directory of the owner ``pid``: where its listening Unix socket is."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and "moegemm-owner-" in fields[7]:
                return os.path.dirname(fields[7])
    raise AssertionError("the owner holds no Unix socket of its own")


def _unix_sockets_under(path: str) -> int:
    with open("/proc/net/unix") as f:
        return sum(1 for line in f.read().splitlines()[1:] if line.endswith(" " + path))


def test_acceptors_exit_when_the_owner_dies():
    server = _Server(1)
    try:
        server.wait_ready()
        directory = _owner_directory(server.process.pid)
        assert os.path.isdir(directory)
        deadline = time.monotonic() + 20  # the acceptor has connected to the owner
        # The listening socket and the acceptor's accepted connection both carry its name.
        while _unix_sockets_under(os.path.join(directory, "owner.sock")) < 2:
            assert time.monotonic() < deadline, "the acceptor never connected"
            time.sleep(0.05)
        children = server.children()
        assert len(children) == 1
        server.process.kill()
        server.process.wait(10)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in children):
            assert time.monotonic() < deadline, "an acceptor outlived its owner"
            time.sleep(0.05)
        assert not _arenas(server.process.pid)
        deadline = time.monotonic() + 20  # the owner's private directory goes too
        while os.path.exists(directory):
            assert time.monotonic() < deadline, f"{directory} outlived the owner"
            time.sleep(0.05)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(10)


def test_a_call_in_flight_when_the_owner_dies_is_closed_without_an_answer():
    """The owner killed while it holds a forwarded request: the acceptor closes that
    connection without an answer (a client sees no answer and may try another server),
    not a 500 (SPEC 2.2 has none; MultiClient would not fail over)."""
    server = _Server(1, MOEGEMM_OWNER_CONNECTIONS="0")
    try:
        server.wait_ready()
        acceptors = set(server.children())
        opened = []
        for _ in range(60):  # a connection an acceptor holds (the owner listens on the port too)
            opened.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
            if server.owner_of(opened[-1]) in acceptors:
                break
        else:
            raise AssertionError("no connection reached an acceptor")
        with contextlib.ExitStack() as stack:
            for other in opened:
                stack.enter_context(other)
            sock = opened[-1]
            os.kill(server.process.pid, signal.SIGSTOP)  # the request waits in the owner
            try:
                sock.sendall(_request("GET", "/v1/info", b"",
                                      {"authorization": f"Bearer {TOKEN}"}))
                time.sleep(0.5)
            finally:
                server.process.kill()
                server.process.wait(10)
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 16):
                    got += chunk
            assert got == b"", got[:200]
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(10)


def test_slots_first_fit_and_coalescing():
    slots = _Slots(8 * 4096)
    a, b, c = slots.take(4096), slots.take(5000), slots.take(1)
    assert (a, b, c) == (0, 4096, 3 * 4096)
    assert slots.take(5 * 4096) is None
    slots.give(b)
    assert slots.take(8192) == 4096
    slots.give(a)
    slots.give(4096)
    slots.give(c)
    assert slots.free == [(0, 8 * 4096)]
    assert slots.take(8 * 4096) == 0


def test_a_request_after_the_owner_link_is_lost_fails_at_once():
    """forward() raises (the connection closes without an answer) instead of waiting for a
    reply that cannot come, once the owner's socket has closed."""
    import asyncio

    from moegemm.server._acceptor import _Acceptor
    from moegemm.server._http_gate import HttpLimits

    acceptor = _Acceptor(0, "127.0.0.1", 0, "/nonexistent", None, None,
                         HttpLimits(max_body_bytes=1 << 20), 1.0)
    scope = {"method": "GET", "path": "/v1/info", "raw_path": b"/v1/info", "query_string": b"",
             "http_version": "1.1", "headers": [], "client": None, "server": None}

    class ClosedWriter:
        def is_closing(self):
            return True

    async def attempt():
        with pytest.raises(ConnectionError):
            await acceptor.forward(scope, memoryview(b""))  # never connected
        acceptor.writer = ClosedWriter()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(acceptor.forward(scope, memoryview(b"")), 5)
        acceptor.writer, acceptor.lost = object(), True
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(acceptor.forward(scope, memoryview(b"")), 5)
        assert not acceptor.pending

    asyncio.run(attempt())
