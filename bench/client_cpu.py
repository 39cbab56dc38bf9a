"""The blocking Client's own cost per gemm call, against a canned local server.

    python bench/client_cpu.py                       # M=1 and M=128, 3 rounds
    python bench/client_cpu.py --ms 1 --profile      # plus cProfile of the client
    python bench/client_cpu.py --stages              # plus the client's steps, timed

A uvloop server in a subprocess (pinned to the last CPU; the client to the
first) answers every POST with a valid canned gemm answer of the right size:
status 200, ``application/vnd.msgpack``, ``{"out": bf16 [M, N]}`` in the
bytes the real server writes, the request's ``X-Request-Id`` echoed. It
receives each body whole before answering, as the real one does.

Two peers call it, one after the other on one keep-alive connection, in
alternating blocks so that drift on a noisy box hits both alike:

    client : ``Client.grouped_gemm(name, x, m_sizes, x_scale=scale)``
    raw    : the same request bytes, prebuilt, with ``sendall`` and
             ``recv_into`` a preallocated buffer (the floor)

For each it reports the median wall time and the median CPU time of the
calling thread (``CLOCK_THREAD_CPUTIME_ID``: Python and the kernel's socket
work both count), and the client's overhead over the floor on each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

G, N, K = 8, 2048, 7168
_NAME = "main"


# -- the canned server ----------------------------------------------------------------


def _answer_body(m: int) -> bytes:
    import ml_dtypes
    from moegemm.client._wire import encode_tensor, packb

    out = np.random.default_rng(m).standard_normal((m, N), dtype=np.float32)
    return packb({"out": encode_tensor(out.astype(ml_dtypes.bfloat16))})


class _Canned(asyncio.BufferedProtocol):
    """Read a head, receive the body into a buffer, write the canned answer for M."""

    def __init__(self, answers: dict[int, bytes]) -> None:
        self.answers = answers  # request body size -> answer body
        self.head = bytearray(1 << 16)
        self.view = memoryview(self.head)
        self.used = 0
        self.body: memoryview | None = None
        self.got = self.want = 0
        self.request_id = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint):
        if self.body is not None:
            return self.body[self.got:]
        return self.view[self.used:]

    def buffer_updated(self, n):
        if self.body is None:
            self.used += n
            end = self.head.find(b"\r\n\r\n", 0, self.used)
            if end < 0:
                return
            fields = {}
            for line in bytes(self.view[:end]).split(b"\r\n")[1:]:
                key, _, value = line.partition(b":")
                fields[key.strip().lower()] = value.strip()
            self.want = int(fields[b"content-length"])
            self.request_id = fields.get(b"x-request-id", b"none")
            self.body = memoryview(np.empty(self.want, dtype=np.uint8))
            have = self.used - end - 4
            self.body[:have] = self.view[end + 4:self.used]
            self.got, self.used = have, 0
        else:
            self.got += n
        if self.got == self.want:
            answer = self.answers[self.want]
            # One writev of head and body, as the real server's writelines.
            self.transport.writelines([
                b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\n"
                b"content-length: %d\r\nx-request-id: %s\r\n\r\n" % (len(answer), self.request_id),
                answer])
            self.body = None


def serve(port: int, ms: list[int]) -> None:
    import uvloop

    answers = {len(_request_body(m)): _answer_body(m) for m in ms}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Canned(answers), "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


# -- the inputs -------------------------------------------------------------------------


def _inputs(m: int):
    import ml_dtypes

    rng = np.random.default_rng(0)
    sizes = rng.multinomial(m, np.full(G, 1.0 / G)).astype(np.int64)
    x = rng.uniform(-448, 448, size=(m, K)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-4, 1e-3, size=(m, K // 128)).astype(np.float32)
    return x, scale, sizes


def _request_body(m: int) -> bytes:
    from moegemm.client._wire import encode_tensor, packb

    x, scale, sizes = _inputs(m)
    return packb({"x": encode_tensor(x), "m_sizes": encode_tensor(sizes),
                  "x_scale": encode_tensor(scale)})


def _request_bytes(port: int, m: int) -> bytes:
    """What the Client sends, spelled out: its head fields, a fixed request id."""
    body = _request_body(m)
    head = (f"POST /v1/weights/{_NAME}/gemm HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "User-Agent: moegemm-client\r\nAccept: application/vnd.msgpack, application/json\r\n"
            f"X-Request-Id: {os.urandom(16).hex()}\r\nContent-Type: application/vnd.msgpack\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


# -- the peers --------------------------------------------------------------------------


class _Raw:
    """One keep-alive socket: prebuilt request bytes, the whole answer read back."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(4 << 20)
        self.view = memoryview(self.buf)

    def call(self, request: bytes) -> None:
        sock, buf, view = self.sock, self.buf, self.view
        sock.sendall(request)
        got = sock.recv_into(view)
        while (end := buf.find(b"\r\n\r\n", 0, got)) < 0:
            got += sock.recv_into(view[got:])
        at = buf.find(b"content-length: ", 0, end) + 16
        want = end + 4 + int(buf[at:buf.find(b"\r\n", at)])
        while got < want:
            got += sock.recv_into(view[got:want])


def _timed(call, n: int) -> tuple[list[int], list[int]]:
    wall, cpu = [], []
    clock, thread = time.perf_counter_ns, time.thread_time_ns
    for _ in range(n):
        t0, c0 = clock(), thread()
        call()
        c1, t1 = thread(), clock()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
    return wall, cpu


def _us(xs: list[int]) -> float:
    return statistics.median(xs) / 1e3


def _wait_port(port: int, proc: subprocess.Popen) -> None:
    for _ in range(200):
        if proc.poll() is not None:
            raise RuntimeError("the canned server exited")
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the canned server did not start")


def _stages(client, args, n: int) -> dict[str, float]:
    """Median microseconds of the client's steps (wrapped with a clock; they nest)."""
    from moegemm.client import _client, _lane

    spent: dict[str, list[int]] = {}
    saved = []

    def wrap(owner, attr):
        orig = owner.__dict__.get(attr)
        if orig is None:
            return
        fn = orig.__func__ if isinstance(orig, staticmethod) else orig

        def timed(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                spent.setdefault(attr, []).append(time.perf_counter_ns() - t0)

        setattr(owner, attr, staticmethod(timed) if isinstance(orig, staticmethod) else timed)
        saved.append((owner, attr, orig))

    for owner, attr in ((_client, "gemm_call"), (_client, "read_answer"),
                        (_client._Base, "_request_args"), (_lane.Lane, "request"),
                        (_lane.Lane, "_take"), (_lane.Lane, "_send"), (_lane.Lane, "_receive")):
        wrap(owner, attr)
    try:
        for _ in range(n):
            client.grouped_gemm(*args[0], **args[1])
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)
    return {k: round(_us(v), 1) for k, v in spent.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,128")
    ap.add_argument("--calls", type=int, default=2000, help="calls per peer per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block", type=int, default=100, help="calls per alternating block")
    ap.add_argument("--port", type=int, default=18790)
    ap.add_argument("--profile", action="store_true", help="cProfile the client calls")
    ap.add_argument("--stages", action="store_true", help="time the client's steps")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if args.serve:
        serve(args.serve, ms)
        return 0

    from moegemm.client import Client

    cpus = sorted(os.sched_getaffinity(0))
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(args.port),
                               "--ms", args.ms])
    try:
        if len(cpus) > 1:
            os.sched_setaffinity(server.pid, {cpus[-1]})
            os.sched_setaffinity(0, {cpus[0]})
        _wait_port(args.port, server)
        raw = _Raw(args.port)
        with Client(f"http://127.0.0.1:{args.port}") as client:
            print(f"G={G} K={K} N={N}; {args.rounds} rounds x {args.calls} calls per peer; "
                  "medians in us", flush=True)
            print(f"{'M':>4} {'round':>5} | {'client wall':>11} {'raw wall':>8} {'over':>6} | "
                  f"{'client cpu':>10} {'raw cpu':>7} {'over':>6}")
            for m in ms:
                x, scale, sizes = _inputs(m)
                request = _request_bytes(args.port, m)
                gemm = (lambda x=x, scale=scale, sizes=sizes:
                        client.grouped_gemm(_NAME, x, sizes, x_scale=scale))
                out = gemm()
                assert out.shape == (m, N) and str(out.dtype) == "bfloat16", (out.shape, out.dtype)
                plain = (lambda request=request: raw.call(request))
                _timed(gemm, 200)
                _timed(plain, 200)
                overs = []
                for r in range(args.rounds):
                    cw, cc, rw, rc = [], [], [], []
                    for _ in range(args.calls // args.block):
                        w, c = _timed(gemm, args.block)
                        cw += w
                        cc += c
                        w, c = _timed(plain, args.block)
                        rw += w
                        rc += c
                    overs.append((_us(cw) - _us(rw), _us(cc) - _us(rc)))
                    print(f"{m:>4} {r:>5} | {_us(cw):>11.1f} {_us(rw):>8.1f} "
                          f"{overs[-1][0]:>6.1f} | {_us(cc):>10.1f} {_us(rc):>7.1f} "
                          f"{overs[-1][1]:>6.1f}", flush=True)
                print(f"{m:>4} {'med':>5} | {'':>11} {'':>8} "
                      f"{statistics.median(o[0] for o in overs):>6.1f} | {'':>10} {'':>7} "
                      f"{statistics.median(o[1] for o in overs):>6.1f}   (client overhead)",
                      flush=True)
                if args.stages:
                    print(f"     stages: {_stages(client, ((_NAME, x, sizes), {'x_scale': scale}), 2000)}")
                if args.profile:
                    import cProfile
                    import pstats

                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(args.calls):
                        gemm()
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
