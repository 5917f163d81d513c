"""The one place the gateway builds ``kvroute.Router`` from its configuration.

The rest of the gateway calls the Router's public API directly: ``route(tokens=...,
endpoint=..., exclude=...)`` → ``Decision`` (``worker``, ``cached_tokens``, ``policy``,
``reason``), ``begin`` / ``prefilled`` / ``finish`` / ``observe``, ``set_healthy`` and
``endpoint_salt``.
"""

from __future__ import annotations

from kvroute import Router

from .config import GatewayConfig

__all__ = ["NoWorker", "build_router"]

#: What ``Router.route`` raises when no candidate is left (none healthy, in the endpoint's pool
#: and not excluded); the gateway's arguments are otherwise always valid.
NoWorker = ValueError


def build_router(config: GatewayConfig) -> Router:
    """A Router over the configured workers (weights) with every endpoint added.

    ``[router] options`` are passed as further keyword arguments (``capacity_blocks``, ``ttl``,
    ``queue_weight``, ``seed`` …); an unknown one raises ``TypeError``.
    """
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
