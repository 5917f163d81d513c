"""Upstream connections and in-flight accounting.

``Upstreams`` holds one ``Connections`` (keep-alive pools) per worker and the count of requests
begun and not finished. ``Upstreams.begin(decision, ...)`` starts one attempt as a ``Flight``:
``router.begin(decision)`` at once; ``prefilled()`` when the upstream's first output arrives;
``close(usage)`` exactly once whatever happens — the response read, the stream ended or broken, the
client gone, the attempt failed or cancelled — reporting the upstream's ``cached_tokens`` to
``router.observe`` first (in routing tokens) and then calling ``router.finish``. A worker with
``max_in_flight_per_worker`` attempts in flight is in ``Upstreams.full`` (the router's choice
skips it) until one of them ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from kvroute import Decision, Router

from .config import ServerConfig, WorkerConfig
from .metrics import GatewayMetrics
from .prompt import to_routing_tokens
from .usage import cached_tokens

__all__ = ["Connections", "Flight", "ReplyTooLarge", "Upstreams", "read_body", "release"]

log = logging.getLogger("kvroute.gateway")


class Connections:
    """HTTP/1.1 keep-alive connections to one worker: httpx transports of ``SHARD`` connections.

    Requests go straight to httpx's transport layer (``httpx.AsyncHTTPTransport``: httpcore
    pools), skipping the client layer's per-request URL merging, cookie jar, auth and redirect
    handling, none of which a proxy wants. A transport's pool does work proportional to its
    pending requests × connections on every request (at 64 concurrent requests on one pool,
    several milliseconds of CPU each), so connections are split into pools of ``SHARD``: a
    request takes the first pool with a free connection (a new pool while fewer than
    ``max_connections / SHARD`` exist), else the least busy one (it waits there, up to
    ``pool_timeout``).
    """

    SHARD = 4

    def __init__(
        self, worker: WorkerConfig, timeout: httpx.Timeout, keepalive: float, ssl: Any
    ) -> None:
        self.base = httpx.URL(worker.url)
        self.timeout = timeout.as_dict()
        self.keepalive = keepalive
        self.ssl = ssl
        self.headers = [("accept-encoding", "identity")]
        if worker.api_key:
            self.headers.append(("authorization", f"Bearer {worker.api_key}"))
        self.per_shard = min(self.SHARD, worker.max_connections)
        self.max_shards = -(-worker.max_connections // self.per_shard)
        self.shards: list[httpx.AsyncHTTPTransport] = []
        self.busy: list[int] = []
        self._urls: dict[str, httpx.URL] = {}

    def _new_shard(self) -> int:
        self.shards.append(
            httpx.AsyncHTTPTransport(
                verify=self.ssl,
                trust_env=False,  # never send upstream traffic through an environment proxy
                limits=httpx.Limits(
                    max_connections=self.per_shard,
                    max_keepalive_connections=self.per_shard,
                    keepalive_expiry=self.keepalive,
                ),
            )
        )
        self.busy.append(0)
        return len(self.shards) - 1

    def acquire(self) -> int:
        """A shard for one request (``release`` it when the response is closed)."""
        busy = self.busy
        free = next((i for i, n in enumerate(busy) if n < self.per_shard), None)
        if free is None:
            free = self._new_shard() if len(busy) < self.max_shards else busy.index(min(busy))
        busy[free] += 1
        return free

    def release(self, shard: int) -> None:
        self.busy[shard] -= 1

    def request(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        content: bytes | None = None,
        timeout: float | None = None,
    ) -> httpx.Request:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self.base.join(self.base.path.rstrip("/") + path)
        limits = self.timeout if timeout is None else dict.fromkeys(self.timeout, timeout)
        return httpx.Request(
            method,
            url,
            headers=self.headers + headers,
            content=content,
            extensions={"timeout": limits},
        )

    async def send(self, shard: int, request: httpx.Request) -> httpx.Response:
        """The response with its body still to read (``aread``/``aiter_raw``, then ``aclose``)."""
        return await self.shards[shard].handle_async_request(request)

    async def get(self, path: str, timeout: float) -> httpx.Response:
        shard = self.acquire()
        try:
            resp = await self.send(shard, self.request("GET", path, [], timeout=timeout))
            await resp.aclose()
            return resp
        finally:
            self.release(shard)

    async def aclose(self) -> None:
        shards, self.shards, self.busy = self.shards, [], []
        for transport in shards:
            await transport.aclose()


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
        self.metrics = metrics
        self.connections: dict[str, Connections] = {}
        self.in_flight: dict[str, int] = dict.fromkeys(self.workers, 0)
        bound = server.max_in_flight_per_worker
        self.bounds = {w.name: bound or w.max_connections for w in workers}
        self.full: set[str] = set()  # workers at their in-flight bound
        #: Called with (prefill tokens, seconds) when a flight's first output arrives.
        self.on_prefilled: Callable[[float, float], None] | None = None

    def start(self) -> None:
        s = self.server
        timeout = httpx.Timeout(
            connect=s.connect_timeout,
            read=s.read_timeout,
            write=s.write_timeout,
            pool=s.pool_timeout,
        )
        ssl = httpx.create_ssl_context()  # shared: building one costs ~25 ms
        for w in self.workers.values():
            self.connections[w.name] = Connections(w, timeout, s.upstream_keepalive, ssl)

    async def stop(self) -> None:
        connections, self.connections = self.connections, {}
        for c in connections.values():
            await c.aclose()

    def begin(self, decision: Decision, routing_prompt: int) -> Flight:
        return Flight(self, decision, routing_prompt)

    def _count(self, worker: str, by: int) -> None:
        n = self.in_flight[worker] = self.in_flight[worker] + by
        if n >= self.bounds[worker]:
            self.full.add(worker)
        else:
            self.full.discard(worker)

    async def probe(self, worker: str, path: str) -> bool:
        """Whether ``GET path`` on the worker answers 200."""
        connections = self.connections.get(worker)
        if connections is None:
            return False
        try:
            resp = await connections.get(path, self.server.connect_timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200


class Flight:
    """One upstream attempt's load accounting: ``begin`` at creation, ``finish`` exactly once."""

    __slots__ = (
        "begun",
        "closed",
        "connections",
        "decision",
        "prefill_done",
        "queued",
        "routing_prompt",
        "shard",
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
        self.usage: Any = None
        self.connections = upstreams.connections[self.worker]
        self.shard = self.connections.acquire()
        self.queued = 0.0
        if upstreams.on_prefilled is not None:
            load = upstreams.router.load(self.worker)
            self.queued = load["prefill_blocks"] * upstreams.router.block_size
        upstreams.router.begin(decision)
        upstreams._count(self.worker, 1)
        self.begun = time.perf_counter()

    def prefilled(self) -> None:
        """The upstream produced its first output: the prompt's prefill is done."""
        if not self.prefill_done and not self.closed:
            self.prefill_done = True
            u = self.upstreams
            u.router.prefilled(self.decision)
            if u.on_prefilled is not None:
                d = self.decision
                work = self.queued + max(d.prompt_tokens - d.cached_tokens, 0)
                u.on_prefilled(work, time.perf_counter() - self.begun)

    def close(self, usage: Any = None) -> None:
        """Reports the upstream's usage (if it has cached tokens) and finishes; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.usage = usage
        u = self.upstreams
        try:
            cached = cached_tokens(usage)
            if cached is not None:
                prompt = usage.get("prompt_tokens")
                routed = to_routing_tokens(
                    cached, prompt if isinstance(prompt, int) else None, self.routing_prompt
                )
                u.router.observe(self.decision, routed)
                m = u.metrics
                m.predicted.inc(self.worker, by=self.decision.cached_tokens)
                m.reported.inc(self.worker, by=routed)
                m.prompt_tokens.inc(self.worker, by=self.routing_prompt)
        except Exception:  # a bad report must never skip finish()
            log.exception("observe failed for worker %s", self.worker)
        finally:
            u._count(self.worker, -1)
            self.connections.release(self.shard)
            u.router.finish(self.decision)

    async def send(self, request: httpx.Request) -> httpx.Response:
        return await self.connections.send(self.shard, request)


class ReplyTooLarge(Exception):
    """A non-streamed upstream reply grew past ``max_response_bytes``."""


async def read_body(resp: httpx.Response, limit: int) -> bytes:
    """The whole body of a response, refusing (``ReplyTooLarge``) past ``limit`` bytes — checked
    on ``Content-Length`` first, then while reading."""
    declared = resp.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ReplyTooLarge(f"the reply declares {declared} bytes, over {limit}")
    chunks = []
    size = 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise ReplyTooLarge(f"the reply exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def release(resp: httpx.Response, flight: Flight, usage: Any = None) -> None:
    """Closes an upstream response (its connection goes back to the pool, or is dropped if the
    body was not read to the end) and ends the flight — even if closing fails or is cancelled."""
    try:
        await resp.aclose()
    except (httpx.HTTPError, OSError) as e:
        log.debug("closing the response of %s: %r", flight.worker, e)
    finally:
        flight.close(usage)
