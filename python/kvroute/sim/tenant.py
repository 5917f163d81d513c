"""The dedicated-endpoint study: one tenant's whole TTFT distribution under each setup, over
several seeds, and the cache pressure from which its reserved share matters.

Every setup is one run of the engine on the same arrivals with **one** :class:`kvroute.Router`
for all traffic, as ``kvroute serve`` runs it (:class:`~.policies.RouterPolicy`):

- ``random`` — the shared fleet routed at random (a plain load balancer); the tenant is one more
  client;
- ``kv_aware`` — the shared fleet routed by ``kv_aware`` (prefix-aware, load-aware) — and, when
  the endpoint's router runs another policy, the shared fleet under that policy too;
- ``endpoint`` — the same router (``EndpointOptions.policy``, default ``kv_aware``) with the
  tenant's dedicated endpoint (:meth:`~.scenario.Scenario.dedicated`): its requests are routed
  with ``endpoint=`` inside a sticky pool, their blocks are salted and kept in a reserved share
  of each pool worker's cache, and the engines schedule them at the endpoint's priority;
- ``no_reserve`` (pressure sweep only) — the endpoint without the reserved share: what an engine
  that cannot reserve cache for a tenant (stock vLLM and SGLang) gives.

For each setup and seed the tenant's own requests and the public traffic are summarised
separately (:func:`~.report.summarize`); :class:`Spread` gives the median, min and max of a
figure over the seeds.

**Cache pressure** ``k`` multiplies the public prompt volume a cache of a given size receives: each
worker's KV capacity is divided by ``k`` while the arrivals (hence the prefill load) stay the
same. It is reported with the resulting **LRU turnover**, the seconds the public traffic takes to
write a worker's whole cache once (capacity in tokens ÷ public prompt tokens per second per
worker): a block not used for that long is gone from a shared LRU. The endpoint *wins* at a
pressure when its tenant's median hit rate and median mean TTFT both beat ``kv_aware``'s.

Guarantees: deterministic for the same arguments (each run seeded by its seed); every setup of a
seed sees the same workload; nothing is shared between runs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engine import FleetModel, run, worker_names
from .policies import KVROUTE_POLICIES, RouterPolicy, make_policy
from .report import PolicyMetrics, json_ready, summarize
from .scenario import Endpoint, Scenario
from .warm import with_warm
from .workloads import Workload

__all__ = [
    "PRESSURE_SETUPS",
    "TENANT_METRICS",
    "TENANT_SETUPS",
    "PressurePoint",
    "SetupRuns",
    "Spread",
    "TenantStudy",
    "endpoint_wins",
    "lru_turnover",
    "pressure_models",
    "run_setup",
    "study_setups",
    "tenant_study",
]

#: The setups of the tenant table, in report order (plus the shared fleet under the endpoint's
#: router policy, before ``endpoint``, when that policy is another one).
TENANT_SETUPS = ("random", "kv_aware", "endpoint")
#: The setups of the pressure sweep.
PRESSURE_SETUPS = ("kv_aware", "endpoint", "no_reserve")
#: The tenant's figures reported per setup (``PolicyMetrics`` fields).
TENANT_METRICS = ("hit_rate", "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99")
#: The public traffic's figures compared with and without the endpoint.
PUBLIC_METRICS = ("ttft_p50", "ttft_p99")


@dataclass(frozen=True)
class Spread:
    """One figure over several seeds: ``values`` in seed order, their median, min and max."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        finite = [v for v in self.values if math.isfinite(v)]
        return float(statistics.median(finite)) if finite else math.nan

    @property
    def min(self) -> float:
        return float(min(self.values)) if self.values else math.nan

    @property
    def max(self) -> float:
        return float(max(self.values)) if self.values else math.nan

    def to_dict(self) -> dict[str, Any]:
        return json_ready(
            {
                "median": self.median,
                "min": self.min,
                "max": self.max,
                "per_seed": [float(v) for v in self.values],
            }
        )


@dataclass
class SetupRuns:
    """One setup's summaries, one per seed (in the study's seed order)."""

    tenant: list[PolicyMetrics] = field(default_factory=list)
    public: list[PolicyMetrics] = field(default_factory=list)

    def spread(self, metric: str, *, public: bool = False) -> Spread:
        runs = self.public if public else self.tenant
        return Spread(tuple(float(getattr(m, metric)) for m in runs))

    def to_json(self, metrics: Sequence[str], *, public: bool = False) -> dict[str, Any]:
        runs = self.public if public else self.tenant
        doc = {m: self.spread(m, public=public).to_dict() for m in metrics}
        doc["requests"] = [m.requests for m in runs]
        return doc


@dataclass
class PressurePoint:
    """The setups at one cache pressure ``factor``: ``capacity_blocks`` per worker and the LRU
    ``turnover_s`` (median over the seeds' workloads)."""

    factor: float
    capacity_blocks: int
    turnover_s: float
    setups: dict[str, SetupRuns]

    def to_json(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "capacity_blocks": self.capacity_blocks,
            "turnover_s": self.turnover_s,
            "tenant": {k: s.to_json(TENANT_METRICS) for k, s in self.setups.items()},
            "public": {k: s.to_json(PUBLIC_METRICS, public=True) for k, s in self.setups.items()},
        }


@dataclass
class TenantStudy:
    """The tenant's figures per setup over ``seeds`` (see the module docs), and the pressure
    sweep when one was run."""

    tenant: str
    endpoint: Endpoint
    policy: str
    seeds: list[int]
    setups: dict[str, SetupRuns]
    pressure: list[PressurePoint] = field(default_factory=list)

    def public_change(self, metric: str) -> Spread:
        """Per seed, the relative change of the public traffic's ``metric`` when the endpoint
        is added to the same router (``endpoint`` ÷ the shared run of ``policy`` − 1)."""
        base, ep = self.setups[self.policy].public, self.setups["endpoint"].public
        ratios = []
        for b, e in zip(base, ep, strict=True):
            before, after = getattr(b, metric), getattr(e, metric)
            ratios.append(after / before - 1.0 if before > 0 else math.nan)
        return Spread(tuple(ratios))

    def wins_from(self) -> float | None:
        """The lowest swept pressure from which the endpoint wins at every higher one (see the
        module docs), or None."""
        return endpoint_wins(self.pressure)

    # -- rendering -----------------------------------------------------------------------------

    def _span(self) -> str:
        seeds = self.seeds
        if len(seeds) == 1:
            return f"seed {seeds[0]}"
        if seeds == list(range(seeds[0], seeds[0] + len(seeds))):
            return f"seeds {seeds[0]}–{seeds[-1]}, median [min–max]"
        return f"seeds {', '.join(map(str, seeds))}, median [min–max]"

    def sections(self) -> list[tuple[str, Sequence[str], list[list[str]]]]:
        """(title, columns, rows) of the tenant table, the public-traffic table and, when swept,
        the pressure table."""
        span = self._span()
        cols = ("setup", "hit rate", "TTFT mean", "TTFT p50", "TTFT p90", "TTFT p99", "requests")
        rows = []
        for name, runs in self.setups.items():
            row = [_setup_label(name, self)]
            row.append(_cell(runs.spread("hit_rate"), _pct1))
            row += [_cell(runs.spread(m), _ms) for m in TENANT_METRICS[1:]]
            row.append(_count([m.requests for m in runs.tenant]))
            rows.append(row)
        out: list[tuple[str, Sequence[str], list[list[str]]]] = [
            (f"tenant {self.tenant!r}: its own requests ({span})", cols, rows)
        ]
        pub_cols = ("setup", "TTFT p50", "TTFT p99", "requests")
        pub_rows = [
            [
                _setup_label(name, self),
                _cell(runs.spread("ttft_p50", public=True), _ms),
                _cell(runs.spread("ttft_p99", public=True), _ms),
                _count([m.requests for m in runs.public]),
            ]
            for name, runs in self.setups.items()
        ]
        out.append((f"public traffic ({span})", pub_cols, pub_rows))
        if self.pressure:
            p_cols = ["pressure", "KV blocks/worker", "LRU turnover"]
            setups = list(self.pressure[0].setups)
            for label in ("hit", "mean", "p99"):
                p_cols += [f"{s} {label}" for s in setups]
            p_rows = []
            for p in self.pressure:
                row = [f"×{p.factor:g}", f"{p.capacity_blocks:,}", f"{p.turnover_s:,.0f} s"]
                for fig, fmt in (("hit_rate", _pct1), ("ttft_mean", _ms), ("ttft_p99", _ms)):
                    row += [fmt(p.setups[s].spread(fig).median) for s in setups]
                p_rows.append(row)
            title = f"tenant under cache pressure (medians over {span.split(',')[0]})"
            out.append((title, p_cols, p_rows))
        return out

    def notes(self) -> list[str]:
        """Sentences under the tables: the setups, the goals' figures, the pressure verdict."""
        ep = self.endpoint
        reserve = (
            f"{ep.reserved_blocks} reserved blocks" if ep.reserved_blocks else "no reservation"
        )
        lines = [
            "Setups: one Router for all traffic in each. random / kv_aware: the tenant is one "
            f"more client of the shared fleet. endpoint: a {self.policy} router with the tenant's "
            f"dedicated endpoint (pool of {ep.pool_size}, {reserve} per pool worker, salted "
            f"blocks, engine priority {ep.priority} over the public traffic's 0).",
        ]
        if ep.warm_interval is not None:
            lines.append(
                f"Kept warm (warm {ep.warm_interval:g} s): the gateway's warm requests "
                "(kvroute serve's warm_interval) run too — the endpoint's shared prefix, learnt "
                "from two of its requests, sent to every pool member at once and then every "
                f"{ep.warm_interval:g} s (a member still running the last one skipped), at "
                "priority 0, 1 output token; they load the workers and are counted in neither "
                "the tenant's nor the public figures."
            )
        if ep.reserved_blocks:
            lines.append(
                "The reservation is the simulated engines': keeping a reserved cache partition "
                "per tenant needs engine support that stock vLLM and SGLang do not have (kvroute's "
                "router only accounts for it in its own approx-mode model). On such engines the "
                "endpoint gives the 'no reserve' row" + (" and column." if self.pressure else ".")
            )
        if "random" in self.setups:
            lines.append("Endpoint vs shared random, per seed: " + self._versus("random"))
        if self.policy in self.setups:
            lines.append(
                f"Endpoint vs shared {self.policy}, per seed: " + self._versus(self.policy)
            )
            p50, p99 = self.public_change("ttft_p50"), self.public_change("ttft_p99")
            lines.append(
                f"Public traffic with the endpoint added (vs shared {self.policy}): TTFT p50 "
                f"{_signed(p50.median)} [{_signed(p50.min)}, {_signed(p50.max)}], p99 "
                f"{_signed(p99.median)} [{_signed(p99.min)}, {_signed(p99.max)}]."
            )
        if self.pressure:
            k = self.wins_from()
            lines.append(
                "Pressure ×k: each worker's KV capacity ÷ k at the same load (k times the public "
                "prompt volume per block of cache); LRU turnover = seconds the public traffic "
                "takes to write a worker's cache once; no_reserve = the endpoint without its "
                "reserved share (an engine that cannot reserve cache for a tenant). "
                + (
                    "The endpoint beats shared kv_aware (median hit rate and mean TTFT) from "
                    f"×{k:g} on."
                    if k is not None
                    else "The endpoint does not beat shared kv_aware at every pressure swept."
                )
            )
        return lines

    def _versus(self, base: str) -> str:
        """Per-seed changes of the endpoint's tenant figures against the shared ``base`` run."""
        ep, b = self.setups["endpoint"].tenant, self.setups[base].tenant
        parts = []
        for label, metric in (("mean", "ttft_mean"), ("p50", "ttft_p50"), ("p99", "ttft_p99")):
            ch = [getattr(e, metric) / getattr(x, metric) - 1.0 for e, x in zip(ep, b, strict=True)]
            parts.append(f"TTFT {label} {_signed(max(ch))} at worst ({_signed(min(ch))} at best)")
        hit = min(m.hit_rate for m in ep)
        return f"hit rate ≥ {hit:.1%}; " + "; ".join(parts) + "."

    def plot(self, ax_ttft: Any, ax_side: Any) -> None:
        """Draws the tenant's TTFT figures per setup on ``ax_ttft`` (bars at the median, whiskers
        from min to max over the seeds) and, on ``ax_side``, its hit rate and mean TTFT against
        cache pressure when swept, else its hit rate per setup (matplotlib axes)."""
        names = list(self.setups)
        figures = TENANT_METRICS[1:]
        width = 0.8 / len(figures)
        x = np.arange(len(names))
        for k, metric in enumerate(figures):
            spreads = [self.setups[n].spread(metric) for n in names]
            med = np.array([sp.median for sp in spreads])
            err = np.array([[med[i] - sp.min, sp.max - med[i]] for i, sp in enumerate(spreads)]).T
            label = metric.replace("ttft_", "")
            ax_ttft.bar(x + (k - 1.5) * width, med, width, yerr=err, capsize=2, label=label)
        ax_ttft.set_yscale("log")
        ax_ttft.set_ylabel("tenant TTFT (s)")
        ax_ttft.set_xticks(x)
        ax_ttft.set_xticklabels([_setup_label(n, self) for n in names], rotation=15, ha="right")
        ax_ttft.legend(fontsize="small", ncol=4)
        ax_ttft.set_title(f"tenant {self.tenant!r}, {self._span()}", fontsize="small")
        if not self.pressure:
            hits = [100 * self.setups[n].spread("hit_rate").median for n in names]
            ax_side.bar(x, hits, color="tab:blue")
            ax_side.set_xticks(x)
            ax_side.set_xticklabels([_setup_label(n, self) for n in names], rotation=15, ha="right")
            ax_side.set_ylabel("tenant hit rate (%)")
            ax_side.set_ylim(0, 100)
            return
        ks = [p.factor for p in self.pressure]
        twin = ax_side.twinx()
        for name in self.pressure[0].setups:
            hits = [100 * p.setups[name].spread("hit_rate").median for p in self.pressure]
            means = [p.setups[name].spread("ttft_mean").median for p in self.pressure]
            (line,) = ax_side.plot(ks, hits, marker="o", label=f"{name} hit rate")
            twin.plot(ks, means, marker="s", ls="--", color=line.get_color(), label=f"{name} mean")
        ax_side.set_xscale("log", base=2)
        ax_side.set_xlabel("cache pressure ×k (KV capacity per worker ÷ k)")
        ax_side.set_ylabel("tenant hit rate (%, solid)")
        ax_side.set_ylim(0, 100)
        twin.set_ylabel("tenant TTFT mean (s, dashed)")
        ax_side.legend(fontsize="small", loc="lower left")

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "tenant": {k: s.to_json(TENANT_METRICS) for k, s in self.setups.items()},
            "public": {k: s.to_json(PUBLIC_METRICS, public=True) for k, s in self.setups.items()},
            "seeds": list(self.seeds),
        }
        if self.endpoint.warm_interval is not None:
            doc["warm_interval"] = self.endpoint.warm_interval
        if self.pressure:
            doc["pressure"] = [p.to_json() for p in self.pressure]
            doc["pressure_wins_from"] = self.wins_from()
        return doc


def _setup_label(name: str, study: TenantStudy) -> str:
    warm = study.endpoint.warm_interval
    kind = study.policy if warm is None else f"{study.policy}, warm {warm:g} s"
    if name == "endpoint":
        return f"endpoint ({kind})"
    if name == "no_reserve":
        return f"endpoint ({kind}), no reserve"
    return f"shared, {name}"


def _ms(x: float, unit: bool = True) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x * 1000:,.0f}" + (" ms" if unit else "")


def _pct1(x: float, unit: bool = True) -> str:
    return f"{x * 100:.1f}" + ("%" if unit else "") if math.isfinite(x) else "—"


def _signed(x: float) -> str:
    return f"{x:+.0%}" if math.isfinite(x) else "—"


def _cell(spread: Spread, fmt: Callable[..., str]) -> str:
    """``median [min–max]`` (just the value for one seed)."""
    if len(spread.values) == 1:
        return fmt(spread.median)
    return f"{fmt(spread.median)} [{fmt(spread.min, False)}–{fmt(spread.max, False)}]"


def _count(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


def endpoint_wins(points: Sequence[PressurePoint]) -> float | None:
    """The lowest pressure factor from which, at that point and every higher one, the endpoint's
    median tenant hit rate and median mean TTFT both beat ``kv_aware``'s; None if it never does
    (or the points lack either setup)."""

    def wins(p: PressurePoint) -> bool:
        ep, kv = p.setups.get("endpoint"), p.setups.get("kv_aware")
        if ep is None or kv is None:
            return False
        return (
            ep.spread("hit_rate").median > kv.spread("hit_rate").median
            and ep.spread("ttft_mean").median < kv.spread("ttft_mean").median
        )

    ordered = sorted(points, key=lambda p: p.factor)
    start: float | None = None
    for p in ordered:
        if wins(p):
            start = p.factor if start is None else start
        else:
            start = None
    return start


def pressure_models(
    model: FleetModel, block_size: int, pressure: Sequence[float], reserved: int | None
) -> list[FleetModel]:
    """``model`` with each worker's capacity divided by each factor of ``pressure``; raises
    ``ValueError`` for a factor that is not positive and finite, or one at which ``reserved``
    blocks no longer fit in a worker's cache."""
    base = model.capacity(block_size)
    out = []
    for k in pressure:
        if not (k > 0 and math.isfinite(k)):
            raise ValueError(f"pressure factors must be positive and finite, got {k}")
        cap = max(1, int(base / k))
        if reserved is not None and reserved > cap:
            raise ValueError(
                f"reserved_blocks = {reserved} do not fit in a worker's {cap} blocks at pressure "
                f"×{k:g}"
            )
        out.append(dataclasses.replace(model, capacity_blocks=cap))
    return out


def lru_turnover(workload: Workload, model: FleetModel) -> float:
    """Seconds the public traffic takes to write one worker's whole KV capacity (capacity in
    tokens ÷ public prompt tokens per second per worker)."""
    public = ~workload.tenant_mask(workload.meta.get("tenant"))
    tokens = float(workload.input_tokens[public].sum())
    rate = tokens / max(workload.duration, 1e-9) / model.workers
    return model.capacity(workload.block_size) * workload.block_size / rate if rate else math.inf


def run_setup(
    setup: str,
    workload: Workload,
    model: FleetModel,
    endpoint: Endpoint,
    *,
    policy: str = "kv_aware",
    index: str = "events",
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, RouterPolicy]:
    """One run of ``setup`` (see the module docs) for ``workload``'s tenant; the result records
    and the policy (its router, and the predictions it made for the endpoint's requests)."""
    tenant = workload.meta.get("tenant")
    if tenant is None:
        raise ValueError(f"workload {workload.name!r} has no tenant (meta['tenant'])")
    opts = dict(options or {})
    scenario = None
    ep = endpoint
    if setup in KVROUTE_POLICIES:  # the shared fleet under that policy
        p = make_policy(setup, index=index, seed=seed, options=opts)
    elif setup in ("endpoint", "no_reserve"):
        p = RouterPolicy(policy, index=index, seed=seed, options=opts)
        ep = endpoint if setup == "endpoint" else _without_reserve(endpoint)
        scenario = Scenario.dedicated(workload, worker_names(model.workers), ep, tenant)
    else:
        raise ValueError(
            f"unknown tenant setup {setup!r}; one of {TENANT_SETUPS + PRESSURE_SETUPS}"
        )
    assert isinstance(p, RouterPolicy)
    if scenario is None or ep.warm_interval is None:
        return run(workload, p, model, scenario=scenario, progress=progress), p
    # Kept warm: the run has the gateway's warm requests too; the results are the workload's.
    # The prefix is capped by the reservation the gateway is configured with, which an engine
    # without reservations (no_reserve) does not change.
    plan = with_warm(
        workload,
        tenant,
        interval=ep.warm_interval,
        pool_size=ep.pool_size,
        max_blocks=endpoint.reserved_blocks,
    )
    names = worker_names(model.workers)
    scenario = Scenario.dedicated(plan.workload, names, ep, tenant, plan.member)
    results = run(plan.workload, p, model, scenario=scenario, progress=progress)
    position = np.flatnonzero(plan.original)  # original request -> its row in the run
    p.predicted = {i: p.predicted[int(r)] for i, r in enumerate(position) if int(r) in p.predicted}
    p.warm_results = results[~plan.original]
    return results[plan.original], p


def study_setups(policy: str, reserve: bool = False) -> list[str]:
    """The setups the study runs on every seed: :data:`TENANT_SETUPS`, plus the shared fleet
    under ``policy`` (the endpoint's policy) when that is not among them, then endpoint, and
    ``no_reserve`` when the endpoint has a reservation (``reserve``): the endpoint on engines
    that cannot reserve cache for a tenant."""
    shared = [s for s in TENANT_SETUPS if s != "endpoint"]
    extra = [policy] if policy not in shared else []
    return [*shared, *extra, "endpoint", *(["no_reserve"] if reserve else [])]


def _without_reserve(endpoint: Endpoint) -> Endpoint:
    return dataclasses.replace(endpoint, reserved_blocks=None)


def _summaries(results: np.ndarray, workload: Workload, model: FleetModel):
    mask = workload.tenant_mask(workload.meta["tenant"])
    n = model.workers
    return summarize(results, num_workers=n, mask=mask), summarize(
        results, num_workers=n, mask=~mask
    )


def tenant_study(
    workloads: Mapping[int, Workload],
    model: FleetModel,
    endpoint: Endpoint,
    *,
    policy: str = "kv_aware",
    index: str = "events",
    options: Mapping[str, Any] | None = None,
    pressure: Sequence[float] = (),
    done: Mapping[tuple[int, str], np.ndarray] | None = None,
    tick: Callable[[int], None] | None = None,
) -> TenantStudy:
    """Runs :data:`TENANT_SETUPS` on every seed's workload (``{seed: workload}``, each with the
    same tenant) and, for each factor in ``pressure``, :data:`PRESSURE_SETUPS` with each worker's
    capacity divided by it. ``done[(seed, setup)]`` are results already computed (not re-run).
    ``tick(n)`` is called after each run with the requests it replayed."""
    if not workloads:
        raise ValueError("tenant_study needs at least one seed")
    tenants = {w.meta.get("tenant") for w in workloads.values()}
    if len(tenants) != 1 or None in tenants:
        raise ValueError(f"every workload needs the same tenant, got {sorted(map(str, tenants))}")
    tenant = str(tenants.pop())
    if endpoint.id != tenant:
        raise ValueError(f"endpoint {endpoint.id!r} is not the workloads' tenant {tenant!r}")
    first = next(iter(workloads.values()))
    fleets = pressure_models(model, first.block_size, pressure, endpoint.reserved_blocks)
    base = model.capacity(first.block_size)
    kw = {"policy": policy, "index": index, "options": options}
    # (seed, setup, capacity) -> (tenant, public) summaries; a run is never repeated.
    computed: dict[tuple[int, str, int], tuple[PolicyMetrics, PolicyMetrics]] = {}
    for (seed, setup), r in (done or {}).items():
        if seed in workloads:
            computed[(seed, setup, base)] = _summaries(r, workloads[seed], model)

    def runs_for(setups: Sequence[str], fleet: FleetModel) -> dict[str, SetupRuns]:
        cap = fleet.capacity(first.block_size)
        out = {s: SetupRuns() for s in setups}
        for seed, w in workloads.items():
            for s in setups:
                key = (seed, s, cap)
                if key not in computed:
                    r, _ = run_setup(s, w, fleet, endpoint, seed=seed, **kw)
                    computed[key] = _summaries(r, w, fleet)
                    if tick is not None:
                        tick(len(w))
                t, p = computed[key]
                out[s].tenant.append(t)
                out[s].public.append(p)
        return out

    study = TenantStudy(
        tenant=tenant,
        endpoint=endpoint,
        policy=policy,
        seeds=list(workloads),
        setups=runs_for(study_setups(policy, bool(endpoint.reserved_blocks)), model),
    )
    for k, fleet in zip(pressure, fleets, strict=True):
        turnover = statistics.median(lru_turnover(w, fleet) for w in workloads.values())
        cap = fleet.capacity(first.block_size)
        study.pressure.append(
            PressurePoint(float(k), cap, float(turnover), runs_for(PRESSURE_SETUPS, fleet))
        )
    return study
