"""The tenant study: spreads over seeds, the pressure verdict, LRU turnover, runs and reuse."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from kvroute.sim import Endpoint, FleetModel, RouterPolicy, Scenario, endpoint_scenario, run
from kvroute.sim.engine import worker_names
from kvroute.sim.tenant import (
    PRESSURE_SETUPS,
    PressurePoint,
    SetupRuns,
    Spread,
    endpoint_wins,
    lru_turnover,
    run_setup,
    tenant_study,
)
from support.sim_helpers import make_workload, metrics


def test_spread_median_range_and_json():
    s = Spread((0.3, 0.1, 0.2, 0.5))
    assert (s.median, s.min, s.max) == (0.25, 0.1, 0.5)
    assert s.to_dict() == {"median": 0.25, "min": 0.1, "max": 0.5, "per_seed": [0.3, 0.1, 0.2, 0.5]}
    odd = Spread((3.0, 1.0, 2.0))
    assert odd.median == 2.0
    nan = Spread((math.nan, 1.0))
    assert nan.median == 1.0 and nan.to_dict()["per_seed"] == [None, 1.0]
    assert math.isnan(Spread(()).median)


def point(factor, ep, kv):
    """A pressure point whose endpoint / kv_aware tenants have (hit, mean) ``ep`` / ``kv``."""
    setups = {
        "endpoint": SetupRuns([metrics(hit=ep[0], mean=ep[1])], [metrics()]),
        "kv_aware": SetupRuns([metrics(hit=kv[0], mean=kv[1])], [metrics()]),
    }
    return PressurePoint(factor, 100, 10.0, setups)


def test_endpoint_wins_from_the_first_pressure_it_keeps_winning():
    win, tie, lose_mean = (
        ((0.9, 0.1), (0.8, 0.2)),
        ((0.9, 0.2), (0.9, 0.2)),
        ((0.9, 0.3), (0.8, 0.2)),
    )
    assert endpoint_wins([point(1, *tie), point(2, *win), point(4, *win)]) == 2
    # Winning needs both figures; a later loss resets the start; the order given does not matter.
    assert endpoint_wins([point(4, *win), point(1, *win), point(2, *lose_mean)]) == 4
    assert endpoint_wins([point(1, *win), point(2, *tie)]) is None
    assert endpoint_wins([]) is None


def test_lru_turnover_by_hand():
    # Public prompts: 8 + 12 = 20 tokens over 10 s on 2 workers = 1 token/s per worker; the
    # tenant's 100 tokens do not count. 6 blocks of 4 tokens = 24 tokens -> 24 s.
    w = make_workload(
        [(0.0, [1, 2], 8, 1), (5.0, [3] * 25, 100, 1), (10.0, [4, 5, 6], 12, 1)],
        tenant=[None, "t", None],
    )
    w.meta["tenant"] = "t"
    assert lru_turnover(w, FleetModel(workers=2, capacity_blocks=6)) == pytest.approx(24.0)


def small(seed):
    return endpoint_scenario(seed=seed, duration=40.0, noise_rate=2.5)


def test_study_runs_every_setup_once_and_reuses_what_was_done():
    model = FleetModel(workers=4)
    ws = {0: small(0), 1: small(1)}
    ep = Endpoint("ep-tenant", pool_size=2, reserved_blocks=126, priority=1)
    done = {(0, "random"): run_setup("random", ws[0], model, ep, seed=0)[0]}
    replayed = []
    study = tenant_study(ws, model, ep, pressure=[8], done=done, tick=replayed.append)
    # no_reserve: the endpoint on engines that cannot reserve cache (stock vLLM), always shown.
    assert list(study.setups) == ["random", "kv_aware", "endpoint", "no_reserve"]
    assert study.seeds == [0, 1]
    # 2 seeds × 4 setups, one given; 2 seeds × 3 pressure setups.
    assert sorted(replayed) == sorted(
        [len(ws[0])] * 3 + [len(ws[1])] * 4 + [len(ws[0]), len(ws[1])] * len(PRESSURE_SETUPS)
    )
    for runs in study.setups.values():
        assert [m.requests for m in runs.tenant] == [
            int(w.tenant_mask("ep-tenant").sum()) for w in ws.values()
        ]
        assert [m.requests + t.requests for m, t in zip(runs.public, runs.tenant, strict=True)] == [
            len(w) for w in ws.values()
        ]
    (p,) = study.pressure
    assert (p.factor, p.capacity_blocks) == (8.0, 6912 // 8)
    assert list(p.setups) == list(PRESSURE_SETUPS)
    doc = study.to_json()
    assert set(doc) == {"tenant", "public", "seeds", "pressure", "pressure_wins_from"}
    assert set(doc["tenant"]["endpoint"]) == {
        "hit_rate",
        "ttft_mean",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "requests",
    }
    assert len(doc["tenant"]["endpoint"]["ttft_p99"]["per_seed"]) == 2
    # The tables: tenant, public traffic, pressure; the notes name the goals' figures.
    titles = [title for title, _, _ in study.sections()]
    assert titles[0].startswith("tenant 'ep-tenant'") and len(titles) == 3
    notes = " ".join(study.notes())
    assert "Endpoint vs shared random, per seed" in notes and "Public traffic" in notes
    assert (
        "The reservation is the simulated engines': keeping a reserved cache partition per "
        "tenant needs engine support that stock vLLM and SGLang do not have" in notes
    )
    assert "the endpoint gives the 'no reserve' row and column." in notes
    rows = [row[0] for row in study.sections()[0][2]]
    assert rows[-1] == "endpoint (kv_aware), no reserve"
    # Without a reservation there is nothing to disclose, and no_reserve would be endpoint again.
    bare = Endpoint("ep-tenant", pool_size=2, reserved_blocks=None, priority=1)
    plain = tenant_study({0: ws[0]}, model, bare)
    assert list(plain.setups) == ["random", "kv_aware", "endpoint"]
    assert "reserved cache partition" not in " ".join(plain.notes())


def test_study_is_deterministic_and_checks_its_arguments():
    model = FleetModel(workers=4)
    ws = {3: small(3)}
    ep = Endpoint("ep-tenant", pool_size=2, reserved_blocks=126)
    a = tenant_study(ws, model, ep).to_json()
    assert a == tenant_study(ws, model, ep).to_json()
    with pytest.raises(ValueError, match="not the workloads' tenant"):
        tenant_study(ws, model, Endpoint("other"))
    with pytest.raises(ValueError, match="pressure factors"):
        tenant_study(ws, model, ep, pressure=[0.0])
    with pytest.raises(ValueError, match="do not fit"):
        tenant_study(ws, model, ep, pressure=[100.0])
    with pytest.raises(ValueError, match="at least one seed"):
        tenant_study({}, model, ep)
    with pytest.raises(ValueError, match="same tenant"):
        tenant_study(
            {0: small(0), 1: endpoint_scenario(seed=1, duration=5.0, tenant="x")}, model, ep
        )
    with pytest.raises(ValueError, match="unknown tenant setup"):
        run_setup("dynamo", ws[3], model, ep)


def test_the_engines_run_the_priority_the_router_decides():
    w = small(5)
    model = FleetModel(workers=4)
    ep = Endpoint("ep-tenant", pool_size=2, priority=3)
    _, policy = run_setup("endpoint", w, model, ep)
    mask = w.tenant_mask("ep-tenant")
    assert policy.router.endpoint_priority("ep-tenant") == 3
    assert set(policy.predicted) == set(np.flatnonzero(mask).tolist())
    # A scenario whose engines run other priorities than the router's decisions carry is refused.
    scenario = Scenario.dedicated(w, worker_names(4), ep, "ep-tenant")
    wrong = dataclasses.replace(scenario, priority=np.zeros(len(w), dtype=np.int64))
    with pytest.raises(ValueError, match="has priority 3, the scenario runs it at 0"):
        run(w, RouterPolicy("kv_aware"), model, scenario=wrong)
