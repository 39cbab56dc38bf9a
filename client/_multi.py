"""MultiClient: one router, several moegemm servers, no coordinator.

Each server owns one GPU. A weight set lives on the ``replicas`` endpoints
that rendezvous hashing ranks first for its name (``_placement``), so every
router configured with the same endpoints and replica counts agrees on where
each set is, and a model whose experts do not fit one GPU spreads over all of
them. Calls take turns over the endpoints of the set's placement and fail
over to the next one when an endpoint cannot answer.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ._client import Client
from ._errors import (
    APIError,
    DeadlineExceeded,
    MoegemmError,
    NoSuchWeights,
    TransportError,
    Unavailable,
)
from ._placement import normalize_endpoint, place

if TYPE_CHECKING:  # annotations only: typing_extensions is not a runtime dependency
    from typing_extensions import Self

__all__ = ["MultiClient"]

T = TypeVar("T")


def _naming(endpoint: str, exc: APIError, context: str = "") -> APIError:
    """The same error class, with the endpoint that answered it in the message."""
    named = type(exc)(
        f"{endpoint}: {exc.message}{context}",
        request_id=exc.request_id,
        retry_after=exc.retry_after,
    )
    named.status, named.code = exc.status, exc.code  # kept for classes chosen by status only
    return named


def _exhausted(
    name: str, placed: list[str], n_endpoints: int, failures: list[tuple[str, MoegemmError]]
) -> MoegemmError:
    """The error once every replica of ``name`` failed: the last answer decides
    its class (an `APIError` keeps its status and ``retry_after``; no answer at
    all is a `TransportError`), and the message names every endpoint tried."""
    last_url, last = failures[-1]
    earlier = "; ".join(f"{url}: {exc}" for url, exc in failures[:-1])
    if isinstance(last, APIError):
        return _naming(last_url, last, f" (after {earlier})" if earlier else "")
    tried = "; ".join(f"{url}: {exc}" for url, exc in failures)
    return TransportError(
        f"no endpoint holding weight set {name!r} answered ({len(placed)} of "
        f"{n_endpoints} endpoints hold it, replicas={len(placed)}): {tried}"
    )


class MultiClient:
    """A blocking client over several moegemm endpoints, one `Client` each.

    ``MultiClient(endpoints, replicas=1, hot={"layer3": 3}, token=..., timeout=...)``:
    every weight set lives on its first ``replicas`` endpoints by rendezvous
    hashing of its name, or on ``hot[name]`` of them for sets that take more
    traffic or must survive an endpoint's loss. Other keyword arguments go to
    each `Client`. Every router must be given the same endpoints, ``replicas``
    and ``hot`` to agree on placement; the order of ``endpoints`` does not
    matter.

    - ``load_weights`` / ``load_weights_file`` load on every endpoint of the
      placement; an unreachable one raises `TransportError` naming it.
    - ``grouped_gemm`` takes turns over the placement's endpoints and moves
      on to the next one on `TransportError`, 503 (`Unavailable`) or
      `NoSuchWeights` (a restarted server that lost its sets). Other errors
      (bad input, a passed deadline) are raised at once: every replica would
      answer the same. When no endpoint answers, the error names each
      endpoint and what went wrong there.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        replicas: int = 1,
        hot: Mapping[str, int] | None = None,
        **client_kwargs: Any,
    ) -> None:
        if isinstance(endpoints, str):
            raise TypeError("endpoints is a sequence of URLs, not one URL")
        urls = list(dict.fromkeys(normalize_endpoint(url) for url in endpoints))
        if not urls:
            raise ValueError("MultiClient needs at least one endpoint")
        self._hot = dict(hot or {})
        for count in (replicas, *self._hot.values()):
            if not 1 <= count <= len(urls):
                raise ValueError(f"replica counts are between 1 and {len(urls)}, got {count}")
        self._replicas = replicas
        # Which replica a call tries first; itertools.count is safe to share
        # between threads (next() on it is atomic under the GIL).
        self._turns = itertools.count()
        self._clients: dict[str, Client] = {}
        try:
            for url in urls:
                self._clients[url] = Client(url, **client_kwargs)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        """The endpoints, normalized, in the order given."""
        return list(self._clients)

    def placement(self, name: str) -> list[str]:
        """The endpoints that hold weight set ``name``, the preferred one first."""
        return place(name, self._clients, self._hot.get(name, self._replicas))

    # -- weight sets: on every endpoint of the placement ---------------------

    def load_weights(self, name: str, w: Any, w_scale: Any = None) -> dict[str, dict]:
        """Load or replace ``name`` on each endpoint of its placement.

        Arguments as `Client.load_weights`; returns each endpoint's answer.
        """
        return self._on_placement(name, lambda c: c.load_weights(name, w, w_scale))

    def load_weights_file(
        self,
        name: str,
        file: str | os.PathLike,
        w_key: str,
        w_scale_key: str | None = None,
    ) -> dict[str, dict]:
        """Load ``name`` from a safetensors file on each endpoint of its placement.

        ``file`` is relative to each server's weights directory, so the servers
        share that directory (a read-only volume) or hold the same files.
        """
        return self._on_placement(
            name, lambda c: c.load_weights_file(name, file, w_key, w_scale_key)
        )

    def delete_weights(self, name: str) -> None:
        """Unload ``name`` from each endpoint of its placement.

        Endpoints that do not hold it are skipped; `NoSuchWeights` only when
        none of them did.
        """
        missing: list[NoSuchWeights] = []

        def delete(client: Client) -> None:
            try:
                client.delete_weights(name)
            except NoSuchWeights as exc:
                missing.append(exc)

        placed = self._on_placement(name, delete)
        if len(missing) == len(placed):
            raise _naming(", ".join(placed), missing[-1]) from missing[-1]

    def _on_placement(self, name: str, action: Callable[[Client], T]) -> dict[str, T]:
        results: dict[str, T] = {}
        placed = self.placement(name)
        for rank, url in enumerate(placed, start=1):
            try:
                results[url] = action(self._clients[url])
            except TransportError as exc:
                raise TransportError(
                    f"weight set {name!r} is placed on {url} (replica {rank} of "
                    f"{len(placed)}), which did not answer: {exc}"
                ) from exc
            except APIError as exc:
                raise _naming(url, exc) from exc
        return results

    # -- the operation: the first endpoint that answers -----------------------

    def grouped_gemm(
        self,
        name: str,
        x: Any,
        m_sizes: Any,
        x_scale: Any = None,
        *,
        deadline: float | None = None,
    ) -> Any:
        """Run the grouped GEMM on weight set ``name``; arguments and result as
        `Client.grouped_gemm`, failing over between the set's replicas.

        Calls for a replicated set take turns over its replicas (so hot sets
        spread their load), each call failing over in rank order from its
        first pick. ``deadline`` (seconds) bounds the whole call, failovers
        included: each replica is given only the time left.
        """
        until = None
        if deadline is not None:
            if not (deadline > 0 and math.isfinite(deadline)):
                raise ValueError(
                    f"deadline is a positive, finite number of seconds, got {deadline!r}"
                )
            until = time.monotonic() + deadline
        placed = self.placement(name)
        first = next(self._turns) % len(placed)
        failures: list[tuple[str, MoegemmError]] = []
        for url in placed[first:] + placed[:first]:
            kwargs = {}
            if until is not None:
                kwargs["deadline"] = until - time.monotonic()
                if kwargs["deadline"] <= 0:
                    tried = "; ".join(f"{u}: {exc}" for u, exc in failures)
                    raise DeadlineExceeded(
                        f"the {deadline} s deadline for weight set {name!r} passed "
                        f"while failing over ({tried})"
                    ) from failures[-1][1]
            try:
                return self._clients[url].grouped_gemm(name, x, m_sizes, x_scale, **kwargs)
            except (TransportError, Unavailable, NoSuchWeights) as exc:
                failures.append((url, exc))
            except APIError as exc:
                raise _naming(url, exc) from exc
        raise _exhausted(name, placed, len(self._clients), failures) from failures[-1][1]

    # -- every endpoint --------------------------------------------------------

    def weights(self) -> dict[str, list[dict]]:
        """Each endpoint's loaded weight sets (as `Client.weights`)."""
        return self._on_all(lambda c: c.weights())

    def health(self) -> dict[str, dict]:
        """Each endpoint's readiness answer; raises (naming the endpoint) if one
        is not ready or cannot be reached."""
        return self._on_all(lambda c: c.health())

    def _on_all(self, action: Callable[[Client], T]) -> dict[str, T]:
        results: dict[str, T] = {}
        for url, client in self._clients.items():
            try:
                results[url] = action(client)
            except TransportError as exc:
                raise TransportError(f"endpoint {url} did not answer: {exc}") from exc
            except APIError as exc:
                raise _naming(url, exc) from exc
        return results

    def close(self) -> None:
        """Close every endpoint's connections."""
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
