"""Many router replicas behind an L4 balancer: ``kvroute simulate --replicas N --replica-sync S``.

A production gateway runs several replicas; each request reaches one of them (round robin over
the arrivals, as an L4 balancer spreads connections). :class:`ReplicaPolicy` models exactly
that: ``N`` :class:`kvroute.Router` objects in approx mode, each with its own model of the
caches and its own load view (the requests it routed itself), driven as a gateway replica drives
its router (``route``/``begin``/``prefilled``/``observe``/``finish``). What they share is the
``sync`` setting, which is the product's replica sync (:mod:`kvroute.cluster`) with the bus
modelled:

- ``none``: nothing; every replica learns only from its own decisions.
- ``shared``: every model update (``Router.take_updates``) is applied by every other replica at
  once (``Router.apply_updates``): one shared picture of the caches, a bus without delay.
- ``bus:D``: the same updates reach the other replicas ``D`` milliseconds later (virtual time;
  an update is applied before the first routing event at or after its arrival).

Load: with ``scrape=S`` seconds (``--replica-scrape``), every replica also reads each engine's
load every ``S`` seconds, as the product's metrics scraper does (:mod:`kvroute.cluster.scrape`):
running + waiting requests and the blocks its running requests hold (vLLM's
``num_requests_running``/``num_requests_waiting`` and KV usage), fed to ``Router.set_load``
as a baseline for the replica's own changes until the next scrape. Waiting prompts' sizes are not
in an engine's metrics: the prefill baseline is the waiting requests times the replica's own mean
prefill per request (what the product estimates from the engines' prompt-length histograms).

``N = 1`` with ``none`` is the single router every other setting is compared with.

Timestamps matter here as nowhere else: a request is routed without the updates published less
than the bus delay before it. The bundled Mooncake trace's timestamps come in 3 s steps (90% of
its requests share their timestamp with the previous one); replayed as given, each step is a
burst of simultaneous requests that no bus, however fast, lets the replicas see each other
route. ``Workload.spread`` (``--spread 3``) spreads each burst over its step, as the requests
arrived.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engine import Fleet, FleetModel, Policy, run
from .policies import fleet_router
from .report import PolicyMetrics, json_ready, summarize
from .workloads import Workload

__all__ = [
    "ReplicaPolicy",
    "ReplicaStudy",
    "parse_replica_sync",
    "render_replicas",
    "replica_study",
]


def parse_replica_sync(text: str) -> float | None:
    """``"none"`` -> None (no sharing), ``"shared"`` -> 0.0, ``"bus:D"`` -> D ms as seconds."""
    text = text.strip()
    if text == "none":
        return None
    if text == "shared":
        return 0.0
    if text.startswith("bus:"):
        try:
            ms = float(text[4:])
        except ValueError:
            ms = math.nan
        if not (ms >= 0 and math.isfinite(ms)):
            raise ValueError(f"bus delay must be a number of milliseconds >= 0, got {text!r}")
        return ms / 1000.0
    raise ValueError(f"replica sync must be none, shared or bus:DELAY_MS, got {text!r}")


class ReplicaPolicy(Policy):
    """``replicas`` routers behind a round-robin balancer (see the module docs).

    ``delay``: None (no sync) or the bus delay in seconds (0 = shared). ``scrape``: seconds
    between engine load scrapes (None: each replica sees only its own requests). ``options`` go
    to every Router's constructor.
    """

    routes_endpoints = True

    def __init__(
        self,
        policy: str = "kv_aware",
        *,
        replicas: int,
        delay: float | None = None,
        scrape: float | None = None,
        seed: int = 0,
        options: dict[str, Any] | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if scrape is not None and not (scrape > 0 and math.isfinite(scrape)):
            raise ValueError(f"scrape must be a positive number of seconds, got {scrape}")
        self.name = policy
        self.replicas = replicas
        self.delay = delay
        self.scrape = scrape
        self.seed = seed
        self.options = dict(options or {})
        self.routers: list[Any] = []
        self.stats = {"published": 0, "applied": 0, "unanchored": 0}

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        self.routers = [
            fleet_router(
                fleet,
                self.name,
                index="approx",
                seed=self.seed + k,
                options=self.options,
                updates=self.delay is not None,
            )
            for k in range(self.replicas)
        ]
        self.sessions = fleet.workload.session
        self.endpoint_of = fleet.scenario.endpoint_of or [None] * len(fleet.workload)
        self.decisions: dict[int, tuple[int, Any]] = {}
        self.arrivals = 0
        self.bus: list[tuple[float, int, int, bytes]] = []
        self.sent = 0
        self.next_scrape = 0.0
        # Per replica: (requests routed, predicted prefill blocks) for the prefill estimate.
        self.prefill_seen = [[0, 0] for _ in range(self.replicas)]
        self.stats = {"published": 0, "applied": 0, "unanchored": 0}

    def _publish(self, k: int, now: float) -> None:
        if self.delay is None:
            return
        batch = self.routers[k].take_updates()
        if not batch:
            return
        self.stats["published"] += 1
        if self.delay == 0:
            self._apply(k, batch, now)
        else:
            self.sent += 1
            heapq.heappush(self.bus, (now + self.delay, self.sent, k, batch))

    def _apply(self, k: int, batch: bytes, now: float) -> None:
        for j, r in enumerate(self.routers):
            if j != k:
                s = r.apply_updates(batch, now=now)
                self.stats["applied"] += s["records"] + s["forgets"]
                self.stats["unanchored"] += s["unanchored"]

    def _deliver(self, now: float) -> None:
        while self.bus and self.bus[0][0] <= now:
            at, _, k, batch = heapq.heappop(self.bus)
            self._apply(k, batch, at)

    def _scrape(self, now: float) -> None:
        if self.scrape is None or now < self.next_scrape:
            return
        self.next_scrape = now + self.scrape
        fleet = self.fleet
        for k, r in enumerate(self.routers):
            seen, blocks = self.prefill_seen[k]
            per_request = blocks / seen if seen else 0.0
            for w, name in enumerate(fleet.names):
                r.set_load(
                    name,
                    active=fleet.waiting[w] + fleet.running[w],
                    queued=fleet.waiting[w],
                    prefill_blocks=round(fleet.waiting[w] * per_request),
                    decode_blocks=len(fleet.pinned[w]),
                )

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        self._deliver(now)
        self._scrape(now)
        k = self.arrivals % self.replicas
        self.arrivals += 1
        router = self.routers[k]
        d = router.route(
            block_hashes=chain,
            key=self.sessions[request],
            endpoint=self.endpoint_of[request],
            now=now,
        )
        router.begin(d)
        seen = self.prefill_seen[k]
        seen[0] += 1
        seen[1] += d.prompt_blocks - d.cached_blocks
        self.decisions[request] = (k, d)
        self._publish(k, now)
        return self.fleet.position[d.worker]

    def first_token(self, request: int, worker: int, now: float) -> None:
        k, d = self.decisions[request]
        self.routers[k].prefilled(d)
        self._publish(k, now)

    def finished(self, request: int, worker: int, cached_tokens: int, now: float) -> None:
        k, d = self.decisions.pop(request)
        self.routers[k].observe(d, cached_tokens, now=now)
        self.routers[k].finish(d, now=now)
        self._publish(k, now)


@dataclass
class ReplicaStudy:
    """Metrics per ``(replicas, sync label)``; ``baseline`` is ``(1, "none")``."""

    title: str
    metrics: dict[tuple[int, str], PolicyMetrics] = field(default_factory=dict)
    stats: dict[tuple[int, str], dict[str, int]] = field(default_factory=dict)

    def vs_single(self, m: PolicyMetrics) -> float:
        """``m``'s hit rate ÷ the single router's (NaN when that is missing or 0)."""
        base = self.metrics.get((1, "none"))
        return m.hit_rate / base.hit_rate if base and base.hit_rate else math.nan

    def to_json(self) -> dict[str, Any]:
        """``{"title", "rows": [{"replicas", "sync", "hit_rate", "vs_single", "ttft_p50",
        "ttft_p99", "ttft_mean", stats...}]}``, non-finite numbers as None."""
        rows = []
        for (n, sync), m in self.metrics.items():
            rows.append(
                {
                    "replicas": n,
                    "sync": sync,
                    "hit_rate": m.hit_rate,
                    "vs_single": self.vs_single(m),
                    "ttft_p50": m.ttft_p50,
                    "ttft_p99": m.ttft_p99,
                    "ttft_mean": m.ttft_mean,
                    **self.stats.get((n, sync), {}),
                }
            )
        return json_ready({"title": self.title, "rows": rows})


def replica_study(
    workload: Workload,
    *,
    model: FleetModel,
    replicas: Sequence[int],
    syncs: Sequence[str],
    policy: str = "kv_aware",
    scrape: float | None = None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplicaStudy:
    """Runs ``policy`` behind every replica count and sync setting (``(1, "none")`` always, as
    the baseline; a single replica has nothing to sync with, so N = 1 runs once)."""
    labels = list(dict.fromkeys(s.strip() for s in syncs))  # each setting runs once
    for s in labels:
        parse_replica_sync(s)
    study = ReplicaStudy(
        title=(
            f"{workload.name}: {len(workload):,} requests, {model.workers} workers, "
            f"{policy} replicas in approx mode (round robin over the arrivals)"
            + (f", engine load scraped every {scrape:g} s" if scrape else "")
        )
    )
    runs = [(1, "none")] + [(n, s) for n in sorted(set(replicas)) if n > 1 for s in labels]
    for n, s in runs:
        p = ReplicaPolicy(
            policy,
            replicas=n,
            delay=parse_replica_sync(s),
            scrape=scrape if n > 1 else None,
            seed=seed,
            options=options,
        )
        results = run(workload, p, model, progress=progress)
        study.metrics[(n, s)] = summarize(results, num_workers=model.workers)
        study.stats[(n, s)] = dict(p.stats)
    return study


def render_replicas(study: ReplicaStudy) -> str:
    """The study as a Markdown table (hit rate, its ratio to one router, TTFT p50 / p99)."""
    lines = [
        study.title,
        "",
        "| replicas | sync | hit rate | × one router | TTFT p50 | TTFT p99 | TTFT mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for (n, s), m in study.metrics.items():
        lines.append(
            f"| {n} | {s if n > 1 else '-'} | {m.hit_rate:.1%} | {study.vs_single(m):.2f} | "
            f"{m.ttft_p50:.2f} s | {m.ttft_p99:.2f} s | {m.ttft_mean:.2f} s |"
        )
    return "\n".join(lines) + "\n"
