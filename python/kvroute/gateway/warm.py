"""Keeping a dedicated endpoint's shared prefix in the cache of every worker of its pool
(``[[endpoints]] warm_interval``).

A pool serves one tenant, whose requests mostly share a prefix (a system prompt, a document, an
agent's tools). The router keeps them on the worker that holds it; but the first request that
lands on another pool member — because the first one is busy — pays a whole prefill, and an
engine that evicts plain LRU (stock vLLM honours no reservation) drops the prefix once public
traffic has written its cache over. Both show in the tenant's tail, not its median. The warmer
prefills the prefix on every pool member before the tenant needs it, and touches it there again
every ``warm_interval`` seconds, so an LRU keeps it as long as the interval is shorter than the
time the worker's cache takes to turn over.

Guarantees:

- The prefix is learned from the endpoint's own requests: the longest run of whole routing
  blocks that a request shares with the endpoint's previous request, at least one block and at
  most its ``reserved_blocks`` (when it has some). A new one replaces the last (a tenant that
  changes its system prompt is followed); a pair that shares less than a block changes nothing.
  Nothing is warmed before two requests share a block.
- On each pass — at once when the first prefix is learnt, then every ``warm_interval`` seconds
  (a new prefix waits for the next: warm requests stay at most one per pool member and
  interval, however often the tenant's prefix changes, as an agent's growing context does) — each
  healthy pool member not at its in-flight bound gets one ``/v1/completions`` request of the
  prefix as token ids, ``max_tokens = 1``, with the endpoint's ``cache_salt`` (its blocks are the
  tenant's) and priority 0 (never ahead of anyone's real request). A member still answering the
  last pass's request is skipped: never two warm requests on one worker.
- A warm request is routed, begun, observed and finished as any request (the router's load, its
  prefix model, the in-flight bound), takes nothing from rate limits or admission, and ejects no
  one when it fails (health checks judge workers): it is counted and logged. A pass that raises
  is logged and the next one runs.
- ``kvroute_gateway_warm_requests_total{endpoint,worker,result}``: ``hit`` (the worker held the
  prefix: the request only touched it), ``filled`` (it prefilled part of it), ``sent`` (the
  engine reports no cached tokens), ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvroute import NoWorkerError
from kvroute.server.warm import WarmPrefix

from .client import BodyTooLarge, UpstreamError
from .errors import UpstreamFailure
from .upstream import UpstreamBody, release_now, request_head
from .usage import routed_cached_tokens

if TYPE_CHECKING:
    from kvroute.server.config import EndpointConfig

    from .app import Gateway

__all__ = ["WarmEndpoint", "Warmer"]

log = logging.getLogger("kvroute.gateway")

#: The request path of warm requests (token ids as the prompt).
PATH = "/v1/completions"
#: Longest a warm request's answer may be: one token and its usage.
MAX_ANSWER_BYTES = 1 << 20


@dataclass
class WarmEndpoint:
    """One endpoint's warming: what it keeps warm and when it runs next."""

    id: str
    upstream_model: str
    interval: float
    #: What is kept warm, learnt from the endpoint's routing tokens (at most its reserved blocks).
    learnt: WarmPrefix
    salt: str | None
    due: float = 0.0

    @property
    def prefix(self) -> np.ndarray | None:
        return self.learnt.prefix


class Warmer:
    """Sends the warm requests of the endpoints with a ``warm_interval`` (see the module docs)."""

    def __init__(self, gateway: Gateway, endpoints: Mapping[str, WarmEndpoint]) -> None:
        self.gateway = gateway
        self.endpoints = dict(endpoints)
        self.block_size = gateway.router.block_size
        self.busy: set[tuple[str, str]] = set()
        self.tasks: set[asyncio.Task[str]] = set()
        self.wake = asyncio.Event()
        self.runner: asyncio.Task[None] | None = None
        self.clock: Callable[[], float] = time.monotonic

    @classmethod
    def for_endpoints(cls, gateway: Gateway, endpoints: Iterable[EndpointConfig]) -> Warmer | None:
        """The warmer of the ``endpoints`` with a ``warm_interval`` (None when none has one): each
        prefix at most its reserved blocks, when it has some (0 reserves nothing: no bound)."""
        block = gateway.router.block_size
        warm = {
            ep.id: WarmEndpoint(
                ep.id,
                ep.model,
                ep.warm_interval,
                WarmPrefix(block, ep.reserved_blocks * block if ep.reserved_blocks else None),
                gateway.salts.get(ep.id),
            )
            for ep in endpoints
            if ep.warm_interval is not None
        }
        return cls(gateway, warm) if warm else None

    def learn(self, endpoint: str | None, tokens: np.ndarray) -> None:
        """A request of ``endpoint`` was admitted with these routing tokens."""
        ep = self.endpoints.get(endpoint) if endpoint is not None else None
        if ep is None:
            return
        if ep.learnt.learn(tokens) == "first":
            ep.due = 0.0  # the first prefix: a pass starts now
            self.wake.set()

    def describe(self) -> dict[str, dict[str, object]]:
        """Per endpoint: the tokens kept warm (0 before any is learnt), the interval, and the
        pool members with a warm request in flight (``/health`` on the admin listener)."""
        return {
            ep.id: {
                "prefix_tokens": 0 if ep.prefix is None else len(ep.prefix),
                "interval": ep.interval,
                "warming": sorted(w for e, w in self.busy if e == ep.id),
            }
            for ep in self.endpoints.values()
        }

    def start(self) -> None:
        if self.endpoints and self.runner is None:
            self.runner = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self.runner, *self.tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.runner = None

    async def _run(self) -> None:
        while True:
            now = self.clock()
            for ep in self.endpoints.values():
                if ep.prefix is not None and ep.due <= now:
                    ep.due = now + ep.interval
                    try:
                        self.warm_pool(ep)
                    except Exception:  # one endpoint's failure stops no one's warming
                        log.exception("warm pass of endpoint %s", ep.id)
            pending = [ep.due for ep in self.endpoints.values() if ep.prefix is not None]
            self.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                timeout = max(min(pending) - self.clock(), 0.0) if pending else None
                await asyncio.wait_for(self.wake.wait(), timeout)

    def warm_pool(self, ep: WarmEndpoint) -> None:
        """Starts one warm request on each pool member that can take one now."""
        g = self.gateway
        # The pool's current members: healthy ones (the router stands another in for one
        # that is not, as for the endpoint's requests).
        for worker in g.router.endpoint_pool(ep.id):
            if (ep.id, worker) in self.busy or worker in g.upstreams.full:
                continue
            self.busy.add((ep.id, worker))
            task = asyncio.get_running_loop().create_task(self.warm(ep, worker))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def warm(self, ep: WarmEndpoint, worker: str) -> str:
        """One warm request of ``ep``'s prefix on ``worker``; returns its result label."""
        try:
            result = await self._warm(ep, worker)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("warm request of endpoint %s on %s", ep.id, worker)
            result = "failed"
        finally:
            self.busy.discard((ep.id, worker))
        self.gateway.metrics.warm.inc(ep.id, worker, result)
        return result

    async def _warm(self, ep: WarmEndpoint, worker: str) -> str:
        g = self.gateway
        prefix = ep.prefix
        if prefix is None:
            return "failed"
        others = [w for w in g.workers if w != worker]
        try:
            d = g.router.route(tokens=prefix, endpoint=ep.id, exclude=others)
        except NoWorkerError:
            log.info("warm request of endpoint %s: %s cannot be routed to now", ep.id, worker)
            return "failed"
        body = {
            "model": ep.upstream_model,
            "prompt": prefix.tolist(),
            "max_tokens": 1,
            "stream": False,
        }
        upstream = UpstreamBody(body, ep.salt, 0, False).get(g.workers[worker].kind)
        flight = g.upstreams.begin(d, len(prefix))
        flight.expect_prefill()
        head = request_head(f"kvroute-warm-{os.urandom(8).hex()}")  # unique, as any request's
        resp = await flight.send(PATH, head, upstream)
        if isinstance(resp, tuple):
            failure: UpstreamFailure = resp[0]
            log.warning("warm request of endpoint %s on %s: %s", ep.id, worker, failure.kind)
            return "failed"
        usage = None
        try:
            if resp.status_code != 200:
                log.warning(
                    "warm request of endpoint %s on %s: status %d",
                    ep.id,
                    worker,
                    resp.status_code,
                )
                return "failed"
            try:
                data = await resp.read(MAX_ANSWER_BYTES)
            except (UpstreamError, BodyTooLarge) as e:
                log.warning("warm request of endpoint %s on %s: %r", ep.id, worker, e)
                return "failed"
            with contextlib.suppress(ValueError, RecursionError):
                reply = json.loads(data)
                usage = reply.get("usage") if isinstance(reply, dict) else None
        finally:
            release_now(resp, flight, usage)
        cached = routed_cached_tokens(usage, len(prefix))
        if cached is None:
            return "sent"
        # An engine caches whole blocks of its own size and computes at least the prompt's last
        # token: a whole hit leaves less than a block (the larger of the two sizes) uncached.
        block = max(self.block_size, g.router.engine_block_size(worker) or 0)
        return "hit" if cached + block >= len(prefix) else "filled"
