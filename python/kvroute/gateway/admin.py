"""The gateway's own routes: ``/health`` (public: up or not; with worker names, event streams,
cluster and warm state on the admin listener or for an admin key), ``/metrics`` (admin only)
and ``GET /v1/models`` (the targets the caller's key may use). A caller who may not see a route
is answered as for a path that does not exist (404)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from .errors import HTTPError

if TYPE_CHECKING:
    from .app import Gateway
    from .request import Incoming

__all__ = ["AdminRoutes", "not_found"]

Handler = Callable[["Incoming"], Awaitable[Response]]

#: The keys of each worker's KV-event stream state in ``/health``.
EVENT_KEYS = (
    "last_seq",
    "stale",
    "gaps",
    "restarts",
    "disconnects",
    "resets",
    "malformed",
    "blocks_stored",
    "skipped_block_size",
    "skipped_partial",
    "foreign_hashes",
    "engine_block_size",
)


def not_found() -> HTTPError:
    """The answer for a path that does not exist (or that the caller may not see)."""
    return HTTPError(404, "not found", "invalid_request_error", "not_found")


class AdminRoutes:
    """``/health``, ``/metrics`` and ``/v1/models`` of one gateway (see the module docs)."""

    def __init__(self, g: Gateway) -> None:
        self.g = g

    def admin_only(self, handler: Handler) -> Handler:
        async def guarded(req: Incoming) -> Response:
            auth = self.g.auth
            if auth.admin and not auth.is_admin(req.headers.get("authorization")):
                return not_found().response()
            return await handler(req)

        return guarded

    async def metrics(self, req: Incoming) -> Response:
        m = self.g.metrics
        return Response(m.render(), media_type=m.content_type)

    def events(self) -> dict[str, Any]:
        """Per worker, the KV-event stream's state (events mode only)."""
        g = self.g
        sub = g.subscriber
        if sub is None and g.cluster is not None:
            sub = g.cluster.follower
        if sub is None:
            return {}
        index = g.router.index
        out = {}
        for w, row in sub.stats().items():
            out[w] = {k: row.get(k) for k in EVENT_KEYS}
            out[w]["blocks"] = index.num_blocks(w) if w in index.workers else 0
        return {"events": out}

    async def health(self, req: Incoming) -> Response:
        g = self.g
        workers = g.health.status()
        ok = any(workers.values())
        return JSONResponse(
            {
                "status": "ok" if ok else "unavailable",
                "workers": workers,
                # Each engine's KV block size once known (events, /metrics; None before).
                "engine_block_sizes": {w: g.router.engine_block_size(w) for w in workers},
                "tokenizer": g.tokenizer.describe(),
                **self.events(),
                **({"cluster": g.cluster.describe()} if g.cluster is not None else {}),
                **({"warm": g.warmer.describe()} if g.warmer is not None else {}),
            },
            status_code=200 if ok else 503,
        )

    async def public_metrics(self, req: Incoming) -> Response:
        if self.g.auth.is_admin(req.headers.get("authorization")):
            return await self.metrics(req)
        return not_found().response()

    async def public_health(self, req: Incoming) -> Response:
        if self.g.auth.is_admin(req.headers.get("authorization")):
            return await self.health(req)
        ok = self.g.health.any_in()
        return JSONResponse(
            {"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503
        )

    async def models(self, req: Incoming) -> Response:
        data = [
            {"id": t.name, "object": "model", "created": 0, "owned_by": "kvroute"}
            for t in self.g.auth.visible(req.headers.get("authorization"))
        ]
        return JSONResponse({"object": "list", "data": data})
