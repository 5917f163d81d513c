"""The deployment a simulation runs: which requests go to which dedicated endpoint, and what the
engines do differently for them. :func:`~kvroute.sim.engine.run` takes it next to the routing
policy; a policy decides *where* a request goes, a :class:`Scenario` says *what the fleet is*.

- :class:`Endpoint` — one dedicated endpoint as a gateway declares it to its router
  (``Router.add_endpoint``): pool size, reserved blocks per pool worker, scheduling priority,
  isolation (its own block-hash salt).
- :class:`Scenario` — the endpoints, which requests each one receives (``endpoint_of``), and what
  follows for the engines: the reserved partitions of the pool workers' caches (``reserved``),
  the partition each request's blocks go to (``partitions``), the block hashes the engines cache
  and announce in KV events (``chains``: salted for an isolated endpoint, as an engine given the
  endpoint's ``cache_salt`` hashes them) and each request's scheduling priority (``priority``).

``Scenario()`` is the public fleet: no endpoint, no reservation, every request at priority 0
(first come, first served). :meth:`Scenario.dedicated` builds the endpoint setup from a workload;
the pool and the salted hashes come from a :class:`kvroute.Router` given the same endpoint, so they
are the product's own (rendezvous order of the endpoint id; the documented salting).

Guarantees: a scenario is immutable and independent of any policy object, so one scenario serves
every policy of a comparison; :meth:`Scenario.check` validates it against a workload and a fleet
size (``run`` calls it) and names the bad field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvroute import Router

from .workloads import Workload

__all__ = ["Endpoint", "Scenario"]


@dataclass(frozen=True)
class Endpoint:
    """A dedicated endpoint (see ``Router.add_endpoint``): a sticky pool of ``pool_size`` workers,
    ``reserved_blocks`` per pool worker that other tenants' blocks never evict (``None``: no
    reservation), scheduling ``priority`` of its requests on the engines (higher is served
    first; the public traffic has 0), its own block-hash namespace when ``isolate``, and the
    gateway's ``warm_interval`` (seconds; ``None``: not kept warm; ``kvroute.sim.warm``)."""

    id: str
    pool_size: int = 2
    reserved_blocks: int | None = None
    priority: int = 0
    isolate: bool = True
    warm_interval: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"endpoint id must be a non-empty str, got {self.id!r}")
        if isinstance(self.pool_size, bool) or not isinstance(self.pool_size, int):
            raise TypeError(f"pool_size must be an int, got {self.pool_size!r}")
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")
        if self.reserved_blocks is not None and self.reserved_blocks < 0:
            raise ValueError(f"reserved_blocks must be >= 0, got {self.reserved_blocks}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"priority must be an int, got {self.priority!r}")
        w = self.warm_interval
        if w is not None and not (w > 0 and math.isfinite(w)):
            raise ValueError(f"warm_interval must be > 0 and finite, got {w!r}")


@dataclass(frozen=True)
class Scenario:
    """What the fleet runs besides the routing policy (see the module docs).

    - ``endpoints``: the dedicated endpoints; a router-driven policy declares each one to its
      router;
    - ``endpoint_of``: per request, the id of the endpoint it is sent to, or ``None`` (public);
    - ``reserved``: ``{worker index: {partition: blocks}}``, the reserved partitions of the
      workers' caches;
    - ``partitions``: per request, the partition its blocks are inserted into (``None``: the
      shared pool; a worker without that partition also uses the shared pool);
    - ``chains``: ``(hashes, offsets)`` like the workload's: the block hashes the engines cache
      and announce (``None``: the workload's own). Policies are still handed the workload's
      hashes: a router salts endpoint requests itself;
    - ``priority``: per request, its scheduling priority on the engine (higher first; ties in
      arrival order); ``None``: all 0;
    - ``warm_target``: per request, the worker (index) a warm request of its endpoint is sent to
      (``kvroute.sim.warm``), ``None`` for every other request; ``None``: no warm requests.
    """

    endpoints: tuple[Endpoint, ...] = ()
    endpoint_of: Sequence[str | None] | None = None
    reserved: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    partitions: Sequence[str | None] | None = None
    chains: tuple[np.ndarray, np.ndarray] | None = None
    priority: np.ndarray | None = None
    warm_target: Sequence[int | None] | None = None

    @classmethod
    def dedicated(
        cls,
        workload: Workload,
        names: Sequence[str],
        endpoint: Endpoint,
        tenant: str,
        warm_member: np.ndarray | None = None,
    ) -> Scenario:
        """``tenant``'s requests go to ``endpoint`` on the fleet of workers ``names``; every
        other request is public. The pool workers reserve ``endpoint.reserved_blocks`` for the
        endpoint's partition (named by its id), the tenant's blocks go there, are salted when the
        endpoint is isolated, and run at ``endpoint.priority``. ``warm_member`` (per request,
        ``kvroute.sim.warm.WarmPlan.member``) marks the endpoint's warm requests, each with the
        rank of the pool member it goes to: their blocks are the tenant's (salted, its
        partition), they run at priority 0."""
        router = Router(list(names), index="events", block_size=workload.block_size)
        router.add_endpoint(endpoint.id, pool_size=endpoint.pool_size, isolate=endpoint.isolate)
        pool = router.endpoint_pool(endpoint.id)
        position = {name: k for k, name in enumerate(names)}
        mask = workload.tenant_mask(tenant)
        warm = np.zeros(len(workload), dtype=bool) if warm_member is None else warm_member >= 0
        mine = np.flatnonzero(mask | warm).tolist()
        endpoint_of: list[str | None] = [None] * len(workload)
        for i in mine:
            endpoint_of[i] = endpoint.id
        reserved: dict[int, dict[str, int]] = {}
        partitions = None
        if endpoint.reserved_blocks is not None:
            reserved = {position[w]: {endpoint.id: endpoint.reserved_blocks} for w in pool}
            partitions = endpoint_of
        chains = None
        if router.endpoint_salt(endpoint.id) is not None:
            hashes = workload.hashes.copy()
            for i in mine:
                a, b = int(workload.offsets[i]), int(workload.offsets[i + 1])
                hashes[a:b] = router.salt_block_hashes(endpoint.id, workload.hashes[a:b])
            chains = (hashes, workload.offsets)
        priority = None
        if endpoint.priority:
            priority = np.where(mask, endpoint.priority, 0).astype(np.int64)
        warm_target = None
        if warm.any():
            assert warm_member is not None
            warm_target = tuple(position[pool[k]] if k >= 0 else None for k in warm_member.tolist())
        return cls(
            endpoints=(endpoint,),
            endpoint_of=tuple(endpoint_of),
            reserved=reserved,
            partitions=None if partitions is None else tuple(partitions),
            chains=chains,
            priority=priority,
            warm_target=warm_target,
        )

    def endpoint(self, endpoint_id: str) -> Endpoint:
        """The endpoint called ``endpoint_id`` (``KeyError`` if there is none)."""
        for ep in self.endpoints:
            if ep.id == endpoint_id:
                return ep
        raise KeyError(f"unknown endpoint {endpoint_id!r}")

    def check(self, n: int, num_workers: int) -> None:
        """Validates the scenario for a workload of ``n`` requests on ``num_workers`` workers."""
        ids = [ep.id for ep in self.endpoints]
        if len(set(ids)) != len(ids):
            raise ValueError(f"scenario: duplicate endpoint ids {ids}")
        for name in ("endpoint_of", "partitions", "priority", "warm_target"):
            col = getattr(self, name)
            if col is not None and len(col) != n:
                raise ValueError(
                    f"scenario: {name} needs one entry per request ({n}), got {len(col)}"
                )
        if self.endpoint_of is not None:
            unknown = {e for e in self.endpoint_of if e is not None} - set(ids)
            if unknown:
                raise ValueError(
                    f"scenario: endpoint_of names undeclared endpoints {sorted(unknown)}"
                )
        if self.warm_target is not None:
            bad_targets = sorted(
                {w for w in self.warm_target if w is not None and not 0 <= w < num_workers}
            )
            if bad_targets:
                raise ValueError(
                    f"scenario: warm_target names workers {bad_targets} of {num_workers}"
                )
            if self.endpoint_of is None or any(
                w is not None and e is None
                for w, e in zip(self.warm_target, self.endpoint_of, strict=True)
            ):
                raise ValueError("scenario: a warm request must belong to an endpoint")
        bad = [w for w in self.reserved if not 0 <= w < num_workers]
        if bad:
            raise ValueError(f"scenario: reserved names workers {bad} of {num_workers}")
        if self.chains is not None and len(self.chains[1]) != n + 1:
            raise ValueError(
                f"scenario: chains offsets need {n + 1} entries, got {len(self.chains[1])}"
            )
