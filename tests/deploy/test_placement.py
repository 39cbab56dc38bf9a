"""Rendezvous placement: stable, order-free, balanced, minimal movement."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from moegemm.client._placement import normalize_endpoint, place, rank

ENDPOINTS = [f"http://moegemm-{i}.moegemm-pods:8000" for i in range(5)]


def _names(n: int) -> list[str]:
    rng = random.Random()  # fresh names every run: properties must hold for any
    return [f"layer{rng.randrange(10**9)}.experts-{i}" for i in range(n)]


def test_normalize_spells_one_endpoint_one_way():
    assert normalize_endpoint("HTTP://Host.Example/") == "http://host.example:80"
    assert normalize_endpoint("https://h") == "https://h:443"
    assert normalize_endpoint("http://h:8000/base/") == "http://h:8000/base"
    assert normalize_endpoint("http://[::1]:9000") == "http://[::1]:9000"
    for bad in ("h:8000", "ftp://h", "http://", "http://h?x=1", "http://u:p@h"):
        with pytest.raises(ValueError):
            normalize_endpoint(bad)


def test_rank_ignores_order_spelling_and_duplicates():
    shuffled = ENDPOINTS[:]
    random.shuffle(shuffled)
    respelled = [url.upper().replace("HTTP://", "http://") + "/" for url in shuffled]
    for name in _names(50):
        expected = rank(name, ENDPOINTS)
        assert rank(name, shuffled) == expected
        assert rank(name, respelled + respelled[:2]) == expected
        assert sorted(expected) == sorted(normalize_endpoint(u) for u in ENDPOINTS)


def test_rank_is_pinned_across_versions():
    # Routers on different client versions must agree: the hash is part of
    # the contract between them. These were computed once and must not move.
    endpoints = ["http://a:8000", "http://b:8000", "http://c:8000"]
    assert rank("layer0", endpoints) == ["http://c:8000", "http://a:8000", "http://b:8000"]
    assert rank("layer1", endpoints) == ["http://a:8000", "http://b:8000", "http://c:8000"]


def test_replicas_are_a_prefix_of_the_ranking():
    for name in _names(30):
        ranked = rank(name, ENDPOINTS)
        for k in range(1, len(ENDPOINTS) + 1):
            assert place(name, ENDPOINTS, k) == ranked[:k]


def test_place_refuses_impossible_replica_counts():
    with pytest.raises(ValueError, match="replicas"):
        place("x", ENDPOINTS, 0)
    with pytest.raises(ValueError, match="only 5 endpoints"):
        place("x", ENDPOINTS, 6)
    with pytest.raises(ValueError, match="no endpoints"):
        place("x", [], 1)


def test_load_spreads_evenly():
    names = _names(4000)
    counts = Counter(place(name, ENDPOINTS)[0] for name in names)
    # 800 expected each; the binomial standard deviation is about 25.
    assert set(counts) == {normalize_endpoint(u) for u in ENDPOINTS}
    assert all(650 <= c <= 950 for c in counts.values()), counts


def test_removing_an_endpoint_moves_only_its_sets():
    names = _names(2000)
    gone = normalize_endpoint(ENDPOINTS[2])
    before = {name: place(name, ENDPOINTS)[0] for name in names}
    after = {name: place(name, [u for u in ENDPOINTS if u != ENDPOINTS[2]])[0] for name in names}
    moved = [name for name in names if before[name] != after[name]]
    assert moved and all(before[name] == gone for name in moved)
    assert len(moved) == sum(1 for owner in before.values() if owner == gone)


def test_adding_an_endpoint_takes_a_fair_share_only():
    names = _names(2000)
    grown = [*ENDPOINTS, "http://moegemm-5.moegemm-pods:8000"]
    before = {name: place(name, ENDPOINTS)[0] for name in names}
    after = {name: place(name, grown)[0] for name in names}
    moved = [name for name in names if before[name] != after[name]]
    assert all(after[name] == normalize_endpoint(grown[-1]) for name in moved)
    assert 2000 / 6 * 0.75 <= len(moved) <= 2000 / 6 * 1.25
