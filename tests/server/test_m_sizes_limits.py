"""Group sizes near the int64 and int32 limits are judged exactly by the one validator.

A body whose int64 ``m_sizes`` wrap around in a fixed-width sum (the exact sum
of ``[2^63-1, 2^63-1, 18, 0, ...]`` is 2^64 + 16, numpy's is 16) once passed the
GPU lanes and wrote out of bounds, losing the device for every later call. The
validator every call takes (`_request.gemm_call`) must refuse what the exact Python-int rule (SPEC 2.2 ``bad_m_sizes``:
every size >= 0, sum == M) refuses, and take only what it takes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moegemm.client._errors import APIError, BadMSizes
from moegemm.client._wire import encode_tensor, packb
from moegemm.server._merge import plan_merge
from moegemm.server._request import decode_gemm, gemm_call
from server_support import assert_error

G, K, N = 8, 256, 128
FP8 = "float8_e4m3fn"
I64 = (-(2**63), 2**63 - 1)
I32 = (-(2**31), 2**31 - 1)
NEAR = st.sampled_from([0, 1, 2, 16, 18, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 16,
                        2**62, 2**63 - 1, -1, -(2**31), -(2**63), 2**63 - 17])


def _body(rows: int, sizes, dtype) -> bytes:
    rng = np.random.default_rng(rows)
    x = rng.uniform(-4, 4, (rows, K)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.1, 1, (rows, K // 128)).astype(np.float32)
    return packb({"x": encode_tensor(x), "x_scale": encode_tensor(scale),
                  "m_sizes": encode_tensor(np.asarray(sizes, dtype=dtype))})


def _exact_ok(sizes, rows) -> bool:
    return all(s >= 0 for s in sizes) and sum(sizes) == rows


def _general(body: bytes):
    """What the server's one validator (every lane's) makes of a body: the sizes, or
    the error."""
    ws = type("WS", (), {"G": G, "K": K, "N": N, "name": "w"})()
    try:
        return gemm_call(decode_gemm(body), lambda: ws, max_m=4096).m_sizes.tolist()
    except APIError as exc:
        return exc


OVERFLOW = [2**63 - 1, 2**63 - 1, 18, 0, 0, 0, 0, 0]  # exact sum 2^64 + 16; int64 sum 16


def test_the_issue_body_is_refused():
    body = _body(16, OVERFLOW, np.int64)
    assert int(np.asarray(OVERFLOW, np.int64).sum()) == 16  # the wrap the lanes once trusted
    assert isinstance(_general(body), BadMSizes)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.one_of(NEAR, st.integers(*I64)), min_size=G, max_size=G),
       rows=st.sampled_from([1, 16, 64, 200]))
def test_int64_sizes_near_the_limits(sizes, rows):
    # Some lists are made to wrap to exactly ``rows`` in int64 arithmetic.
    if sizes[0] not in (0, 1):
        wrapped = (rows - sum(sizes[1:])) % 2**64
        sizes[0] = wrapped - 2**64 if wrapped >= 2**63 else wrapped
    body = _body(rows, sizes, np.int64)
    ok = _exact_ok(sizes, rows)
    general = _general(body)
    if ok:
        assert general == sizes
    else:
        assert isinstance(general, BadMSizes), general


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.one_of(NEAR.filter(lambda v: I32[0] <= v <= I32[1]),
                                st.integers(*I32)), min_size=G, max_size=G),
       rows=st.sampled_from([1, 16, 64]))
def test_int32_sizes_near_the_limits(sizes, rows):
    if sizes[0] not in (0, 1):
        wrapped = (rows - sum(sizes[1:])) % 2**32
        sizes[0] = wrapped - 2**32 if wrapped >= 2**31 else wrapped
    body = _body(rows, sizes, np.int32)
    ok = _exact_ok(sizes, rows)
    general = _general(body)
    assert (general == sizes) if ok else isinstance(general, BadMSizes)


def _sized_body(rows: int, sizes, dtype) -> bytes:
    x = np.zeros((rows, K), dtype=ml_dtypes.float8_e4m3fn)
    scale = np.ones((rows, K // 128), dtype=np.float32)
    return packb({"x": encode_tensor(x), "x_scale": encode_tensor(scale),
                  "m_sizes": encode_tensor(np.asarray(sizes, dtype=dtype))})


# Both ways of judging the sizes: Python ints up to 96 groups, numpy's reductions beyond.
@pytest.mark.parametrize("groups", [1, 8, 96, 97, 256])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.sampled_from([0, 1, 16, 200]))
def test_sizes_are_judged_exactly_at_any_group_count(groups, dtype, data, rows):
    bounds = I64 if dtype is np.int64 else I32
    near = NEAR.filter(lambda v: bounds[0] <= v <= bounds[1])
    small = st.integers(-2, rows + 2)
    sizes = data.draw(st.lists(st.one_of(small, small, near), min_size=groups,
                               max_size=groups))
    if data.draw(st.booleans()):  # an exact split of the rows, now and then wrapped
        sizes = [0] * groups
        sizes[data.draw(st.integers(0, groups - 1))] = rows
        if groups > 1 and data.draw(st.booleans()):
            span = 2**64 if dtype is np.int64 else 2**32
            sizes[0] += bounds[1]
            sizes[-1] -= bounds[1]
            sizes = [(v + span // 2) % span - span // 2 for v in sizes]
    ws = type("WS", (), {"G": groups, "K": K, "N": N, "name": "w"})()
    try:
        got = gemm_call(decode_gemm(_sized_body(rows, sizes, dtype)), lambda: ws,
                        max_m=4096).m_sizes
    except BadMSizes:
        assert not _exact_ok(sizes, rows)
    else:
        assert _exact_ok(sizes, rows)
        assert got.dtype == np.int64 and got.tolist() == sizes


@pytest.mark.parametrize("groups", [8, 97, 256])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("moved", [1, 5, 16])
def test_a_negative_size_in_an_exact_sum_is_refused(groups, dtype, moved):
    """One size below zero, none above M, the sum exactly M: rows moved from one group to
    another. Random sizes almost never sum to M exactly, so the property above rarely
    draws this (numpy's signed max passed it beyond 96 groups)."""
    rows = 16
    sizes = [0] * groups
    sizes[-1] = rows
    sizes[0], sizes[groups // 2] = -moved, moved
    assert sum(sizes) == rows and max(sizes) <= rows
    ws = type("WS", (), {"G": groups, "K": K, "N": N, "name": "w"})()
    with pytest.raises(BadMSizes):
        gemm_call(decode_gemm(_sized_body(rows, sizes, dtype)), lambda: ws, max_m=4096)


def test_plan_merge_refuses_sums_past_int32():
    with pytest.raises(ValueError):
        plan_merge([[2**31, 0], [0, 5]])
    with pytest.raises(ValueError):
        plan_merge([[2**31 - 1, 1]])


@pytest.mark.parametrize("sizes", [OVERFLOW, [2**32 + 8, 2**64 - 2**32] + [0] * 6,
                                   [-1, 17, 0, 0, 0, 0, 0, 0]])
def test_the_server_answers_bad_m_sizes_and_keeps_serving(server, sizes):
    """The CPU server: 400 bad_m_sizes (the int64 body), then exact answers."""
    from server_support import close_to, fp8_problem, out_of, reference, wire

    p = fp8_problem(1, N, K, G)
    assert server.put("limits", {"w": wire(p.wq), "w_scale": wire(p.w_scale)}).status_code in (
        200, 201)
    raw = np.array([s % 2**64 for s in sizes], dtype=np.uint64).view(np.int64)
    x = fp8_problem(16, N, K, G)
    bad = {"x": wire(x.xq), "x_scale": wire(x.x_scale), "m_sizes": encode_tensor(raw)}
    assert_error(server.gemm("limits", bad), 400, "bad_m_sizes")
    out = out_of(server.gemm("limits", {"x": wire(x.xq), "x_scale": wire(x.x_scale),
                                        "m_sizes": wire(x.m_sizes)}))
    assert close_to(out, reference(x.xq, x.x_scale, p.wq, p.w_scale, x.m_sizes))
    assert server.http.get("/v1/health/ready").status_code == 200


def test_a_lost_device_fails_health_and_stops_the_process(tmp_path):
    """A failure that leaves the device unusable (a sticky CUDA error) turns health to
    503 and calls the engine's on_lost (the app: exit so the supervisor restarts it)."""
    from moegemm.server import Settings
    from server_support import fp8_problem, serve, wire

    with serve(Settings(device="cpu", demo=False)) as srv:
        engine = srv.app.state.services.engine
        lost: list[str] = []
        engine.on_lost = lost.append  # not the process exit, in a test
        p = fp8_problem(1, N, K, G)
        assert srv.put("w", {"w": wire(p.wq), "w_scale": wire(p.w_scale)}).status_code == 201

        def broken(*args, **kwargs):
            raise RuntimeError("CUDA driver stream wait failed with CUresult 700")

        engine._executor.run = broken
        engine._device_alive = lambda: False
        x = fp8_problem(4, N, K, G)
        body = {"x": wire(x.xq), "x_scale": wire(x.x_scale), "m_sizes": wire(x.m_sizes)}
        assert_error(srv.gemm("w", body), 500, "internal")
        assert len(lost) == 1 and "CUresult 700" in lost[0]
        assert_error(srv.http.get("/v1/health/live"), 503, "not_ready")
        assert_error(srv.http.get("/v1/health/ready"), 503, "not_ready")
        assert_error(srv.gemm("w", body), 503, "not_ready")
        assert len(lost) == 1
