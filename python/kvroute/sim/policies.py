"""The policies ``kvroute simulate`` compares, by name.

kvroute's own policies are one :class:`kvroute.Router` over the whole fleet, driven exactly as a
gateway (``kvroute serve``) drives it: ``route(block_hashes=..., key=session, endpoint=...)`` at
arrival, ``begin`` right after, ``prefilled`` at the first token, ``observe(decision,
cached_tokens)`` with the engine-reported cached tokens and ``finish`` when the response ends. The
router therefore sees all traffic, public and dedicated, and the load it weighs is the fleet's.
The scenario's dedicated endpoints (:class:`~.scenario.Scenario`) are declared to that router
(``add_endpoint``), and their requests are routed with ``endpoint=``. With ``index="events"``
the router's index receives the engines' KV events (the engine feeds it every cache store and
remove); with ``index="approx"`` the router models each worker's cache from its own decisions.

The peers (:mod:`.peers`) run in their own default modes whatever ``index`` says: Dynamo with KV
events (on by default), SGLang and llm-d approximate (they have no other mode by default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvroute import Router

from .engine import Fleet, Policy
from .peers import DynamoKv, LlmdScheduler, SGLangCacheAware

__all__ = [
    "DEFAULT_POLICIES",
    "INDEX_MODES",
    "KVROUTE_POLICIES",
    "PEER_POLICIES",
    "RouterPolicy",
    "fleet_router",
    "make_policy",
]

KVROUTE_POLICIES = ("random", "round_robin", "least_loaded", "power_of_two", "hash", "kv_aware")
PEER_POLICIES = ("sglang_cache_aware", "dynamo", "llmd")
#: What ``kvroute simulate`` runs when ``--policies`` is not given.
DEFAULT_POLICIES = (
    "random",
    "round_robin",
    "least_loaded",
    "hash",
    "kv_aware",
    "sglang_cache_aware",
    "dynamo",
    "llmd",
)
#: The router's index modes, by the Router's own names.
INDEX_MODES = ("events", "approx")


def fleet_router(
    fleet: Fleet, policy: str, *, index: str, seed: int, options: dict[str, Any], **config: Any
) -> Router:
    """A Router for ``fleet`` as the simulation runs one: its workers, block size and (approx
    mode) modelled capacity, ``seed``, ``config`` and ``options`` for the constructor, and every
    endpoint of the fleet's scenario (pool, reservation, isolation, priority)."""
    router = Router(
        fleet.names,
        policy=policy,
        block_size=fleet.block_size,
        index=index,
        seed=seed,
        capacity_blocks=fleet.capacity,
        **config,
        **options,
    )
    for ep in fleet.scenario.endpoints:
        router.add_endpoint(
            ep.id,
            pool_size=ep.pool_size,
            reserved_blocks=ep.reserved_blocks,
            isolate=ep.isolate,
            priority=ep.priority,
        )
    return router


class RouterPolicy(Policy):
    """A :class:`kvroute.Router` with one of its policies, as a simulator policy (see the module
    docs). ``decisions`` holds the decision of every request in flight; ``predicted`` the cached
    tokens the router expected for each request sent to a dedicated endpoint. The priority on
    each decision (what a gateway passes upstream) must be the one the scenario's engines run the
    request at.

    ``key``: the request's session id (when the workload has sessions) is passed as the
    consistent-hash key, as a gateway doing sticky sessions would; else the router's default key.
    ``options`` go to the Router's constructor (e.g. ``queue_weight``, ``ttl``); the block size,
    seed and (approx mode) the modelled capacity are the simulation's.
    """

    routes_endpoints = True

    def __init__(
        self,
        policy: str,
        *,
        index: str = "events",
        seed: int = 0,
        options: dict[str, Any] | None = None,
    ) -> None:
        if policy not in KVROUTE_POLICIES:
            raise ValueError(f"unknown kvroute policy {policy!r}; one of {KVROUTE_POLICIES}")
        if index not in INDEX_MODES:
            raise ValueError(f"index must be one of {INDEX_MODES}, got {index!r}")
        self.name = policy
        self.index_mode = index
        self.seed = seed
        self.options = dict(options or {})
        self.router: Any = None
        self.decisions: dict[int, Any] = {}
        self.predicted: dict[int, int] = {}

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        self.router = fleet_router(
            fleet, self.name, index=self.index_mode, seed=self.seed, options=self.options
        )
        if self.index_mode == "events":
            fleet.subscribe(self.router.index)
        self.sessions = fleet.workload.session
        self.endpoint_of = fleet.scenario.endpoint_of or [None] * len(fleet.workload)
        priority = fleet.scenario.priority
        self.priority = [0] * len(fleet.workload) if priority is None else priority.tolist()
        self.decisions = {}
        self.predicted = {}

    def endpoint_pool(self, endpoint_id: str) -> list[str]:
        """The pool of a dedicated endpoint (after :meth:`bind`)."""
        return list(self.router.endpoint_pool(endpoint_id))

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        endpoint = self.endpoint_of[request]
        d = self.router.route(
            block_hashes=chain, key=self.sessions[request], endpoint=endpoint, now=now
        )
        if endpoint is not None:
            self.predicted[request] = d.cached_tokens
        if d.priority != self.priority[request]:  # the engine schedules by the scenario's
            raise ValueError(
                f"request {request}: the router's decision has priority {d.priority}, the "
                f"scenario runs it at {self.priority[request]}"
            )
        self.router.begin(d)
        self.decisions[request] = d
        return self.fleet.position[d.worker]

    def first_token(self, request: int, worker: int, now: float) -> None:
        self.router.prefilled(self.decisions[request])

    def finished(self, request: int, worker: int, cached_tokens: int, now: float) -> None:
        d = self.decisions.pop(request)
        self.router.observe(d, cached_tokens, now=now)
        self.router.finish(d, now=now)


_PEERS: dict[str, Callable[..., Policy]] = {
    "sglang_cache_aware": lambda seed, options: SGLangCacheAware(**options),
    "dynamo": lambda seed, options: DynamoKv(seed=seed, **options),
    "llmd": lambda seed, options: LlmdScheduler(seed=seed, **options),
}


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown policy {name!r}; choose from {', '.join(KVROUTE_POLICIES + PEER_POLICIES)}"
    )


def make_policy(
    name: str, *, index: str = "events", seed: int = 0, options: dict[str, Any] | None = None
) -> Policy:
    """A fresh policy by name (one object per run). ``options`` go to the Router's constructor
    (kvroute's policies) or to the peer emulation's."""
    if name in KVROUTE_POLICIES:
        return RouterPolicy(name, index=index, seed=seed, options=options)
    if name in _PEERS:
        return _PEERS[name](seed, dict(options or {}))
    raise _unknown(name)


def parse_policies(text: str | Sequence[str]) -> list[str]:
    """``"a,b"`` or a list of names -> validated, de-duplicated names in order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names: list[str] = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        if item not in KVROUTE_POLICIES and item not in PEER_POLICIES:
            raise _unknown(item)
        if item not in names:
            names.append(item)
    if not names:
        raise ValueError("no policy given")
    return names
