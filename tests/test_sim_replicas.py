"""``kvroute simulate --replicas``: N router replicas behind a round-robin balancer, held against
the single router (the reference every synced setting should reproduce)."""

from __future__ import annotations

import numpy as np
import pytest
from kvroute.cli import main
from kvroute.sim.engine import FleetModel, run
from kvroute.sim.policies import RouterPolicy
from kvroute.sim.replicas import ReplicaPolicy, parse_replica_sync, replica_study
from kvroute.sim.report import summarize


@pytest.fixture(scope="module")
def workload(mooncake):
    return mooncake.head(800).spread(3.0)


MODEL = FleetModel(workers=8)


def test_one_replica_is_the_single_router(workload):
    single = run(workload, RouterPolicy("kv_aware", index="approx"), MODEL)
    one = run(workload, ReplicaPolicy("kv_aware", replicas=1), MODEL)
    assert np.array_equal(single, one)


def test_shared_replicas_route_exactly_as_one_router(workload):
    """Every update applied by every replica at once: three replicas (requests round robin)
    make the single router's decisions, request by request."""
    single = run(workload, ReplicaPolicy("kv_aware", replicas=1), MODEL)
    shared = run(workload, ReplicaPolicy("kv_aware", replicas=3, delay=0.0), MODEL)
    assert np.array_equal(single["worker"], shared["worker"])
    assert np.array_equal(single["cached_tokens"], shared["cached_tokens"])


def test_independent_replicas_lose_the_hit_rate_and_a_bus_keeps_it(workload):
    study = replica_study(workload, model=MODEL, replicas=[4], syncs=["none", "bus:50"])
    one = study.metrics[(1, "none")].hit_rate
    alone, bus = study.metrics[(4, "none")].hit_rate, study.metrics[(4, "bus:50")].hit_rate
    assert alone < 0.8 * one
    # (The full trace keeps >= 0.95x with 8 replicas: README; 800 requests are a short sample.)
    assert bus >= 0.9 * one and bus > 1.3 * alone
    assert study.stats[(4, "bus:50")]["published"] > 0
    assert study.to_json()["rows"][0]["vs_single"] == 1.0


def test_parse_replica_sync():
    assert parse_replica_sync("none") is None
    assert parse_replica_sync("shared") == 0.0
    assert parse_replica_sync("bus:25") == 0.025
    for bad in ("bus:", "bus:-1", "bus:nan", "gossip"):
        with pytest.raises(ValueError, match=r"bus|sync"):
            parse_replica_sync(bad)


def test_spread_keeps_the_order_and_spreads_equal_timestamps(mooncake):
    w = mooncake.head(200)
    s = w.spread(3.0)
    assert s.arrival[0] == w.arrival[0]
    assert np.all(np.diff(s.arrival) >= 0)
    assert np.all(s.arrival >= w.arrival) and np.all(s.arrival < w.arrival + 3.0)
    # Within a burst of equal timestamps the gaps are equal.
    burst = np.flatnonzero(w.arrival == w.arrival[0])
    assert len(burst) > 2
    gaps = np.diff(s.arrival[burst])
    assert np.allclose(gaps, gaps[0]) and gaps[0] > 0
    with pytest.raises(ValueError, match="spread"):
        w.spread(0)


def test_cli_replicas(capsys):
    argv = ["simulate", "--scenario", "mooncake", "--requests", "200", "--workers", "4"]
    assert (
        main(
            [
                *argv,
                "--spread",
                "3",
                "--replicas",
                "1,2",
                "--replica-sync",
                "none,shared",
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| 2 | shared |" in out and "| 2 | none |" in out
    assert main([*argv, "--replicas", "2", "--replica-sync", "gossip", "--quiet"]) == 2
    assert "replica sync" in capsys.readouterr().err
    # The shared setting's row is the single router's (same numbers).
    rows = [r for r in out.splitlines() if r.startswith("| ") and not r.startswith("| replicas")]
    assert len(rows) == 3
    single = rows[0].split("|")[3:]
    shared = next(r for r in rows if "| shared |" in r).split("|")[3:]
    assert single == shared


def test_summaries_are_sane(workload):
    r = run(workload, ReplicaPolicy("kv_aware", replicas=2, delay=0.01, scrape=1.0), MODEL)
    m = summarize(r, num_workers=MODEL.workers)
    assert m.requests == len(workload) and m.unfinished == 0
