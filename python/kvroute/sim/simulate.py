"""``kvroute simulate``: every policy on the same arrivals, the two oracles, and a report.

:func:`simulate` runs each named policy through the engine (:mod:`.engine`) on one workload and
fleet model, computes the infinite-cache and pooled-LRU oracles (the pooled LRU on a
``kvroute.BlockCache`` of the fleet's total capacity), and returns a :class:`~.report.Report`.

For a workload with a tenant (the ``endpoint`` scenario records it in ``meta["tenant"]``) it also
runs the tenant study (:mod:`.tenant`) over this workload's seed and any further seeds' workloads
(``tenant_workloads``), and optionally the cache-pressure sweep, into the report's ``tenant``:
the tenant on the shared fleet under ``random`` and ``kv_aware``, and through its dedicated
endpoint (one :class:`~.policies.RouterPolicy` for all traffic, the tenant's requests sent with
``endpoint=``: sticky pool, reserved share, salted blocks, priority) — what ``kvroute serve``
does with one ``[[endpoints]]`` entry. The two-call demo — the tenant's first two requests, and
what the router predicted for them — goes into the report's notes.

Guarantees: the same arguments give the same report (every random choice is seeded by ``seed``);
all policies see identical arrivals; nothing is shared between runs (fresh fleet, fresh policy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute import BlockCache

from .engine import FleetModel, run, worker_names
from .instruments import Recorder, explain
from .oracles import infinite_cache, pooled_lru
from .policies import DEFAULT_POLICIES, RouterPolicy, make_policy
from .report import Progress, Report, summarize
from .scenario import Endpoint, Scenario
from .synthetic import SCENARIOS
from .tenant import PRESSURE_SETUPS, pressure_models, run_setup, study_setups, tenant_study
from .traces import claude_code_sessions, load_trace, mooncake_conversation
from .workloads import Workload, WorkloadBuilder

__all__ = ["SCENARIO_WORKERS", "EndpointOptions", "load_workload", "simulate", "unbounded_load"]

#: Default fleet size per scenario: the synthetic scenarios are sized for 8 workers; the Mooncake
#: conversation trace (41k prompt tokens/s) is the issue's 16-worker benchmark.
SCENARIO_WORKERS = {
    "endpoint": 16,
    "rag": 8,
    "agent": 8,
    "mooncake": 16,
    "claude-code": 4,
    "trace": 8,
}


#: The bundled traces' block sizes: they were recorded in them.
_RECORDED = {"mooncake": 512, "claude-code": 64}


def load_workload(
    scenario: str = "endpoint",
    *,
    trace: str | None = None,
    seed: int = 0,
    duration: float | None = None,
    block_size: int | None = None,
) -> Workload:
    """The workload of a scenario name or a trace file (Mooncake or Qwen-Bailian JSONL,
    kv-cache-tester JSON; detected). ``duration`` and ``block_size`` apply to the synthetic
    scenarios (and ``block_size`` to Mooncake and Qwen-Bailian files); given where they do not
    apply, they are refused (``ValueError``), not ignored."""
    if duration is not None and (trace is not None or scenario in _RECORDED):
        raise ValueError(
            f"--duration applies to the synthetic scenarios ({', '.join(SCENARIOS)}), not to "
            f"{'--trace' if trace is not None else f'--scenario {scenario}'}"
        )
    if block_size is not None and trace is None and scenario in _RECORDED:
        raise ValueError(
            f"--block-size applies to the synthetic scenarios and to Mooncake or Qwen-Bailian "
            f"traces, not to --scenario {scenario} (recorded in {_RECORDED[scenario]}-token blocks)"
        )
    if trace is not None:
        if block_size is None:
            return load_trace(trace)
        try:
            return load_trace(trace, block_size=block_size)
        except TypeError:  # the kv-cache-tester loader takes no block size
            raise ValueError(
                f"{trace}: a block size applies to Mooncake and Qwen-Bailian traces only "
                "(kv-cache-tester files carry their own)"
            ) from None
    if scenario == "mooncake":
        return mooncake_conversation()
    if scenario == "claude-code":
        return claude_code_sessions(seed=seed)
    if scenario not in SCENARIOS:
        raise ValueError(
            f"unknown scenario {scenario!r}; choose from "
            f"{', '.join(['mooncake', 'claude-code', *SCENARIOS])}"
        )
    kw: dict[str, Any] = {"seed": seed}
    if duration is not None:
        kw["duration"] = duration
    if block_size is not None:
        kw["block_size"] = block_size
    return SCENARIOS[scenario](**kw)


@dataclass(frozen=True)
class EndpointOptions:
    """The dedicated endpoint of the tenant: ``pool_size`` workers (rendezvous top-k of the
    fleet; default 4: the endpoint's requests wait behind a running prefill only when every pool
    worker is busy, and prefills are not preempted), ``reserved_blocks`` per pool worker
    (default: twice the tenant's system prompt in blocks — the prompt itself plus room for the
    question blocks of the requests around it),
    engine scheduling ``priority`` of its requests (default 1, one above the public traffic's 0:
    the engines run priority scheduling, vLLM ``--scheduling-policy priority``), and ``policy``,
    the router's policy for all traffic in the endpoint setup (inside the pool for the
    endpoint's requests), and ``warm_interval``: the gateway keeps the endpoint's shared prefix
    warm on its pool every so many seconds (``kvroute.sim.warm``; default: not kept warm)."""

    pool_size: int = 4
    reserved_blocks: int | None = None
    policy: str = "kv_aware"
    priority: int = 1
    warm_interval: float | None = None

    def reserved_for(self, workload: Workload) -> int:
        if self.reserved_blocks is not None:
            return int(self.reserved_blocks)
        system = int(workload.meta.get("tenant_system_tokens", workload.block_size))
        return 2 * math.ceil(system / workload.block_size)

    def check(self, workload: Workload, model: FleetModel, pressure: Sequence[float] = ()) -> None:
        """Raises ``ValueError`` naming the problem when this endpoint cannot run on ``model``
        (pool larger than the fleet, a negative reservation or one larger than a worker's cache,
        at full capacity or at any of the ``pressure`` factors) — before any simulation starts."""
        if not 1 <= self.pool_size <= model.workers:
            raise ValueError(
                f"pool_size must be between 1 and the {model.workers} workers, got {self.pool_size}"
            )
        w = self.warm_interval
        if w is not None and not (w > 0 and math.isfinite(w)):
            raise ValueError(f"--warm-interval must be > 0 seconds and finite, got {w:g}")
        reserved = self.reserved_for(workload)
        given = (
            "--reserved-blocks"
            if self.reserved_blocks is not None
            else "default: 2x the tenant's system prompt"
        )
        if reserved < 0:
            raise ValueError(f"--reserved-blocks must be >= 0, got {reserved}")
        cap = model.capacity(workload.block_size)
        if reserved > cap:
            raise ValueError(
                f"the endpoint's reserved blocks ({given}: {reserved} per pool worker) do not "
                f"fit in a worker's {cap} KV blocks (--capacity-blocks)"
            )
        pressure_models(model, workload.block_size, pressure, reserved)

    def endpoint(self, workload: Workload, tenant: str) -> Endpoint:
        """The endpoint ``tenant`` is given on ``workload``."""
        return Endpoint(
            tenant,
            pool_size=self.pool_size,
            reserved_blocks=self.reserved_for(workload),
            priority=self.priority,
            warm_interval=self.warm_interval,
        )


def simulate(
    workload: Workload,
    *,
    model: FleetModel,
    policies: Sequence[str] = DEFAULT_POLICIES,
    index: str = "events",
    seed: int = 0,
    endpoint: EndpointOptions | None = None,
    progress: bool = True,
    policy_options: dict[str, dict[str, Any]] | None = None,
    instrument: bool = False,
    tenant_workloads: Mapping[int, Workload] | None = None,
    pressure: Sequence[float] = (),
) -> tuple[Report, dict[str, np.ndarray]]:
    """Run ``policies`` (names, see :mod:`.policies`) and the oracles; returns the report and the
    raw result records per run (policy names, plus ``"endpoint"`` for the tenant's endpoint setup
    on this workload). ``policy_options[name]`` is passed to :func:`~.policies.make_policy` as
    ``options``. ``instrument`` records every decision of every policy (:mod:`.instruments`): the
    report's ``decisions`` holds each policy's :func:`~.instruments.explain` summary, and the raw
    rows are returned under ``"decisions:<policy>"``. For a workload with a tenant,
    ``tenant_workloads`` (``{seed: workload}``) are further seeds for the tenant study (when it
    holds ``seed`` too, the study runs exactly its seeds, in its order) and
    ``pressure`` its cache-pressure factors (:func:`~.tenant.tenant_study`)."""
    n = len(workload)
    cap = model.capacity(workload.block_size)
    tenant = workload.meta.get("tenant")
    endpoint = endpoint or EndpointOptions()
    options = policy_options or {}
    runs: list[str] = list(policies)
    seeds: dict[int, Workload] = {}
    setups: list[str] = []
    if tenant is not None:  # the tenant's shared-fleet baselines
        endpoint.check(workload, model, pressure)
        setups = study_setups(endpoint.policy, bool(endpoint.reserved_for(workload)))
        runs += [p for p in setups if p not in ("endpoint", "no_reserve") and p not in runs]
        given = dict(tenant_workloads or {})
        if seed in given:  # the study's seeds in the order given, this workload at its own
            seeds = {s: workload if s == seed else w for s, w in given.items()}
        else:
            seeds = {seed: workload, **given}
    study_runs = sum(len(w) for s, w in seeds.items() if s != seed) * len(setups)
    study_runs += n * ("no_reserve" in setups)
    study_runs += sum(len(w) for w in seeds.values()) * len(PRESSURE_SETUPS) * len(pressure)
    total = n * (len(runs) + 1 + (tenant is not None)) + study_runs
    results: dict[str, np.ndarray] = {}
    setup: RouterPolicy | None = None

    quiet = {} if progress else {"file": _Null(), "use_rich": False}
    with Progress(total, f"simulating {workload.name}", **quiet) as bar:
        done = 0

        def tick(k: int) -> None:
            bar.update(done + k)

        def advance(k: int) -> None:
            nonlocal done
            done += k
            bar.update(done)

        pooled = pooled_lru(workload, cap * model.workers, cache=BlockCache(cap * model.workers))
        oracles = {"infinite": infinite_cache(workload), "pooled_lru": pooled}
        advance(n)
        for name in runs:
            policy = make_policy(name, index=index, seed=seed, options=options.get(name))
            if instrument:
                recorder = Recorder(policy)
                results[name] = run(workload, recorder, model, progress=tick)
                results[f"decisions:{name}"] = recorder.rows(results[name])
            else:
                results[name] = run(workload, policy, model, progress=tick)
            advance(n)
        study = None
        if tenant is not None:
            spec = endpoint.endpoint(workload, tenant)
            kw = {
                "policy": endpoint.policy,
                "index": index,
                "options": options.get(endpoint.policy),
            }
            results["endpoint"], setup = run_setup(
                "endpoint", workload, model, spec, seed=seed, progress=tick, **kw
            )
            advance(n)
            study = tenant_study(
                seeds,
                model,
                spec,
                pressure=pressure,
                done={(seed, s): results[s] for s in (*runs, "endpoint")},
                tick=advance,
                **kw,
            )
        bar.update(total)

    metrics = {name: summarize(results[name], num_workers=model.workers) for name in policies}
    report = Report(policies=metrics, oracles=oracles, title=_title(workload, model, index, seed))
    share = max((float(o.get("non_streamed", 0.0)) for o in options.values()), default=0.0)
    report.notes.extend(_model_notes(workload, model, share))
    if instrument:
        report.decisions = {
            name: explain(
                results[f"decisions:{name}"],
                block_size=workload.block_size,
                prefill_rate=model.prefill_rate,
                sessions=workload.session,
            )
            for name in policies
        }
    if study is not None and setup is not None:
        report.tenant = study
        report.notes.extend(study.notes())
        mask = workload.tenant_mask(tenant)
        report.notes.extend(_endpoint_notes(workload, setup, study.endpoint, results, mask, model))
    return report, results


def unbounded_load(workload: Workload) -> str | None:
    """Why ``workload`` has no offered load as a rate (every request at one instant: no time
    span to divide its prompt tokens by), or None when it has one."""
    if len(workload) == 0 or workload.duration > 0:
        return None
    n = len(workload)
    at = f"t = {float(workload.arrival[0]):g} s"
    if n == 1:
        return f"the workload is one request (at {at}): no time span, the offered load is unbounded"
    return (
        f"all {n:,} requests arrive at the same instant ({at}): no time span, the offered load "
        "is unbounded"
    )


class _Null:
    """A sink for the progress bar of a quiet run."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _title(workload: Workload, model: FleetModel, index: str, seed: int) -> str:
    cap = model.capacity(workload.block_size)
    return (
        f"{workload.name}: {len(workload):,} requests over {workload.duration:,.0f} s, "
        f"{model.workers} workers × {cap:,} blocks of {workload.block_size} tokens, "
        f"kvroute index {index}, seed {seed}"
    )


def _model_notes(workload: Workload, model: FleetModel, non_streamed: float = 0.0) -> list[str]:
    s = workload.summary()
    load = s["prompt_tokens_per_s"] / (model.workers * model.prefill_rate)
    rate = f"{model.prefill_rate:,.0f} tokens/s"
    overhead = f"{model.prefill_overhead * 1000:.0f} ms"
    decode = f"{model.decode_time_per_token * 1000:.0f} ms/token"
    blocks = f"{model.capacity(workload.block_size):,}"
    unbounded = unbounded_load(workload)
    offered = (
        f"Workload: {s['prompt_tokens_per_s']:,.0f} prompt tokens/s offered = {load:.0%} of the "
        f"fleet's prefill capacity before caching ({model.workers} × {rate})"
        if unbounded is None
        else f"Workload: offered load n/a ({unbounded}; the fleet's prefill capacity is "
        f"{model.workers} × {rate})"
    )
    return [
        f"{offered}; mean prompt {s['mean_input_tokens']:,.0f} tokens.",
        f"Model: prefill {rate} + {overhead} (FIFO per worker), decode {decode} (continuous "
        f"batch), KV {blocks} blocks per worker; hit rate = cached ÷ prompt tokens; imbalance = "
        "max ÷ mean prefill tokens computed per worker.",
        "Peers (docs/peers.md) run in their default modes: dynamo with exact KV events, "
        "sglang_cache_aware and llmd with their approximate prefix trees.",
        _streaming_note(non_streamed),
    ]


def _streaming_note(share: float) -> str:
    if not share:
        return (
            "Every request is simulated as streamed: the router is told a request's prefill is "
            "over at its first token (Router.prefilled); --non-streamed SHARE models clients "
            "that do not stream."
        )
    return (
        f"{share:.0%} of the requests are not streamed (the same ones for every kvroute "
        "policy): as kvroute serve does, the router is told their prefill is over when the "
        "gateway's model, learned from the streamed requests' first tokens, predicts it done "
        "(at their end before it has learned anything); the peers' emulations are unchanged."
    )


def _endpoint_notes(
    workload: Workload,
    setup: RouterPolicy,
    ep: Endpoint,
    results: dict[str, np.ndarray],
    mask: np.ndarray,
    model: FleetModel,
) -> list[str]:
    pool = ", ".join(setup.endpoint_pool(ep.id))
    seed = workload.meta.get("seed", "?")
    lines = [
        f"Dedicated endpoint {ep.id!r}: pool [{pool}]. Where the tenant's TTFT goes (seed {seed}):"
    ]
    for key, label in (
        ("random", "shared random"),
        ("kv_aware", "shared kv_aware"),
        ("endpoint", "endpoint"),
    ):
        r = results[key][mask]
        queue = r["prefill_start"] - r["arrival"]
        prefill = r["first_token"] - r["prefill_start"]
        lines.append(
            f"  {label}: queueing mean {queue.mean() * 1000:,.0f} ms, p99 "
            f"{np.percentile(queue, 99) * 1000:,.0f} ms; own prefill mean "
            f"{prefill.mean() * 1000:,.0f} ms, p99 {np.percentile(prefill, 99) * 1000:,.0f} ms."
        )
    first_two = np.flatnonzero(mask)[:2].tolist()
    if len(first_two) < 2:
        return lines
    # The demo on an idle fleet: only the tenant's first two requests, at their own times.
    b = WorkloadBuilder(workload.block_size)
    for i in first_two:
        b.add(
            float(workload.arrival[i]),
            workload.block_hashes(i),
            int(workload.input_tokens[i]),
            int(workload.output_tokens[i]),
            tenant=workload.tenant[i],
        )
    pair = b.build(name="two calls", meta=dict(workload.meta))
    idle = RouterPolicy(setup.name, index=setup.index_mode, seed=setup.seed, options=setup.options)
    names = worker_names(model.workers)
    alone = run(
        pair,
        idle,
        model,
        scenario=Scenario.dedicated(pair, names, ep, workload.tenant[first_two[0]]),
    )
    lines.append("Two-call demo: the tenant's first two requests, through the dedicated endpoint.")
    lines.append("  on an idle fleet:    " + _calls(alone, [0, 1], idle.predicted))
    lines.append(
        "  in the run above:    " + _calls(results["endpoint"], first_two, setup.predicted)
    )
    lines.append("  shared fleet, random: " + _calls(results["random"], first_two, None))
    system = workload.meta.get("tenant_system_tokens")
    if system:
        full = (int(system) // workload.block_size) * workload.block_size
        lines.append(
            f"  (the {int(system):,}-token system prompt fills {full:,} tokens of whole "
            f"{workload.block_size}-token blocks; the block it ends in also holds the question, "
            "so it is the request's own)"
        )
    return lines


def _calls(r: np.ndarray, ids: list[int], predicted: dict[int, int] | None) -> str:
    out = []
    for k, i in enumerate(ids, start=1):
        queue = (r["prefill_start"][i] - r["arrival"][i]) * 1000
        prefill = (r["first_token"][i] - r["prefill_start"][i]) * 1000
        expect = f" (router expected {predicted[i]:,})" if predicted else ""
        out.append(
            f"call {k}: {int(r['cached_tokens'][i]):,}/{int(r['prompt_tokens'][i]):,} tokens "
            f"cached{expect}, TTFT {queue + prefill:,.0f} ms = {queue:,.0f} queued + "
            f"{prefill:,.0f} prefill"
        )
    return "; ".join(out)
