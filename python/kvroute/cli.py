"""The ``kvroute`` command line."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from . import HashRing, JumpHash, Maglev, Rendezvous

HASHERS: dict[str, Callable[[list[str]], object]] = {
    "ring (ketama)": lambda fleet: HashRing(fleet),
    "ring (xxh3)": lambda fleet: HashRing(fleet, hash="xxh3"),
    "maglev": lambda fleet: Maglev(fleet),
    "rendezvous": lambda fleet: Rendezvous(fleet),
    "jump (memento)": lambda fleet: JumpHash(fleet),
}


def _moves(before: list[str], after: list[str]) -> tuple[int, Counter[tuple[str, str]]]:
    moved = Counter((b, a) for b, a in zip(before, after, strict=True) if b != a)
    return sum(moved.values()), moved


def _describe(moved: Counter[tuple[str, str]], changed: str, leaving: bool, keys: int) -> str:
    """Where the moved keys went: from/to the changed worker, how evenly, and any strays."""
    if not moved:
        return "-"
    total = sum(moved.values())
    own = sum(c for (src, dst), c in moved.items() if (src if leaving else dst) == changed)
    peers = Counter()
    for (src, dst), c in moved.items():
        if (src if leaving else dst) == changed:
            peers[dst if leaving else src] += c
    text = (
        f"{'to' if leaving else 'from'} {len(peers)} workers, "
        f"the busiest {max(peers.values()) / own:.0%} (even: {1 / len(peers):.0%})"
        if peers
        else ""
    )
    if own < total:
        text += f"; plus {total - own} keys ({(total - own) / keys:.1%}) between other workers"
    return text


def _sticky(args: argparse.Namespace) -> int:
    """Show that endpoint IDs stick to workers, and how few move when the fleet changes."""
    fleet = [f"worker-{i}" for i in range(args.workers)]
    endpoints = [f"ep-{i:05d}" for i in range(args.endpoints)]
    leaver = fleet[args.workers // 3]
    joiner = f"worker-{args.workers}"
    n = len(fleet)
    print(f"Sticky routing of {len(endpoints):,} endpoint IDs over {n} workers.\n")

    shown = endpoints[: args.show]
    width = max(len(name) for name in HASHERS)
    print(f"{'':{width}}  " + "  ".join(f"{e:>9}" for e in shown))
    placements: dict[str, list[str]] = {}
    hashers = {}
    for name, make in HASHERS.items():
        h = make(fleet)
        hashers[name] = h
        placements[name] = h.get_many(endpoints)
        print(f"{name:{width}}  " + "  ".join(f"{p:>9}" for p in placements[name][: len(shown)]))

    key = endpoints[0]
    print(f"\nFailover order of {key} (preference): where it goes if its worker fails")
    for name, h in hashers.items():
        print(f"  {name:{width}}  " + " -> ".join(h.preference(key, 3)))

    print(f"\n{leaver} leaves ({n} -> {n - 1} workers). Ideal: only its keys, 1/{n} = {1 / n:.1%}")
    for name, h in hashers.items():
        h.remove(leaver)
        after = h.get_many(endpoints)
        count, moved = _moves(placements[name], after)
        print(
            f"  {name:{width}}  moved {count / len(endpoints):6.1%}  "
            f"{_describe(moved, leaver, leaving=True, keys=len(endpoints))}"
        )
        h.add(leaver)
        restored = h.get_many(endpoints)
        if restored != placements[name]:
            print(f"  {name:{width}}  (re-adding {leaver} did not restore every placement)")

    print(f"\n{joiner} joins ({n} -> {n + 1} workers). Ideal: 1/{n + 1} = {1 / (n + 1):.1%}, to it")
    for name, h in hashers.items():
        h.add(joiner)
        count, moved = _moves(placements[name], h.get_many(endpoints))
        print(
            f"  {name:{width}}  moved {count / len(endpoints):6.1%}  "
            f"{_describe(moved, joiner, leaving=False, keys=len(endpoints))}"
        )

    return 0


def _simulate(args: argparse.Namespace) -> int:
    """Run every policy on one workload and print (and optionally write) the report."""
    from .sim.engine import DEFAULT_DECODE_TIME_PER_TOKEN, FleetModel
    from .sim.options import SEED_LIMIT, check_modes, check_outputs
    from .sim.policies import DEFAULT_POLICIES, parse_policies
    from .sim.report import print_report, write_json, write_plot
    from .sim.simulate import SCENARIO_WORKERS, EndpointOptions, load_workload, simulate
    from .sim.sweep import parse_sweep, positive_numbers
    from .sim.traces import export_losses, write_mooncake

    def prepare(seed: int):
        workload = load_workload(
            args.scenario,
            trace=args.trace,
            seed=seed,
            duration=args.duration,
            block_size=args.block_size,
        )
        if args.requests is not None:
            workload = workload.head(args.requests)
        if args.spread is not None:
            workload = workload.spread(args.spread)
        if args.time_scale != 1.0:
            workload = workload.time_scaled(args.time_scale)
        return workload

    try:
        check_outputs(args)
        check_modes(args)
        if args.seed is None and not args.seeds:
            args.seed = 0
    except (ValueError, ImportError) as e:
        print(f"kvroute simulate: {e}", file=sys.stderr)
        return 2
    if args.pd is not None:
        return _pd(args, prepare)
    try:
        policies = parse_policies(args.policies) if args.policies else list(DEFAULT_POLICIES)
        args.index = args.index or "events"
        swept = parse_sweep(args.sweep) if args.sweep else None
        if swept is not None and args.time_scale != 1.0:
            raise ValueError("--sweep and --time-scale are exclusive (the sweep sets the scale)")
        if swept is not None and (args.explain or args.decisions):
            raise ValueError("--explain and --decisions apply to one run, not to a --sweep")
        pressure = positive_numbers(args.pressure, "--pressure") if args.pressure else []
        seeds = _seeds(args.seeds) if args.seeds else None
        if seeds is not None and args.seed is None:
            args.seed = seeds[0]  # the policies table runs on the study's first seed
        elif seeds is not None and args.seed not in seeds:
            raise ValueError(
                f"--seed {args.seed} is not among --seeds {args.seeds}: the policies table and "
                "the two-call demo run on one of the study's seeds (default: the first)"
            )
        if swept is not None and (pressure or seeds):
            raise ValueError("--seeds and --pressure study the tenant at one load, not a --sweep")
        workers = args.workers
        if workers is None:
            workers = SCENARIO_WORKERS["trace" if args.trace else args.scenario]
        model = FleetModel(
            workers=workers,
            capacity_blocks=args.capacity_blocks,
            prefill_rate=args.prefill_rate,
            prefill_overhead=args.prefill_overhead,
            decode_time_per_token=(
                DEFAULT_DECODE_TIME_PER_TOKEN if args.decode_time is None else args.decode_time
            ),
        )
        endpoint = EndpointOptions(
            pool_size=4 if args.pool_size is None else args.pool_size,
            reserved_blocks=args.reserved_blocks,
            priority=1 if args.priority is None else args.priority,
            warm_interval=args.warm_interval,
        )
        workload = prepare(args.seed)
        others = {}
        if workload.meta.get("tenant") is not None and args.trace is None:
            endpoint.check(workload, model, pressure)
            if swept is None:
                study = seeds or [(args.seed + k) % SEED_LIMIT for k in range(5)]
                others = {s: workload if s == args.seed else prepare(s) for s in study}
        elif seeds or pressure:
            raise ValueError("--seeds and --pressure need a scenario with a tenant (endpoint)")
    except (ValueError, TypeError, OSError) as e:
        print(f"kvroute simulate: {e}", file=sys.stderr)
        return 2
    if args.export_trace:
        write_mooncake(workload, args.export_trace)
        print(f"wrote {len(workload):,} requests to {args.export_trace}", file=sys.stderr)
        lost = export_losses(workload)
        if lost:
            print(
                f"kvroute simulate: warning: --export-trace {args.export_trace}: {lost}",
                file=sys.stderr,
            )
    options = _client_options(args, policies, endpoint.policy)
    if swept is not None:
        return _sweep(args, workload, model, policies, *swept, options=options)
    if args.replicas is not None:
        return _replicas(args, workload, model, policies)
    report, results = simulate(
        workload,
        model=model,
        policies=policies,
        index=args.index,
        seed=args.seed,
        endpoint=endpoint,
        progress=not args.quiet,
        instrument=bool(args.explain or args.decisions),
        tenant_workloads=others,
        pressure=pressure,
        policy_options=options,
    )
    if not args.explain:
        report.decisions = None
    print_report(report)
    if args.json:
        write_json(report, args.json)
    if args.plot:
        write_plot(report, args.plot)
    if args.decisions:
        from .sim.instruments import write_decisions

        write_decisions({p: results[f"decisions:{p}"] for p in policies}, args.decisions)
    return 0


def _pd(args: argparse.Namespace, prepare) -> int:
    """``kvroute simulate --pd P:D``: aggregated / disaggregated / conditional (kvroute.sim.pd)."""
    from .sim.pd import PdModel, parse_ratio
    from .sim.pd_study import parse_thresholds, pd_study, render_study
    from .sim.sweep import parse_sweep

    try:
        alone = {
            "--policies": args.policies,
            "--replicas": args.replicas,
            "--explain": args.explain,
            "--decisions": args.decisions,
            "--seeds": args.seeds,
            "--pressure": args.pressure,
            "--plot": args.plot,
            "--decode-time": args.decode_time,
            "--workers": args.workers,
            "--index": args.index,
            "--pool-size": args.pool_size,
            "--priority": args.priority,
            "--reserved-blocks": args.reserved_blocks,
            "--warm-interval": args.warm_interval,
            "--export-trace": args.export_trace,
        }
        given = [flag for flag, v in alone.items() if v is not None and v is not False]
        if given:
            raise ValueError(f"{', '.join(given)} do not apply to --pd (the fleet is P:D)")
        ratios = [parse_ratio(r) for r in args.pd.split(",") if r.strip()]
        if not ratios:
            raise ValueError("--pd lists no P:D ratio")
        scales = [args.time_scale]
        if args.sweep:
            axis, scales = parse_sweep(args.sweep)
            if axis != "time-scale" or args.time_scale != 1.0:
                raise ValueError("with --pd, --sweep takes time-scale=... (and no --time-scale)")
        thresholds = parse_thresholds(args.pd_thresholds) if args.pd_thresholds else None
        args.time_scale = 1.0  # the study scales the workload (and labels its points)
        workload = prepare(args.seed)
        model = PdModel(
            capacity_blocks=args.capacity_blocks,
            prefill_rate=args.prefill_rate,
            prefill_overhead=args.prefill_overhead,
        )
        report = None if args.quiet else (lambda what: print(f"  {what}", file=sys.stderr))
        study = pd_study(
            workload,
            model,
            ratios=ratios,
            time_scales=scales,
            thresholds=thresholds,
            seed=args.seed,
            progress=report,
        )
    except (ValueError, TypeError, OSError) as e:
        print(f"kvroute simulate: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_study(study))
    if args.json:
        study.write_json(args.json)
    return 0


def _replicas(args, workload, model, policies) -> int:
    """``kvroute simulate --replicas``: one policy behind N replicas per sync setting."""
    import json

    from .sim.replicas import render_replicas, replica_study

    try:
        try:
            counts = [int(x) for x in args.replicas.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--replicas must list counts >= 1, got {args.replicas!r}") from None
        if not counts or min(counts) < 1:
            raise ValueError(f"--replicas must list counts >= 1, got {args.replicas!r}")
        if len(policies) != 1 or policies[0] not in ("kv_aware", "hash", "least_loaded"):
            if args.policies:
                raise ValueError("--replicas runs one kvroute policy (--policies kv_aware)")
            policies = ["kv_aware"]
        syncs = [s for s in (args.replica_sync or "none").split(",") if s.strip()]
        study = replica_study(
            workload,
            model=model,
            replicas=counts,
            syncs=syncs,
            policy=policies[0],
            scrape=args.replica_scrape,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"kvroute simulate: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_replicas(study))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(study.to_json(), f, indent=2)
    return 0


def _client_options(args: argparse.Namespace, *names: Any) -> dict[str, dict[str, Any]]:
    """``--non-streamed`` as the options of every kvroute policy among ``names`` (str or lists
    of them); the peers' emulations take none."""
    from .sim.policies import KVROUTE_POLICIES

    if not args.non_streamed:
        return {}
    flat = [n for x in names for n in ([x] if isinstance(x, str) else x)]
    return {n: {"non_streamed": args.non_streamed} for n in flat if n in KVROUTE_POLICIES}


def _sweep(
    args, workload, model, policies, axis: str, values: list[float], options: dict | None = None
) -> int:
    """``kvroute simulate --sweep``: every policy at every point; tables, JSON and plot."""
    from .sim.sweep import render_sweep, sweep, write_sweep_json, write_sweep_plot

    try:
        result = sweep(
            workload,
            model=model,
            axis=axis,
            values=values,
            policies=policies,
            index=args.index,
            seed=args.seed,
            progress=not args.quiet,
            policy_options=options,
        )
    except ValueError as e:
        print(f"kvroute simulate: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_sweep(result))
    if args.json:
        write_sweep_json(result, args.json)
    if args.plot:
        write_sweep_plot(result, args.plot)
    return 0


def _seeds(text: str) -> list[int]:
    """``"0-4"`` or ``"0,3,7"`` (or both, comma-separated) → distinct seeds in order."""
    from .sim.options import check_seed
    from .sim.sweep import comma_items

    out: list[int] = []
    for item in comma_items(text, "--seeds"):
        lo, dash, hi = item.partition("-")
        try:
            span = range(int(lo), int(hi) + 1) if dash else [int(item)]
        except ValueError:
            raise ValueError(f"--seeds: {item!r} is not a seed or a range A-B") from None
        if dash and int(hi) < int(lo):
            raise ValueError(f"--seeds: empty range {item!r}")
        for s in (int(lo), int(hi)) if dash else (int(item),):
            check_seed(s, "--seeds")
        out += [s for s in span if s not in out]
    return out


def _from_config(
    command: str, path: str, build: Callable[[str], Any], *also: type[Exception]
) -> Any:
    """``build(path)``: a server from its config file, or None after saying on stderr why the
    file is bad (cannot be read, fails validation, or raises one of ``also``)."""
    try:
        return build(path)
    except (OSError, ValueError, TypeError, KeyError, *also) as e:
        print(f"kvroute {command}: bad config {path}: {e}", file=sys.stderr)
        return None


def _log_to_stderr(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")


def _serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible gateway (needs the `gateway` extra)."""
    try:
        from .gateway import Gateway, load_config, serve
    except ImportError as e:
        print(
            f"kvroute serve needs the gateway extra (pip install 'kvroute[gateway]'): {e}",
            file=sys.stderr,
        )
        return 2
    # Building the gateway builds the router: the whole config is validated here.
    gateway = _from_config("serve", args.config, lambda path: Gateway(load_config(path)))
    if gateway is None:
        return 2
    serve(
        gateway,
        host=args.host,
        port=args.port,
        access_log=args.access_log,
        log_level=args.log_level,
    )
    return 0


def _epp(args: argparse.Namespace) -> int:
    """Run the ext_proc endpoint picker (needs the `epp` extra)."""
    try:
        from .epp import EppServer
        from .epp.config import load_config
    except ImportError as e:
        print(f"kvroute epp needs the epp extra (pip install 'kvroute[epp]'): {e}", file=sys.stderr)
        return 2
    server = _from_config("epp", args.config, lambda path: EppServer(load_config(path)))
    if server is None:
        return 2
    _log_to_stderr(args.log_level)
    server.run()
    return 0


def _relay(args: argparse.Namespace) -> int:
    """Republish the engines' KV events into NATS JetStream for every replica (`cluster` and
    `events` extras)."""
    import asyncio
    import signal

    try:
        from .cluster.relay import relay_from_config, run_relay
        from .server.config import load_toml
        from .server.metrics import Registry
    except ImportError as e:
        print(f"kvroute relay needs the cluster and events extras: {e}", file=sys.stderr)
        return 2
    registry = Registry()
    relay = _from_config(
        "relay",
        args.config,
        lambda path: relay_from_config(load_toml(path), registry),
        ImportError,
    )
    if relay is None:
        return 2
    _log_to_stderr(args.log_level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_relay(relay, stop, registry=registry, host=args.host, port=args.port)

    asyncio.run(main())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sticky = sub.add_parser("sticky", help="show sticky routing of endpoint IDs over a fleet")
    sticky.add_argument("--workers", type=int, default=8)
    sticky.add_argument("--endpoints", type=int, default=20_000)
    sticky.add_argument("--show", type=int, default=5, help="endpoint placements to print")
    sticky.set_defaults(func=_sticky)

    from .sim.engine import (
        DEFAULT_DECODE_TIME_PER_TOKEN,
        DEFAULT_KV_TOKENS,
        DEFAULT_PREFILL_OVERHEAD,
        DEFAULT_PREFILL_RATE,
    )
    from .sim.policies import DEFAULT_POLICIES, INDEX_MODES, KVROUTE_POLICIES, PEER_POLICIES

    sim = sub.add_parser(
        "simulate",
        help="compare routing policies on a simulated fleet (default: the endpoint scenario)",
        description=(
            "Replay a workload on a simulated fleet (one Llama-3-8B per A100-80GB by default) "
            "under each routing policy, with the infinite-cache and pooled-LRU oracles."
        ),
    )
    src = sim.add_mutually_exclusive_group()
    src.add_argument(
        "--scenario",
        choices=["endpoint", "mooncake", "claude-code", "rag", "agent"],
        default="endpoint",
        help=(
            "bundled workload (default: endpoint; mooncake = the FAST'25 conversation trace; "
            "claude-code = four real agent sessions from kv-cache-tester)"
        ),
    )
    src.add_argument(
        "--trace",
        help="Mooncake or Qwen-Bailian JSONL, or kv-cache-tester JSON file/directory",
    )
    sim.add_argument(
        "--workers",
        type=int,
        help="fleet size (default: 16 for endpoint and mooncake, 4 for claude-code, 8 otherwise)",
    )
    sim.add_argument(
        "--capacity-blocks",
        type=int,
        help=f"KV blocks per worker (default: {DEFAULT_KV_TOKENS:,} tokens / block size)",
    )
    sim.add_argument(
        "--prefill-rate",
        type=float,
        default=DEFAULT_PREFILL_RATE,
        help="prefill tokens/s per worker (default %(default)s)",
    )
    sim.add_argument(
        "--prefill-overhead",
        type=float,
        default=DEFAULT_PREFILL_OVERHEAD,
        help="fixed seconds per prefill (default %(default)s)",
    )
    sim.add_argument(
        "--decode-time",
        type=float,
        help=f"seconds per output token (default {DEFAULT_DECODE_TIME_PER_TOKEN})",
    )
    sim.add_argument(
        "--pd",
        metavar="P:D[,P:D...]",
        help=(
            "prefill/decode fleets of P prefill + D decode workers: aggregated, disaggregated "
            "and conditional serving side by side (TTFT, time per output token, hit rate, share "
            "split); --sweep time-scale=... runs several loads"
        ),
    )
    sim.add_argument(
        "--pd-thresholds",
        metavar="T1,T2,...",
        help="with --pd: run the conditional mode at each pd_threshold (tokens) and rank them "
        "(default: once, at the Router's default)",
    )
    sim.add_argument(
        "--policies",
        help=(
            f"comma-separated, from {', '.join(KVROUTE_POLICIES + PEER_POLICIES)} "
            f"(default: {','.join(DEFAULT_POLICIES)})"
        ),
    )
    sim.add_argument(
        "--index",
        choices=list(INDEX_MODES),
        help="the router's index: events (fed by the engines' KV events; the default) or approx "
        "(own model)",
    )
    sim.add_argument(
        "--seed",
        type=int,
        help="seed of workloads and policies, in [0, 2**64) (default 0, or the first of --seeds)",
    )
    sim.add_argument(
        "--seeds",
        metavar="A-B|A,B,...",
        help="seeds of the tenant study, exactly these (endpoint scenario; default: --seed and "
        "the next four); the policies table runs on --seed, which must be one of them",
    )
    sim.add_argument(
        "--pressure",
        metavar="K1,K2,...",
        help=(
            "cache-pressure sweep of the tenant study: each worker's KV capacity / K at the same "
            "load (e.g. 1,2,4,8,16)"
        ),
    )
    sim.add_argument(
        "--duration",
        type=float,
        help="seconds of synthetic traffic (default: 1800 for endpoint, 300 for rag and agent)",
    )
    sim.add_argument(
        "--block-size",
        type=int,
        help="block size of a synthetic scenario, or of a Mooncake or Qwen-Bailian trace "
        "(default: 512, 16 or the file's own; checked against the trace's rows)",
    )
    sim.add_argument("--requests", type=int, help="replay only the first N requests")
    sim.add_argument(
        "--non-streamed",
        type=float,
        metavar="SHARE",
        help="share of requests whose clients do not stream (0 to 1, default 0): the router "
        "learns their prefill is over when kvroute serve's model predicts it, not at the first "
        "token",
    )
    sim.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply arrival times (0.5 = 2x load)"
    )
    sim.add_argument("--pool-size", type=int, help="dedicated endpoint's workers (default 4)")
    sim.add_argument(
        "--priority",
        type=int,
        help="engine priority of the endpoint's requests, public traffic has 0 (default 1)",
    )
    sim.add_argument(
        "--reserved-blocks",
        type=int,
        help="endpoint's reserved blocks per pool worker (default: 2x its system prompt); "
        "modelled in the simulated engines: it needs engine support (stock vLLM and SGLang have "
        "none) — the report's 'no reserve' row is the endpoint without it",
    )
    sim.add_argument(
        "--warm-interval",
        type=float,
        help="keep the endpoint's shared prefix warm on its pool every this many seconds, as "
        "kvroute serve's [[endpoints]] warm_interval does (default: not kept warm)",
    )
    sim.add_argument(
        "--sweep",
        metavar="AXIS=V1,V2,...",
        help=(
            "run every policy at several loads: time-scale=1,0.3,0.1 (arrival times x value) "
            "or load=0.5,1,2 (offered prompt tokens / fleet prefill capacity); prints hit rate "
            "and TTFT p50/p99 per point, --json and --plot write the curves"
        ),
    )
    sim.add_argument(
        "--explain",
        action="store_true",
        help="record every decision and print what each policy saw (kvroute.sim.instruments)",
    )
    sim.add_argument(
        "--spread",
        type=float,
        metavar="SECONDS",
        help="spread arrivals sharing a timestamp over this step (rounded trace timestamps: "
        "the Mooncake trace's come in 3 s steps)",
    )
    sim.add_argument(
        "--replicas",
        metavar="N[,N...]",
        help="route through N router replicas (round robin over arrivals, approx mode each); "
        "a list gives one row per count",
    )
    sim.add_argument(
        "--replica-sync",
        metavar="SYNC[,SYNC...]",
        help="what replicas share: none, shared (every model update at once) or bus:DELAY_MS "
        "(default none)",
    )
    sim.add_argument(
        "--replica-scrape",
        type=float,
        metavar="SECONDS",
        help="replicas also read every engine's load this often (as from /metrics)",
    )
    sim.add_argument("--decisions", metavar="FILE.csv", help="write every decision's record as CSV")
    sim.add_argument("--json", metavar="FILE", help="write the report as JSON")
    sim.add_argument("--plot", metavar="FILE.png", help="plot hit rate and TTFT (matplotlib)")
    sim.add_argument(
        "--export-trace",
        metavar="FILE",
        help="also write the workload as Mooncake JSONL (each row with its block_size: --trace "
        "FILE replays the same arrivals, prompt lengths and block sharing; tenants and sessions "
        "are not in the format and are dropped, with a warning)",
    )
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(func=_simulate)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible gateway (TOML config)")
    serve.add_argument("--config", required=True, help="the gateway's TOML file")
    serve.add_argument("--host", default=None, help="overrides gateway.host")
    serve.add_argument("--port", type=int, default=None, help="overrides gateway.port")
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(func=_serve)

    epp = sub.add_parser(
        "epp",
        help="run the Gateway API Inference Extension endpoint picker (Envoy ext_proc)",
    )
    epp.add_argument("--config", required=True, help="the TOML file (kvroute serve's, plus [epp])")
    epp.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    epp.set_defaults(func=_epp)

    relay = sub.add_parser(
        "relay",
        help="read every engine's KV events once and republish them into NATS JetStream for the "
        "[cluster] replicas (relay = true)",
    )
    relay.add_argument("--config", required=True, help="the TOML file (kvroute serve's)")
    relay.add_argument(
        "--port",
        type=int,
        default=None,
        help="serve GET /metrics and /health (200 while connected to NATS, else 503) on this "
        "port (default: no HTTP endpoint)",
    )
    relay.add_argument("--host", default="0.0.0.0", help="the address for --port")
    relay.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    relay.set_defaults(func=_relay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
