"""Concurrent callers, merging, and atomic replacement through a real server."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from moegemm.client._wire import packb
from moegemm.kernels.testing import random_m_sizes
from moegemm.server import Settings
from server_support import MSGPACK, close_to, fp8_problem, out_of, reference, serve, wire

N, K, G = 128, 256, 4


def _caller_inputs(callers: int):
    """Different rows (and group splits) per caller, so a mix-up cannot pass."""
    return [fp8_problem(5 + 13 * i, N, K, G) for i in range(callers)]


def _hammer(url: str, name: str, problems, rounds: int = 3):
    # Every round's calls leave together (a barrier), so they are concurrent on the
    # server however the threads happen to be scheduled on a busy machine.
    together = threading.Barrier(len(problems))

    def one(i):
        p = problems[i % len(problems)]
        body = packb({"x": wire(p.xq), "x_scale": wire(p.x_scale), "m_sizes": wire(p.m_sizes)})
        outs = []
        with httpx.Client(base_url=url, timeout=60) as http:
            for _ in range(rounds):
                together.wait(timeout=60)
                outs.append(out_of(http.post(f"/v1/weights/{name}/gemm", content=body,
                                             headers=MSGPACK)))
        return i % len(problems), outs

    with ThreadPoolExecutor(len(problems)) as pool:
        return list(pool.map(one, range(len(problems))))


@pytest.mark.parametrize("merge_window_us", [0, 20_000])
def test_concurrent_callers_get_their_own_rows(merge_window_us):
    weights = fp8_problem(1, N, K, G)
    settings = Settings(device="cpu", demo=False, merge_window_us=merge_window_us,
                        max_bucket_m=64)
    with serve(settings) as srv:
        srv.put("w", {"w": wire(weights.wq), "w_scale": wire(weights.w_scale)})
        problems = _caller_inputs(8)
        for i, outs in _hammer(srv.url, "w", problems):
            p = problems[i]
            ref = reference(p.xq, p.x_scale, weights.wq, weights.w_scale, p.m_sizes)
            for out in outs:
                assert out.shape == (p.xq.shape[0], N)
                assert close_to(out, ref)
        batches = srv.app.state.metrics.batch_calls.collect()[0].samples
        count = next(s.value for s in batches if s.name.endswith("_count"))
        total = next(s.value for s in batches if s.name.endswith("_sum"))
        assert total == 8 * 3  # every call ran exactly once
        if merge_window_us:
            assert count < total  # with a 20 ms window, concurrent calls were merged


def test_merged_float_and_fp8_callers():
    """Callers of different input dtypes in one merge window each get their rows."""
    settings = Settings(device="cpu", demo=False, merge_window_us=30_000)
    w = torch.randn(G, N, K).bfloat16()
    with serve(settings) as srv:
        srv.put("w", {"w": wire(w)})
        ws = srv.services.store.get("w")
        from moegemm.kernels import quantize_activations

        def one(i):
            x = torch.randn(7 + i, K).to((torch.bfloat16, torch.float32)[i % 2])
            m = random_m_sizes(G, 7 + i)
            with httpx.Client(base_url=srv.url, timeout=60) as http:
                r = http.post("/v1/weights/w/gemm", headers=MSGPACK,
                              content=packb({"x": wire(x), "m_sizes": wire(m)}))
            xq, xs = quantize_activations(x)
            return close_to(out_of(r), reference(xq, xs, ws.wq, ws.w_scale, m))

        with ThreadPoolExecutor(6) as pool:
            assert all(pool.map(one, range(6)))


def test_replacement_never_mixes_weight_sets():
    """Every answer equals exactly one of the two sets' outputs while they swap."""
    a = fp8_problem(1, N, K, G)
    b = fp8_problem(1, N, K, G)
    x = fp8_problem(40, N, K, G)
    body_a = {"w": wire(a.wq), "w_scale": wire(a.w_scale)}
    body_b = {"w": wire(b.wq), "w_scale": wire(b.w_scale)}
    settings = Settings(device="cpu", demo=False, merge_window_us=2_000)
    with serve(settings) as srv:
        srv.put("swap", body_a)
        # What the server answers for each set, computed through the server itself.
        call = packb({"x": wire(x.xq), "x_scale": wire(x.x_scale), "m_sizes": wire(x.m_sizes)})
        out_a = out_of(srv.http.post("/v1/weights/swap/gemm", content=call, headers=MSGPACK))
        srv.put("swap", body_b)
        out_b = out_of(srv.http.post("/v1/weights/swap/gemm", content=call, headers=MSGPACK))
        assert close_to(out_a, reference(x.xq, x.x_scale, a.wq, a.w_scale, x.m_sizes))
        assert close_to(out_b, reference(x.xq, x.x_scale, b.wq, b.w_scale, x.m_sizes))
        assert not torch.equal(out_a, out_b)

        stop = threading.Event()
        seen = {"a": 0, "b": 0}
        failures = []

        def reader():
            try:
                read_until_stopped()
            except Exception as exc:  # noqa: BLE001 -- the test fails on it below
                failures.append(exc)

        def read_until_stopped():
            with httpx.Client(base_url=srv.url, timeout=60) as http:
                while not stop.is_set():
                    out = out_of(http.post("/v1/weights/swap/gemm", content=call,
                                           headers=MSGPACK))
                    if torch.equal(out, out_a):
                        seen["a"] += 1
                    elif torch.equal(out, out_b):
                        seen["b"] += 1
                    else:
                        failures.append(out)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        # Swap at least 12 times, and until the readers got 30 answers in between.
        i = 0
        while i < 12 or (seen["a"] + seen["b"] < 30 and not failures and i < 2000):
            r = srv.put("swap", body_a if i % 2 == 0 else body_b)
            assert r.status_code == 200
            i += 1
        stop.set()
        for t in threads:
            t.join(60)
        assert not failures
        assert seen["a"] + seen["b"] >= 30
