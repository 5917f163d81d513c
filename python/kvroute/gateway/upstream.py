"""Upstream connections and in-flight accounting.

``Upstreams`` holds one keep-alive connection pool per worker (``kvroute.gateway.client.Pool``)
and the count of requests begun and not finished. ``Upstreams.begin(decision, ...)`` starts one
attempt as a ``Flight``: ``router.begin(decision)`` at once; ``prefilled()`` when the upstream's
first output arrives — or, for a response that shows no output until it is whole (not
streamed), when the prefill is predicted done (``expect_prefill``: ``Upstreams.predict_prefill``,
the admission model's time for the flight's work; at ``close`` when there is no prediction);
``close(usage)`` exactly once whatever happens — the response read, the
stream ended or broken, the client gone, the attempt failed or cancelled — reporting the
upstream's ``cached_tokens`` to ``router.observe`` first (in routing tokens; not for the decode
half of a prefill/decode pair, whose engine counts the KV it received) and then calling
``router.finish`` — or, for an attempt that got no connection (refused, connect or pool
timeout: not one byte of it left), ``router.withdraw``, so a prompt that never reached the worker
leaves the router's model of that worker's cache. A worker with ``max_in_flight_per_worker``
attempts in flight is in ``Upstreams.full`` (the router's choice skips it) until one of them
ends. ``UpstreamBody`` is a request's body as sent upstream, encoded once per set of engine
fields.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl as _ssl
import time
from collections.abc import Callable
from typing import Any

from kvroute import Decision, Router
from kvroute.server.config import engine_fields

from .client import NOT_SENT, Pool, Response, UpstreamError
from .config import ServerConfig, WorkerConfig
from .errors import SEND_FAILURES, Failed, classify
from .metrics import GatewayMetrics
from .rawjson import RawObject, dumps
from .usage import routed_cached_tokens

#: A caller's fields that name an engine's prefix-cache partition — vLLM's ``cache_salt``;
#: SGLang's ``cache_salt`` and ``extra_key``, which it joins — never forwarded.
CACHE_KEY_FIELDS = ("cache_salt", "extra_key")

__all__ = ["Flight", "UpstreamBody", "Upstreams", "release", "release_now", "request_head"]

log = logging.getLogger("kvroute.gateway")


def request_head(request_id: str) -> str:
    """The head lines every upstream request sends besides the pool's own: the JSON body's type
    and ``x-request-id`` (which engines may key the request by)."""
    return f"content-type: application/json\r\nx-request-id: {request_id}\r\n"


class UpstreamBody:
    """The body sent upstream, encoded once for each set of engine fields a worker kind gets
    (``cache_salt``, ``priority``: ``kvroute.server.config.engine_fields``), each only when a
    worker of that kind is tried; and whether the usage chunk is the gateway's. With ``raw`` (the
    client's body as ``kvroute.gateway.rawjson`` parsed it) the fields the gateway left alone
    keep the client's JSON text."""

    __slots__ = ("body", "by_kind", "encoded", "priority", "raw", "salt", "strip_usage")

    def __init__(
        self,
        body: dict[str, Any],
        salt: str | None,
        priority: int,
        strip_usage: bool,
        raw: RawObject | None = None,
    ) -> None:
        self.body = body
        self.salt = salt
        self.priority = priority
        self.strip_usage = strip_usage
        self.raw = raw
        self.encoded: dict[tuple[tuple[str, Any], ...], bytes] = {}
        self.by_kind: dict[str, bytes] = {}  # the same bytes by worker kind: one lookup

    def get(self, kind: str) -> bytes:
        data = self.by_kind.get(kind)
        if data is not None:
            return data
        extra = engine_fields(kind, self.salt, self.priority)
        key = tuple(extra.items())
        data = self.encoded.get(key)
        if data is None:
            body = {**self.body, **extra} if extra else self.body
            data = self.raw.encode(body) if self.raw is not None else dumps(body).encode()
            self.encoded[key] = data
        self.by_kind[kind] = data
        return data


class Upstreams:
    """The fleet's connection pools and its in-flight accounting."""

    def __init__(
        self,
        workers: tuple[WorkerConfig, ...],
        server: ServerConfig,
        router: Router,
        metrics: GatewayMetrics,
    ) -> None:
        self.workers = {w.name: w for w in workers}
        self.server = server
        self.router = router
        self.block_size = router.block_size
        self.metrics = metrics
        self.pools: dict[str, Pool] = {}
        self.in_flight: dict[str, int] = dict.fromkeys(self.workers, 0)
        bound = server.max_in_flight_per_worker
        self.bounds = {w.name: bound or w.max_connections for w in workers}
        self.full: set[str] = set()  # workers at their in-flight bound
        #: Called with (prefill tokens, seconds) when a flight's first output arrives.
        self.on_prefilled: Callable[[float, float], None] | None = None
        #: Seconds a prefill of so many tokens (queued + own) takes, None while unknown.
        self.predict_prefill: Callable[[float], float | None] | None = None

    def start(self) -> None:
        """Opens the pools (in the running event loop)."""
        s = self.server
        ssl = None
        if any(w.url.startswith("https:") for w in self.workers.values()):
            ssl = _ssl.create_default_context()  # shared: building one costs ~25 ms
        for w in self.workers.values():
            headers = [("accept-encoding", "identity")]
            if w.api_key:
                headers.append(("authorization", f"Bearer {w.api_key}"))
            self.pools[w.name] = Pool(
                w.url,
                max_connections=w.max_connections,
                connect_timeout=s.connect_timeout,
                read_timeout=s.read_timeout,
                write_timeout=s.write_timeout,
                pool_timeout=s.pool_timeout,
                keepalive=s.upstream_keepalive,
                ssl=ssl,
                headers=headers,
            )

    async def stop(self) -> None:
        pools, self.pools = self.pools, {}
        for p in pools.values():
            await p.aclose()

    def begin(self, decision: Decision, routing_prompt: int) -> Flight:
        return Flight(self, decision, routing_prompt)

    def _count(self, worker: str, by: int) -> None:
        n = self.in_flight[worker] = self.in_flight[worker] + by
        if n >= self.bounds[worker]:
            self.full.add(worker)
        else:
            self.full.discard(worker)

    async def fetch(self, worker: str, path: str) -> bytes | None:
        """The body of ``GET path`` on the worker when it answers 200 within the read timeout."""
        pool = self.pools.get(worker)
        if pool is None:
            return None
        try:
            status, body = await asyncio.wait_for(
                pool.fetch(path, 16 << 20), self.server.read_timeout
            )
        except (UpstreamError, asyncio.TimeoutError):
            return None
        return body if status == 200 else None

    async def probe(self, worker: str, path: str) -> bool:
        """Whether ``GET path`` on the worker answers 200 (within the connect timeout)."""
        pool = self.pools.get(worker)
        if pool is None:
            return False
        try:
            status = await asyncio.wait_for(pool.get(path), self.server.connect_timeout)
        except (UpstreamError, asyncio.TimeoutError):
            return False
        return status == 200


class Flight:
    """One upstream attempt's load accounting: ``begin`` at creation, ``finish`` exactly once."""

    __slots__ = (
        "begun",
        "closed",
        "decision",
        "pool",
        "prefill_done",
        "prefill_timer",
        "queued",
        "routing_prompt",
        "upstreams",
        "usage",
        "worker",
    )

    def __init__(self, upstreams: Upstreams, decision: Decision, routing_prompt: int) -> None:
        self.upstreams = upstreams
        self.decision = decision
        self.worker = decision.worker
        self.routing_prompt = routing_prompt
        self.closed = False
        self.prefill_done = False
        self.prefill_timer: asyncio.TimerHandle | None = None
        self.usage: Any = None
        self.pool = upstreams.pools[self.worker]
        # The prefill queued ahead of this request (begin returns it): timed at its first output.
        self.queued = upstreams.router.begin(decision) * upstreams.block_size
        upstreams._count(self.worker, 1)
        self.begun = time.perf_counter()

    @property
    def work(self) -> int:
        """The prefill tokens ahead of this request's first token: queued + its own uncached."""
        d = self.decision
        return self.queued + max(d.prompt_tokens - d.cached_tokens, 0)

    def prefilled(self) -> None:
        """The upstream produced its first output: the prompt's prefill is done."""
        if not self.prefill_done and not self.closed:
            self._prefilled()
            if self.upstreams.on_prefilled is not None:
                self.upstreams.on_prefilled(self.work, time.perf_counter() - self.begun)

    def expect_prefill(self) -> None:
        """The response shows no output before it is whole (called as it is sent, right after
        ``begin``): the router is told the prefill is done when it is predicted done (no
        prediction: at ``close``). Not a sample of the prediction's model."""
        predict = self.upstreams.predict_prefill
        seconds = None if predict is None else predict(self.work)
        if seconds is not None and seconds < math.inf and not self.closed:
            self.prefill_timer = asyncio.get_running_loop().call_later(seconds, self._predicted)

    def _predicted(self) -> None:
        self.prefill_timer = None
        if not self.prefill_done and not self.closed:
            self._prefilled()

    def _prefilled(self) -> None:
        self.prefill_done = True
        self._cancel_timer()
        self.upstreams.router.prefilled(self.decision)

    def close(self, usage: Any = None) -> None:
        """Reports the upstream's usage (if it has cached tokens) and finishes; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._cancel_timer()
        self.usage = usage
        u = self.upstreams
        try:
            # A decode half's engine counts the KV it received as cached: only the prefill's
            # report says what its worker held.
            routed = (
                routed_cached_tokens(usage, self.routing_prompt)
                if self.decision.half != "decode"
                else None
            )
            if routed is not None:
                u.router.observe(self.decision, routed)
                m = u.metrics
                m.predicted.inc(self.worker, by=self.decision.cached_tokens)
                m.reported.inc(self.worker, by=routed)
                m.prompt_tokens.inc(self.worker, by=self.routing_prompt)
        except Exception:  # a bad report must never skip finish()
            log.exception("observe failed for worker %s", self.worker)
        finally:
            u._count(self.worker, -1)
            u.router.finish(self.decision)

    def withdraw(self) -> None:
        """Ends a flight whose request never reached its worker: ``router.withdraw`` (its load
        and the prompt its route recorded leave the router's model) instead of ``finish``."""
        if self.closed:
            return
        self.closed = True
        self._cancel_timer()
        u = self.upstreams
        try:
            u.router.withdraw(self.decision)
        finally:
            u._count(self.worker, -1)

    def _cancel_timer(self) -> None:
        if self.prefill_timer is not None:
            self.prefill_timer.cancel()
            self.prefill_timer = None

    async def send(self, path: str, headers: str, body: bytes) -> Response | Failed:
        """POSTs the request: the response with its body still to read, or how sending failed
        (the flight then closed: withdrawn when no connection was had, so no byte of the
        request left, else finished). An exception that is no upstream failure propagates (the
        flight closed too)."""
        try:
            return await self.pool.request("POST", path, headers, body)
        except BaseException as e:
            if isinstance(e, NOT_SENT):
                self.withdraw()
            else:
                self.close()
            failure = classify(e, SEND_FAILURES) if isinstance(e, UpstreamError) else None
            if failure is None:
                raise
            return failure, e, None


async def release(resp: Response, flight: Flight, usage: Any = None) -> None:
    """Closes an upstream response (its connection goes back to the pool, or is dropped if the
    body was not read to the end) and ends the flight — even if closing fails or is cancelled."""
    try:
        await resp.aclose()
    finally:
        flight.close(usage)


def release_now(resp: Response, flight: Flight, usage: Any = None) -> None:
    """``release`` without awaiting (closing never waits): the flight ends even if closing
    fails."""
    try:
        resp.close()
    finally:
        flight.close(usage)
