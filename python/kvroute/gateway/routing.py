"""The one place the gateway meets ``kvroute.Router``: building it from the config, and the few
calls whose spelling might differ between Router versions.

Everything else in the gateway uses the Router's public API directly: ``route(tokens=...,
endpoint=...)`` → Decision (``worker``, ``cached_tokens``, ``policy``, ``reason``),
``begin``/``finish``/``observe`` and ``set_healthy``.
"""

from __future__ import annotations

from typing import Any

from .config import GatewayConfig

__all__ = ["NoWorker", "build_router", "decision_reason", "endpoint_salt"]

try:
    from kvroute import Router
except ImportError:  # TEMPORARY until issue #5 lands
    from ._router_standin import Router  # type: ignore[assignment]

#: What ``Router.route`` raises when no candidate is left (none healthy, in the endpoint's pool
#: and not excluded). The gateway's arguments are otherwise always valid.
NoWorker: tuple[type[BaseException], ...] = (ValueError,)


def build_router(config: GatewayConfig) -> Any:
    """A Router over the configured workers (weights), with every endpoint's pool added."""
    r = config.router
    router = Router(
        {w.name: w.weight for w in config.workers},
        policy=r.policy,
        block_size=r.block_size,
        hash_profile=r.hash_profile,
        index=r.index,
        **dict(r.options),
    )
    for ep in config.endpoints:
        router.add_endpoint(
            ep.id, pool_size=ep.pool_size, reserved_blocks=ep.reserved_blocks, salt=ep.salt
        )
    return router


def endpoint_salt(router: Any, endpoint_id: str) -> str | None:
    """The salt of ``endpoint_id``'s blocks in the router: the ``cache_salt`` sent upstream."""
    salt = router.endpoint_salt(endpoint_id)
    return None if salt is None else str(salt)


def decision_reason(decision: Any) -> str:
    return str(getattr(decision, "reason", "") or "none")
