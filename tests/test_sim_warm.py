"""The simulator's warm requests (``kvroute.sim.warm``): the passes ``kvroute serve`` would send
to keep a dedicated endpoint's prefix warm, added to the workload and run on the fleet.

The passes are checked against a reference written from the gateway's documented rule (the
first prefix at once, then every interval with the prefix learnt by then; Hypothesis over
tenants whose requests share starts of random lengths); the run against what the engines must
then hold: each warm request reaches its own pool member, finds there the tenant's salted blocks
once the tenant or an earlier pass put them there, and one is dropped only while that member's
last one still runs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.sim import Endpoint, FleetModel, RouterPolicy, Scenario, run
from kvroute.sim.engine import worker_names
from kvroute.sim.simulate import EndpointOptions
from kvroute.sim.tenant import run_setup
from kvroute.sim.warm import warm_label, with_warm
from support.sim_helpers import make_workload

BS = 4


def reference_passes(rows, tenant_of, interval, pool, cap):
    """(time, prefix block ids) of each pass, from the rule as documented."""
    prefix, last, changes = None, None, []
    for (t, ids, _, _), who in zip(rows, tenant_of, strict=True):
        if who != "t":
            continue
        if last is not None:
            n = 0
            while n < min(len(last), len(ids)) and last[n] == ids[n]:
                n += 1
            if cap:
                n = min(n, cap)
            if n and ids[:n] != prefix:
                prefix = ids[:n]
                changes.append((t, prefix))
        last = ids
    out = []
    if changes:
        end = max(r[0] for r in rows)
        t = changes[0][0]
        while t <= end:
            out.append((t, [p for when, p in changes if when <= t][-1]))
            t += interval
    return out


request = st.tuples(
    st.integers(0, 40),  # arrival in quarter seconds
    st.integers(0, 2),  # which shared start
    st.integers(0, 6),  # blocks of it kept
    st.integers(0, 3),  # blocks of its own
    st.booleans(),  # the tenant's (else public)
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(request, min_size=1, max_size=12),
    st.sampled_from([0.5, 1.0, 2.5]),
    st.integers(1, 3),
    st.one_of(st.none(), st.integers(1, 5)),
)
def test_passes_follow_the_gateways_rule(reqs, interval, pool, cap):
    reqs = sorted(reqs, key=lambda r: r[0])
    rows, tenant_of = [], []
    for k, (q, start, keep, own, mine) in enumerate(reqs):
        ids = [100 * start + j for j in range(keep)] + [10_000 + 10 * k + j for j in range(own)]
        ids = ids or [20_000 + k]
        rows.append((q / 4, ids, len(ids) * BS, 2))
        tenant_of.append("t" if mine else None)
    w = make_workload(rows, block_size=BS, tenant=tenant_of)
    w.meta["source"] = "test"
    w.session = [f"s{k % 3}" for k in range(len(w))]
    plan = with_warm(w, "t", interval=interval, pool_size=pool, max_blocks=cap)
    aug = plan.workload
    # The original requests, in their order, unchanged.
    orig = np.flatnonzero(plan.original)
    assert len(orig) == len(w)
    assert aug.arrival[orig].tolist() == w.arrival.tolist()
    for i, r in enumerate(orig.tolist()):
        assert aug.block_hashes(r).tolist() == w.block_hashes(i).tolist()
        assert aug.tenant[r] == w.tenant[i]
    assert (plan.member[orig] == -1).all()
    assert (aug.name, aug.description, aug.meta) == (w.name, w.description, w.meta)
    assert [aug.session[r] for r in orig.tolist()] == list(w.session)
    assert aug.output_tokens.dtype == np.int64 and aug.arrival.dtype == np.float64
    # The warm requests: pool_size per pass, members 0..pool-1, the reference's prefixes.
    warm = np.flatnonzero(~plan.original).tolist()
    want = reference_passes(rows, tenant_of, interval, pool, cap)
    assert len(warm) == pool * len(want) and plan.passes == len(want)
    for k, (t, prefix) in enumerate(want):
        group = warm[k * pool : (k + 1) * pool]
        assert plan.member[group].tolist() == list(range(pool))
        for r in group:
            assert aug.arrival[r] == t
            assert aug.tenant[r] == warm_label("t")
            assert aug.output_tokens[r] == 1 and aug.input_tokens[r] == len(prefix) * BS
            # The prefix's hashes are the chain of its block ids: those of a tenant request
            # that starts with it.
            source = next(
                i
                for i, (_, ids, _, _) in enumerate(rows)
                if tenant_of[i] == "t" and ids[: len(prefix)] == prefix
            )
            assert aug.block_hashes(r).tolist() == w.block_hashes(source)[: len(prefix)].tolist()
        # A warm request arriving with an original one comes after it.
        for r in group:
            before = [x for x in range(r) if plan.original[x]]
            assert all(aug.arrival[x] <= t for x in before)


def tenant_workload():
    """4 workers; the tenant every 10 s with a shared 8-block start and a block of its own, and
    a little public traffic."""
    rows, who = [], []
    for k in range(8):
        rows.append((10.0 * k, [*range(1, 9), 1000 + k], 9 * BS, 3))
        who.append("t")
        rows.append((10.0 * k + 3, [5000 + k, 5001 + k], 2 * BS, 3))
        who.append(None)
    w = make_workload(rows, block_size=BS, tenant=who)
    w.meta["tenant"] = "t"
    return w


def run_warm(interval, model=None, reserved=16):
    w = tenant_workload()
    model = model or FleetModel(workers=4, capacity_blocks=64, prefill_rate=100.0)
    ep = Endpoint("t", pool_size=2, reserved_blocks=reserved, priority=1)
    plan = with_warm(w, "t", interval=interval, pool_size=2, max_blocks=reserved)
    names = worker_names(4)
    scenario = Scenario.dedicated(plan.workload, names, ep, "t", plan.member)
    policy = RouterPolicy("kv_aware")
    return plan, scenario, run(plan.workload, policy, model, scenario=scenario)


def test_each_warm_request_reaches_its_member_and_finds_the_tenants_blocks_there():
    plan, scenario, results = run_warm(4.0)
    warm = np.flatnonzero(~plan.original).tolist()
    assert warm and scenario.warm_target is not None
    first_pass = float(plan.workload.arrival[warm[0]])
    before = {
        int(results["worker"][i])
        for i in np.flatnonzero(plan.original)
        if plan.workload.tenant[i] == "t" and results["arrival"][i] <= first_pass
    }
    sent = {}  # member -> its warm requests' (cached, prompt), in order
    for r in warm:
        target = scenario.warm_target[r]
        w = int(results["worker"][r])
        if w != -1:
            assert w == target
            sent.setdefault(target, []).append(
                (int(results["cached_tokens"][r]), int(results["prompt_tokens"][r]))
            )
    pool = {t for t in scenario.warm_target if t is not None}
    assert len(pool) == 2 and set(sent) == pool
    # The member the tenant had not used: its first warm request fills the prefix (nothing of
    # the tenant's salted blocks was there), every later one finds it whole.
    (fresh,) = pool - before
    (first, *later) = sent[fresh]
    assert first[0] == 0 and later
    assert all(cached == prompt for cached, prompt in later)
    # The member it had used finds the prefix on every pass.
    (used,) = pool & before
    assert all(cached == prompt for cached, prompt in sent[used])
    # Warm requests run at priority 0, the tenant's at its own.
    pr = scenario.priority
    assert pr is not None
    assert all(pr[r] == 0 for r in warm)
    assert all(pr[i] == 1 for i in np.flatnonzero(plan.original) if scenario.endpoint_of[i])


def test_a_member_still_warming_is_skipped():
    # Prefill at 1 token/s: a warm request of 32 tokens runs ~32 s, passes come every 2 s.
    slow = FleetModel(workers=4, capacity_blocks=64, prefill_rate=1.0)
    plan, scenario, results = run_warm(2.0, slow)
    warm = np.flatnonzero(~plan.original).tolist()
    dropped = [r for r in warm if results["worker"][r] == -1]
    assert dropped
    sent = [r for r in warm if results["worker"][r] != -1]
    for r in dropped:
        t, target = float(results["arrival"][r]), scenario.warm_target[r]
        running = [
            s
            for s in sent
            if scenario.warm_target[s] == target
            and results["arrival"][s] <= t < results["finish"][s]
        ]
        assert running, f"warm request {r} dropped with none running on {target}"
    for r in sent:  # and one is never sent while another runs on its member
        t, target = float(results["arrival"][r]), scenario.warm_target[r]
        assert not [
            s
            for s in sent
            if s != r
            and scenario.warm_target[s] == target
            and results["arrival"][s] < t < results["finish"][s]
        ]


def test_run_setup_returns_the_workloads_results_and_keeps_the_warm_ones_apart():
    w = tenant_workload()
    model = FleetModel(workers=4, capacity_blocks=64, prefill_rate=100.0)
    ep = Endpoint("t", pool_size=2, reserved_blocks=16, priority=1, warm_interval=4.0)
    results, policy = run_setup("endpoint", w, model, ep)
    assert len(results) == len(w)
    assert results["arrival"].tolist() == w.arrival.tolist()
    assert results["prompt_tokens"].tolist() == w.input_tokens.tolist()
    assert policy.warm_results is not None and len(policy.warm_results) > 0
    assert set(policy.predicted) <= set(np.flatnonzero(w.tenant_mask("t")).tolist())
    cold, _ = run_setup("endpoint", w, model, Endpoint("t", pool_size=2, reserved_blocks=16))
    assert len(cold) == len(w)
    # The tenant's requests after the first pass find more cached with warming than without.
    mask = w.tenant_mask("t")
    assert results["cached_tokens"][mask].sum() >= cold["cached_tokens"][mask].sum()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_interval_is_refused(bad):
    with pytest.raises(ValueError, match="warm_interval must be > 0 and finite"):
        Endpoint("t", warm_interval=bad)
    with pytest.raises(ValueError, match="warm interval must be > 0 and finite"):
        with_warm(tenant_workload(), "t", interval=bad, pool_size=2)
    w = tenant_workload()
    with pytest.raises(ValueError, match="--warm-interval must be > 0 seconds and finite"):
        EndpointOptions(warm_interval=bad).check(w, FleetModel(workers=4))


def test_scenario_check_names_a_bad_warm_target():
    w = tenant_workload()
    n = len(w)
    ep = Endpoint("t")
    with pytest.raises(ValueError, match=r"warm_target names workers \[9\] of 4"):
        Scenario((ep,), endpoint_of=["t"] * n, warm_target=[9] + [None] * (n - 1)).check(n, 4)
    with pytest.raises(ValueError, match="a warm request must belong to an endpoint"):
        Scenario((ep,), endpoint_of=[None] * n, warm_target=[1] + [None] * (n - 1)).check(n, 4)
    with pytest.raises(ValueError, match="warm_target needs one entry per request"):
        Scenario((ep,), endpoint_of=["t"] * n, warm_target=[1]).check(n, 4)


def test_a_study_kept_warm_says_so():
    from kvroute.sim import endpoint_scenario
    from kvroute.sim.tenant import tenant_study

    ws = {0: endpoint_scenario(seed=0, duration=40.0, noise_rate=2.5)}
    ep = Endpoint("ep-tenant", pool_size=2, reserved_blocks=126, priority=1, warm_interval=7.5)
    study = tenant_study(ws, FleetModel(workers=4), ep)
    assert study.to_json()["warm_interval"] == 7.5
    rows = [row[0] for _, _, table in study.sections() for row in table]
    assert "endpoint (kv_aware, warm 7.5 s)" in rows
    assert "endpoint (kv_aware, warm 7.5 s), no reserve" in rows
    assert any(
        n.startswith("Kept warm (warm 7.5 s): the gateway's warm requests") for n in study.notes()
    )


def test_without_reservation_the_prefix_is_still_capped_by_the_configured_one():
    """``no_reserve`` is the same gateway config on engines that reserve nothing: the prefix
    kept warm stays capped by the endpoint's ``reserved_blocks`` (here 2 of the 8 shared)."""
    w = tenant_workload()
    model = FleetModel(workers=4, capacity_blocks=64, prefill_rate=100.0)
    ep = Endpoint("t", pool_size=2, reserved_blocks=2, priority=1, warm_interval=4.0)
    for setup in ("endpoint", "no_reserve"):
        _, policy = run_setup(setup, w, model, ep)
        assert policy.warm_results is not None
        assert set(policy.warm_results["prompt_tokens"].tolist()) == {2 * BS}, setup
