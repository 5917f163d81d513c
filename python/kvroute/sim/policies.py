"""The policies ``kvroute simulate`` compares, by name.

kvroute's own policies are one :class:`kvroute.Router` over the whole fleet, driven exactly as a
gateway (``kvroute serve``) drives it: ``route(block_hashes=..., key=session, endpoint=...)`` at
arrival, ``begin`` right after, ``prefilled`` at the first token, ``observe(decision,
cached_tokens)`` with the engine-reported cached tokens and ``finish`` when the response ends.
A request its client does not stream (a share ``non_streamed`` of them, the same requests for
every policy of a seed) shows the gateway no first token: ``prefilled`` comes when the gateway's
admission model predicts the prefill done (``prefill_tokens_per_second`` when configured, else
the fit learned from the streamed requests' first tokens: ``kvroute.gateway.admission``), or at
``finish`` while it predicts nothing. The
router therefore sees all traffic, public and dedicated, and the load it weighs is the fleet's.
The scenario's dedicated endpoints (:class:`~.scenario.Scenario`) are declared to that router
(``add_endpoint``), and their requests are routed with ``endpoint=``. With ``index="events"``
the router's index receives the engines' KV events (the engine feeds it every cache store and
remove); with ``index="approx"`` the router models each worker's cache from its own decisions.

The peers (:mod:`.peers`) run in their own default modes whatever ``index`` says: Dynamo with KV
events (on by default), SGLang and llm-d approximate (they have no other mode by default).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvroute import Router
from kvroute.gateway.admission import PrefillModel

from .engine import DROPPED, Fleet, Policy
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
    seed and (approx mode) the modelled capacity are the simulation's. Two of them are the
    gateway's and its clients' instead (module docs): ``non_streamed``, the share of requests not
    streamed (0 to 1, default 0), and ``prefill_tokens_per_second`` (the gateway's setting;
    default: learned).
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
        self.router_options = dict(self.options)
        share = self.router_options.pop("non_streamed", 0.0)
        rate = self.router_options.pop("prefill_tokens_per_second", None)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"non_streamed must be a share from 0 to 1, got {share!r}")
        if rate is not None and not (
            isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < math.inf
        ):
            raise ValueError(f"prefill_tokens_per_second must be positive, got {rate!r}")
        self.non_streamed = float(share)
        self.fixed_rate = rate
        self.router: Any = None
        self.decisions: dict[int, Any] = {}
        self.predicted: dict[int, int] = {}
        #: The warm requests' result records, when the run had some (``tenant.run_setup``).
        self.warm_results: np.ndarray | None = None

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        self.router = fleet_router(
            fleet, self.name, index=self.index_mode, seed=self.seed, options=self.router_options
        )
        if self.index_mode == "events":
            fleet.subscribe(self.router.index)
        self.sessions = fleet.workload.session
        self.endpoint_of = fleet.scenario.endpoint_of or [None] * len(fleet.workload)
        priority = fleet.scenario.priority
        self.priority = [0] * len(fleet.workload) if priority is None else priority.tolist()
        self.decisions = {}
        self.predicted = {}
        n = len(fleet.workload)
        # Which requests stream: a draw of the seed alone, so every policy sees the same ones.
        draw = np.random.default_rng([self.seed, 0x73747265616D]).random(n)
        self.streamed = (draw >= self.non_streamed).tolist()
        self.warm_target = fleet.scenario.warm_target
        if self.warm_target is not None:  # warm requests are never streamed
            for i, target in enumerate(self.warm_target):
                if target is not None:
                    self.streamed[i] = False
        self.prefill_model = PrefillModel()  # the gateway's, fed by streamed first tokens
        self.work: dict[int, tuple[float, float]] = {}  # request -> (begun at, prefill tokens)
        self.due: list[tuple[float, int]] = []  # (predicted prefill end, request)
        self.warming: dict[int, int] = {}  # worker -> its warm request still running

    def endpoint_pool(self, endpoint_id: str) -> list[str]:
        """The pool of a dedicated endpoint (after :meth:`bind`)."""
        return list(self.router.endpoint_pool(endpoint_id))

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        self._predicted_until(now)
        endpoint = self.endpoint_of[request]
        target = self.warm_target[request] if self.warm_target is not None else None
        if target is not None:
            return self._warm(request, chain, endpoint, target, now)
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
        self._begin(request, d, now)
        return self.fleet.position[d.worker]

    def _begin(self, request: int, d: Any, now: float) -> None:
        """The request is sent: begun on its worker; a non-streamed one is told prefilled when
        the gateway predicts it done."""
        queued = self.router.begin(d) * self.router.block_size
        self.decisions[request] = d
        work = queued + max(d.prompt_tokens - d.cached_tokens, 0)
        self.work[request] = (now, work)
        if not self.streamed[request]:
            seconds = (
                work / self.fixed_rate if self.fixed_rate else self.prefill_model.predict(work)
            )
            if seconds is not None and seconds < math.inf:
                heapq.heappush(self.due, (now + seconds, request))

    def _warm(self, request: int, chain: np.ndarray, endpoint: Any, target: int, now: float) -> int:
        """A warm request (``kvroute.sim.warm``), routed as the gateway's warmer routes it: to
        its pool member alone, sent at priority 0, not streamed — or dropped while the member's
        last one is still running."""
        if target in self.warming:
            return DROPPED
        names = self.fleet.names
        others = [w for k, w in enumerate(names) if k != target]
        d = self.router.route(block_hashes=chain, endpoint=endpoint, exclude=others, now=now)
        if self.fleet.position[d.worker] != target:
            raise ValueError(f"warm request {request} routed to {d.worker}, not {names[target]}")
        self._begin(request, d, now)
        self.warming[target] = request
        return target

    def first_token(self, request: int, worker: int, now: float) -> None:
        self._predicted_until(now)
        if self.streamed[request]:
            self.router.prefilled(self.decisions[request])
            begun, work = self.work[request]
            if not self.fixed_rate:
                self.prefill_model.add(work, now - begun)

    def finished(self, request: int, worker: int, cached_tokens: int, now: float) -> None:
        self._predicted_until(now)
        d = self.decisions.pop(request)
        self.work.pop(request)
        if self.warming.get(worker) == request:
            del self.warming[worker]
        self.router.observe(d, cached_tokens, now=now)
        self.router.finish(d, now=now)

    def _predicted_until(self, now: float) -> None:
        """The non-streamed requests whose prefill is predicted done by ``now``, in that order:
        ``prefilled`` as the gateway's timer does (unless the request ended first)."""
        while self.due and self.due[0][0] <= now:
            _, request = heapq.heappop(self.due)
            if request in self.decisions:  # each is due once, unless it ended first
                self.router.prefilled(self.decisions[request])


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
