"""The gateway: an ASGI app that routes OpenAI-style requests with ``kvroute.Router``.

Request path (``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
— the Responses API's routing tokens, follow-ups and streams: ``kvroute.gateway.responses``):

1. The caller's bearer key is checked from the headers (``kvroute.gateway.auth``): a caller that
   can open no target is answered 401 before its body is read.
2. The body is read within ``body_timeout`` (408 past it) and up to ``max_body_bytes`` (413 past
   it, before reading when ``Content-Length`` says so), and parsed as a JSON object (400
   otherwise: invalid JSON, nesting too deep for the parser, lone UTF-16 surrogates, a
   ``stream`` that is not a boolean). A client that goes away meanwhile is counted as 499.
3. ``model`` names a target the caller may use; anything else is answered alike (404 for a
   caller with a valid key, 401 without one), whether the model exists or not.
4. The prompt is rendered and tokenized for routing (``kvroute.gateway.prompt``).
5. Limits and admission (``kvroute.gateway.limits``, ``kvroute.gateway.admission``): the key's
   and endpoint's token buckets, the fleet's bound with weighted fair share, the per-worker
   bounds, the request's ``x-slo-ttft-ms`` — 429 with ``Retry-After`` when any refuses.
6. ``router.route(tokens=..., endpoint=..., exclude=...)`` picks the worker (with ``[pd]``:
   ``route_pd`` picks a prefill/decode pair, served by ``kvroute.gateway.pd``), and the body goes
   upstream with ``model`` replaced by the real model name. For an endpoint with ``cache_salt =
   true`` and a ``vllm``/``sglang`` worker, ``cache_salt`` is set to the router's salt of that
   endpoint (``Router.endpoint_salt``), so the engine's prefix cache is partitioned per endpoint
   exactly as the router's block hashes are. A ``cache_salt`` or SGLang ``extra_key`` sent by
   the caller is never forwarded (SGLang partitions its cache by the two joined): either would
   let one tenant name another's cache partition and read its hits (``cached_tokens``, timing).
   An endpoint's ``priority`` (``Router.add_endpoint(..., priority=)``) goes to ``vllm`` /
   ``sglang`` workers in each engine's own direction (``kvroute.server.config.engine_fields``);
   a caller's ``priority`` is never forwarded either: it would let anyone jump the queues.
   The upstream's ``x-request-id`` is the caller's prefixed by 16 random hex digits (engines use
   it as their request id: two tenants choosing the same id must not collide); the reply carries
   the caller's own. The KV hand-over fields of prefill/decode engines (``kv_transfer_params``,
   ``bootstrap_host`` / ``_port`` / ``_room``) are never forwarded from a caller.
7. Load accounting (``kvroute.gateway.upstream``): ``router.begin`` when the upstream request
   starts, ``router.prefilled`` at its first output (a response not streamed: when the
   admission model predicts its prefill done, else at its end), ``router.observe`` with the
   reported cached tokens and ``router.finish`` exactly once when it ended, failed, or the client
   went away.

Failover: each upstream failure is looked up in one table (``kvroute.gateway.errors``), which
says how it is answered, whether the request moves on to the router's next choice among the
workers not yet tried for it (up to ``max_attempts``; past an endpoint's pool when none of its
members is left untried) and what the health model
(``kvroute.server.health``) is told. A worker that cannot be reached is ejected at once. Other
failures are attributed when the request is over: to the failing workers when another worker then
served the request, to the request itself when it failed on two or more workers (its content made
them fail, most likely: no worker is charged, so one tenant's poison request cannot eject the
fleet, but each is health-probed at once and ejected if the probe fails), and to the one worker
when only one was tried. ``eject_after`` charged failures in a row eject a worker.
Nothing reaches the caller before the upstream's answer is known: a non-streamed reply is read
whole (up to ``max_response_bytes``), a stream's first event is awaited (the engine's error
event is a failure): such failures are retried, never a 200 without output. 4xx answers pass.

Replies carry ``x-request-id`` and, with ``routing_headers``, ``x-kvroute-worker``,
``x-kvroute-cached-tokens`` (predicted, routing tokens) and ``x-kvroute-attempts``. ``/metrics``
and ``/health`` with worker names are served on the admin listener (``admin_port``) or to callers
with an admin key; the public ``/health`` says only whether any worker is up.

Modules: ``request`` (the body read within its limits, the JSON object parsed), ``auth``
(targets and keys), ``upstream`` (connection pools, in-flight accounting,
the body sent upstream), ``stream`` (the SSE pass-through and the whole reply's response),
``errors`` (the failure table), ``limits`` and ``admission``,
``usage`` (cache fields), ``listener`` (HTTP/1.1 under connection deadlines and a cap; its
``kvroute`` ASGI extension sends whole responses and reports disconnections without a task per
request), ``rawjson`` (the upstream body keeps the client's JSON text for the fields the gateway
leaves alone), ``metrics`` (the series), ``prompt`` (routing tokens), ``admin`` (``/health``,
``/metrics``, ``/v1/models``), ``responses`` and ``responses_api`` (the Responses API);
``kvroute.server`` holds
what every kvroute server shares. The app keeps all mutable state on its event loop (one uvicorn
process); the Router is thread-safe and the KV-event subscriber feeds it from its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import numpy as np
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvroute import Decision, Router
from kvroute.server.events import event_subscriber
from kvroute.server.health import Health
from kvroute.server.routing import NoWorkerError, build_router

from .admin import AdminRoutes, not_found
from .admission import Admission, Shed
from .auth import Access, Auth, Target
from .client import BodyTooLarge, UpstreamError
from .config import GatewayConfig, WorkerConfig
from .engine_sizes import EngineBlockSizes
from .errors import (
    BAD_STATUS,
    CONNECT,
    POOL_TIMEOUT,
    STATUS_5XX,
    TOO_LARGE,
    HTTPError,
    Outcome,
    UpstreamFailure,
    body_failed,
)
from .limits import RateLimits
from .listener import ConnectionGuard
from .metrics import GatewayMetrics
from .pd import HANDOVER_FIELDS, PdForwarder
from .prompt import OFFLOAD_CHARS, RequestError, Tokenizer, load_tokenizer
from .rawjson import RawObject, dumps
from .request import REQUEST_ID, ClientGone, Incoming, parse_payload, read_body, uncancel
from .responses import RESPONSES, chat_usage
from .responses_api import BY_ID, ResponsesApi
from .stream import (
    EventTooLarge,
    ProxyStream,
    SseScanner,
    WholeResponse,
    failed_answer,
    first_events,
    first_failure,
    first_output,
    forwarded_headers,
    responses_failure,
    wait_disconnect,
)
from .upstream import (
    CACHE_KEY_FIELDS,
    Flight,
    UpstreamBody,
    Upstreams,
    release_now,
    request_head,
)
from .usage import with_cache_fields_body
from .warm import Warmer

__all__ = ["Gateway"]

log = logging.getLogger("kvroute.gateway")

#: Failures of an attempt that never reached its worker (no connection made).
UNSENT = (CONNECT, POOL_TIMEOUT)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

Handler = Callable[["Incoming"], Awaitable[Response]]


#: Responses whose whole body is known: sent by the listener in one call when it can.
_WHOLE = (Response, JSONResponse, WholeResponse)


class Call:
    """One completion request on its way: who, what, and what it has used."""

    __slots__ = (
        "digest",
        "flight",
        "history",
        "paired",
        "pinned",
        "rid",
        "route",
        "slo",
        "started",
        "target",
        "tenant",
        "upstream_headers",
    )

    def __init__(self, route: str, rid: str, upstream_rid: str, started: float) -> None:
        self.route = route
        self.rid = rid
        # The request head every upstream attempt sends (both halves of a pair alike).
        self.upstream_headers = request_head(upstream_rid)
        self.started = started
        self.target: Target | None = None
        self.digest: bytes | None = None
        self.tenant = "-"
        self.slo: float | None = None
        self.flight: Flight | None = None  # the attempt that answered
        self.paired = False  # counted in pd_pairs_total (once, by its first pair's reason)
        # (previous response id, its worker): a Responses follow-up only that worker can serve.
        self.pinned: tuple[str, str] | None = None
        # A Responses follow-up: the engine's prompt starts with a history the tokens do not.
        self.history = False


class Gateway:
    """An OpenAI-compatible gateway over a fleet, routing with ``kvroute.Router``.

    ``Gateway(config).app`` is the ASGI app and ``admin_app`` the admin listener's (serve them
    with ``kvroute.gateway.serve``: ``kvroute serve``). ``router`` and ``tokenizer`` may be given to
    share or replace the ones built from the config.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        router: Router | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        s = self.server = config.server
        if router is None:
            router = build_router(
                config.workers,
                config.router,
                config.events,
                config.pd,
                updates=config.cluster is not None,
            )
            for ep in config.endpoints:
                router.add_endpoint(
                    ep.id,
                    pool_size=ep.pool_size,
                    reserved_blocks=ep.reserved_blocks,
                    salt=ep.salt,
                    priority=ep.priority,
                )
        self.router = router
        self.tokenizer = tokenizer or load_tokenizer(
            config.tokenizer.path,
            config.tokenizer.bytes_per_token,
            config.tokenizer.model_dir,
            config.tokenizer.exclude_tools_when_tool_choice_none,
        )
        self.workers: dict[str, WorkerConfig] = {w.name: w for w in config.workers}
        self.auth = Auth(config)
        self.salts = {
            ep.id: self.router.endpoint_salt(ep.id) for ep in config.endpoints if ep.cache_salt
        }
        self.priorities = {ep.id: self.router.endpoint_priority(ep.id) for ep in config.endpoints}
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
        self.upstreams = Upstreams(config.workers, s, self.router, self.metrics)
        self.limits = RateLimits(
            ((ep.id, ep.requests_per_minute, ep.tokens_per_minute) for ep in config.endpoints),
            {d for t in self.auth.targets.values() for d in t.key_digests},
            s.key_requests_per_minute,
            s.key_tokens_per_minute,
        )
        self.admission = Admission(
            self.router,
            self.upstreams.bounds,
            s.max_in_flight,
            {ep.id: ep.weight for ep in config.endpoints},
            s.prefill_tokens_per_second,
        )
        if not s.prefill_tokens_per_second:
            self.upstreams.on_prefilled = self.admission.observe_prefill
        self.upstreams.predict_prefill = self.admission.predict_prefill
        self.guard = ConnectionGuard(
            header_timeout=s.header_timeout,
            keep_alive_timeout=s.keep_alive_timeout,
            write_timeout=s.client_write_timeout,
            max_connections=s.max_connections,
        )
        self.subscriber: Any = None
        self.cluster: Any = None
        self.responses = ResponsesApi(self)
        # vLLM's with the load by [cluster]'s scraper when there is one; SGLang's always here.
        self.engine_sizes = EngineBlockSizes(
            self.router,
            {w.name: w.kind for w in config.workers},
            self.upstreams.fetch,
            config.health.interval,
            kinds=("vllm", "sglang") if config.cluster is None else ("sglang",),
        )
        if config.cluster is not None:
            from kvroute.cluster import Cluster

            self.cluster = Cluster(
                self.router,
                config.cluster,
                [(w.name, w.url, w.kind, w.api_key) for w in config.workers],
                registry=self.metrics.registry,
                event_mode=config.events.mode,
                limits=self.limits,
                responses=self.responses.owners,
            )
        self.pd = PdForwarder(self) if config.pd is not None else None
        self.warmer = Warmer.for_endpoints(self, config.endpoints)
        # Who routes and sends each attempt of _forward's loop: single requests or pairs.
        self._via: Gateway | PdForwarder = self if self.pd is None else self.pd
        admin = self.admin = AdminRoutes(self)
        self.routes: dict[str, dict[str, Handler]] = {
            CHAT: {"POST": partial(self._handle, route=CHAT)},
            COMPLETIONS: {"POST": partial(self._handle, route=COMPLETIONS)},
            RESPONSES: {"POST": partial(self._handle, route=RESPONSES)},
            "/v1/models": {"GET": admin.models},
            "/health": {"GET": admin.public_health},
            "/metrics": {"GET": admin.public_metrics},
        }
        self.admin_routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": admin.admin_only(admin.health)},
            "/metrics": {"GET": admin.admin_only(admin.metrics)},
        }

    # ---- ASGI --------------------------------------------------------------------------------

    # Not mutated by tests/mutants: uvicorn probes an app for a factory by calling it with no
    # arguments (a TypeError: not one), and mutmut's trampoline takes (*args, **kwargs), so the
    # probe would get a coroutine and serve it as the app.
    # pragma: no mutate start
    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The public ASGI app (runs the gateway's lifespan)."""
        if scope["type"] == "http":
            await self._dispatch(self.routes, scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def admin_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The admin listener's ASGI app: ``/metrics`` and ``/health`` with worker names."""
        if scope["type"] == "http":
            await self._dispatch(self.admin_routes, scope, receive, send)
        elif scope["type"] == "lifespan":  # the public app's lifespan runs the gateway
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    # pragma: no mutate end
    async def _dispatch(
        self, routes: dict[str, dict[str, Handler]], scope: Scope, receive: Receive, send: Send
    ) -> None:
        req = Incoming(scope, receive)
        methods = routes.get(scope["path"])
        if methods is None and routes is self.routes and scope["path"].startswith(BY_ID):
            methods = {scope["method"]: self.responses.by_id}  # it answers 404 / 405 itself
        handler = methods.get(scope["method"]) if methods is not None else None
        if handler is None:
            if methods is None:
                error = not_found()
            else:
                error = HTTPError(
                    405, f"use {' or '.join(methods)} on {scope['path']}", code="method_not_allowed"
                )
            response: Response = error.response()
        else:
            response = await handler(req)
        try:
            cycle = req.listener
            if cycle is not None and type(response) in _WHOLE and response.background is None:
                cycle.respond(response.status_code, response.raw_headers, response.body)
            else:
                await response(scope, receive, send)
        finally:
            for done in req.after:
                done()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as e:
                    log.exception("the gateway failed to start")
                    await send({"type": "lifespan.startup.failed", "message": repr(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Opens the upstream connection pools, the health prober, the KV-event subscriber and
        (``[cluster]``) the replica sync and engine scraper."""
        self.upstreams.start()
        self.health.start()
        if self.cluster is not None:
            self.cluster.start()
        self.engine_sizes.start()
        if self.warmer is not None:
            self.warmer.start()
        if not self.server.admin_port and not self.auth.admin:
            log.info("/metrics is off: set gateway.admin_port or gateway.admin_api_keys")
        c = self.config
        if self.cluster is None or self.cluster.follower is None:  # else: kvroute relay's stream
            self.subscriber = event_subscriber(self.router, c.workers, c.router, c.events)
        if self.subscriber is not None:
            await self.subscriber.__aenter__()

    async def stop(self) -> None:
        if self.warmer is not None:
            await self.warmer.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        await self.engine_sizes.stop()
        await self.health.stop()
        if self.pd is not None:
            await self.pd.stop()
        if self.subscriber is not None:
            await self.subscriber.__aexit__(None, None, None)
            self.subscriber = None
        await self.upstreams.stop()

    # ---- request handling ------------------------------------------------------------------

    def _slo(self, req: Incoming) -> float | None:
        value = req.headers.get("x-slo-ttft-ms")
        if value is None:
            return None
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not ms > 0 or ms == float("inf"):
            raise HTTPError(
                400, f"x-slo-ttft-ms must be a positive number, got {value!r:.40}", code="bad_slo"
            )
        return ms / 1e3

    def _rejected(self, call: Call, model: str, error: HTTPError) -> Response:
        """A request answered without reaching an upstream: counted, logged in one line."""
        self.metrics.done(call.route, model, error.status, call.started)
        self.metrics.rejected.inc(str(error.code))
        log.info("rejected %s %s: %d %s", call.route, call.rid, error.status, error)
        return error.response({"x-request-id": call.rid})

    async def _handle(self, req: Incoming, route: str) -> Response:
        started = time.perf_counter()
        given = req.headers.get("x-request-id")
        if given and REQUEST_ID.fullmatch(given):
            # os.urandom, as secrets.token_hex draws it, without its two Python layers.
            call = Call(route, given, f"{os.urandom(8).hex()}-{given}", started)
        else:
            rid = os.urandom(16).hex()  # 32 hex digits, like uuid4().hex, without the UUID object
            call = Call(route, rid, rid, started)
        model = "-"
        try:
            access: Access = self.auth.access(req.headers.get("authorization"))
            call.slo = self._slo(req)
            server = self.server
            body = await read_body(req, server.max_body_bytes, server.body_timeout)
            payload, raw = parse_payload(body)
            target = call.target = access.target(payload.get("model"))
            call.digest = access.digest
            model = target.name
            call.tenant = target.endpoint or "-"
            tok = self.tokenizer
            encode = tok.chat_tokens if route == CHAT else tok.completion_tokens
            if route == RESPONSES:
                if self.pd is not None:
                    raise HTTPError(
                        501,
                        "/v1/responses is not served with [pd] (prefill/decode pairs) yet",
                        code="not_supported",
                    )
                encode = self.responses.tokens
                call.pinned = self.responses.pinned(target, payload)
                call.history = payload.get("previous_response_id") is not None
            try:
                if tok.slow and len(body) > OFFLOAD_CHARS:  # a large body: off the event loop
                    tokens = await asyncio.to_thread(encode, payload)
                else:
                    tokens = encode(payload)
            except RequestError as e:
                raise HTTPError(400, str(e), code="invalid_prompt") from None
            upstream = self._upstream_body(target, payload, raw, route)
            shed = self.admission.admit(call.tenant)
            if shed is not None:
                raise self._shed(shed)
            limited = self.limits.admit(target.endpoint, access.digest, len(tokens))
            if limited is not None:
                self.admission.release(call.tenant)
                self.metrics.rate_limited.inc(limited.scope, limited.limit)
                raise HTTPError(
                    429,
                    f"rate limit of the {limited.scope} reached ({limited.limit} per minute); "
                    f"retry after {limited.retry_after_header} s",
                    "rate_limit_error",
                    "rate_limited",
                    {"retry-after": limited.retry_after_header},
                )
            if self.warmer is not None:
                self.warmer.learn(target.endpoint, tokens)
        except ClientGone:
            self.metrics.done(route, model, 499, started)
            self.metrics.rejected.inc("client_gone")
            log.info("rejected %s %s: the client went away while sending its body", route, call.rid)
            return Response(status_code=499)
        except HTTPError as e:
            return self._rejected(call, model, e)
        except (UnicodeError, RecursionError) as e:
            # A lone surrogate ("\ud800") cannot be encoded as UTF-8 by the tokenizer or for the
            # upstream; a structure nested this deep cannot be rendered.
            what = (
                "contains a lone UTF-16 surrogate (not valid Unicode)"
                if isinstance(e, UnicodeError)
                else "is nested too deeply"
            )
            return self._rejected(
                call, model, HTTPError(400, f"the request {what}", code="invalid_text")
            )
        req.after.append(lambda: self._ended(call))
        # Forwarded in this coroutine (one layer fewer); the client going away cancels it (499).
        cycle = req.listener
        task = (cycle.task if cycle is not None else None) or asyncio.current_task()
        active, gone = True, False

        def disconnected() -> None:
            nonlocal gone
            if active and task is not None:
                gone = True
                task.cancel()

        watch: asyncio.Future[None] | None = None
        if cycle is not None:  # the listener says so: no task per request to find out
            cycle.watch(disconnected)
        else:
            watch = asyncio.ensure_future(wait_disconnect(req.receive))
            watch.add_done_callback(lambda w: None if w.cancelled() else disconnected())
        try:
            return await self._forward(call, payload, tokens, upstream)
        except asyncio.CancelledError:
            if not gone:
                raise  # this handler itself is being cancelled
            if task is not None:
                uncancel(task)
            self.metrics.done(call.route, target.name, 499, call.started)
            return Response(status_code=499)
        finally:
            active = False
            if cycle is not None:
                cycle.watch(None)
            if watch is not None:
                watch.cancel()

    def _ended(self, call: Call) -> None:
        """The response was sent (or the client went away): the fleet slot is free again and the
        completion's tokens are taken from the token buckets."""
        self.admission.release(call.tenant)
        usage = call.flight.usage if call.flight is not None else None
        completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(completion, int) and call.target is not None:
            self.limits.charge(call.target.endpoint, call.digest, completion)

    def _shed(self, shed: Shed) -> HTTPError:
        self.metrics.shed.inc(shed.reason)
        return HTTPError(429, shed.message, "rate_limit_error", shed.reason, {"retry-after": "1"})

    def _upstream_body(
        self,
        target: Target,
        payload: dict[str, Any],
        raw: RawObject | None = None,
        route: str = CHAT,
    ) -> UpstreamBody:
        body = dict(payload)
        body["model"] = target.upstream_model
        for name in CACHE_KEY_FIELDS:  # a caller never names an engine's cache partition
            body.pop(name, None)
        body.pop("priority", None)
        for name in HANDOVER_FIELDS:  # only the gateway may point an engine at another's KV
            body.pop(name, None)
        if route == RESPONSES:  # the engine names the response by it: never the caller
            body.pop("request_id", None)
        strip_usage = False
        if payload.get("stream") is True and route != RESPONSES:  # its usage comes at the end
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage")):
                body["stream_options"] = {**(options or {}), "include_usage": True}
                strip_usage = True
        salt = self.salts.get(target.endpoint) if target.salted and target.endpoint else None
        priority = self.priorities.get(target.endpoint, 0) if target.endpoint else 0
        upstream = UpstreamBody(body, salt, priority, strip_usage, raw)
        upstream.get("vllm")  # encoded now: a text that cannot be encoded is the caller's 400
        return upstream

    # ---- upstream attempts -------------------------------------------------------------------

    def _choose(self, call: Call, tokens: np.ndarray, tried: list[str]) -> Decision | HTTPError:
        """The router's choice among the workers neither tried for this request nor full."""
        assert call.target is not None
        full = self.upstreams.full
        exclude = [*tried, *full] if full else tried
        endpoint = call.target.endpoint
        if call.pinned is not None:
            pinned = self.responses.choose(call, tokens, tried, exclude)
            if isinstance(pinned, HTTPError):
                return pinned
            d: Decision | None = pinned
        else:
            try:
                d = self.router.route(tokens=tokens, endpoint=endpoint, exclude=exclude)
            except NoWorkerError:
                d = None
            if d is None and endpoint is not None and tried:
                # The endpoint's pool has no untried member left: this one request spills over
                # to the router's choice outside the pool (still salted upstream); nobody is
                # ejected.
                with contextlib.suppress(NoWorkerError):
                    d = self.router.route(tokens=tokens, exclude=exclude)
            if d is None:
                return self._none_left(tried)
        shed = self.admission.check_slo(d, call.slo)
        if shed is None:
            return d
        self.router.withdraw(d)  # never sent: its prompt leaves the router's model
        return self._shed(shed)

    def _none_left(self, tried: list[str]) -> HTTPError:
        """The answer when the router has no worker left for a request (single or pair)."""
        if self.upstreams.full and not tried:
            return self._shed(
                Shed("worker_queue", "every worker that can serve this request is full")
            )
        return HTTPError(503, "no upstream worker available", "service_unavailable", "no_worker")

    def _failed(self, failure: UpstreamFailure, worker: str, error: object) -> None:
        """Counts an upstream failure; a worker that cannot be reached is ejected at once."""
        self.metrics.errors.inc(worker, failure.kind)
        if failure.health == "down":
            self.health.down(worker, f"{failure.kind}: {error!r}")
        else:
            log.warning("upstream %s: %s: %s", worker, failure.kind, error)

    def _settle(self, call: Call, served_by: str | None, suspects: list[str]) -> None:
        """Charges the request's failures to workers when it is over (see the module docs)."""
        if served_by is not None:
            for worker in suspects:
                self.health.failed(worker, "failed a request another worker then served")
            self.health.succeeded(served_by)
        elif len(set(suspects)) == 1:
            self.health.failed(suspects[0], "failed a request only it was tried for")
            self.health.suspect(suspects[0], f"request {call.rid} failed there")
        elif suspects:
            log.warning(
                "request %s failed on %d workers: charged to none (its content, most likely); "
                "probing them",
                call.rid,
                len(set(suspects)),
            )
            for worker in dict.fromkeys(suspects):
                self.health.suspect(worker, f"request {call.rid} failed there and elsewhere")

    async def _forward(
        self,
        call: Call,
        payload: dict[str, Any],
        tokens: np.ndarray,
        upstream: UpstreamBody,
    ) -> Response:
        """The attempt / retry / give-up loop of every request, single or a prefill/decode pair
        (``self._via`` routes and sends each attempt)."""
        via = self._via
        stream = payload.get("stream") is True
        error: HTTPError | None = None
        failed_response: tuple[int, bytes, dict[str, str]] | None = None
        tried: list[str] = []
        suspects: list[str] = []
        sent = False  # a worker may have seen the request (a pair: any failure counts)
        for attempt in range(1, self.server.max_attempts + 1):
            choice = via._choose(call, tokens, tried)
            if isinstance(choice, HTTPError):
                if attempt == 1:  # later, the failures so far are the better answer
                    error, failed_response = choice, None
                break
            if attempt > 1:
                self.metrics.retries.inc()
            outcome, worker = await via._send(call, choice, len(tokens), upstream, stream)
            if isinstance(outcome, Response):
                self._settle(call, worker, suspects)
                if self.server.routing_headers:
                    # Names the reply does not carry (it has only the forwarded ones and
                    # x-request-id): appended, without MutableHeaders' search for each.
                    marks = via._mark(choice)
                    marks.append(("x-kvroute-attempts", str(attempt)))
                    outcome.raw_headers += [(k.encode(), v.encode()) for k, v in marks]
                return outcome
            failure, detail, answered = outcome
            if via is not self or failure not in UNSENT:
                sent = True
            self._failed(failure, worker, detail)
            tried.append(worker)
            if failure.health == "count":
                suspects.append(worker)
            error, failed_response = failure.error(worker), answered
            if not failure.retry:
                break
        if not sent:
            # No worker got it (shed, no worker, none reachable, no free connection): the
            # caller's rate limits get back what admission took, as for the fleet's own 429s.
            assert call.target is not None
            self.limits.refund(call.target.endpoint, call.digest, len(tokens))
        return self._give_up(call, suspects, error, failed_response)

    async def _send(
        self, call: Call, d: Decision, prompt: int, upstream: UpstreamBody, stream: bool
    ) -> tuple[Outcome, str]:
        """One attempt of a single request: its outcome and the worker it went to."""
        self.metrics.decisions.inc(d.policy, d.reason, d.worker)
        body = upstream.get(self.workers[d.worker].kind)
        return await self._send_to(call, d, prompt, body, upstream, stream), d.worker

    async def _send_to(
        self,
        call: Call,
        d: Decision,
        prompt: int,
        body: bytes,
        upstream: UpstreamBody,
        stream: bool,
        client_usage: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> Outcome:
        """``body`` sent to ``d``'s worker as one flight: its answer (the client's) or failure.
        ``client_usage`` rewrites the usage the client is shown (a pair's decode half)."""
        flight = self.upstreams.begin(d, prompt)
        outcome = await self._attempt(
            call, flight, call.upstream_headers, body, stream, upstream.strip_usage, client_usage
        )
        if isinstance(outcome, Response):
            call.flight = flight
        return outcome

    @staticmethod
    def _mark(d: Decision) -> list[tuple[str, str]]:
        """The routing headers of a single request's answer."""
        return [("x-kvroute-worker", d.worker), ("x-kvroute-cached-tokens", str(d.cached_tokens))]

    def _give_up(
        self,
        call: Call,
        suspects: list[str],
        error: HTTPError | None,
        failed_response: tuple[int, bytes, dict[str, str]] | None,
    ) -> Response:
        """The answer when no attempt succeeded: the last upstream's own answer if it gave one,
        else ``error``."""
        assert call.target is not None
        self._settle(call, None, suspects)
        headers = {"x-request-id": call.rid}
        if failed_response is not None:
            status, data, passed = failed_response
            self.metrics.done(call.route, call.target.name, status, call.started)
            return Response(data, status_code=status, headers={**passed, **headers})
        assert error is not None
        self.metrics.done(call.route, call.target.name, error.status, call.started)
        return error.response(headers)

    async def _attempt(
        self,
        call: Call,
        flight: Flight,
        headers: str,
        body: bytes,
        stream: bool,
        strip_usage: bool,
        client_usage: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> Outcome:
        """One upstream attempt: the response to send, or (failure, detail, the upstream's own
        5xx answer if any). The flight is closed unless a ``ProxyStream`` takes it over."""
        assert call.target is not None
        if not stream:
            flight.expect_prefill()
        resp = await flight.send(call.route, headers, body)
        if isinstance(resp, tuple):
            return resp
        handed_over = False
        usage = None
        try:
            status = resp.status_code
            if not 200 <= status <= 599:
                return BAD_STATUS, f"status {status}", None
            limit = self.server.max_response_bytes
            if status >= 500:
                try:
                    data = await resp.read(limit)
                except (UpstreamError, BodyTooLarge):
                    data = b""
                return STATUS_5XX, f"status {status}", failed_answer(status, data, resp.headers)
            reply_headers = forwarded_headers(resp.headers)
            reply_headers["x-request-id"] = call.rid  # at construction: no header rewrite after
            # A Responses answer's usage in chat terms, for the router and the token buckets.
            responses: Callable[[Any], Any] | None = None
            if call.route == RESPONSES:
                responses = partial(chat_usage, cached=not call.history)
            if stream and status == 200:
                scanner = SseScanner(self.server.max_event_bytes)
                chunks = resp.__aiter__()
                if responses is not None:
                    first = await first_output(chunks, scanner, flight.prefilled)
                    failed = responses_failure(first)
                else:
                    first = await first_events(chunks, scanner, flight.prefilled)
                    failed = first_failure(first)
                if failed is not None:
                    return failed
                if responses is not None:
                    self.responses.learn_stream(call, flight, first)
                handed_over = True
                return ProxyStream(
                    self.metrics,
                    call.route,
                    call.target.name,
                    resp,
                    chunks,
                    scanner,
                    first,
                    flight,
                    strip_usage=strip_usage,
                    cache_fields=self.server.cache_usage_fields and responses is None,
                    client_usage=client_usage,
                    headers=reply_headers,
                    started=call.started,
                    responses=responses,
                )
            data = resp.read_complete(limit)  # usually here whole with the head: no await
            if data is None:
                data = await resp.read(limit)
            if status == 200:
                with contextlib.suppress(ValueError, RecursionError):
                    reply = json.loads(data)
                    usage = reply.get("usage") if isinstance(reply, dict) else None
                    if responses is not None:
                        self.responses.learn_reply(call, flight, reply)
                        usage = responses(usage)
                    if client_usage is not None and isinstance(usage, dict):
                        reply["usage"] = client_usage(usage)
                        data = dumps(reply).encode()
                    if self.server.cache_usage_fields:
                        data = with_cache_fields_body(reply, data)
            self.metrics.first_byte.observe(time.perf_counter() - call.started, call.route)
            self.metrics.done(call.route, call.target.name, status, call.started)
            return WholeResponse(data, status, reply_headers)
        except (BodyTooLarge, EventTooLarge) as e:
            return TOO_LARGE, e, None
        except UpstreamError as e:
            return body_failed(e)
        finally:
            if not handed_over:
                release_now(resp, flight, usage)
