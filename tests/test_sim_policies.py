"""kvroute's Router inside the simulator: load accounting, KV-event index, endpoints, salting."""

from __future__ import annotations

import kvroute
import numpy as np
import pytest
from kvroute.sim import Endpoint, FleetModel, Scenario, endpoint_scenario, run, simulate
from kvroute.sim.engine import worker_names
from kvroute.sim.policies import RouterPolicy, make_policy, parse_policies
from support.sim_helpers import family_trace


def small_trace(n=300, seed=3):
    return family_trace(n, seed, families=8, first=1000, ids=3, extra=(0, 6), gap=0.03, out=30)


@pytest.mark.parametrize("index", ["events", "approx"])
@pytest.mark.parametrize("policy", ["random", "round_robin", "least_loaded", "hash", "kv_aware"])
def test_router_load_returns_to_zero(policy, index):
    w = small_trace()
    p = RouterPolicy(policy, index=index, seed=1)
    r = run(w, p, FleetModel(workers=3, capacity_blocks=15, prefill_rate=300.0))
    assert np.all(np.isfinite(r["finish"]))
    for name in p.router.workers:
        load = p.router.load(name)
        assert (load["active"], load["prefill_blocks"], load["decode_blocks"]) == (0, 0, 0)
    assert p.decisions == {}


def test_events_index_mirrors_engine_caches():
    # In events mode the router's prediction is what the engine finds cached when nothing
    # changes between routing and admission: no queueing (instant prefill) and no waiting for
    # memory (no decode, so no blocks stay pinned) — while the small caches keep evicting.
    w = small_trace(200)
    model = FleetModel(
        workers=3,
        capacity_blocks=12,
        prefill_rate=1e9,
        prefill_overhead=0.0,
        decode_time_per_token=0.0,
    )
    p = RouterPolicy("kv_aware", seed=1)
    predicted = {}
    route = p.route

    def spy(request, chain, now):
        k = route(request, chain, now)
        predicted[request] = p.decisions[request].cached_blocks
        return k

    p.route = spy
    r = run(w, p, model)
    got = np.minimum(np.array([predicted[i] for i in range(len(w))]) * 4, w.input_tokens)
    assert r["cached_tokens"].tolist() == got.tolist()


def test_salted_hashes_agree_with_the_router():
    xxhash = pytest.importorskip("xxhash")
    r = kvroute.Router(["a", "b", "c"], index="events", block_size=4)
    r.add_endpoint("ep", pool_size=2)
    raw = np.array([1, 2**63 + 5, 2**64 - 1, 77], dtype=np.uint64)
    salted = r.salt_block_hashes("ep", raw)
    # The documented salting: XXH3-64 of the hash's 8 little-endian bytes, seeded by the salt's
    # hash_key (an independent reference: the xxhash package).
    seed = kvroute.hash_key(r.endpoint_salt("ep"))
    expected = [xxhash.xxh3_64_intdigest(int(h).to_bytes(8, "little"), seed=seed) for h in raw]
    assert salted.tolist() == expected
    assert not np.any(salted == raw)
    member = r.endpoint_pool("ep")[1]
    r.index.store(member, salted)
    d = r.route(block_hashes=raw, endpoint="ep", now=0.0)
    assert (d.worker, d.cached_blocks) == (member, 4)
    # Unsalted requests do not see the endpoint's blocks.
    assert r.route(block_hashes=raw, now=0.0).cached_blocks == 0


@pytest.mark.parametrize("index", ["events", "approx"])
def test_one_router_for_public_and_endpoint_traffic(index):
    w = endpoint_scenario(duration=60, seed=2)
    tenant = w.meta["tenant"]
    names = worker_names(6)
    scenario = Scenario.dedicated(w, names, Endpoint(tenant, reserved_blocks=130), tenant)
    p = RouterPolicy("kv_aware", index=index, seed=2)
    r = run(w, p, FleetModel(workers=6), scenario=scenario)
    mask = w.tenant_mask(tenant)
    pool = p.endpoint_pool(tenant)
    assert len(pool) == 2
    assert set(pool) == set(kvroute.Rendezvous(names).preference(tenant, 2))
    workers = {names[k] for k in r["worker"][mask].tolist()}
    assert workers <= set(pool)
    assert scenario.reserved == {names.index(n): {tenant: 130} for n in pool}
    assert scenario.partitions == tuple(tenant if m else None for m in mask)
    # The one router saw every request: public ones went everywhere, load returned to zero.
    assert {names[k] for k in r["worker"][~mask].tolist()} == set(names)
    assert all(p.router.load(n)["active"] == 0 for n in names)
    # Every tenant request after the first one on each pool worker finds the system prompt.
    system = (w.meta["tenant_system_tokens"] // w.block_size) * w.block_size
    cached = r["cached_tokens"][mask]
    assert cached[0] == 0
    assert np.sum(cached < system) <= len(pool)
    # The engine caches the tenant's blocks salted (the endpoint's cache_salt), the rest as is.
    hashes, offsets = scenario.chains
    first = int(np.flatnonzero(mask)[0])
    a, b = offsets[first], offsets[first + 1]
    assert np.array_equal(hashes[a:b], p.router.salt_block_hashes(tenant, w.hashes[a:b]))
    assert not np.any(hashes[a:b] == w.hashes[a:b])
    other = int(np.flatnonzero(~mask)[0])
    a, b = offsets[other], offsets[other + 1]
    assert np.array_equal(hashes[a:b], w.hashes[a:b])


def test_peers_cannot_run_endpoints():
    w = endpoint_scenario(duration=5, seed=1)
    tenant = w.meta["tenant"]
    scenario = Scenario.dedicated(w, worker_names(4), Endpoint(tenant), tenant)
    with pytest.raises(ValueError, match="cannot route to dedicated endpoints"):
        run(w, make_policy("dynamo"), FleetModel(workers=4), scenario=scenario)


def test_simulate_report_and_two_call_demo():
    w = endpoint_scenario(duration=40, seed=4)
    report, results = simulate(
        w, model=FleetModel(workers=4), policies=["kv_aware", "dynamo"], progress=False
    )
    assert list(report.policies) == ["kv_aware", "dynamo"]
    assert set(results) == {"kv_aware", "dynamo", "random", "endpoint"}
    assert report.tenant is not None and report.tenant.seeds == [0]
    assert list(report.tenant.setups) == ["random", "kv_aware", "endpoint", "no_reserve"]
    demo = [line for line in report.notes if line.startswith("  on an idle fleet")]
    assert len(demo) == 1
    assert "call 1: 0/" in demo[0] and "(router expected 0)" in demo[0]
    assert "call 2: 3,968/" in demo[0] and "(router expected 3,968)" in demo[0]
    # Oracles: the pooled LRU never beats the infinite cache.
    assert report.oracles["pooled_lru"].hit_rate <= report.oracles["infinite"].hit_rate


def test_policy_names():
    assert parse_policies("kv_aware, dynamo,kv_aware") == ["kv_aware", "dynamo"]
    with pytest.raises(ValueError, match="unknown policy 'x'"):
        parse_policies("x")
    with pytest.raises(ValueError, match="no policy"):
        parse_policies(" , ")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
    p = make_policy("kv_aware", options={"queue_weight": 2.0})
    p.bind(
        kvroute.sim.engine.Fleet(
            workload=small_trace(5), names=["w0", "w1"], capacity=10, waiting=[0, 0]
        )
    )
    assert p.router.policy == "kv_aware"
