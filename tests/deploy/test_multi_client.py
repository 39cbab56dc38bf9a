"""MultiClient against several real `moegemm serve` processes on loopback (CPU).

One server per "GPU", as deployed: the client places each weight set by
rendezvous hashing, the set lands exactly there, calls reach it, and a
missing endpoint gives a clear error or a failover to a replica.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import ml_dtypes
import msgspec
import numpy as np
import pytest
from moegemm.client import Client, DeadlineExceeded, InternalError, NoSuchWeights, TransportError
from moegemm.client._client import DEADLINE_HEADER
from moegemm.client._media import MSGPACK
from moegemm.client._multi import AsyncMultiClient, MultiClient
from moegemm.client._placement import normalize_endpoint, place
from moegemm.client._wire import encode_tensor, packb

G, N, K = 3, 128, 256


@pytest.fixture(scope="module")
def servers(start_servers):
    return start_servers(3)


def _dead_endpoint() -> str:
    # A port nothing listens on: bound and closed, so connects are refused.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _name_placed(endpoints: list[str], replicas: int, want: list[str]) -> str:
    """A fresh weight-set name whose placement is exactly ``want`` (in order)."""
    want = [normalize_endpoint(u) for u in want]
    rng = np.random.default_rng()
    for _ in range(10_000):
        name = f"set-{rng.integers(1 << 40)}"
        if place(name, endpoints, replicas) == want:
            return name
    raise AssertionError(f"no name placed on {want}")


def _weights(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((G, N, K)).astype(ml_dtypes.bfloat16)


def _call(rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    m_sizes = [5, 0, 4]
    x = rng.standard_normal((sum(m_sizes), K)).astype(ml_dtypes.bfloat16)
    return x, m_sizes


def _holders(servers: list, name: str) -> set[str]:
    held = set()
    for server in servers:
        with Client(server.url, token=servers[0].token) as client:
            if any(entry["name"] == name for entry in client.weights()):
                held.add(normalize_endpoint(server.url))
    return held


def test_weight_sets_land_where_the_placement_says(servers):
    rng = np.random.default_rng()
    urls = [s.url for s in servers]
    names = [f"layer{i}-{rng.integers(1 << 30)}" for i in range(6)]
    hot = {names[0]: 2, names[1]: 3}
    with MultiClient(urls, replicas=1, hot=hot, token=servers[0].token) as multi:
        for name in names:
            answers = multi.load_weights(name, _weights(rng))
            assert list(answers) == multi.placement(name)
        for name in names:
            placed = multi.placement(name)
            assert len(placed) == hot.get(name, 1)
            assert _holders(servers, name) == set(placed)
        # Another router, given the endpoints in another order, agrees.
        with MultiClient(urls[::-1], replicas=1, hot=hot, token=servers[0].token) as other:
            assert all(other.placement(n) == multi.placement(n) for n in names)
        listed = multi.weights()
        assert set(listed) == {normalize_endpoint(u) for u in urls}
        for name in names:
            multi.delete_weights(name)
            assert _holders(servers, name) == set()
        with pytest.raises(NoSuchWeights, match="127.0.0.1"):
            multi.delete_weights(names[2])


def test_grouped_gemm_goes_to_the_holder_and_matches_it(servers):
    rng = np.random.default_rng()
    urls = [s.url for s in servers]
    with MultiClient(urls, token=servers[0].token) as multi:
        name = f"experts-{rng.integers(1 << 30)}"
        multi.load_weights(name, _weights(rng))
        (holder,) = multi.placement(name)
        x, m_sizes = _call(rng)
        out = multi.grouped_gemm(name, x, m_sizes)
        assert out.shape == (9, N) and out.dtype == ml_dtypes.bfloat16
        assert (
            np.isfinite(out.astype(np.float32)).all() and np.abs(out.astype(np.float32)).max() > 0
        )
        with Client(holder, token=servers[0].token) as direct:
            np.testing.assert_array_equal(direct.grouped_gemm(name, x, m_sizes), out)
        for url in urls:
            if normalize_endpoint(url) != holder:
                with Client(url, token=servers[0].token) as other, pytest.raises(NoSuchWeights):
                    other.grouped_gemm(name, x, m_sizes)
        multi.delete_weights(name)


def test_an_expert_sets_matrices_are_reached_where_it_lives(servers):
    """SPEC 5: ``{name}.w13`` and ``{name}.w2`` are weight sets, held with the expert set:
    placed by its name, not their own (which sent most calls to an endpoint without them)."""
    rng = np.random.default_rng()
    urls = [s.url for s in servers]
    H, I = K, 128
    w13 = rng.standard_normal((G, 2 * I, H)).astype(ml_dtypes.bfloat16)
    w2 = rng.standard_normal((G, H, I)).astype(ml_dtypes.bfloat16)
    with MultiClient(urls, token=servers[0].token) as multi:
        names = [f"moe-{rng.integers(1 << 30)}" for _ in range(4)]
        for name in names:
            multi.load_experts(name, w13, w2)
            (holder,) = multi.placement(name)
            assert multi.placement(f"{name}.w13") == multi.placement(f"{name}.w2") == [holder]
            # An expert set named like a matrix has its own matrices with it too.
            odd = f"{name}.w13"
            assert multi.placement(f"{odd}.w13") == multi.placement(f"{odd}.w2") == \
                multi.placement(odd)
            x, m_sizes = _call(rng)
            out = multi.grouped_gemm(f"{name}.w13", x, m_sizes)
            with Client(holder, token=servers[0].token) as direct:
                np.testing.assert_array_equal(
                    direct.grouped_gemm(f"{name}.w13", x, m_sizes), out)
            multi.delete_experts(name)


def test_an_endpoint_down_without_replica_is_named(servers):
    rng = np.random.default_rng()
    dead = _dead_endpoint()
    urls = [*(s.url for s in servers), dead]
    name = _name_placed(urls, 1, [dead])
    with MultiClient(urls, token=servers[0].token, timeout=5.0) as multi:
        with pytest.raises(TransportError, match=f"{normalize_endpoint(dead)}.*did not answer"):
            multi.load_weights(name, _weights(rng))
        x, m_sizes = _call(rng)
        with pytest.raises(TransportError) as info:
            multi.grouped_gemm(name, x, m_sizes)
        assert normalize_endpoint(dead) in str(info.value)
        assert "replicas=1" in str(info.value)
        # Sets placed on live endpoints are not affected.
        live_name = _name_placed(urls, 1, [servers[0].url])
        multi.load_weights(live_name, _weights(rng))
        assert multi.grouped_gemm(live_name, x, m_sizes).shape == (9, N)
        multi.delete_weights(live_name)


def test_a_replicated_set_fails_over_when_its_first_endpoint_dies(servers, start_servers):
    rng = np.random.default_rng()
    (victim,) = start_servers(1)
    try:
        urls = [*(s.url for s in servers), victim.url]
        name = _name_placed(urls, 2, [victim.url, servers[1].url])
        with MultiClient(urls, replicas=2, token=servers[0].token, timeout=5.0) as multi:
            multi.load_weights(name, _weights(rng))
            x, m_sizes = _call(rng)
            before = multi.grouped_gemm(name, x, m_sizes)
            victim.stop()
            # Calls take turns over the replicas: of two calls, one picks the
            # dead endpoint first and must fail over.
            for _ in range(2):
                after = multi.grouped_gemm(name, x, m_sizes)
                # Both replicas quantized the same weights: the same answer.
                np.testing.assert_array_equal(before, after)
            # Loading needs every replica: the dead one is named, once the live one has
            # the new weights, so calls fail over to them.
            with pytest.raises(TransportError, match=normalize_endpoint(victim.url)):
                multi.load_weights(name, _weights(rng))
            with Client(servers[1].url, token=servers[0].token) as live:
                renewed = live.grouped_gemm(name, x, m_sizes)
                assert not np.array_equal(renewed, before)
                for _ in range(2):
                    np.testing.assert_array_equal(multi.grouped_gemm(name, x, m_sizes), renewed)
                live.delete_weights(name)
    finally:
        victim.stop()


def test_a_replica_that_lost_its_sets_is_skipped(servers):
    # A restarted server comes back empty: the call moves to the next replica.
    rng = np.random.default_rng()
    urls = [s.url for s in servers]
    name = _name_placed(urls, 2, [servers[2].url, servers[0].url])
    with Client(servers[0].url, token=servers[0].token) as second:
        second.load_weights(name, _weights(rng))
        x, m_sizes = _call(rng)
        with MultiClient(urls, replicas=2, token=servers[0].token) as multi:
            np.testing.assert_array_equal(
                multi.grouped_gemm(name, x, m_sizes), second.grouped_gemm(name, x, m_sizes)
            )
        # With one replica there is nowhere to go: the holder's 404, named.
        with (
            MultiClient(urls, replicas=1, token=servers[0].token) as single,
            pytest.raises(NoSuchWeights, match=normalize_endpoint(servers[2].url)),
        ):
            single.grouped_gemm(name, x, m_sizes)
        second.delete_weights(name)


def test_multi_client_refuses_bad_configuration():
    with pytest.raises(TypeError):
        MultiClient("http://127.0.0.1:1")
    with pytest.raises(ValueError):
        MultiClient([])
    with pytest.raises(ValueError, match="between 1 and 2"):
        MultiClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], replicas=3)
    with pytest.raises(ValueError, match="between 1 and 1"):
        MultiClient(["http://127.0.0.1:1"], hot={"x": 0})
    for count in (1.5, True):  # a fraction failed every call; True passed as 1
        with pytest.raises(TypeError, match="replica counts are ints"):
            MultiClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], replicas=count)
    with pytest.raises(TypeError, match="replica counts are ints"):
        MultiClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], hot={"x": 2.0})


def test_probes_need_no_token(servers):
    # Kubernetes probes and the image's HEALTHCHECK send no Authorization.
    for path in ("/v1/health/live", "/v1/health/ready"):
        assert httpx.get(servers[0].url + path, timeout=5).status_code == 200
    assert httpx.get(servers[0].url + "/v1/weights", timeout=5).status_code == 401


def _fake_servers(log: list, down: set[int] = frozenset()) -> httpx.MockTransport:
    """Answers every gemm call with fresh random rows, recording who was asked."""
    rng = np.random.default_rng()

    def handle(request: httpx.Request) -> httpx.Response:
        log.append((request.url.port, request.headers.get(DEADLINE_HEADER)))
        if request.url.port in down:
            raise httpx.ConnectError("connection refused", request=request)
        out = rng.standard_normal((9, N)).astype(ml_dtypes.bfloat16)
        body = packb({"out": encode_tensor(out)})
        return httpx.Response(200, content=body, headers={"content-type": MSGPACK})

    return httpx.MockTransport(handle)


def test_calls_take_turns_over_the_replicas_of_a_hot_set():
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002, 9003, 9004)]
    rng = np.random.default_rng()
    x, m_sizes = _call(rng)
    log: list = []
    with MultiClient(urls, hot={"hot": 3}, transport=_fake_servers(log)) as multi:
        placed = [int(u.rsplit(":", 1)[1]) for u in multi.placement("hot")]
        for _ in range(6):
            assert multi.grouped_gemm("hot", x, m_sizes).shape == (9, N)
        assert [port for port, _ in log] == placed * 2
        log.clear()
        (single,) = [int(u.rsplit(":", 1)[1]) for u in multi.placement("cold")]
        for _ in range(3):
            multi.grouped_gemm("cold", x, m_sizes)
        assert [port for port, _ in log] == [single] * 3


def test_hot_sets_called_in_turn_each_spread_over_their_replicas():
    """A layer loop alternating two hot sets: each set's calls take turns over its own
    replicas (one count shared by both pinned each to one replica)."""
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002, 9003, 9004)]
    x, m_sizes = _call(np.random.default_rng())
    log: list = []
    with MultiClient(urls, hot={"a": 2, "b": 2}, transport=_fake_servers(log)) as multi:
        for _ in range(4):
            for name in ("a", "b"):
                multi.grouped_gemm(name, x, m_sizes)
        for offset, name in ((0, "a"), (1, "b")):
            placed = [int(u.rsplit(":", 1)[1]) for u in multi.placement(name)]
            assert [port for port, _ in log[offset::2]] == placed * 2


def test_a_deleted_sets_turns_are_forgotten():
    """Sets that come and go under new names (a version in the name) leave nothing behind in
    the client: deleting a weight set drops its turn count, deleting an expert set drops
    its own and its matrices'."""
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002)]
    x, m_sizes = _call(np.random.default_rng())
    log: list = []
    gemm = _fake_servers(log)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(204)
        return gemm.handle_request(request)

    with MultiClient(urls, hot={"v0": 2}, transport=httpx.MockTransport(handle)) as multi:
        for version in range(50):
            multi.grouped_gemm(f"v{version}", x, m_sizes)
            multi.grouped_gemm(f"e{version}.w13", x, m_sizes)
            multi.grouped_gemm(f"e{version}.w2", x, m_sizes)
            multi.delete_weights(f"v{version}")
            multi.delete_experts(f"e{version}")
        assert multi._turns == {}
        # A set loaded again under a deleted name takes turns from the first again.
        first = multi.placement("v0")[0]
        log.clear()
        multi.grouped_gemm("v0", x, m_sizes)
        assert log[0][0] == int(first.rsplit(":", 1)[1])


def test_a_deadline_gone_before_the_first_try_is_deadline_exceeded():
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002)]
    x, m_sizes = _call(np.random.default_rng())
    log: list = []
    with MultiClient(urls, transport=_fake_servers(log)) as multi, \
            pytest.raises(DeadlineExceeded, match="before it was sent"):
        multi.grouped_gemm("w", x, m_sizes, deadline=1e-12)

    async def scenario():
        async with AsyncMultiClient(urls, transport=_fake_servers(log)) as multi:
            await multi.grouped_gemm("w", x, m_sizes, deadline=1e-12)

    with pytest.raises(DeadlineExceeded, match="before it was sent"):
        asyncio.run(scenario())
    assert log == []


def test_the_deadline_covers_the_failover():
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002)]
    rng = np.random.default_rng()
    x, m_sizes = _call(rng)
    log: list = []
    with MultiClient(urls, replicas=2, transport=_fake_servers(log)) as probe:
        first, second = (int(u.rsplit(":", 1)[1]) for u in probe.placement("w"))
    transport = _fake_servers(log, down={first})
    with MultiClient(urls, replicas=2, transport=transport) as multi:
        multi.grouped_gemm("w", x, m_sizes, deadline=5.0)
        (tried_port, tried_budget), (used_port, used_budget) = log
        assert (tried_port, used_port) == (first, second)
        # Each replica is told the time left, never more than the whole budget.
        assert 0 < int(used_budget) <= int(tried_budget) <= 5000
        with pytest.raises(ValueError, match="deadline"):
            multi.grouped_gemm("w", x, m_sizes, deadline=0)
        with pytest.raises(TypeError, match="deadline"):  # as Client's own calls
            multi.grouped_gemm("w", x, m_sizes, deadline=True)


def test_a_callers_request_id_goes_to_every_replica_tried():
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002)]
    x, m_sizes = _call(np.random.default_rng())
    ids: list = []
    with MultiClient(urls, replicas=2, transport=_fake_servers([])) as probe:
        first = int(probe.placement("w")[0].rsplit(":", 1)[1])
    inner = _fake_servers([], down={first})

    def handle(request: httpx.Request) -> httpx.Response:
        ids.append(request.headers.get_list("x-request-id"))
        return inner.handle_request(request)

    with MultiClient(urls, replicas=2, transport=httpx.MockTransport(handle)) as multi:
        multi.grouped_gemm("w", x, m_sizes, request_id="router-1")
        multi.grouped_gemm("w", x, m_sizes, request_id="router-2")
    # The first call fails over from the dead replica: both tries carry its id.
    assert ids[:2] == [["router-1"], ["router-1"]] and ids[-1] == ["router-2"]

    async def scenario():
        async with AsyncMultiClient(urls, replicas=2,
                                    transport=httpx.MockTransport(handle)) as multi:
            return await multi.grouped_gemm("w", x, m_sizes, request_id="router-3")

    del ids[:]
    asyncio.run(scenario())
    assert ["router-3"] in ids and all(i == ["router-3"] for i in ids)


def test_async_multi_client_places_calls_and_fails_over(servers):
    rng = np.random.default_rng()
    dead = _dead_endpoint()
    urls = [*(s.url for s in servers), dead]
    token = servers[0].token
    replicated = _name_placed(urls, 2, [dead, servers[0].url])
    single = _name_placed(urls, 1, [servers[1].url])
    lost = _name_placed(urls, 1, [dead])
    x, m_sizes = _call(rng)

    async def scenario() -> None:
        async with AsyncMultiClient(urls, hot={replicated: 2}, token=token, timeout=5.0) as multi:
            await multi.load_weights(single, _weights(rng))
            assert _holders(servers, single) == {normalize_endpoint(servers[1].url)}
            out = await multi.grouped_gemm(single, x, m_sizes, deadline=30)
            with Client(servers[1].url, token=token) as direct:
                np.testing.assert_array_equal(direct.grouped_gemm(single, x, m_sizes), out)
            with pytest.raises(TransportError, match=normalize_endpoint(dead)):
                await multi.load_weights(replicated, _weights(rng))
            with pytest.raises(TransportError, match="replicas=1"):
                await multi.grouped_gemm(lost, x, m_sizes)
            # The live replica got its copy before the dead one failed the load:
            # both turns answer, the one that starts at the dead endpoint by failover.
            for _ in range(2):
                assert (await multi.grouped_gemm(replicated, x, m_sizes)).shape == (9, N)
            with pytest.raises(TransportError, match=normalize_endpoint(dead)):
                await multi.weights()
            await multi.delete_weights(single)
            assert _holders(servers, single) == set()

    asyncio.run(scenario())
    with Client(servers[0].url, token=token) as live:
        live.delete_weights(replicated)


def _versioned_servers(log: list, failing: set[int], slow: set[int] = frozenset()):
    """Servers that keep, per port, the version each set was last loaded with (the load's
    first weight value), weight sets and expert sets apart as the server keeps them (an
    expert set's matrices are weight sets), and answer calls with rows filled with it. A
    load or delete sent to a port in ``failing`` times out there and changes nothing; one
    sent to a port in ``slow`` takes 5 s (async clients only)."""
    held: dict[tuple[int, str, str], float] = {}

    def change(request: httpx.Request) -> httpx.Response:
        port, path = request.url.port, request.url.path
        kind, name = path.split("/")[2:4]
        if port in failing:
            raise httpx.WriteTimeout("the server stopped reading", request=request)
        keys = [(port, kind, name)]
        if kind == "experts":
            keys += [(port, "weights", f"{name}.w13"), (port, "weights", f"{name}.w2")]
        for key in keys:
            if request.method == "DELETE":
                held.pop(key, None)
            else:
                held[key] = _wire_first(request.content)
        return httpx.Response(204 if request.method == "DELETE" else 201, json={"name": name})

    def call(request: httpx.Request) -> httpx.Response:
        port, path = request.url.port, request.url.path
        kind, name = path.split("/")[2:4]
        log.append(port)
        if (port, kind, name) not in held:
            return httpx.Response(404, json={"error": {"code": "no_such_weights",
                                                       "message": name}})
        rows = 9 if kind == "weights" else 6
        out = np.full((rows, N), held[(port, kind, name)], ml_dtypes.bfloat16)
        return httpx.Response(200, content=packb({"out": encode_tensor(out)}),
                              headers={"content-type": MSGPACK})

    def handle(request: httpx.Request) -> httpx.Response:
        return change(request) if request.method in ("PUT", "DELETE") else call(request)

    async def handle_async(request: httpx.Request) -> httpx.Response:
        if request.method in ("PUT", "DELETE") and request.url.port in slow:
            await asyncio.sleep(5)
        return handle(request)

    return httpx.MockTransport(handle), httpx.MockTransport(handle_async)


def _wire_first(content: bytes) -> float:
    """The first value of a load's weights (bf16 on the wire)."""
    body = msgspec.msgpack.decode(content)
    tensor = body.get("w", body.get("w13"))
    assert tensor["dtype"] == "bfloat16"
    return float(np.frombuffer(tensor["data"], ml_dtypes.bfloat16)[0])


def _versions(multi, name: str, calls: int) -> list[float]:
    x, m_sizes = _call(np.random.default_rng())
    return [float(multi.grouped_gemm(name, x, m_sizes)[0, 0]) for _ in range(calls)]


def test_a_replica_that_missed_a_change_is_left_out_of_calls_until_one_succeeds_there():
    """A replace that timed out on one replica (a hung server) while the other took it:
    raised naming that replica, and this client's calls then go to the replica that has
    the new version only, never alternating new and old answers; a later load that
    succeeds there brings it back. The same for an expert set (its matrices too) and a
    delete."""
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002, 9003)]
    log: list = []
    failing: set[int] = set()
    w = np.full((G, N, K), 1.0, ml_dtypes.bfloat16)
    with MultiClient(urls, hot={"s": 2, "e": 2},
                     transport=_versioned_servers(log, failing)[0]) as multi:
        a, b = (int(u.rsplit(":", 1)[1]) for u in multi.placement("s"))
        multi.load_weights("s", w)
        assert _versions(multi, "s", 4) == [1.0] * 4
        failing.add(b)
        with pytest.raises(TransportError, match=f"127.0.0.1:{b}.*avoid the endpoints"):
            multi.load_weights("s", w * 2)
        failing.clear()
        log.clear()
        assert _versions(multi, "s", 4) == [2.0] * 4 and set(log) == {a}
        multi.load_weights("s", w * 3)  # succeeds on both: b is fresh again
        log.clear()
        assert _versions(multi, "s", 4) == [3.0] * 4 and set(log) == {a, b}

        # Both fail: nothing took the change, every failure named, nothing left out.
        failing.update({a, b})
        with pytest.raises(TransportError) as raised:
            multi.load_weights("s", w * 4)
        assert f":{a}" in str(raised.value) and f":{b}" in str(raised.value)
        assert "avoid" not in str(raised.value)
        failing.clear()
        log.clear()
        assert _versions(multi, "s", 4) == [3.0] * 4 and set(log) == {a, b}

        # A delete that reaches one replica only: the other, still holding the set, is
        # left out, so calls find the set gone.
        failing.add(b)
        with pytest.raises(TransportError):
            multi.delete_weights("s")
        failing.clear()
        with pytest.raises(NoSuchWeights):
            multi.grouped_gemm("s", *_call(np.random.default_rng()))

        # An expert set's matrices follow it.
        e1, e2 = (int(u.rsplit(":", 1)[1]) for u in multi.placement("e"))
        w13 = np.full((G, 256, 128), 1.0, ml_dtypes.bfloat16)
        w2 = np.full((G, 128, 128), 1.0, ml_dtypes.bfloat16)
        multi.load_experts("e", w13, w2)
        failing.add(e1)
        with pytest.raises(TransportError):
            multi.load_experts("e", w13 * 5, w2)
        failing.clear()
        log.clear()
        assert _versions(multi, "e.w13", 4) == [5.0] * 4 and set(log) == {e2}


def test_an_async_replica_that_missed_a_change_is_left_out_of_calls():
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002)]
    log: list = []
    failing: set[int] = set()
    w = np.full((G, N, K), 1.0, ml_dtypes.bfloat16)
    x, m_sizes = _call(np.random.default_rng())

    async def run():
        async with AsyncMultiClient(urls, hot={"s": 2},
                                    transport=_versioned_servers(log, failing)[1]) as multi:
            a, b = (int(u.rsplit(":", 1)[1]) for u in multi.placement("s"))
            await multi.load_weights("s", w)
            failing.add(a)
            with pytest.raises(TransportError, match=f"127.0.0.1:{a}.*avoid the endpoints"):
                await multi.load_weights("s", w * 2)
            failing.clear()
            log.clear()
            got = [float((await multi.grouped_gemm("s", x, m_sizes))[0, 0]) for _ in range(4)]
            assert got == [2.0] * 4 and set(log) == {b}
            await multi.load_weights("s", w * 3)
            log.clear()
            got = [float((await multi.grouped_gemm("s", x, m_sizes))[0, 0]) for _ in range(4)]
            assert got == [3.0] * 4 and set(log) == {a, b}

    asyncio.run(run())


@pytest.mark.parametrize("status", [502, 504])
def test_a_proxys_error_fails_over_and_the_servers_own_do_not(status):
    """A 5xx without the contract's body comes from a proxy in front of one replica: the
    call goes on to the next. The server's own errors (here 500 internal) are raised."""
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002)]
    log: list = []
    good = _fake_servers(log)
    x, m_sizes = _call(np.random.default_rng())
    own = False

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.port == first:
            log.append((request.url.port, None))
            if own:
                return httpx.Response(500, json={"error": {"code": "internal",
                                                           "message": "a bug"}})
            return httpx.Response(status, text="<html>Bad Gateway</html>")
        return good.handle_request(request)

    with MultiClient(urls, hot={"s": 2}, transport=httpx.MockTransport(handle)) as multi:
        first = int(multi.placement("s")[0].rsplit(":", 1)[1])
        for _ in range(4):
            assert multi.grouped_gemm("s", x, m_sizes).shape == (9, N)
        assert sum(port == first for port, _ in log) == 2  # tried on its turns, failed over
        own = True
        with pytest.raises(InternalError):
            for _ in range(2):
                multi.grouped_gemm("s", x, m_sizes)


def test_a_weight_set_and_an_expert_set_of_one_name_are_marked_apart():
    """The server keeps weight sets and expert sets apart, so one name may be both: a
    change of weight set ``e`` that succeeds everywhere leaves expert set ``e``'s stale
    replica (and its matrices') out still; ffn calls on ``e`` avoid it too."""
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002)]
    log: list = []
    failing: set[int] = set()
    w13 = np.full((G, 256, 128), 1.0, ml_dtypes.bfloat16)
    w2 = np.full((G, 128, 128), 1.0, ml_dtypes.bfloat16)
    with MultiClient(urls, hot={"e": 2}, transport=_versioned_servers(log, failing)[0]) as multi:
        a, b = (int(u.rsplit(":", 1)[1]) for u in multi.placement("e"))
        multi.load_experts("e", w13, w2)
        failing.add(b)
        with pytest.raises(TransportError, match="expert set 'e'"):
            multi.load_experts("e", w13 * 5, w2)
        failing.clear()
        multi.load_weights("e", np.full((G, N, K), 7.0, ml_dtypes.bfloat16))  # both take it
        log.clear()
        assert _versions(multi, "e.w13", 4) == [5.0] * 4 and set(log) == {a}
        assert _versions(multi, "e", 4) == [7.0] * 4  # the weight set: on both, fresh
        x = np.ones((6, 128), ml_dtypes.bfloat16)
        log.clear()
        for _ in range(4):
            assert float(multi.expert_ffn("e", x, [6, 0, 0])[0, 0]) == 5.0
        assert set(log) == {a}


def test_a_change_cut_short_by_the_callers_timeout_marks_what_it_did_not_reach():
    """An async load bounded by the caller (``asyncio.wait_for``) that one replica took
    and another had not finished: calls then avoid the unfinished one."""
    urls = [f"http://127.0.0.1:{port}" for port in (9001, 9002)]
    log: list = []
    slow: set[int] = set()
    w = np.full((G, N, K), 1.0, ml_dtypes.bfloat16)
    x, m_sizes = _call(np.random.default_rng())

    async def run():
        transport = _versioned_servers(log, set(), slow)[1]
        async with AsyncMultiClient(urls, hot={"s": 2}, transport=transport) as multi:
            a, b = (int(u.rsplit(":", 1)[1]) for u in multi.placement("s"))
            await multi.load_weights("s", w)
            slow.add(b)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(multi.load_weights("s", w * 2), 0.5)
            log.clear()
            got = [float((await multi.grouped_gemm("s", x, m_sizes))[0, 0]) for _ in range(4)]
            assert got == [2.0] * 4 and set(log) == {a}

    asyncio.run(run())
