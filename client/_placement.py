"""Where a weight set lives among several servers: rendezvous hashing.

Every router that knows the same endpoints computes the same placement, with
no coordinator and no shared state: each endpoint gets a score for the weight
set's name, the endpoints are ranked by score, and the set lives on the first
``replicas`` of them. Adding or removing an endpoint moves only the sets whose
top-ranked endpoints changed (about 1/n of them), never the rest.

Endpoints are identified by their normalized URL (scheme and host lowercased,
no trailing slash, default port spelled out), so ``http://Host:80/`` and
``http://host`` are one endpoint to every router.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit, urlunsplit

__all__ = ["normalize_endpoint", "place", "rank"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_endpoint(url: str) -> str:
    """The canonical spelling of a server's base URL, used as its identity.

    Raises ValueError for anything that is not an ``http(s)://host[:port][/path]``.
    """
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"endpoint {url!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(
            f"endpoint {url!r} has a query, fragment or credentials; give the base URL"
        )
    host = parts.hostname.lower()
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    port = parts.port if parts.port is not None else _DEFAULT_PORTS[scheme]
    return urlunsplit((scheme, f"{host}:{port}", parts.path.rstrip("/"), "", ""))


def _score(endpoint: str, name: str) -> int:
    # A keyed 64-bit hash of (endpoint, name); blake2b because Python's hash()
    # is salted per process and every router must agree. The NUL separator
    # keeps ("ab", "c") and ("a", "bc") apart.
    digest = hashlib.blake2b(f"{endpoint}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _unique(endpoints: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for url in endpoints:
        seen.setdefault(normalize_endpoint(url), None)
    if not seen:
        raise ValueError("no endpoints given")
    return list(seen)


def rank(name: str, endpoints: Iterable[str]) -> list[str]:
    """All endpoints (normalized, duplicates dropped), best first for ``name``.

    The order depends only on the name and the set of endpoints, never on the
    order they were given in; ties (a 64-bit collision) break by URL.
    """
    return sorted(_unique(endpoints), key=lambda url: (-_score(url, name), url))


def place(name: str, endpoints: Sequence[str], replicas: int = 1) -> list[str]:
    """The endpoints that hold ``name``: the first ``replicas`` of :func:`rank`.

    Asking for more replicas than there are endpoints is an error rather than a
    silent shortfall: the caller believes its set survives that many failures.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ranked = rank(name, endpoints)
    if replicas > len(ranked):
        raise ValueError(
            f"{replicas} replicas of {name!r} asked for, but only {len(ranked)} endpoints"
        )
    return ranked[:replicas]
