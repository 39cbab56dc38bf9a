"""Soak: many concurrent clients, valid and invalid calls, weights replaced and deleted.

    python bench/soak.py --spawn --duration 30 --clients 16                 # CPU, a few MB
    python bench/soak.py --spawn --device cuda --duration 420 --procs 8 --clients 256 \
        --G 8 --N 2048 --K 7168 --max-rows 256 --check-rows 4 --check-fraction 0.25 \
        --churn-every 5 --queue-size 256 --fill-memory --fill-G 128 \
        --server-arg=--max-body-bytes=4294967296 --json bench/results/soak_h200.json
    python bench/soak.py --url http://host:8000 --token T --admin-token A ...

The GPU line is the scaled run: 8 client processes, DeepSeek-like N and K, and
mid-run the H200 filled with 1.9 GB sets until it answers 507 (the fill set
must fit the server's body limit, hence the larger one there).

What it checks, and reports as JSON (exit status 1 when anything fails):

- every valid call is answered exactly once: 200 with exactly its own rows,
  each checked against a float32 evaluation of SPEC 1 on the weight version
  that was live during the call (a version replaced or deleted before the call
  was sent, or loaded after it was answered, does not count), or a refusal the
  contract allows for it (503 with a full queue, 504 past its deadline, 404
  when its set was deleted meanwhile);
- every invalid call gets exactly the 4xx code its defect calls for;
- nothing is lost: no call without an answer, no connection dropped, no 500;
- the server's resident memory is stable (``--spawn``, or ``--server-pid``):
  the median of the last quarter of the run against the first, after warm-up.

The clients are asyncio tasks on one event loop, using ``moegemm.client``'s
`AsyncClient` (numpy only, no torch: a router's view) for valid calls and raw
HTTP for malformed ones; one more task replaces and deletes weight sets
during the traffic. Imported by ``tests/server/test_soak.py`` for the bounded
CI run. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import ml_dtypes
import numpy as np
from moegemm.client import (
    APIError,
    AsyncClient,
    DeadlineExceeded,
    NoSuchWeights,
    Overloaded,
    TransportError,
)
from moegemm.client._wire import encode_tensor, packb

FP8 = ml_dtypes.float8_e4m3fn
BLOCK = 128
MSGPACK = {"content-type": "application/vnd.msgpack"}


@dataclass
class Config:
    """One soak run."""

    url: str
    token: str | None = None
    admin_token: str | None = None
    duration: float = 30.0
    clients: int = 16
    G: int = 4
    N: int = 256
    K: int = 256
    max_rows: int = 48
    invalid_fraction: float = 0.25
    deadline_fraction: float = 0.1
    churn_every: float = 0.5
    check_rows: int = 0  # rows checked per call; 0: all of them
    check_fraction: float = 1.0  # calls whose rows are checked (all are counted)
    retries: int = 1
    fill_memory: bool = False  # mid-run, load copies of a set until 507, then drop them
    fill_G: int = 0  # the fill set's G (its N and K are the soak's); 0: G
    tag: str = ""  # appended to this run's weight-set names (one per process)
    server_pid: int | None = None
    seed: int = 0


@dataclass
class Report:
    """What happened, as counts; ``failures`` lists each thing that must not happen."""

    served: int = 0
    rows_checked: int = 0
    allowed_refusals: dict = field(default_factory=dict)
    invalid_answered: dict = field(default_factory=dict)
    weight_puts: int = 0
    weight_deletes: int = 0
    lost: int = 0
    failures: list = field(default_factory=list)
    fill: dict = field(default_factory=dict)
    rss_mib_first_quarter: float | None = None
    rss_mib_last_quarter: float | None = None
    seconds: float = 0.0
    calls_per_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and self.lost == 0

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)
        else:
            self.failures[-1] = f"... and more (last: {what})"


# -- data and the reference -------------------------------------------------------------


def _fp8(rng: np.random.Generator, shape) -> np.ndarray:
    """Random e4m3fn values over the whole range, drawn as bytes (fast at any size)."""
    bits = rng.integers(0, 256, shape, dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] ^= 1  # 0x7F/0xFF are NaN: make them +-448
    return bits.view(FP8)


def _scales(rng: np.random.Generator, shape) -> np.ndarray:
    return (rng.random(shape, np.float32) * 1.5 + 0.25) * 2.0**-8


@dataclass(eq=False)
class Version:
    """One upload of a weight set, and when it could have been live."""

    name: str
    wq: np.ndarray
    w_scale: np.ndarray
    put_started: float
    put_done: float = float("inf")
    ended: float = float("inf")  # when its replacement or deletion was done

    def live_during(self, sent: float, answered: float) -> bool:
        """Whether a call sent and answered at these instants may have run on it."""
        return self.put_started <= answered and self.ended >= sent


class Dequantized:
    """float32 ``wq[g] * w_scale[g]`` per (version, group), the most recent few kept."""

    def __init__(self, budget_bytes: int = 2 << 30) -> None:
        self.budget = budget_bytes
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.bytes = 0

    def group(self, version: Version, g: int) -> np.ndarray:
        key = (id(version), g)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key][1]
        scale = np.repeat(np.repeat(version.w_scale[g].T, BLOCK, 0), BLOCK, 1)
        w = version.wq[g].astype(np.float32) * scale
        # The version is kept in the entry so its id() cannot be reused meanwhile.
        self.cache[key] = (version, w)
        self.bytes += w.nbytes
        while self.bytes > self.budget and len(self.cache) > 1:
            _, (_, old) = self.cache.popitem(last=False)
            self.bytes -= old.nbytes
        return w


def reference_rows(weights: Dequantized, version: Version, x: np.ndarray,
                   x_scale: np.ndarray, m_sizes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """SPEC 1 in float32 for the given rows of one call: [len(rows), N]."""
    group = np.repeat(np.arange(len(m_sizes)), m_sizes)[rows]
    xd = x[rows].astype(np.float32) * np.repeat(x_scale[rows], BLOCK, 1)
    out = np.empty((len(rows), version.wq.shape[1]), np.float32)
    for g in np.unique(group):
        mine = group == g
        out[mine] = xd[mine] @ weights.group(version, int(g)).T
    return out


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref||_F / ||ref||_F in float64."""
    denom = float(np.linalg.norm(ref.astype(np.float64)))
    return float(np.linalg.norm(out.astype(np.float64) - ref)) / max(denom, 1e-30)


def matching(weights: Dequantized, candidates: list[Version], got: np.ndarray, x, x_scale,
             m_sizes, rows) -> Version | None:
    """The first candidate whose SPEC 1 rows ``got`` matches within SPEC tolerance."""
    for version in candidates:
        ref = reference_rows(weights, version, x, x_scale, m_sizes, rows)
        if rel_error(got, ref) <= 5e-3:
            return version
    return None


# -- the soak --------------------------------------------------------------------------------


class Soak:
    def __init__(self, config: Config) -> None:
        self.c = config
        self.rng = np.random.default_rng(config.seed)
        self.report = Report()
        # One set replaced under traffic, one deleted and re-created; per process.
        self.stable, self.churn_name = f"soak-stable{config.tag}", f"soak-churn{config.tag}"
        self.versions: dict[str, list[Version]] = {self.stable: [], self.churn_name: []}
        self.deleted: dict[str, list[list[float]]] = {self.churn_name: []}  # [started, done]
        self.weights = Dequantized()
        self.filling = False
        self.t0 = time.monotonic()
        self.stop = asyncio.Event()
        self.rss: list[tuple[float, float]] = []

    def _auth(self, admin: bool) -> dict:
        token = self.c.admin_token if admin and self.c.admin_token else self.c.token
        return {"authorization": f"Bearer {token}"} if token else {}

    # -- weights -------------------------------------------------------------

    async def put(self, http: httpx.AsyncClient, name: str) -> None:
        c = self.c
        wq = _fp8(self.rng, (c.G, c.N, c.K))
        w_scale = _scales(self.rng, (c.G, c.K // BLOCK, c.N // BLOCK))
        version = Version(name, wq, w_scale, time.monotonic())
        previous = self.versions[name][-1] if self.versions[name] else None
        self.versions[name].append(version)
        body = packb({"w": encode_tensor(wq), "w_scale": encode_tensor(w_scale)})
        r = await http.put(f"/v1/weights/{name}", content=body,
                           headers={**MSGPACK, **self._auth(True)})
        version.put_done = time.monotonic()
        if r.status_code == 507 and self.filling:
            # The device is full on purpose: a refused load must change nothing.
            self._refused("out_of_memory (while full)")
            self.versions[name].remove(version)
            return
        if r.status_code not in (200, 201):
            self.report.fail(f"PUT {name} answered {r.status_code}: {r.text[:200]}")
            self.versions[name].remove(version)  # never live
            return
        self.report.weight_puts += 1
        if previous is not None and previous.ended == float("inf"):
            previous.ended = version.put_done

    async def delete(self, http: httpx.AsyncClient, name: str) -> None:
        # Recorded before it is sent: calls may see the 404 before DELETE's answer.
        span = [time.monotonic(), float("inf")]
        self.deleted[name].append(span)
        r = await http.delete(f"/v1/weights/{name}", headers=self._auth(True))
        span[1] = time.monotonic()
        if r.status_code != 204:
            self.report.fail(f"DELETE {name} answered {r.status_code}: {r.text[:200]}")
            self.deleted[name].remove(span)
            return
        self.report.weight_deletes += 1
        for v in self.versions[name]:
            v.ended = min(v.ended, span[1])

    async def _stopped_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    async def churn(self, http: httpx.AsyncClient) -> None:
        """Replace the stable set, delete and re-create the churn set, and send bad
        uploads, until stopped."""
        step = 0
        while not await self._stopped_within(self.c.churn_every):
            step += 1
            if step % 3 == 0:
                await self.delete(http, self.churn_name)
                await asyncio.sleep(self.c.churn_every / 4)
                await self.put(http, self.churn_name)
            else:
                await self.put(http, self.stable)
            # A broken upload over the live set must change nothing.
            r = await http.put(f"/v1/weights/{self.stable}", content=b"\x81\xa1w\xc1",
                               headers={**MSGPACK, **self._auth(True)})
            self._expect("put garbage", r, 400, "bad_msgpack")


    # -- device memory -------------------------------------------------------------

    async def _gauge(self, http: httpx.AsyncClient, name: str) -> float | None:
        r = await http.get("/metrics", headers=self._auth(False))
        for line in r.text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    async def fill_memory(self, http: httpx.AsyncClient) -> None:
        """At a third of the run, load copies of one set until the server answers
        507; the sets loaded before, and the traffic, must not notice. At two thirds,
        delete them: the device memory they held must come back."""
        c, fill = self.c, self.report.fill
        if await self._stopped_within(c.duration / 3):
            return
        G = c.fill_G or c.G
        wq = _fp8(self.rng, (G, c.N, c.K))
        w_scale = _scales(self.rng, (G, c.K // BLOCK, c.N // BLOCK))
        version = Version("fill", wq, w_scale, 0.0, 0.0)
        body = packb({"w": encode_tensor(wq), "w_scale": encode_tensor(w_scale)})
        fill["device_bytes_before"] = await self._gauge(http, "moegemm_device_memory_bytes")
        self.filling = True
        names: list[str] = []
        started = time.monotonic()
        while not self.stop.is_set() and len(names) < 100_000:
            name = f"soak-fill-{len(names)}"
            r = await http.put(f"/v1/weights/{name}", content=body,
                               headers={**MSGPACK, **self._auth(True)})
            if r.status_code == 201:
                names.append(name)
                continue
            fill["refusal"] = f"{r.status_code} {r.text[:200]}"
            if r.status_code != 507:
                self.report.fail(f"filling: PUT {name} answered {r.status_code}: {r.text[:200]}")
            break
        fill.update(reached_507="refusal" in fill, sets_loaded=len(names), set_bytes=len(body),
                    seconds_to_fill=round(time.monotonic() - started, 1))
        fill["device_bytes_full"] = await self._gauge(http, "moegemm_device_memory_bytes")
        # Every set loaded before the refusal still answers, with its own weights.
        for name in names[:1] + names[-1:]:
            x, x_scale, m_sizes = self._call_inputs(G)
            async with AsyncClient(c.url, token=c.token, timeout=120, retries=20,
                                   backoff=0.05) as client:
                try:
                    out = await client.grouped_gemm(name, x, m_sizes, x_scale)
                except APIError as exc:
                    self.report.fail(f"filling: {name} answered {exc}")
                    continue
            if x.shape[0]:
                rows = np.arange(x.shape[0])
                got = out.astype(np.float32)
                found = await asyncio.to_thread(matching, self.weights, [version], got, x,
                                                x_scale, m_sizes, rows)
                if found is None:
                    self.report.fail(f"filling: {name} answered wrong rows")
        await self._stopped_within(c.duration / 3)
        for name in names:
            r = await http.delete(f"/v1/weights/{name}", headers=self._auth(True))
            if r.status_code != 204:
                self.report.fail(f"filling: DELETE {name} answered {r.status_code}")
        self.filling = False
        after = fill["device_bytes_after_delete"] = await self._gauge(
            http, "moegemm_device_memory_bytes")
        before, held = fill["device_bytes_before"], len(names) * len(body)
        # The allocator may keep some blocks cached; most of what the sets held comes back.
        if before is not None and after is not None and after > before + held / 10 + (1 << 30):
            self.report.fail(f"filling: device memory {before:.0f} -> {after:.0f} bytes after "
                             f"deleting {len(names)} sets of {len(body)} bytes")

    # -- calls -----------------------------------------------------------------

    def _call_inputs(self, G: int | None = None):
        c = self.c
        G = G or c.G
        m = int(self.rng.integers(0, c.max_rows + 1))
        cuts = np.sort(self.rng.integers(0, m + 1, G - 1))
        m_sizes = np.diff(np.concatenate([[0], cuts, [m]])).astype(np.int64)
        x = _fp8(self.rng, (m, c.K))
        x_scale = _scales(self.rng, (m, c.K // BLOCK))
        return x, x_scale, m_sizes

    async def valid_call(self, client: AsyncClient) -> None:
        name = self.stable if self.rng.random() < 0.7 else self.churn_name
        x, x_scale, m_sizes = self._call_inputs()
        deadline = 0.05 if self.rng.random() < self.c.deadline_fraction else None
        sent = time.monotonic()
        try:
            out = await client.grouped_gemm(name, x, m_sizes, x_scale, deadline=deadline)
        except Overloaded:
            self._refused("overloaded")
            # A router would send this call elsewhere; here it just comes back later.
            await asyncio.sleep(self.rng.uniform(0.005, 0.05))
            return
        except DeadlineExceeded:
            if deadline is None:
                self.report.fail(f"a call without a deadline got 504 ({name})")
            self._refused("timeout")
            return
        except NoSuchWeights:
            answered = time.monotonic()
            spans = self._deletions_around(name) if name == self.churn_name else []
            if not any(s <= answered and d >= sent for s, d in spans):
                t0 = self.t0
                self.report.fail(
                    f"404 for {name} while it was loaded (call {sent - t0:.3f}-"
                    f"{answered - t0:.3f} s; deleted {[(round(s - t0, 3), round(d - t0, 3)) for s, d in spans]})"
                )
            self._refused("no_such_weights")
            return
        except TransportError as exc:
            self.report.lost += 1
            self.report.fail(f"no answer to a gemm on {name}: {exc}")
            return
        except APIError as exc:
            self.report.fail(f"a valid gemm on {name} answered {exc}")
            return
        answered = time.monotonic()
        await self.check(name, out, x, x_scale, m_sizes, sent, answered)

    def _deletions_around(self, name: str):
        # A 404 is allowed between a delete's start and the re-creation's end.
        spans = []
        for started, _ in self.deleted[name]:
            after = [v.put_done for v in self.versions[name] if v.put_started >= started]
            spans.append((started, min(after) if after else float("inf")))
        return spans

    async def check(self, name, out, x, x_scale, m_sizes, sent, answered) -> None:
        m = x.shape[0]
        if out.shape != (m, self.c.N) or out.dtype != ml_dtypes.bfloat16:
            self.report.fail(f"{name}: out is {out.dtype} {out.shape}, expected ({m}, {self.c.N})")
            return
        self.report.served += 1
        if m == 0 or self.rng.random() >= self.c.check_fraction:
            return
        n_rows = m if self.c.check_rows <= 0 else min(m, self.c.check_rows)
        rows = np.sort(self.rng.choice(m, n_rows, replace=False))
        got = out[rows].astype(np.float32)
        if not np.isfinite(got).all():
            self.report.fail(f"{name}: non-finite output")
            return
        # The versions live during the call first; the others only to name a failure.
        live = [v for v in self.versions[name] if v.live_during(sent, answered)]
        found = await asyncio.to_thread(matching, self.weights, live, got, x, x_scale,
                                        m_sizes, rows)
        self.report.rows_checked += n_rows
        if found is not None:
            return
        others = [v for v in self.versions[name] if v not in live]
        stale = await asyncio.to_thread(matching, self.weights, others, got, x, x_scale,
                                        m_sizes, rows)
        if stale is not None:
            self.report.fail(f"{name}: rows computed on a version that was not live")
        else:
            self.report.fail(f"{name}: {m} rows match no weight version (wrong or mixed rows)")

    async def invalid_call(self, http: httpx.AsyncClient) -> None:
        """One malformed call and the one code it must get."""
        c = self.c
        x, x_scale, m_sizes = self._call_inputs()
        body = {"x": encode_tensor(x), "x_scale": encode_tensor(x_scale),
                "m_sizes": encode_tensor(m_sizes)}
        kind = self.rng.integers(0, 8)
        path, headers = f"/v1/weights/{self.stable}/gemm", {**MSGPACK, **self._auth(False)}
        content = None
        if kind == 0:
            content, expect = bytes(self.rng.integers(0, 256, 64, dtype=np.uint8)) + b"\xc1", \
                (400, "bad_msgpack")
        elif kind == 1:
            other = _fp8(self.rng, (x.shape[0], c.K + BLOCK))
            body["x"] = encode_tensor(other)
            expect = (400, "bad_shape")
        elif kind == 2:
            sizes = m_sizes.copy()
            sizes[0] += 1
            body["m_sizes"] = encode_tensor(sizes)
            expect = (400, "bad_m_sizes")
        elif kind == 3:
            if x.shape[0] == 0:
                x, x_scale, m_sizes = _fp8(self.rng, (1, c.K)), _scales(self.rng, (1, c.K // BLOCK)), \
                    np.array([1] + [0] * (c.G - 1), np.int64)
                body = {"x": encode_tensor(x), "m_sizes": encode_tensor(m_sizes)}
            bad = x_scale.copy()
            bad[0, 0] = np.nan
            body["x_scale"] = encode_tensor(bad)
            expect = (400, "not_finite")
        elif kind == 4:
            path, expect = "/v1/weights/soak-missing/gemm", (404, "no_such_weights")
        elif kind == 5:
            path, expect = "/v1/weights/bad$name/gemm", (400, "bad_name")
        elif kind == 6:
            headers["content-type"] = "application/json"
            expect = (415, "unsupported_media_type")
        else:
            body["extra"] = 1
            expect = (400, "bad_field")
        if c.token and self.rng.random() < 0.1:
            headers["authorization"] = "Bearer not-the-token"
            expect = (401, "unauthorized")
        try:
            r = await http.post(path, content=content if content is not None else packb(body),
                                headers=headers)
        except httpx.TransportError as exc:
            self.report.lost += 1
            self.report.fail(f"no answer to an invalid call ({expect[1]}): {exc!r}")
            return
        # Contents are checked with the launch (after the queue), so a not_finite
        # call meets a full queue first like any valid call: 503 is allowed.
        also = ((503, "overloaded"),) if expect[1] == "not_finite" else ()
        self._expect(f"invalid call ({expect[1]})", r, *expect, also=also)

    def _expect(self, what: str, r: httpx.Response, status: int, code: str,
                also: tuple = ()) -> None:
        try:
            got = r.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            got = None
        if (r.status_code, got) in also:
            self._refused(got)
            return
        if (r.status_code, got) != (status, code):
            self.report.fail(f"{what}: expected {status} {code}, got {r.status_code} "
                             f"{r.text[:200]}")
            return
        key = f"{status} {code}"
        self.report.invalid_answered[key] = self.report.invalid_answered.get(key, 0) + 1

    def _refused(self, code: str) -> None:
        self.report.allowed_refusals[code] = self.report.allowed_refusals.get(code, 0) + 1

    async def worker(self, index: int, http: httpx.AsyncClient) -> None:
        # Half the clients retry 503s, half fail over at once (as a MultiClient would).
        retries = self.c.retries if index % 2 else 0
        async with AsyncClient(self.c.url, token=self.c.token, retries=retries,
                               backoff=0.02, timeout=120) as client:
            while not self.stop.is_set():
                if self.rng.random() < self.c.invalid_fraction:
                    await self.invalid_call(http)
                else:
                    await self.valid_call(client)

    async def watch_memory(self) -> None:
        if self.c.server_pid is None:
            return
        started = time.monotonic()
        while not self.stop.is_set():
            rss = _rss_mib(self.c.server_pid)
            if rss is not None:
                self.rss.append((time.monotonic() - started, rss))
            await self._stopped_within(0.25)

    async def run(self) -> Report:
        limits = httpx.Limits(max_connections=self.c.clients + 4)
        async with httpx.AsyncClient(base_url=self.c.url, timeout=120, limits=limits) as http:
            await self.put(http, self.stable)
            await self.put(http, self.churn_name)
            if self.report.failures:
                return self.report
            started = time.monotonic()
            tasks = [asyncio.create_task(self.worker(i, http)) for i in range(self.c.clients)]
            tasks += [asyncio.create_task(self.churn(http)),
                      asyncio.create_task(self.watch_memory())]
            if self.c.fill_memory:
                tasks.append(asyncio.create_task(self.fill_memory(http)))
            await asyncio.sleep(self.c.duration)
            self.stop.set()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 300)
            for result in results:
                if isinstance(result, BaseException):
                    self.report.fail(f"a client task crashed: {result!r}")
            elapsed = time.monotonic() - started
        self.report.seconds = round(elapsed, 2)
        self.report.calls_per_s = round(self.report.served / elapsed, 1)
        self._memory_summary()
        return self.report

    def _memory_summary(self) -> None:
        if len(self.rss) < 8:
            return
        quarter = len(self.rss) // 4
        first = statistics.median(r for _, r in self.rss[quarter:2 * quarter])
        last = statistics.median(r for _, r in self.rss[-quarter:])
        self.report.rss_mib_first_quarter = round(first, 1)
        self.report.rss_mib_last_quarter = round(last, 1)
        # Steady traffic on a fixed set of shapes: growth past this is a leak.
        if last > first * 1.15 + 64:
            self.report.fail(f"server memory grew from {first:.0f} MiB to {last:.0f} MiB")


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run(config: Config) -> Report:
    """Run one soak against ``config.url`` and return its report."""
    random.seed(config.seed)
    return asyncio.run(Soak(config).run())


def run_processes(config: Config, procs: int) -> Report:
    """The soak from ``procs`` client processes at once (one event loop cannot feed a
    GPU), each with its own weight sets; the device fill and the memory watch run in
    the first. Their reports are added up."""
    if procs <= 1:
        return run(config)
    configs = [
        dataclasses.replace(
            config, tag=f"-p{i}", seed=config.seed + i,
            clients=max(1, config.clients // procs),
            fill_memory=config.fill_memory and i == 0,
            server_pid=config.server_pid if i == 0 else None,
        )
        for i in range(procs)
    ]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        reports = pool.map(run, configs)
    total = Report()
    for r in reports:
        total.served += r.served
        total.rows_checked += r.rows_checked
        total.weight_puts += r.weight_puts
        total.weight_deletes += r.weight_deletes
        total.lost += r.lost
        for mine, theirs in ((total.allowed_refusals, r.allowed_refusals),
                             (total.invalid_answered, r.invalid_answered)):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
        total.failures += r.failures
        total.seconds = max(total.seconds, r.seconds)
    first = reports[0]
    total.fill = first.fill
    total.rss_mib_first_quarter = first.rss_mib_first_quarter
    total.rss_mib_last_quarter = first.rss_mib_last_quarter
    total.calls_per_s = round(total.served / max(total.seconds, 1e-9), 1)
    return total


# -- a server to soak -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SpawnedServer:
    """``moegemm serve`` in a child process on loopback (stopped with SIGINT)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")  # noqa: SIM115 -- open for the server's lifetime
        cmd = [sys.executable, "-m", "moegemm.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--no-demo", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env})

    def wait_live(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/v1/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the server did not become ready")

    def stop(self) -> int:
        """SIGINT, then the exit status (a graceful shutdown exits 0)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="soak a running server")
    parser.add_argument("--spawn", action="store_true", help="start a server for the run")
    parser.add_argument("--device", default="cpu", help="the spawned server's device")
    parser.add_argument("--queue-size", type=int, default=64, help="the spawned server's queue")
    parser.add_argument("--max-weight-bytes", type=int,
                        help="the spawned server's total weight limit (needed to fill a CPU)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="more flags for the spawned server (repeatable)")
    parser.add_argument("--server-log", default=None)
    parser.add_argument("--token")
    parser.add_argument("--admin-token")
    parser.add_argument("--server-pid", type=int)
    parser.add_argument("--json", help="also write the report here")
    for name, default in (("duration", 30.0), ("invalid_fraction", 0.25),
                          ("deadline_fraction", 0.1), ("churn_every", 0.5),
                          ("check_fraction", 1.0)):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float,
                            default=default)
    parser.add_argument("--procs", type=int, default=1,
                        help="client processes (the clients are shared out among them)")
    parser.add_argument("--fill-memory", action="store_true",
                        help="mid-run, load sets until 507, check, then delete them")
    for name, default in (("clients", 16), ("G", 4), ("N", 256), ("K", 256), ("max_rows", 48),
                          ("check_rows", 0), ("retries", 1), ("seed", 0), ("fill_G", 0)):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
    args = parser.parse_args(argv)
    if bool(args.url) == args.spawn:
        parser.error("give exactly one of --url and --spawn")
    fields = {k: v for k, v in vars(args).items() if k in Config.__dataclass_fields__}
    server = None
    if args.spawn:
        env = {}
        if args.token:
            env["MOEGEMM_TOKEN"] = args.token
        if args.admin_token:
            env["MOEGEMM_ADMIN_TOKEN"] = args.admin_token
        log = Path(args.server_log or tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
        server_args = ["--device", args.device, "--queue-size", str(args.queue_size),
                       *args.server_arg]
        if args.max_weight_bytes:
            server_args += ["--max-weight-bytes", str(args.max_weight_bytes)]
        elif args.fill_memory and args.device == "cpu":
            parser.error("--fill-memory on the CPU needs --max-weight-bytes (host memory)")
        server = SpawnedServer(server_args, env, log)
        server.wait_live()
        fields.update(url=server.url, server_pid=server.proc.pid)
    report = run_processes(Config(**fields), args.procs)
    result = asdict(report)
    result["ok"] = report.ok
    result["config"] = {k: v for k, v in fields.items() if "token" not in k}
    result["config"]["procs"] = args.procs
    if server is not None:
        result["server_exit"] = server.stop()
        result["server_log"] = str(server.log.name)
        if result["server_exit"] != 0:
            result["ok"] = False
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
