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

Failover: each upstream failure is looked up in one table (``kvroute.gateway.errors``), which
says how it is answered, whether the request moves on to the router's next choice among the
workers not yet tried for it (``route(..., exclude=tried)``, up to ``max_attempts`` attempts) and
what the health model (``kvroute.server.health``) is told: a worker that cannot be reached is
ejected at once, one that fails ``eject_after`` requests in a row is ejected, and an ejected worker
is readmitted when its ``health_path`` answers 200 again. 4xx answers pass through untouched.
After the first response byte nothing is retried: a stream that breaks is ended.

Streams are passed through as the upstream's SSE events arrive (each complete event is forwarded
at once; only the usage chunk the gateway itself asked for is removed). A client that disconnects
cancels the upstream request (its connection is closed) whether or not the response had started.

Replies carry ``x-request-id`` (the caller's, or a new one; also sent upstream) and, with
``routing_headers``, ``x-kvroute-worker``, ``x-kvroute-cached-tokens`` (predicted, routing
tokens) and ``x-kvroute-attempts``.

Modules: ``auth`` (targets and keys), ``upstream`` (connection pools, in-flight accounting),
``stream`` (the SSE pass-through), ``errors`` (the failure table), ``metrics`` (the series),
``prompt`` (routing tokens); ``kvroute.server`` holds what every kvroute server shares.

The app keeps all mutable state on its event loop (one uvicorn worker process); the Router is
thread-safe and the KV-event subscriber feeds it from its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvroute import Decision, Router
from kvroute.server.health import Health
from kvroute.server.routing import NoWorkerError, build_router

from .auth import Auth, Target, bearer
from .config import GatewayConfig, WorkerConfig
from .errors import BODY_FAILURES, SEND_FAILURES, STATUS_5XX, HTTPError, UpstreamFailure, classify
from .metrics import GatewayMetrics
from .prompt import (
    OFFLOAD_CHARS,
    RequestError,
    Tokenizer,
    load_tokenizer,
)
from .stream import ProxyStream, wait_disconnect
from .upstream import Flight, Upstreams, release

__all__ = ["Gateway"]

log = logging.getLogger("kvroute.gateway")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_FORWARDED_RESPONSE_HEADERS = ("content-type", "cache-control")


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
        if router is None:
            router = build_router(config.workers, config.router, config.events)
            for ep in config.endpoints:
                router.add_endpoint(
                    ep.id, pool_size=ep.pool_size, reserved_blocks=ep.reserved_blocks, salt=ep.salt
                )
        self.router = router
        self.tokenizer = tokenizer or load_tokenizer(
            config.tokenizer.path, config.tokenizer.bytes_per_token, config.tokenizer.model_dir
        )
        self.workers: dict[str, WorkerConfig] = {w.name: w for w in config.workers}
        self.auth = Auth(config)
        self.salts = {
            ep.id: self.router.endpoint_salt(ep.id) for ep in config.endpoints if ep.cache_salt
        }
        self.health = Health(
            self.workers,
            config.health,
            set_healthy=self.router.set_healthy,
            probe=lambda w: self.upstreams.probe(w, config.health.path),
        )
        self.metrics = GatewayMetrics(
            lambda: self.upstreams.in_flight,
            self.health.status,
            (self.tokenizer.name, self.tokenizer.exact),
        )
        self.upstreams = Upstreams(config.workers, config.server, self.router, self.metrics)
        self.subscriber: Any = None
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
        self.upstreams.start()
        self.health.start()
        if self.config.router.index == "events":
            from kvroute.events import KvEventSubscriber

            endpoints = {w.name: w.kv_events for w in self.config.workers if w.kv_events}
            replay = {w.name: w.kv_replay for w in self.config.workers if w.kv_replay}
            bind = {w.name: w.kv_events_bind for w in self.config.workers if w.kv_events}
            self.subscriber = KvEventSubscriber(
                self.router,
                endpoints,
                replay=replay,
                bind=bind,
                topic=self.config.events.topic,
                mode=self.config.events.mode,
            )
            await self.subscriber.__aenter__()

    async def stop(self) -> None:
        await self.health.stop()
        if self.subscriber is not None:
            await self.subscriber.__aexit__(None, None, None)
            self.subscriber = None
        await self.upstreams.stop()

    # ---- simple routes ---------------------------------------------------------------------

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    def _events_health(self) -> dict[str, Any]:
        """Per worker, the KV-event stream's state (events mode only)."""
        sub = self.subscriber
        if sub is None:
            return {}
        keys = ("last_seq", "stale", "gaps", "restarts", "disconnects", "resets", "blocks_stored")
        index = self.router.index
        out = {}
        for w, row in sub.stats().items():
            out[w] = {k: row.get(k) for k in keys}
            out[w]["blocks"] = index.num_blocks(w) if w in index.workers else 0
        return {"events": out}

    async def _health(self, request: Request) -> Response:
        workers = self.health.status()
        ok = any(workers.values())
        return JSONResponse(
            {
                "status": "ok" if ok else "unavailable",
                "workers": workers,
                "tokenizer": self.tokenizer.describe(),
                **self._events_health(),
            },
            status_code=200 if ok else 503,
        )

    async def _models(self, request: Request) -> Response:
        key = bearer(request.headers.get("authorization"))
        data = [
            {"id": t.name, "object": "model", "created": 0, "owned_by": "kvroute"}
            for t in self.auth.visible(key)
        ]
        return JSONResponse({"object": "list", "data": data})

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

    async def _routing_tokens(self, route: str, payload: dict[str, Any], size: int) -> np.ndarray:
        """The request's routing tokens; a large body (``size`` bytes) is tokenized off the
        event loop by a slow tokenizer."""
        tok = self.tokenizer
        encode = tok.chat_tokens if route == CHAT else tok.completion_tokens
        if tok.slow and size > OFFLOAD_CHARS:
            return await asyncio.to_thread(encode, payload)
        return encode(payload)

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
            target = self.auth.target(payload.get("model"))
            model = target.name
            self.auth.authorize(bearer(request.headers.get("authorization")), target)
            try:
                tokens = await self._routing_tokens(route, payload, len(body))
            except RequestError as e:
                raise HTTPError(400, str(e), "invalid_request_error") from None
        except HTTPError as e:
            self.metrics.done(route, model, e.status, started)
            return e.response({"x-request-id": rid})

        forward = asyncio.ensure_future(self._forward(route, target, payload, tokens, rid, started))
        watch = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait((forward, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not forward.done():  # the client went away, or this handler is cancelled
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward  # its cleanup: the upstream closed, the flight finished
        if forward.cancelled():
            self.metrics.done(route, model, 499, started)
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

    def _failed(self, failure: UpstreamFailure, worker: str, error: BaseException | None) -> None:
        """Counts an upstream failure and tells the health model what the table says."""
        self.metrics.errors.inc(worker, failure.kind)
        if failure.health == "down":
            self.health.down(worker, f"{failure.kind}: {error!r}")
        elif failure.health == "count":
            self.health.failed(worker, f"{failure.kind}: {error!r}")
        else:
            log.warning("upstream %s: %s: %r", worker, failure.kind, error)

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
                self.metrics.retries.inc()
            worker = d.worker
            self.metrics.decisions.inc(d.policy, d.reason, worker)
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
            flight = self.upstreams.begin(d, len(tokens))
            req = flight.connections.request(
                "POST", route, headers, salted_body if wcfg.sends_cache_salt else plain_body
            )
            try:
                resp = await flight.send(req)
            except httpx.HTTPError as e:
                flight.close()
                kind = classify(e, SEND_FAILURES)
                if kind is None:
                    raise
                self._failed(kind, worker, e)
                failure = kind.error(worker)
                if not kind.retry:
                    break
                tried.append(worker)
                continue
            except BaseException:
                flight.close()
                raise
            if resp.status_code >= 500:
                try:
                    data = await resp.aread()
                except httpx.HTTPError:
                    data = b""
                finally:
                    await release(resp, flight)
                tried.append(worker)
                self._failed(STATUS_5XX, worker, None)
                failed_response = (
                    resp.status_code,
                    data,
                    resp.headers.get("content-type", "application/json"),
                )
                failure = None
                continue
            self.health.succeeded(worker)
            for name in _FORWARDED_RESPONSE_HEADERS:
                value = resp.headers.get(name)
                if value is not None:
                    reply_headers[name] = value
            if stream and resp.status_code == 200:
                return ProxyStream(
                    self.metrics,
                    route,
                    target.name,
                    resp,
                    flight,
                    strip_usage,
                    reply_headers,
                    started,
                )
            return await self._whole(route, target.name, resp, flight, reply_headers, started)

        if failed_response is not None and failure is None:
            status, data, ctype = failed_response
            self.metrics.done(route, target.name, status, started)
            return Response(
                data, status_code=status, media_type=ctype, headers={"x-request-id": rid}
            )
        assert failure is not None
        self.metrics.done(route, target.name, failure.status, started)
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
        except httpx.HTTPError as e:
            kind = classify(e, BODY_FAILURES)
            if kind is None:
                raise
            self._failed(kind, flight.worker, e)
            self.metrics.done(route, model, kind.status, started)
            return kind.error(flight.worker).response(headers)
        finally:
            await release(resp, flight, usage)
        self.metrics.first_byte.observe(time.perf_counter() - started, route)
        self.metrics.done(route, model, resp.status_code, started)
        return Response(data, status_code=resp.status_code, headers=headers)

    # ---- routing -----------------------------------------------------------------------------

    def _route(self, tokens: np.ndarray, endpoint: str | None, tried: list[str]) -> Decision | None:
        """The router's choice among the workers not yet tried for this request, or None.

        When an endpoint's pool has no untried member left, the members that failed this request
        are ejected, so the pool's next workers in rendezvous order step in (the pool returns to
        its members when they are readmitted).
        """
        try:
            return self.router.route(tokens=tokens, endpoint=endpoint, exclude=tried or None)
        except NoWorkerError:
            fresh = [w for w in dict.fromkeys(tried) if self.health.is_in(w)]
            if endpoint is None or not fresh:
                return None
        for worker in fresh:
            self.health.eject(worker, "its endpoint's pool has no untried member left")
        try:
            return self.router.route(tokens=tokens, endpoint=endpoint, exclude=tried)
        except NoWorkerError:
            return None
