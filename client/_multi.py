"""MultiClient and AsyncMultiClient: one router, several moegemm servers, no coordinator.

Each server owns one GPU. A weight set lives on the ``replicas`` endpoints
that rendezvous hashing ranks first for its name (``_placement``), so every
router configured with the same endpoints and replica counts agrees on where
each set is, and a model whose experts do not fit one GPU spreads over all of
them. Calls take turns over the endpoints of the set's placement and fail
over to the next one when an endpoint cannot answer.

The two classes share everything but the awaiting: `_Fleet` holds the
placement, the turn order, and the rules for which errors fail over and how
the final error reads.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._calls import budget as deadline_instant
from ._client import AsyncClient, Client
from ._errors import (
    APIError,
    ArgumentDtype,
    DeadlineExceeded,
    MoegemmError,
    NoSuchWeights,
    TransportError,
    Unavailable,
)
from ._placement import normalize_endpoint, place

if TYPE_CHECKING:  # annotations only: typing_extensions is not a runtime dependency
    from typing_extensions import Self

__all__ = ["AsyncMultiClient", "MultiClient"]

T = TypeVar("T")
C = TypeVar("C", Client, AsyncClient)

# Errors after which another replica may still answer: no answer at all, a
# 503 (the server did nothing with the call), or a server that lost the set.
# A lost answer (read error or timeout after the request went out) also fails
# over: the first server may have run the call, but gemm has no side effects,
# so running it twice costs time, never correctness. Weight loads and deletes
# never fail over.
_FAIL_OVER = (TransportError, Unavailable, NoSuchWeights)


def _fails_over(exc: MoegemmError) -> bool:
    """Whether another replica may answer after ``exc``: `_FAIL_OVER`, or a 5xx of a status
    the contract does not use and without its error body (``http_<status>``: a proxy's 502,
    a gateway's 504), which is something in front of the server, like no answer."""
    return isinstance(exc, _FAIL_OVER) or (
        isinstance(exc, APIError) and exc.status >= 500 and exc.code == f"http_{exc.status}")

# The two kinds of set, in the server's two namespaces (a weight set and an expert set may
# share a name), as errors name them.
_KIND = {"weights": "weight set", "experts": "expert set"}

# An expert set's matrices are weight sets named after it (SPEC 5): they live where it does.
_MATRICES = (".w13", ".w2")


def _owner(name: str) -> str:
    """The expert set whose matrix ``name`` would be (``{set}.w13`` or ``{set}.w2``), else
    ``name`` itself."""
    for suffix in _MATRICES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def _placed_by(name: str) -> str:
    """The name whose rank places ``name``: every matrix suffix stripped, so an expert set
    and its matrices share one (an expert set may itself be named ``a.w13``: it, its
    ``a.w13.w13`` and ``a.w13.w2`` all rank by ``a``). Any weight set so named is placed the
    same way: the server holds the names apart."""
    owner = _owner(name)
    return name if owner == name else _placed_by(owner)


def _naming(endpoint: str, exc: APIError, context: str = "") -> APIError:
    """The same error class, with the endpoint that answered it in the message (an
    ``ArgumentDtype`` as it is: no endpoint saw the call)."""
    if isinstance(exc, ArgumentDtype):
        return exc
    named = type(exc)(
        f"{endpoint}: {exc.message}{context}",
        request_id=exc.request_id,
        retry_after=exc.retry_after,
    )
    named.status, named.code = exc.status, exc.code  # kept for classes chosen by status only
    return named


def _on_endpoints(kind: str, name: str, placed: list[str],
                  failed: list[tuple[str, MoegemmError]], stale: bool) -> MoegemmError:
    """The failure of a change of set ``name`` (``kind``: "weights" or "experts") on
    endpoints of the placement: the first one's class, its message naming every endpoint
    that failed (``stale``: others took the change, so this client's calls now avoid the
    failed ones)."""
    url, exc = failed[0]
    others = "; ".join(f"{u}: {e}" for u, e in failed[1:])
    context = (f" (also failed: {others})" if others else "") + (
        "; calls on this client avoid the endpoints that failed until the set's next load "
        "or delete succeeds there" if stale else "")
    if isinstance(exc, APIError):
        return _naming(url, exc, context)
    return TransportError(
        f"{_KIND[kind]} {name!r} is placed on {url} (replica {placed.index(url) + 1} of "
        f"{len(placed)}), which did not answer: {exc}{context}",
        request_id=getattr(exc, "request_id", None),
    )


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
        f"{n_endpoints} endpoints hold it, replicas={len(placed)}): {tried}",
        request_id=getattr(last, "request_id", None),
    )


class _Fleet(Generic[C]):
    """Placement, turns and error rules shared by the blocking and async classes."""

    def __init__(
        self,
        endpoints: Sequence[str],
        replicas: int,
        hot: Mapping[str, int] | None,
        make_client: Callable[[str], C],
    ) -> None:
        if isinstance(endpoints, str):
            raise TypeError("endpoints is a sequence of URLs, not one URL")
        urls = list(dict.fromkeys(normalize_endpoint(url) for url in endpoints))
        if not urls:
            raise ValueError("a multi-endpoint client needs at least one endpoint")
        self._hot = dict(hot or {})
        for count in (replicas, *self._hot.values()):
            if isinstance(count, bool) or not isinstance(count, int):
                raise TypeError(f"replica counts are ints, got {count!r}")
            if not 1 <= count <= len(urls):
                raise ValueError(f"replica counts are between 1 and {len(urls)}, got {count}")
        self._replicas = replicas
        # Which replica a set's next call tries first, per set: one count shared by every
        # set pinned each set to one replica when calls of several sets alternate. next()
        # on an itertools.count is atomic under the GIL, so threads may share them.
        self._turns: dict[str, itertools.count] = {}
        # Per set (kind, name), the endpoints where its last change (load, replace, delete)
        # failed or was cut short while another endpoint took it: they may hold another
        # version (a replace that timed out on a hung server), so calls leave them out until
        # a change succeeds there. Each entry is replaced whole (threads read without a lock).
        self._stale: dict[tuple[str, str], frozenset[str]] = {}
        self._clients: dict[str, C] = {url: make_client(url) for url in urls}

    @property
    def endpoints(self) -> list[str]:
        """The endpoints, normalized, in the order given."""
        return list(self._clients)

    def placement(self, name: str) -> list[str]:
        """The endpoints that hold weight set ``name``, the preferred one first; an expert
        set's matrices (``{name}.w13``, ``{name}.w2``) are where the expert set is."""
        # A matrix takes its expert set's replica count (a count of its own would send
        # calls to replicas of the set's rank that do not hold the set).
        count = self._hot.get(_owner(name), self._hot.get(name, self._replicas))
        return place(_placed_by(name), self._clients, count)

    def _turn(self, name: str, kind: str) -> list[str]:
        # This call's order: the placement rotated by one per call of this set, so calls
        # on a replicated set spread over its replicas; stale replicas left out (an expert
        # set's are its matrices' too).
        placed = self.placement(name)
        if self._stale:  # (a call's path stays as it was while no change failed)
            placed = self._fresh(placed, name, kind)
        turns = self._turns.get(name)
        if turns is None:
            turns = self._turns.setdefault(name, itertools.count())
        first = next(turns) % len(placed)
        return placed[first:] + placed[:first]

    def _fresh(self, placed: list[str], name: str, kind: str) -> list[str]:
        """``placed`` without the endpoints stale for this call's set; raises when none is
        left."""
        stale = self._stale.get((kind, name), frozenset())
        owner = _owner(name)
        if kind == "weights" and owner != name:
            stale |= self._stale.get(("experts", owner), frozenset())
        fresh = [url for url in placed if url not in stale]
        if not fresh:
            raise TransportError(
                f"every endpoint holding {_KIND[kind]} {name!r} missed a change of it "
                f"({', '.join(placed)}): load it again")
        return fresh

    def _mark(self, kind: str, name: str, placed: list[str], missed: list[str]) -> None:
        """After a change of set ``name`` on ``placed`` that ``missed`` did not take (failed or
        cut short): they become stale when another endpoint took it, those that took it
        fresh."""
        took = [url for url in placed if url not in missed]
        if not took:
            return  # nothing changed anywhere (as far as any answer says)
        stale = (self._stale.get((kind, name), frozenset()) - set(took)) | set(missed)
        if stale:
            self._stale[(kind, name)] = frozenset(stale)
        else:
            self._stale.pop((kind, name), None)

    def _settle(self, kind: str, name: str, placed: list[str],
                failed: list[tuple[str, MoegemmError]]) -> None:
        """Mark what a finished change missed; then, if any endpoint failed, raise the error
        naming every failure."""
        self._mark(kind, name, placed, [url for url, _ in failed])
        if failed:
            took = len(failed) < len(placed)
            raise _on_endpoints(kind, name, placed, failed, took) from failed[0][1]

    def _forget(self, *names: str) -> None:
        # A deleted set's turn counts go with it: names that come and go (a set reloaded
        # under a new version's name) would otherwise pile up for the client's life.
        for name in names:
            self._turns.pop(name, None)

    @staticmethod
    def _budget(
        name: str,
        deadline: float | None,
        until: float | None,
        failures: list[tuple[str, MoegemmError]],
    ) -> dict[str, float]:
        """The keyword arguments for the next attempt: the time left, if bounded."""
        if until is None:
            return {}
        left = until - time.monotonic()
        if left <= 0:
            tried = "; ".join(f"{url}: {exc}" for url, exc in failures)
            raise DeadlineExceeded(
                f"the {deadline} s deadline for weight set {name!r} passed "
                + (f"while failing over ({tried})" if failures else "before it was sent")
            ) from (failures[-1][1] if failures else None)
        return {"deadline": left}


class MultiClient(_Fleet[Client]):
    """A blocking client over several moegemm endpoints, one `Client` each.

    ``MultiClient(endpoints, replicas=1, hot={"layer3": 3}, token=..., timeout=...)``:
    every weight set lives on its first ``replicas`` endpoints by rendezvous
    hashing of its name, or on ``hot[name]`` of them for sets that take more
    traffic or must survive an endpoint's loss. Other keyword arguments go to
    each `Client`. Every router must be given the same endpoints, ``replicas``
    and ``hot`` to agree on placement; the order of ``endpoints`` does not
    matter.

    - ``load_weights`` / ``load_weights_file`` load on every endpoint of the
      placement; an unreachable one raises `TransportError` naming it (every
      endpoint that failed), once the others have the set. An endpoint where a
      load, replace or delete failed (or was cut short by the caller) while
      another took it may hold another version: this client's calls leave it
      out until a later load or delete of the set succeeds there (other clients
      do not know: repeat the load).
    - ``grouped_gemm`` takes turns over the placement's endpoints and moves
      on to the next one on `TransportError`, 503 (`Unavailable`),
      `NoSuchWeights` (a restarted server that lost its sets) or a 5xx of a
      status the contract does not use, without its error body (a proxy's 502, a
      gateway's 504). Other errors
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
        super().__init__(endpoints, replicas, hot, lambda url: Client(url, **client_kwargs))

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
        self._forget(name)
        self._delete(name, lambda c: c.delete_weights(name), "weights")

    def load_experts(self, name: str, w13: Any, w2: Any, w13_scale: Any = None,
                     w2_scale: Any = None) -> dict[str, dict]:
        """Load or replace expert set ``name`` on each endpoint of its placement (placed
        by the expert-set name, as weight sets are); arguments as `Client.load_experts`."""
        return self._on_placement(
            name, lambda c: c.load_experts(name, w13, w2, w13_scale, w2_scale), kind="experts"
        )

    def load_experts_checkpoint(self, name: str, checkpoint: str | os.PathLike,
                                layer: int) -> dict[str, dict]:
        """Load expert set ``name`` from a checkpoint layer on each endpoint of its
        placement (the servers share the checkpoint directory)."""
        return self._on_placement(
            name, lambda c: c.load_experts_checkpoint(name, checkpoint, layer), kind="experts"
        )

    def delete_experts(self, name: str) -> None:
        """Unload expert set ``name`` from each endpoint of its placement (as
        `delete_weights`)."""
        self._forget(name, f"{name}.w13", f"{name}.w2")
        self._delete(name, lambda c: c.delete_experts(name), "experts")

    def experts(self) -> dict[str, list[dict]]:
        """Each endpoint's loaded expert sets (as `Client.experts`); raises as `weights`
        does."""
        return self._on_all(lambda c: c.experts())

    def _delete(self, name: str, delete_one: Callable[[Client], None], kind: str) -> None:
        missing: list[NoSuchWeights] = []

        def delete(client: Client) -> None:
            try:
                delete_one(client)
            except NoSuchWeights as exc:
                missing.append(exc)

        placed = self._on_placement(name, delete, kind)
        if len(missing) == len(placed):
            raise _naming(", ".join(placed), missing[-1]) from missing[-1]

    def _on_placement(self, name: str, action: Callable[[Client], T],
                      kind: str = "weights") -> dict[str, T]:
        """``action`` on every endpoint of the placement (as the async class does), then
        the first failure, named: the endpoints that answered have the change, so calls
        fail over to them while the others are down."""
        results: dict[str, T] = {}
        placed = self.placement(name)
        failed: list[tuple[str, MoegemmError]] = []
        try:
            for url in placed:
                try:
                    results[url] = action(self._clients[url])
                except MoegemmError as exc:
                    failed.append((url, exc))
        except BaseException:  # cut short (Ctrl-C): where it was, and what it had not reached
            self._mark(kind, name, placed, [url for url in placed if url not in results])
            raise
        self._settle(kind, name, placed, failed)
        return results

    def grouped_gemm(
        self,
        name: str,
        x: Any,
        m_sizes: Any,
        x_scale: Any = None,
        *,
        deadline: float | None = None,
        request_id: str | None = None,
    ) -> Any:
        """Run the grouped GEMM on weight set ``name``; arguments and result as
        `Client.grouped_gemm`, failing over between the set's replicas.

        Calls for a replicated set take turns over its replicas (so hot sets
        spread their load), each call failing over in rank order from its
        first pick. ``deadline`` (seconds) bounds the whole call, failovers
        included: each replica is given only the time left.
        """
        return self._failing_over(
            name, deadline, lambda c, budget: c.grouped_gemm(name, x, m_sizes, x_scale, **budget),
            request_id,
        )

    def expert_ffn(self, name: str, x: Any, m_sizes: Any, x_scale: Any = None, *,
                   deadline: float | None = None, request_id: str | None = None) -> Any:
        """`Client.expert_ffn` on expert set ``name``, placed and failing over like
        `grouped_gemm` (placement by the expert-set name)."""
        return self._failing_over(
            name, deadline, lambda c, budget: c.expert_ffn(name, x, m_sizes, x_scale, **budget),
            request_id, kind="experts",
        )

    def moe(self, name: str, x: Any, topk_ids: Any, topk_weights: Any, x_scale: Any = None,
            *, deadline: float | None = None, request_id: str | None = None) -> Any:
        """`Client.moe` on expert set ``name``, placed and failing over like `grouped_gemm`."""
        return self._failing_over(
            name, deadline,
            lambda c, budget: c.moe(name, x, topk_ids, topk_weights, x_scale, **budget),
            request_id, kind="experts",
        )

    def _failing_over(self, name: str, deadline: float | None,
                      call: Callable[[Client, dict[str, Any]], T],
                      request_id: str | None = None, kind: str = "weights") -> T:
        until = deadline_instant(deadline)
        failures: list[tuple[str, MoegemmError]] = []
        for url in self._turn(name, kind):
            budget: dict[str, Any] = self._budget(name, deadline, until, failures)
            if request_id is not None:  # one id for every replica tried
                budget["request_id"] = request_id
            try:
                return call(self._clients[url], budget)
            except (TransportError, APIError) as exc:
                if not _fails_over(exc):
                    raise _naming(url, exc) from exc
                failures.append((url, exc))
        raise _exhausted(name, self.placement(name), len(self._clients), failures) from (
            failures[-1][1]
        )

    def weights(self) -> dict[str, list[dict]]:
        """Each endpoint's loaded weight sets (as `Client.weights`); raises, naming the
        endpoint, if one cannot be reached (a listing without it would read as sets lost)."""
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
                raise TransportError(f"endpoint {url} did not answer: {exc}",
                                     request_id=exc.request_id) from exc
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


class AsyncMultiClient(_Fleet[AsyncClient]):
    """The asyncio twin of `MultiClient` over `AsyncClient`: the same methods
    and placement, awaited. Loads and listings reach their endpoints
    concurrently; a call still tries its replicas one after another."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        replicas: int = 1,
        hot: Mapping[str, int] | None = None,
        **client_kwargs: Any,
    ) -> None:
        super().__init__(endpoints, replicas, hot, lambda url: AsyncClient(url, **client_kwargs))

    async def load_weights(self, name: str, w: Any, w_scale: Any = None) -> dict[str, dict]:
        """See `MultiClient.load_weights`."""
        return await self._on_placement(name, lambda c: c.load_weights(name, w, w_scale))

    async def load_weights_file(
        self,
        name: str,
        file: str | os.PathLike,
        w_key: str,
        w_scale_key: str | None = None,
    ) -> dict[str, dict]:
        """See `MultiClient.load_weights_file`."""
        return await self._on_placement(
            name, lambda c: c.load_weights_file(name, file, w_key, w_scale_key)
        )

    async def delete_weights(self, name: str) -> None:
        """See `MultiClient.delete_weights`."""
        self._forget(name)
        await self._delete(name, lambda c: c.delete_weights(name), "weights")

    async def load_experts(self, name: str, w13: Any, w2: Any, w13_scale: Any = None,
                           w2_scale: Any = None) -> dict[str, dict]:
        """See `MultiClient.load_experts`."""
        return await self._on_placement(
            name, lambda c: c.load_experts(name, w13, w2, w13_scale, w2_scale), kind="experts"
        )

    async def load_experts_checkpoint(self, name: str, checkpoint: str | os.PathLike,
                                      layer: int) -> dict[str, dict]:
        """See `MultiClient.load_experts_checkpoint`."""
        return await self._on_placement(
            name, lambda c: c.load_experts_checkpoint(name, checkpoint, layer), kind="experts"
        )

    async def delete_experts(self, name: str) -> None:
        """See `MultiClient.delete_experts`."""
        self._forget(name, f"{name}.w13", f"{name}.w2")
        await self._delete(name, lambda c: c.delete_experts(name), "experts")

    async def experts(self) -> dict[str, list[dict]]:
        """See `MultiClient.experts`."""
        return await self._on_all(lambda c: c.experts())

    async def _delete(self, name: str, delete_one: Callable[[AsyncClient], Awaitable[None]],
                      kind: str) -> None:
        async def delete(client: AsyncClient) -> NoSuchWeights | None:
            try:
                await delete_one(client)
            except NoSuchWeights as exc:
                return exc
            return None

        answers = await self._on_placement(name, delete, kind)
        missing = [exc for exc in answers.values() if exc is not None]
        if len(missing) == len(answers):
            raise _naming(", ".join(answers), missing[-1]) from missing[-1]

    async def _on_placement(
        self, name: str, action: Callable[[AsyncClient], Awaitable[T]], kind: str = "weights"
    ) -> dict[str, T]:
        placed = self.placement(name)
        tasks = [asyncio.ensure_future(action(self._clients[url])) for url in placed]
        try:
            answers = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # cancelled (a caller's timeout): what had not finished missed it
            for task in tasks:
                task.cancel()
            self._mark(kind, name, placed, [
                url for url, task in zip(placed, tasks)
                if not task.done() or task.cancelled() or task.exception() is not None])
            raise
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, MoegemmError):
                raise answer  # not one of ours (a bug): as it came
        failed = [(url, a) for url, a in zip(placed, answers) if isinstance(a, MoegemmError)]
        self._settle(kind, name, placed, failed)
        return dict(zip(placed, answers))

    async def grouped_gemm(
        self,
        name: str,
        x: Any,
        m_sizes: Any,
        x_scale: Any = None,
        *,
        deadline: float | None = None,
        request_id: str | None = None,
    ) -> Any:
        """See `MultiClient.grouped_gemm`."""
        return await self._failing_over(
            name, deadline, lambda c, budget: c.grouped_gemm(name, x, m_sizes, x_scale, **budget),
            request_id,
        )

    async def expert_ffn(self, name: str, x: Any, m_sizes: Any, x_scale: Any = None, *,
                         deadline: float | None = None, request_id: str | None = None) -> Any:
        """See `MultiClient.expert_ffn`."""
        return await self._failing_over(
            name, deadline, lambda c, budget: c.expert_ffn(name, x, m_sizes, x_scale, **budget),
            request_id, kind="experts",
        )

    async def moe(self, name: str, x: Any, topk_ids: Any, topk_weights: Any,
                  x_scale: Any = None, *, deadline: float | None = None,
                  request_id: str | None = None) -> Any:
        """See `MultiClient.moe`."""
        return await self._failing_over(
            name, deadline,
            lambda c, budget: c.moe(name, x, topk_ids, topk_weights, x_scale, **budget),
            request_id, kind="experts",
        )

    async def _failing_over(self, name: str, deadline: float | None,
                            call: Callable[[AsyncClient, dict[str, Any]], Awaitable[T]],
                            request_id: str | None = None, kind: str = "weights") -> T:
        until = deadline_instant(deadline)
        failures: list[tuple[str, MoegemmError]] = []
        for url in self._turn(name, kind):
            budget: dict[str, Any] = self._budget(name, deadline, until, failures)
            if request_id is not None:  # one id for every replica tried
                budget["request_id"] = request_id
            try:
                return await call(self._clients[url], budget)
            except (TransportError, APIError) as exc:
                if not _fails_over(exc):
                    raise _naming(url, exc) from exc
                failures.append((url, exc))
        raise _exhausted(name, self.placement(name), len(self._clients), failures) from (
            failures[-1][1]
        )

    async def weights(self) -> dict[str, list[dict]]:
        """See `MultiClient.weights`."""
        return await self._on_all(lambda c: c.weights())

    async def health(self) -> dict[str, dict]:
        """See `MultiClient.health`."""
        return await self._on_all(lambda c: c.health())

    async def _on_all(self, action: Callable[[AsyncClient], Awaitable[T]]) -> dict[str, T]:
        urls = list(self._clients)
        answers = await asyncio.gather(
            *(action(self._clients[url]) for url in urls), return_exceptions=True
        )
        for url, answer in zip(urls, answers):
            if isinstance(answer, TransportError):
                raise TransportError(f"endpoint {url} did not answer: {answer}",
                                     request_id=answer.request_id) from answer
            if isinstance(answer, APIError):
                raise _naming(url, answer) from answer
            if isinstance(answer, BaseException):
                raise answer
        return dict(zip(urls, answers))

    async def close(self) -> None:
        """Close every endpoint's connections."""
        await asyncio.gather(*(client.close() for client in self._clients.values()))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
