"""The one place a kvroute server builds its ``kvroute.Router`` from the fleet's configuration.

The servers call the Router's public API directly: ``route(tokens=..., endpoint=...,
exclude=...)`` → ``Decision`` (``worker``, ``cached_tokens``, ``policy``, ``reason``), ``begin`` /
``prefilled`` / ``finish`` / ``observe``, ``set_healthy`` and ``endpoint_salt``.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvroute import NoWorkerError, Router

from .config import EventsConfig, PdConfig, RouterConfig, WorkerConfig

# NoWorkerError (a ValueError) is what ``Router.route`` raises when no candidate is left (none
# healthy, in the endpoint's pool and not excluded), and only then: the servers' 503. Any other
# error from ``route`` is a bug, not "no worker".
__all__ = ["NoWorkerError", "build_router"]


def build_router(
    workers: Iterable[WorkerConfig],
    router: RouterConfig,
    events: EventsConfig | None = None,
    pd: PdConfig | None = None,
    *,
    updates: bool = False,
) -> Router:
    """A Router over the configured workers (weights and roles); ``[router]`` keys left out
    take the Router's defaults (read the values in effect from ``router.config``).

    ``[router] options`` are passed as further keyword arguments (``capacity_blocks``, ``ttl``,
    ``queue_weight``, ``seed``, ``hash_algo`` …); an unknown one raises ``TypeError``. In events
    mode the router's own event applier hashes as ``[events] mode`` says (unless ``options``
    names an ``event_mode``). ``[pd]`` sets the router's ``pd_threshold`` and
    ``pd_saturation``; with SGLang's protocol decode workers never prefill a request themselves
    (``pd_local_prefill = False``). ``updates``: keep an outbox of updates for other replicas
    (``kvroute.cluster``).
    """
    options = dict(router.options)
    if updates:
        options["updates"] = True
    if router.events and events is not None:
        options.setdefault("event_mode", events.mode)
    if pd is not None:
        options.setdefault("pd_threshold", pd.threshold)
        options.setdefault("pd_saturation", pd.saturation)
        options.setdefault("pd_local_prefill", pd.protocol != "sglang")
    workers = list(workers)
    # None (not in the file) is the Router's own default: the core's Config::default.
    return Router(
        {w.name: w.weight for w in workers},
        roles={w.name: w.role for w in workers},
        policy=router.policy,
        block_size=router.block_size,
        hash_profile=router.hash_profile,
        index=router.index,
        **options,
    )
