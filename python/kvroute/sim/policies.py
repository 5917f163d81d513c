"""The policies ``kvroute simulate`` compares, by name, and the dedicated-endpoint setup.

kvroute's own policies are a :class:`kvroute.Router` driven exactly as a gateway would drive it:
``route(block_hashes=..., key=session, endpoint=...)`` at arrival, ``begin`` right after,
``observe(decision, cached_tokens)`` with the engine-reported cached tokens and ``finish`` when the
response ends. With ``index="exact"`` the router is built with ``index="events"`` and the engine
applies every cache store/remove to ``router.index`` (what the KV-event subscriber does); with
``index="approx"`` the router models each worker's cache itself from its own decisions.

The peers (:mod:`.peers`) run in their own default modes whatever ``index`` says: Dynamo exact
(KV events on by default), SGLang and llm-d approximate (they have no other mode by default).
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
    "KVROUTE_POLICIES",
    "PEER_POLICIES",
    "EndpointSetup",
    "RouterPolicy",
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
INDEX_MODES = ("exact", "approx")


def _router(
    names: list[str],
    policy: str,
    *,
    block_size: int,
    index: str,
    seed: int,
    capacity: int,
    options: dict[str, Any] | None = None,
) -> Any:
    if index not in INDEX_MODES:
        raise ValueError(f"index must be one of {INDEX_MODES}, got {index!r}")
    return Router(
        names,
        policy=policy,
        block_size=block_size,
        index="events" if index == "exact" else "approx",
        seed=seed,
        capacity_blocks=capacity,
        **(options or {}),
    )


class _RouterDriven(Policy):
    """Drives :class:`kvroute.Router` objects as a gateway does: ``begin`` right after routing,
    ``prefilled`` at the first token, ``observe`` and ``finish`` at the end. ``decisions`` holds
    the decision of every request in flight; :meth:`router_for` says which router made it."""

    decisions: dict[int, Any]

    def router_for(self, request: int) -> Any:
        raise NotImplementedError

    def _begin(self, request: int, decision: Any) -> int:
        self.router_for(request).begin(decision)
        self.decisions[request] = decision
        return self.fleet.position[decision.worker]

    def first_token(self, request: int, worker: int, now: float) -> None:
        self.router_for(request).prefilled(self.decisions[request])

    def finished(self, request: int, worker: int, cached_tokens: int, now: float) -> None:
        d = self.decisions.pop(request)
        router = self.router_for(request)
        router.observe(d, cached_tokens, now=now)
        router.finish(d, now=now)


class RouterPolicy(_RouterDriven):
    """A :class:`kvroute.Router` with one of its policies, as a simulator policy.

    ``key``: the request's session id (when the workload has sessions) is passed as the
    consistent-hash key, as a gateway doing sticky sessions would; else the router's default key.
    ``options`` go to the Router's constructor (e.g. ``queue_weight``, ``ttl``); the block size,
    seed and (approx mode) the modelled capacity are the simulation's.
    """

    def __init__(
        self,
        policy: str,
        *,
        index: str = "exact",
        seed: int = 0,
        options: dict[str, Any] | None = None,
    ) -> None:
        if policy not in KVROUTE_POLICIES:
            raise ValueError(f"unknown kvroute policy {policy!r}; one of {KVROUTE_POLICIES}")
        self.name = policy
        self.index_mode = index
        self.seed = seed
        self.options = dict(options or {})
        self.router: Any = None

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        self.router = _router(
            fleet.names,
            self.name,
            block_size=fleet.block_size,
            index=self.index_mode,
            seed=self.seed,
            capacity=fleet.capacity,
            options=self.options,
        )
        if self.index_mode == "exact":
            self.exact_index = self.router.index
        self.sessions = fleet.workload.session
        self.decisions = {}

    def router_for(self, request: int) -> Any:
        return self.router

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        d = self.router.route(block_hashes=chain, key=self.sessions[request], now=now)
        return self._begin(request, d)


class EndpointSetup(_RouterDriven):
    """The tenant on a dedicated endpoint, everyone else on the public pool.

    Two routers over the same fleet: the public one (``random``, seeded) takes every request
    without a tenant, exactly like the ``random`` baseline; the dedicated one (``policy``,
    default ``kv_aware``) has ``add_endpoint(tenant, pool_size=..., reserved_blocks=...)`` and
    takes the tenant's requests with ``endpoint=tenant``, inside the endpoint's pool. The engine
    gives each pool worker's cache a partition of ``reserved_blocks`` for the tenant
    (``reserved``), into which the tenant's blocks go (``partitions``). The endpoint is isolated
    (salted, the Router's default): the engine caches the tenant's blocks under the salted hashes
    (``chains``), as an engine given the endpoint's ``cache_salt`` does, so that in exact mode
    the index the dedicated router reads holds what it matches.
    """

    name = "endpoint"

    def __init__(
        self,
        tenant: str,
        *,
        pool_size: int,
        reserved_blocks: int,
        policy: str = "kv_aware",
        index: str = "exact",
        seed: int = 0,
    ) -> None:
        self.tenant = tenant
        self.pool_size = int(pool_size)
        self.reserved_blocks = int(reserved_blocks)
        self.policy = policy
        self.index_mode = index
        self.seed = seed

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        kw = {"block_size": fleet.block_size, "seed": self.seed, "capacity": fleet.capacity}
        self.public = _router(fleet.names, "random", index="approx", **kw)
        self.dedicated = _router(fleet.names, self.policy, index=self.index_mode, **kw)
        self.dedicated.add_endpoint(
            self.tenant, pool_size=self.pool_size, reserved_blocks=self.reserved_blocks
        )
        if self.index_mode == "exact":
            self.exact_index = self.dedicated.index
        self.reserved = {
            fleet.position[w]: {self.tenant: self.reserved_blocks} for w in self.pool()
        }
        self.tenants = fleet.workload.tenant
        self.predicted: dict[int, int] = {}  # tenant request -> cached tokens the router expected
        self.partitions = [self.tenant if t == self.tenant else None for t in self.tenants]
        if self.dedicated.endpoint_salt(self.tenant) is not None:
            wl = fleet.workload
            hashes = wl.hashes.copy()
            for i in np.flatnonzero(wl.tenant_mask(self.tenant)).tolist():
                a, b = int(wl.offsets[i]), int(wl.offsets[i + 1])
                hashes[a:b] = self.dedicated.salt_block_hashes(self.tenant, wl.hashes[a:b])
            self.chains = (hashes, wl.offsets)
        self.decisions = {}

    def pool(self) -> list[str]:
        """The endpoint's workers (after :meth:`bind`)."""
        return list(self.dedicated.endpoint_pool(self.tenant))

    def router_for(self, request: int) -> Any:
        return self.dedicated if self.tenants[request] == self.tenant else self.public

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        if self.tenants[request] == self.tenant:
            d = self.dedicated.route(block_hashes=chain, endpoint=self.tenant, now=now)
            self.predicted[request] = d.cached_tokens
        else:
            d = self.public.route(block_hashes=chain, now=now)
        return self._begin(request, d)


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
    name: str, *, index: str = "exact", seed: int = 0, options: dict[str, Any] | None = None
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
