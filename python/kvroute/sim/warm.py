"""Warm requests in the simulator: what ``kvroute serve`` sends to keep a dedicated endpoint's
shared prefix warm on its pool (``[[endpoints]] warm_interval``, ``kvroute.gateway.warm``), as
extra requests of the workload.

The gateway learns the prefix with :class:`kvroute.server.warm.WarmPrefix`; here the same rule
runs on the tenant's block-hash chains (a chain's leading hashes are equal exactly as far as the
whole blocks of the prompts are), at each tenant request's arrival. The first prefix learnt
starts a pass at once; passes then run every ``interval`` seconds until the workload's last
arrival, each with the prefix learnt by then: one request per pool member (``output_tokens = 1``,
routed to that member, run at priority 0). A member whose last warm request has not finished is
skipped, as the gateway skips it (:class:`~kvroute.sim.policies.RouterPolicy` drops it: see
:class:`~kvroute.sim.engine.Policy`).

Guarantees: the original requests keep their order in the returned workload (a warm request
arriving with one comes after it); ``member`` is ``-1`` for them and the pool member's rank
(``0 .. pool_size - 1``, in ``Router.endpoint_pool`` order) for warm requests; ``original`` marks
the original rows, so ``results[original]`` are the original workload's results in its order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvroute.server.warm import WarmPrefix

from .workloads import Workload

__all__ = ["WarmPlan", "warm_label", "with_warm"]


def warm_label(tenant: str) -> str:
    """The tenant label of ``tenant``'s warm requests (not the tenant's: its figures exclude
    them, and they are no public traffic either)."""
    return f"warm:{tenant}"


@dataclass(frozen=True)
class WarmPlan:
    """A workload with its warm requests (module docs)."""

    workload: Workload
    original: np.ndarray
    member: np.ndarray

    @property
    def passes(self) -> int:
        return int((self.member == 0).sum())


def with_warm(
    workload: Workload,
    tenant: str,
    *,
    interval: float,
    pool_size: int,
    max_blocks: int | None = None,
) -> WarmPlan:
    """``workload`` with the warm requests of ``tenant``'s endpoint (module docs); the prefix is
    at most ``max_blocks`` blocks (its reserved blocks)."""
    if not (interval > 0 and np.isfinite(interval)):
        raise ValueError(f"warm interval must be > 0 and finite, got {interval!r}")
    n = len(workload)
    learnt = WarmPrefix(1, max_blocks or None)
    changes: list[tuple[float, np.ndarray]] = []  # (arrival, prefix learnt there)
    for i in np.flatnonzero(workload.tenant_mask(tenant)).tolist():
        if learnt.learn(workload.block_hashes(i)) != "same":
            assert learnt.prefix is not None
            changes.append((float(workload.arrival[i]), learnt.prefix))
    times: list[float] = []
    chains: list[np.ndarray] = []
    if changes:
        end = float(workload.arrival[-1])
        t, k = changes[0][0], 0
        while t <= end:
            while k + 1 < len(changes) and changes[k + 1][0] <= t:
                k += 1
            times += [t] * pool_size
            chains += [changes[k][1]] * pool_size
            t += interval
    m = len(times)
    lengths = np.array([len(c) for c in chains], dtype=np.int64)
    arrival = np.concatenate([workload.arrival, np.asarray(times, dtype=np.float64)])
    member = np.concatenate([np.full(n, -1), np.tile(np.arange(pool_size), m // pool_size)])
    hashes = np.concatenate([workload.hashes, *chains]) if chains else workload.hashes
    offsets = np.concatenate([workload.offsets, workload.offsets[-1] + np.cumsum(lengths)])
    input_tokens = np.concatenate([workload.input_tokens, lengths * workload.block_size])
    order = np.argsort(arrival, kind="stable")  # the order Workload sorts its rows in
    aug = Workload(
        arrival=arrival,
        input_tokens=input_tokens,
        output_tokens=np.concatenate([workload.output_tokens, np.ones(m, dtype=np.int64)]),
        hashes=hashes,
        offsets=offsets,
        block_size=workload.block_size,
        tenant=[*workload.tenant, *[warm_label(tenant)] * m],
        session=[*workload.session, *[None] * m],
        name=workload.name,
        description=workload.description,
        meta=workload.meta,
    )
    return WarmPlan(aug, order < n, member[order])
