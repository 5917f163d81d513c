"""The gateway: an ASGI (Starlette) app that routes OpenAI-style requests with ``kvroute.Router``.

Request path (``POST /v1/chat/completions``, ``POST /v1/completions``):

1. The body is read up to ``max_body_bytes`` (413 past it, before reading further when
   ``Content-Length`` says so), parsed as a JSON object (400 otherwise).
2. ``model`` names an endpoint (``[[endpoints]] id``) or a directly served model
   (``gateway.models``); anything else is 404. The caller's bearer key is checked against the
   target's keys: missing → 401, wrong → 403 (SHA-256 digests compared with
   ``hmac.compare_digest`` against every configured key, so neither timing nor length tells which
   byte differed). The caller's key is never sent upstream; a worker's own ``api_key`` is.
3. The prompt is rendered and tokenized for routing (``kvroute.gateway.prompt``), and
   ``router.route(tokens=..., endpoint=...)`` picks the worker.
4. The body goes upstream with ``model`` replaced by the real model name. For an endpoint with
   ``cache_salt = true`` and a ``vllm``/``sglang`` worker, ``cache_salt`` is set to the router's
   salt of that endpoint (``Router.endpoint_salt``), so the engine's prefix cache is partitioned
   per endpoint exactly as the router's block hashes are (and, in events mode, the engine's KV
   events carry the same salt). A ``cache_salt`` sent by the caller is never forwarded: it would
   let one tenant name another's cache partition and probe it by timing.
5. ``router.begin(d)`` when the upstream request starts; ``router.prefilled(d)`` when a stream's
   first bytes arrive (the prompt is prefilled); ``router.finish(d)`` exactly once when the
   response or stream has ended, failed, or the client went away. When the upstream reports
   ``usage.prompt_tokens_details.cached_tokens`` (the final usage chunk of a stream; the gateway
   asks for it with ``stream_options.include_usage`` and strips that chunk again when the caller
   did not ask for it), ``router.observe(d, cached)`` is called first, in routing tokens.

Failover: a connection failure (refused, connect timeout, or no free pooled connection to the
worker within ``pool_timeout``), a connection reset before any response byte, or a 5xx status is
retried on the router's next choice among the workers not yet tried for this request
(``route(..., exclude=tried)``), up to ``max_attempts`` attempts; when an endpoint's pool has no
untried member left, the members that failed are ejected so that the pool's next workers in
rendezvous order step in. A worker is ejected (``router.set_healthy(worker, False)``) at once when
it cannot be reached, and after ``eject_after`` failed requests in a row otherwise; it is
readmitted when, at least ``eject_seconds`` later, its ``health_path`` answers 200 (probed every
``health_interval``). Read timeouts are not retried (the upstream may still be computing): they
answer 504. 4xx answers pass through untouched. After the first response byte nothing is retried:
a stream that breaks is ended. A reset before any response byte is retried although the upstream
may have read the request (a keep-alive connection it closed at that moment, typically):
completions have no side effects, so at worst it computed twice.

Streams are passed through as the upstream's SSE events arrive (each complete event is forwarded
at once; only the usage chunk the gateway itself asked for is removed). A client that disconnects
cancels the upstream request (its connection is closed) whether or not the response had started.

Replies carry ``x-request-id`` (the caller's, or a new one; also sent upstream) and, with
``routing_headers``, ``x-kvroute-worker``, ``x-kvroute-cached-tokens`` (predicted, routing
tokens) and ``x-kvroute-attempts``.

The app keeps all mutable state on its event loop (one uvicorn worker process); the Router is
thread-safe and the KV-event subscriber feeds it from its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvroute import Router

from .config import GatewayConfig, WorkerConfig, key_digest
from .metrics import Counter, Gauge, Histogram, Registry
from .prompt import (
    OFFLOAD_CHARS,
    RequestError,
    Tokenizer,
    load_tokenizer,
    prompt_of,
    render_chat,
    to_routing_tokens,
)
from .routing import NoWorker, build_router

__all__ = ["Gateway"]

log = logging.getLogger("kvroute.gateway")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_FORWARDED_RESPONSE_HEADERS = ("content-type", "cache-control")


class HTTPError(Exception):
    """An error answered to the client as an OpenAI-style error object."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code

    def response(self, headers: dict[str, str] | None = None) -> Response:
        body = {
            "error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}
        }
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` names: an endpoint (with its pool) or a directly served model."""

    name: str
    upstream_model: str
    endpoint: str | None
    key_digests: tuple[bytes, ...]
    salted: bool


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


class Flight:
    """One upstream attempt's load accounting: ``begin`` at creation, ``finish`` exactly once."""

    __slots__ = (
        "closed",
        "connections",
        "decision",
        "gateway",
        "prefill_done",
        "routing_prompt",
        "shard",
        "worker",
    )

    def __init__(self, gateway: Gateway, decision: Any, routing_prompt: int) -> None:
        self.gateway = gateway
        self.decision = decision
        self.worker = decision.worker
        self.routing_prompt = routing_prompt
        self.closed = False
        self.prefill_done = False
        self.connections = gateway.connections[self.worker]
        self.shard = self.connections.acquire()
        gateway.router.begin(decision)
        gateway.in_flight[self.worker] = gateway.in_flight.get(self.worker, 0) + 1

    def prefilled(self) -> None:
        """The upstream produced its first output: the prompt's prefill is done."""
        if not self.prefill_done and not self.closed:
            self.prefill_done = True
            self.gateway.router.prefilled(self.decision)

    def close(self, usage: Any = None) -> None:
        """Reports the upstream's usage (if it has cached tokens) and finishes; idempotent."""
        if self.closed:
            return
        self.closed = True
        g = self.gateway
        try:
            cached = _cached_tokens(usage)
            if cached is not None:
                prompt = usage.get("prompt_tokens")
                routed = to_routing_tokens(
                    cached, prompt if isinstance(prompt, int) else None, self.routing_prompt
                )
                g.router.observe(self.decision, routed)
                g.m_predicted.inc(self.worker, by=self.decision.cached_tokens)
                g.m_reported.inc(self.worker, by=routed)
                g.m_prompt_tokens.inc(self.worker, by=self.routing_prompt)
        except Exception:  # a bad report must never skip finish()
            log.exception("observe failed for worker %s", self.worker)
        finally:
            g.in_flight[self.worker] -= 1
            self.connections.release(self.shard)
            g.router.finish(self.decision)

    async def send(self, request: httpx.Request) -> httpx.Response:
        return await self.connections.send(self.shard, request)


def _cached_tokens(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        return cached
    return None


async def _release(resp: httpx.Response, flight: Flight, usage: Any = None) -> None:
    """Closes an upstream response (its connection goes back to the pool, or is dropped if the
    body was not read to the end) and ends the flight — even if closing fails or is cancelled."""
    try:
        await resp.aclose()
    except (httpx.HTTPError, OSError) as e:
        log.debug("closing the response of %s: %r", flight.worker, e)
    finally:
        flight.close(usage)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Gateway:
    """An OpenAI-compatible gateway over a fleet, routing with ``kvroute.Router``.

    ``Gateway(config).app`` is the ASGI app (serve it with uvicorn: ``kvroute serve``). ``router``
    and ``tokenizer`` may be given to share or replace the ones built from the config.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        router: Router | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        self.server = config.server
        self.router = router if router is not None else build_router(config)
        self.tokenizer = tokenizer or load_tokenizer(
            config.tokenizer.path, config.tokenizer.bytes_per_token
        )
        self.workers: dict[str, WorkerConfig] = {w.name: w for w in config.workers}
        self.targets: dict[str, Target] = {}
        for ep in config.endpoints:
            self.targets[ep.id] = Target(ep.id, ep.model, ep.id, ep.key_digests, ep.cache_salt)
        for model in config.server.models:
            self.targets[model] = Target(model, model, None, config.server.key_digests, False)
        self.salts = {
            ep.id: self.router.endpoint_salt(ep.id) for ep in config.endpoints if ep.cache_salt
        }
        self.connections: dict[str, Connections] = {}
        self.in_flight: dict[str, int] = dict.fromkeys(self.workers, 0)
        self.ejected: dict[str, float] = {}  # worker -> monotonic time of ejection
        self.failures: dict[str, int] = {}  # worker -> failed requests in a row
        self.subscriber: Any = None
        self._health_task: asyncio.Task[None] | None = None
        self._init_metrics()
        self.app = Starlette(
            routes=[
                Route(CHAT, self._chat, methods=["POST"]),
                Route(COMPLETIONS, self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        """Opens the upstream connection pools, the health prober and the KV-event subscriber."""
        s = self.server
        timeout = httpx.Timeout(
            connect=s.connect_timeout,
            read=s.read_timeout,
            write=s.write_timeout,
            pool=s.pool_timeout,
        )
        ssl = httpx.create_ssl_context()  # shared: building one costs ~25 ms
        for w in self.config.workers:
            self.connections[w.name] = Connections(w, timeout, s.upstream_keepalive, ssl)
        self._health_task = asyncio.create_task(self._health_loop(), name="kvroute-health")
        if self.config.router.index == "events":
            from kvroute.events import KvEventSubscriber

            endpoints = {w.name: w.kv_events for w in self.config.workers if w.kv_events}
            replay = {w.name: w.kv_replay for w in self.config.workers if w.kv_replay}
            self.subscriber = KvEventSubscriber(
                self.router,
                endpoints,
                replay=replay,
                topic=self.config.events.topic,
                mode=self.config.events.mode,
            )
            await self.subscriber.__aenter__()

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self.subscriber is not None:
            await self.subscriber.__aexit__(None, None, None)
            self.subscriber = None
        connections, self.connections = self.connections, {}
        for c in connections.values():
            await c.aclose()

    # ---- metrics ---------------------------------------------------------------------------

    def _init_metrics(self) -> None:
        reg = self.registry = Registry()
        p = "kvroute_gateway_"
        self.m_requests = reg.add(
            Counter(p + "requests_total", "Requests answered.", ("route", "model", "status"))
        )
        self.m_latency = reg.add(
            Histogram(
                p + "request_duration_seconds",
                "Request received to response or stream end.",
                ("route",),
            )
        )
        self.m_first_byte = reg.add(
            Histogram(
                p + "time_to_first_byte_seconds",
                "Request received to first body byte sent.",
                ("route",),
            )
        )
        self.m_decisions = reg.add(
            Counter(
                p + "routing_decisions_total",
                "Routing decisions (one per upstream attempt).",
                ("policy", "reason", "worker"),
            )
        )
        self.m_predicted = reg.add(
            Counter(
                p + "cached_tokens_predicted_total",
                "Cached routing tokens the router predicted, on "
                "requests whose upstream reported cached tokens.",
                ("worker",),
            )
        )
        self.m_reported = reg.add(
            Counter(
                p + "cached_tokens_reported_total",
                "Cached tokens reported by upstreams, in routing tokens.",
                ("worker",),
            )
        )
        self.m_prompt_tokens = reg.add(
            Counter(
                p + "prompt_tokens_total",
                "Routing tokens of prompts whose upstream reported cached tokens.",
                ("worker",),
            )
        )
        self.m_errors = reg.add(
            Counter(p + "upstream_errors_total", "Upstream failures.", ("worker", "kind"))
        )
        self.m_retries = reg.add(Counter(p + "retries_total", "Upstream attempts after the first."))
        reg.add(
            Gauge(
                p + "in_flight",
                "Upstream requests begun and not finished.",
                ("worker",),
                lambda: (((w,), n) for w, n in self.in_flight.items()),
            )
        )
        reg.add(
            Gauge(
                p + "worker_healthy",
                "1 when the router may choose the worker.",
                ("worker",),
                lambda: (((w,), 0 if w in self.ejected else 1) for w in self.workers),
            )
        )

    def _done(self, route: str, model: str, status: int, started: float) -> None:
        self.m_requests.inc(route, model, str(status))
        self.m_latency.observe(time.perf_counter() - started, route)

    # ---- simple routes ---------------------------------------------------------------------

    async def _metrics(self, request: Request) -> Response:
        return Response(self.registry.render(), media_type=self.registry.content_type)

    async def _health(self, request: Request) -> Response:
        workers = {w: w not in self.ejected for w in self.workers}
        ok = any(workers.values())
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "workers": workers},
            status_code=200 if ok else 503,
        )

    async def _models(self, request: Request) -> Response:
        key = self._bearer(request)
        data = [
            {"id": t.name, "object": "model", "created": 0, "owned_by": "kvroute"}
            for t in self.targets.values()
            if not t.key_digests or (key is not None and self._key_matches(key, t))
        ]
        return JSONResponse({"object": "list", "data": data})

    # ---- auth ------------------------------------------------------------------------------

    @staticmethod
    def _bearer(request: Request) -> str | None:
        auth = request.headers.get("authorization")
        if not auth:
            return None
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        return token if scheme.lower() == "bearer" and token else None

    @staticmethod
    def _key_matches(key: str, target: Target) -> bool:
        digest = key_digest(key)
        ok = False
        for expected in target.key_digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(digest, expected)
        return ok

    def _authorize(self, request: Request, target: Target) -> None:
        if not target.key_digests:
            return
        key = self._bearer(request)
        if key is None:
            raise HTTPError(
                401,
                "missing API key (Authorization: Bearer ...)",
                "invalid_request_error",
                "missing_api_key",
            )
        if not self._key_matches(key, target):
            raise HTTPError(
                403,
                f"the API key is not valid for model {target.name!r}",
                "invalid_request_error",
                "invalid_api_key",
            )

    # ---- request handling ------------------------------------------------------------------

    async def _chat(self, request: Request) -> Response:
        return await self._handle(request, CHAT)

    async def _completions(self, request: Request) -> Response:
        return await self._handle(request, COMPLETIONS)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.server.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPError(
                413,
                f"request body of {declared} bytes exceeds {limit}",
                "invalid_request_error",
                "request_too_large",
            )
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(
                    413,
                    f"request body exceeds {limit} bytes",
                    "invalid_request_error",
                    "request_too_large",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def _routing_tokens(self, route: str, payload: dict[str, Any]) -> np.ndarray:
        if route == CHAT:
            text: str | np.ndarray = render_chat(payload.get("messages"), payload.get("tools"))
        else:
            text = prompt_of(payload.get("prompt"))
        if isinstance(text, np.ndarray):
            return text
        if self.tokenizer.slow and len(text) > OFFLOAD_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        return self.tokenizer.encode(text)

    async def _handle(self, request: Request, route: str) -> Response:
        started = time.perf_counter()
        given = request.headers.get("x-request-id")
        rid = given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        model = "-"
        try:
            body = await self._read_body(request)
            try:
                payload = json.loads(body)
            except ValueError as e:
                raise HTTPError(
                    400, f"request body is not valid JSON: {e}", "invalid_request_error"
                ) from None
            if not isinstance(payload, dict):
                raise HTTPError(400, "request body must be a JSON object", "invalid_request_error")
            name = payload.get("model")
            target = self.targets.get(name) if isinstance(name, str) else None
            if target is None:
                raise HTTPError(
                    404,
                    f"the model {name!r} does not exist",
                    "invalid_request_error",
                    "model_not_found",
                )
            model = target.name
            self._authorize(request, target)
            try:
                tokens = await self._routing_tokens(route, payload)
            except RequestError as e:
                raise HTTPError(400, str(e), "invalid_request_error") from None
        except HTTPError as e:
            self._done(route, model, e.status, started)
            return e.response({"x-request-id": rid})

        forward = asyncio.ensure_future(self._forward(route, target, payload, tokens, rid, started))
        watch = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait((forward, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not forward.done():  # the client went away, or this handler is cancelled
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward  # its cleanup: the upstream closed, the flight finished
        if forward.cancelled():
            self._done(route, model, 499, started)
            return Response(status_code=499)
        return forward.result()

    def _upstream_body(
        self,
        target: Target,
        payload: dict[str, Any],
        stream: bool,
    ) -> tuple[bytes, bytes, bool]:
        """(body for salting workers, body for others, whether the usage chunk is ours)."""
        body = dict(payload)
        body["model"] = target.upstream_model
        body.pop("cache_salt", None)
        strip_usage = False
        if stream:
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage")):
                body["stream_options"] = {
                    **(options if isinstance(options, dict) else {}),
                    "include_usage": True,
                }
                strip_usage = True
        plain = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        salt = self.salts.get(target.endpoint) if target.salted and target.endpoint else None
        if salt is None:
            return plain, plain, strip_usage
        body["cache_salt"] = salt
        salted = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        return salted, plain, strip_usage

    async def _forward(
        self,
        route: str,
        target: Target,
        payload: dict[str, Any],
        tokens: np.ndarray,
        rid: str,
        started: float,
    ) -> Response:
        stream = payload.get("stream") is True
        salted_body, plain_body, strip_usage = self._upstream_body(target, payload, stream)
        failure: HTTPError | None = None
        failed_response: tuple[int, bytes, str] | None = None
        tried: list[str] = []
        for attempt in range(1, self.server.max_attempts + 1):
            d = self._route(tokens, target.endpoint, tried)
            if d is None:
                if failure is None and failed_response is None:
                    failure = HTTPError(
                        503, "no upstream worker available", "service_unavailable", "no_worker"
                    )
                break
            if attempt > 1:
                self.m_retries.inc()
            worker = d.worker
            self.m_decisions.inc(d.policy, d.reason, worker)
            wcfg = self.workers[worker]
            headers = [("content-type", "application/json"), ("x-request-id", rid)]
            if self.server.routing_headers:
                reply_headers = {
                    "x-request-id": rid,
                    "x-kvroute-worker": worker,
                    "x-kvroute-cached-tokens": str(d.cached_tokens),
                    "x-kvroute-attempts": str(attempt),
                }
            else:
                reply_headers = {"x-request-id": rid}
            flight = Flight(self, d, len(tokens))
            req = flight.connections.request(
                "POST", route, headers, salted_body if wcfg.sends_cache_salt else plain_body
            )
            try:
                resp = await flight.send(req)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                flight.close()
                tried.append(worker)
                self._upstream_failed(worker, "connect", e, down=True)
                failure = HTTPError(
                    502, f"upstream {worker} unreachable", "upstream_error", "upstream_unreachable"
                )
                continue
            except httpx.PoolTimeout:  # every connection to it stayed busy: try another worker
                flight.close()
                tried.append(worker)
                self.m_errors.inc(worker, "pool_timeout")
                failure = HTTPError(
                    503, f"upstream {worker} has no free connection", "upstream_error", "busy"
                )
                continue
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                flight.close()
                tried.append(worker)
                self._upstream_failed(worker, "reset", e)
                failure = HTTPError(
                    502,
                    f"upstream {worker} closed the connection",
                    "upstream_error",
                    "upstream_reset",
                )
                continue
            except httpx.TimeoutException as e:
                flight.close()
                self.m_errors.inc(worker, "timeout")
                log.warning("upstream %s timed out: %r", worker, e)
                failure = HTTPError(
                    504, f"upstream {worker} timed out", "upstream_error", "upstream_timeout"
                )
                break
            except BaseException:
                flight.close()
                raise
            if resp.status_code >= 500:
                try:
                    data = await resp.aread()
                except httpx.HTTPError:
                    data = b""
                finally:
                    await _release(resp, flight)
                tried.append(worker)
                self._upstream_failed(worker, "status_5xx", None)
                failed_response = (
                    resp.status_code,
                    data,
                    resp.headers.get("content-type", "application/json"),
                )
                failure = None
                continue
            self.failures.pop(worker, None)
            for name in _FORWARDED_RESPONSE_HEADERS:
                value = resp.headers.get(name)
                if value is not None:
                    reply_headers[name] = value
            if stream and resp.status_code == 200:
                return ProxyStream(
                    self, route, target.name, resp, flight, strip_usage, reply_headers, started
                )
            return await self._whole(route, target.name, resp, flight, reply_headers, started)

        if failed_response is not None and failure is None:
            status, data, ctype = failed_response
            self._done(route, target.name, status, started)
            return Response(
                data, status_code=status, media_type=ctype, headers={"x-request-id": rid}
            )
        assert failure is not None
        self._done(route, target.name, failure.status, started)
        return failure.response({"x-request-id": rid})

    async def _whole(
        self,
        route: str,
        model: str,
        resp: httpx.Response,
        flight: Flight,
        headers: dict[str, str],
        started: float,
    ) -> Response:
        """A non-streamed (or failed) upstream response, read whole and passed on."""
        usage = None
        try:
            data = await resp.aread()
            if resp.status_code == 200:
                with contextlib.suppress(ValueError):
                    parsed = json.loads(data)
                    usage = parsed.get("usage") if isinstance(parsed, dict) else None
        except httpx.TimeoutException:
            self.m_errors.inc(flight.worker, "timeout")
            err = HTTPError(
                504, f"upstream {flight.worker} timed out", "upstream_error", "upstream_timeout"
            )
            self._done(route, model, 504, started)
            return err.response(headers)
        except httpx.HTTPError as e:
            self.m_errors.inc(flight.worker, "protocol")
            log.warning("upstream %s failed mid-response: %r", flight.worker, e)
            err = HTTPError(
                502,
                f"upstream {flight.worker} failed mid-response",
                "upstream_error",
                "upstream_broken",
            )
            self._done(route, model, 502, started)
            return err.response(headers)
        finally:
            await _release(resp, flight, usage)
        self.m_first_byte.observe(time.perf_counter() - started, route)
        self._done(route, model, resp.status_code, started)
        return Response(data, status_code=resp.status_code, headers=headers)

    # ---- health ----------------------------------------------------------------------------

    def _route(self, tokens: np.ndarray, endpoint: str | None, tried: list[str]) -> Any:
        """The router's choice among the workers not yet tried for this request, or None.

        When an endpoint's pool has no untried member left, the members that failed this request
        are ejected, so the pool's next workers in rendezvous order step in (the pool returns to
        its members when they are readmitted).
        """
        try:
            return self.router.route(tokens=tokens, endpoint=endpoint, exclude=tried or None)
        except NoWorker:
            fresh = [w for w in dict.fromkeys(tried) if w not in self.ejected]
            if endpoint is None or not fresh:
                return None
        for worker in fresh:
            self._eject(worker)
        try:
            return self.router.route(tokens=tokens, endpoint=endpoint, exclude=tried)
        except NoWorker:
            return None

    def _upstream_failed(
        self, worker: str, kind: str, error: BaseException | None, *, down: bool = False
    ) -> None:
        """Counts a failure; ejects the worker when it is down (cannot be reached) or has failed
        ``eject_after`` requests in a row."""
        self.m_errors.inc(worker, kind)
        count = self.failures[worker] = self.failures.get(worker, 0) + 1
        log.warning("upstream %s failed (%s, %d in a row): %r", worker, kind, count, error)
        if down or count >= self.server.eject_after:
            self._eject(worker)

    def _eject(self, worker: str) -> None:
        if worker not in self.ejected:
            log.warning("ejecting upstream %s", worker)
            self.ejected[worker] = time.monotonic()
            self.router.set_healthy(worker, False)

    async def _health_loop(self) -> None:
        s = self.server
        while True:
            await asyncio.sleep(s.health_interval)
            now = time.monotonic()
            due = [w for w, t in self.ejected.items() if now - t >= s.eject_seconds]
            if due:
                results = await asyncio.gather(*(self._probe(w) for w in due))
                for worker, ok in zip(due, results):
                    if ok and worker in self.ejected:
                        del self.ejected[worker]
                        self.failures.pop(worker, None)
                        self.router.set_healthy(worker, True)
                        log.info("upstream %s is healthy again", worker)

    async def _probe(self, worker: str) -> bool:
        connections = self.connections.get(worker)
        if connections is None:
            return False
        try:
            resp = await connections.get(self.server.health_path, self.server.connect_timeout)
            return resp.status_code == 200
        except httpx.HTTPError:
            return False


class ProxyStream(Response):
    """An upstream SSE stream passed through event by event; ends the flight exactly once."""

    def __init__(
        self,
        gateway: Gateway,
        route: str,
        model: str,
        upstream: httpx.Response,
        flight: Flight,
        strip_usage: bool,
        headers: dict[str, str],
        started: float,
    ) -> None:
        # No body and no Content-Length: the stream is sent chunked as it arrives.
        self.status_code = upstream.status_code
        self.background = None
        self.init_headers(headers)
        self.gateway = gateway
        self.route = route
        self.model = model
        self.upstream = upstream
        self.flight = flight
        self.strip_usage = strip_usage
        self.started = started
        self.usage: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        g = self.gateway
        status = self.status_code
        pump = watch = None
        try:
            await send(
                {"type": "http.response.start", "status": status, "headers": self.raw_headers}
            )
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(_wait_disconnect(receive))
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                broken = pump.result()
                if broken is not None:
                    g.m_errors.inc(self.flight.worker, "broken_stream")
                    log.warning("stream from %s broke: %r", self.flight.worker, broken)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                status = 499
        except OSError:  # the client's socket is gone
            status = 499
        finally:
            for task in (pump, watch):
                if task is not None:
                    task.cancel()
            if pump is not None:
                with contextlib.suppress(BaseException):
                    await pump
            try:
                await _release(self.upstream, self.flight, self.usage)
            finally:
                g._done(self.route, self.model, status, self.started)

    async def _pump(self, send: Send) -> BaseException | None:
        """Forwards complete SSE events; returns the error that broke the stream, if any."""
        buf = b""
        first = True
        try:
            async for chunk in self.upstream.aiter_raw():
                if first:
                    self.flight.prefilled()
                buf += chunk
                out = []
                start = 0
                while True:
                    m = _EVENT_END.search(buf, start)
                    if m is None:
                        break
                    event = buf[start : m.end()]
                    start = m.end()
                    if b'"prompt_tokens"' in event and self._is_usage(event):
                        continue
                    out.append(event)
                buf = buf[start:]
                if out:
                    if first:
                        first = False
                        self.gateway.m_first_byte.observe(
                            time.perf_counter() - self.started, self.route
                        )
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
        except httpx.HTTPError as e:
            return e
        if buf:
            await send({"type": "http.response.body", "body": buf, "more_body": True})
        return None

    def _is_usage(self, event: bytes) -> bool:
        """Records a usage chunk; True when it is to be dropped (the gateway asked for it)."""
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                chunk = json.loads(line[5:])
            except ValueError:
                return False
            if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
                self.usage = chunk["usage"]
                return self.strip_usage and not chunk.get("choices")
        return False
