"""``EppServer``: the ext_proc service, gRPC health, metrics, and where the workers come from.

One process, one asyncio event loop: the gRPC server (``grpc.aio``: ``ExternalProcessor`` and the
standard ``grpc.health.v1.Health``), an HTTP server for ``GET /metrics`` (Prometheus, the
gateway's metrics module) and ``GET /health``, the KV-event subscriber (``router.index =
"events"``), with ``[cluster]`` the replica sync and the engines' ``/metrics`` scraper
(``kvroute.cluster``), and, with ``[epp.pool]``, the Kubernetes ``InferencePool`` watch.

Health services (GIE): ``liveness`` is ``SERVING`` while the process answers; ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor`` (and the overall ``""``) are ``SERVING`` once the
worker set is known — at once for static workers, after the pool's first listing otherwise — and
``NOT_SERVING`` while stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvroute import Router

from ..gateway.prompt import Tokenizer
from ..server.events import event_subscriber
from ..server.health import Health
from ..server.metrics import Gauge, Registry
from .config import EppConfig
from .picker import Member, Picker
from .service import ExtProcService

__all__ = ["EXT_PROC_SERVICE", "EppServer"]

log = logging.getLogger("kvroute.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EppServer:
    """``kvroute epp``: serve with ``await start()`` … ``await stop()``, or ``run()`` (blocking)."""

    def __init__(
        self,
        config: EppConfig,
        *,
        router: Router | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        self.picker = Picker(config, router=router, tokenizer=tokenizer)
        self.router = self.picker.router
        self.registry = Registry()
        self.service = ExtProcService(self.picker, self.registry)
        self.registry.add(
            Gauge(
                "kvroute_epp_worker_healthy",
                "1 when the router may pick the worker.",
                ("worker",),
                lambda: (((w,), int(self.router.is_healthy(w))) for w in self.picker.members),
            )
        )
        self.grpc_health = health_aio.HealthServicer()
        self.health = Health(
            self.picker.members,
            config.health,
            set_healthy=self.router.set_healthy,
            probe=self._probe,
        )
        self.service.failures = lambda worker, status: self.health.failed(
            worker, f"status {status}"
        )
        self.service.successes = self.health.succeeded
        self.ready = config.pool is None
        self._probes: httpx.AsyncClient | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.subscriber: Any = None
        self.cluster: Any = None
        if config.cluster is not None:
            from ..cluster import Cluster

            self.cluster = Cluster(
                self.router,
                config.cluster,
                self._scraped(),
                registry=self.registry,
                event_mode=config.events.mode,
            )
        self.pool: Any = None
        self._membership = asyncio.Lock()  # one pool change at a time
        self._grpc: grpc.aio.Server | None = None
        self._http: Any = None
        self._http_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        epp = self.config.server
        self._grpc = grpc.aio.server(
            options=[("grpc.max_concurrent_streams", 1 << 16), ("grpc.so_reuseport", 0)]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.service, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.grpc_health, self._grpc)
        self.port = self._grpc.add_insecure_port(_join(epp.host, epp.port))
        await self.grpc_health.set("liveness", _SERVING)
        await self._set_ready(self.ready)
        await self._grpc.start()
        await self._start_http()
        if self.cluster is not None:
            self.cluster.start()
        await self._start_events()
        self._probes = httpx.AsyncClient(trust_env=False, timeout=2.0)
        self.health.start()
        if self.config.pool is not None:
            from .pool import PoolWatch

            self.pool = PoolWatch(self.config.pool, self._pool_changed)
            await self.pool.start()
        log.info("kvroute epp: ext_proc on :%s, metrics on :%s", self.port, self.metrics_port)

    async def stop(self, grace: float = 1.0) -> None:
        await self._set_ready(False)
        if self.pool is not None:
            await self.pool.stop()
            self.pool = None
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        await self._stop_events()
        if self.cluster is not None:
            await self.cluster.stop()
        await self.health.stop()
        if self._probes is not None:
            await self._probes.aclose()
            self._probes = None
        if self._http is not None:
            self._http.should_exit = True
            if self._http_task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await self._http_task
            self._http = self._http_task = None

    def run(self) -> None:
        """Serves until SIGINT/SIGTERM."""

        async def main() -> None:
            await self.start()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, stop.set)
            try:
                await stop.wait()
            finally:
                await self.stop()

        asyncio.run(main())

    async def _set_ready(self, ready: bool) -> None:
        status = _SERVING if ready else _NOT_SERVING
        for name in ("readiness", EXT_PROC_SERVICE, ""):
            await self.grpc_health.set(name, status)

    async def _probe(self, worker: str) -> bool:
        """An ejected worker's health endpoint answers 200 (the health model readmits it)."""
        member = self.picker.members.get(worker)
        if member is None or self._probes is None:
            return False
        try:
            resp = await self._probes.get(member.config.url + self.config.health.path)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    # ---- metrics and health over HTTP -------------------------------------------------------

    async def _start_http(self) -> None:
        import socket

        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        async def metrics(request: Request) -> Response:
            return Response(self.registry.render(), media_type=self.registry.content_type)

        async def health(request: Request) -> Response:
            workers = {w: self.router.is_healthy(w) for w in self.picker.members}
            ok = self.ready and any(workers.values())
            body = {
                "status": "ok" if ok else "unavailable",
                "ready": self.ready,
                "workers": workers,
                "tokenizer": self.picker.tokenizer.describe(),
            }
            if self.cluster is not None:
                body["cluster"] = self.cluster.describe()
            return JSONResponse(body, status_code=200 if ok else 503)

        app = Starlette(routes=[Route("/metrics", metrics), Route("/health", health)])
        epp = self.config.server
        family = socket.AF_INET6 if ":" in epp.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((epp.host, epp.metrics_port))
        self.metrics_port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._http = uvicorn.Server(config)
        self._http.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started and not self._http_task.done():
            await asyncio.sleep(0.01)
        if self._http_task.done():
            self._http_task.result()

    # ---- where the workers come from --------------------------------------------------------

    def _scraped(self) -> list[tuple[str, str, str, str | None]]:
        """The members as the engine scraper takes them."""
        return [
            (m.name, m.config.url, m.config.kind, m.config.api_key)
            for m in self.picker.members.values()
        ]

    async def _start_events(self) -> None:
        if self.cluster is not None and self.cluster.follower is not None:
            return  # the engines' events come from kvroute relay's stream
        c = self.config
        workers = [m.config for m in self.picker.members.values()]
        self.subscriber = event_subscriber(self.router, workers, c.router, c.events)
        if self.subscriber is not None:
            await self.subscriber.__aenter__()

    async def _stop_events(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.__aexit__(None, None, None)
            self.subscriber = None

    async def _pool_changed(self, members: dict[str, Member]) -> None:
        """The InferencePool's ready pods changed (or were listed for the first time). Only the
        workers that changed are touched: one gone, or whose engine is another (a new address:
        a pod replaced under its name; other KV-event endpoints), is unsubscribed from its KV
        events before the router drops it, and one new (or renewed) is subscribed once the
        router has it. The others keep their event subscription and its sequence state, so
        nothing they publish meanwhile is lost."""
        async with self._membership:
            self.picker.check_members(members)  # refused before anything changes
            old = dict(self.picker.members)
            renewed = [
                n for n, m in old.items() if n in members and _engine(m) != _engine(members[n])
            ]
            leaving = [n for n in old if n not in members] + renewed
            joining = [n for n in members if n not in old] + renewed
            await self._unsubscribe(leaving)
            self.picker.set_members(members)
            self.health.workers = tuple(members)
            for w in leaving:  # a new engine starts with a clean record
                self.health.ejected.pop(w, None)
                self.health.failures.pop(w, None)
            if self.cluster is not None:
                self.cluster.scraper.set_workers(self._scraped())
            if leaving or joining:
                log.info(
                    "kvroute epp: %d workers from the InferencePool (%d left, %d joined)",
                    len(members),
                    len(leaving),
                    len(joining),
                )
            await self._subscribe(joining)
            if not self.ready:
                self.ready = True
                await self._set_ready(True)

    async def _unsubscribe(self, names: list[str]) -> None:
        """Ends these workers' KV-event subscriptions (before the router drops them: no event of
        theirs is applied afterwards)."""
        sub = self.subscriber
        if sub is None:
            return
        subscribed = set(sub.workers)
        for name in names:
            if name in subscribed:
                try:
                    await asyncio.to_thread(sub.remove_worker, name)
                except Exception:
                    log.exception("kvroute epp: unsubscribing %s from its KV events failed", name)

    async def _subscribe(self, names: list[str]) -> None:
        """Subscribes to these workers' KV events (the first of all starts the subscriber)."""
        if self.subscriber is None:
            await self._start_events()  # over every member: none was subscribed
            return
        sub = self.subscriber
        for name in names:
            c = self.picker.members[name].config
            if not c.kv_events:
                continue
            try:
                await asyncio.to_thread(
                    sub.add_worker, name, c.kv_events, replay=c.kv_replay, bind=c.kv_events_bind
                )
            except Exception:
                log.exception("kvroute epp: subscribing to %s's KV events failed", name)


def _engine(m: Member) -> tuple[str, str | None, str | None, bool]:
    """What makes a member's engine another one: its address and its KV-event endpoints."""
    c = m.config
    return m.address, c.kv_events, c.kv_replay, c.kv_events_bind


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
