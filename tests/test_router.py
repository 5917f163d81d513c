"""kvroute.Router: the approx model, events-mode freshness and tiers, load accounting, health,
bad input, threads, and requests without a prefix.

The policies and the kv_aware cost are checked in test_router_policies.py, endpoint pools and
membership in test_router_membership.py.
"""

from __future__ import annotations

import kvroute
import numpy as np
import pytest
from support import events_payloads as P
from support.helpers import run_threads
from support.router_reference import (
    BS,
    IDLE,
    bounded_pick,
    idle_load,
    toks,
)

# ---- approx mode ------------------------------------------------------------------------------


def test_approx_affinity_capacity_and_ttl():
    r = kvroute.Router(["a", "b", "c"], block_size=BS, capacity_blocks=20, ttl=10.0)
    t = toks(5, 40)
    first = r.route(t, now=0.0)
    assert first.cached_tokens == 0
    for now in (1.0, 2.0, 9.0):
        d = r.route(t, now=now)
        assert (d.worker, d.cached_tokens, d.reason) == (first.worker, 40, "prefix")
    # Idle past the TTL: forgotten everywhere.
    late = r.route(t, now=25.0)
    assert late.cached_tokens == 0
    assert r.index.match(kvroute.BlockHasher(BS).hash(t)) == {late.worker: 10}
    r._check_model()
    # Capacity: other prompts routed to the same worker evict it (LRU).
    w = late.worker
    for i in range(6):
        r.route(toks(50 + i, 40), exclude=[n for n in r.workers if n != w], now=26.0)
    assert r.index.match(kvroute.BlockHasher(BS).hash(t)).get(w, 0) == 0
    assert r.index.num_blocks(w) <= 20
    r._check_model()


def test_approx_index_is_read_only_from_python():
    """The approx model is the router's: every write from Python (an event applier over it too)
    raises ReadOnlyError naming why, and changes nothing (routing and the model stay
    consistent); events mode stays writable."""
    r = kvroute.Router(["a", "b"], block_size=BS)
    t = toks(8, 32)
    d = r.route(t, now=0.0)
    hashes = kvroute.BlockHasher(BS).hash(t)
    before = (r.index.match(hashes), len(r.index), r.index.dump())
    assert r.index.read_only
    writes = [
        lambda: r.index.store("b", hashes),
        lambda: r.index.remove(d.worker, hashes[:1]),
        lambda: r.index.clear(d.worker),
        lambda: r.index.remove_worker(d.worker),
        lambda: kvroute.KvEventApplier(r.index, mode="direct"),
    ]
    for write in writes:
        with pytest.raises(kvroute.ReadOnlyError, match='read-only with index="approx"'):
            write()
    assert issubclass(kvroute.ReadOnlyError, RuntimeError)
    assert (r.index.match(hashes), len(r.index), r.index.dump()) == before
    r._check_model()
    assert r.route(t, now=1.0).worker == d.worker
    events = kvroute.Router(["a", "b"], block_size=BS, index="events")
    assert not events.index.read_only and not kvroute.PrefixIndex().read_only
    events.index.store("a", hashes)
    assert events.index.match(hashes) == {"a": len(hashes)}


def test_observe_corrects_the_model():
    r = kvroute.Router(["a", "b"], block_size=BS)
    t = toks(6, 64)
    r.route(t, now=0.0)
    branch = np.concatenate([t[:32], toks(7, 32)])
    d = r.route(branch, now=1.0)
    assert d.cached_blocks == 8
    r.observe(d, 16, now=2.0)  # the engine had only 4 blocks
    with pytest.raises(ValueError, match="already observed"):
        r.observe(d, 16)
    got = r.route(t, exclude=[n for n in r.workers if n != d.worker], now=3.0)
    assert got.cached_blocks == 8  # only the branch is back: t's blocks 4.. were dropped
    r._check_model()
    # More than predicted: the worker had them; the model keeps the prompt.
    d2 = r.route(toks(8, 16), now=4.0)
    r.observe(d2, 16, now=5.0)
    assert r.route(toks(8, 16), now=6.0).cached_tokens == 16
    with pytest.raises(ValueError, match="exceeds"):
        r.observe(r.route(toks(9, 16), now=7.0), 17)


# ---- events mode: freshness and tiers ---------------------------------------------------------


def test_stale_workers_credit_decays_by_half_life():
    r = kvroute.Router(["a", "b"], index="events", block_size=BS, stale_half_life=4.0)
    t = toks(30, 32)
    r.index.store("a", kvroute.BlockHasher(BS).hash(t))
    r.mark_stale("a", now=10.0)
    r.mark_stale("a", now=12.0)  # already stale: keeps its first time
    for now, f in ((10.0, 1.0), (14.0, 0.5), (18.0, 0.25)):
        assert r.freshness("a", now=now) == pytest.approx(f)
        d = r.route(t, now=now)
        assert d.scores["a"] == pytest.approx(2 * (8 - 8 * f))  # idle fleet: own + 1 delayed
    r.mark_fresh("a")
    assert r.freshness("a", now=100.0) == 1.0
    r.set_freshness("b", 0.3)
    assert r.freshness("b", now=0.0) == 0.3
    with pytest.raises(ValueError):
        r.set_freshness("b", 1.5)
    with pytest.raises(KeyError):
        r.mark_stale("zz")


def test_cpu_tier_overlap_counts_at_its_weight():
    r = kvroute.Router(["a", "b"], index="events", block_size=BS, decode_weight=0.0)
    assert isinstance(r.event_applier, kvroute.KvEventApplier)
    t = list(range(1000, 1032))  # 8 blocks
    gpu = P.batch([P.map16(P.stored_fields([1, 2], None, t[:8], BS))])
    cpu = P.batch(
        [P.map16(P.stored_fields([11, 12, 13, 14, 15, 16], None, t[:24], BS, medium="CPU"))]
    )
    r.event_applier.apply("a", gpu)
    r.event_applier.apply("b", cpu)
    d = r.route(np.array(t, dtype=np.uint32), now=0.0)
    # a: 2 GPU blocks -> 6 left; b: 6 CPU blocks at 0.5 -> 5 left; each left block costs 2 (the
    # request's own and the one it delays; the fleet is idle).
    assert d.scores == pytest.approx({"a": 12.0, "b": 10.0})
    assert d.worker == "b" and d.cached_blocks == 0
    r.event_applier.apply("b", gpu)
    assert r.route(np.array(t, dtype=np.uint32), now=0.0).scores["b"] == pytest.approx(2 * (8 - 4))


# ---- load, health, errors ---------------------------------------------------------------------


def test_load_accounting_and_lifecycle_errors():
    r = kvroute.Router(["a", "b"], block_size=BS)
    d = r.route(toks(40, 40), now=0.0)
    assert (d.prompt_blocks, d.prompt_tokens, d.stage) == (10, 40, "routed")
    with pytest.raises(ValueError, match="not begun"):
        r.finish(d)
    with pytest.raises(ValueError, match="not active"):
        r.prefilled(d)
    r.begin(d)
    with pytest.raises(ValueError, match="already begun"):
        r.begin(d)
    assert r.load(d.worker) == {
        "active": 1,
        "queued": 1,
        "prefill_blocks": 10,
        "decode_blocks": 10,
        "written_blocks": 10,
        "weight": 1.0,
        "others": IDLE,
    }
    r.prefilled(d)
    assert r.load(d.worker)["prefill_blocks"] == 0
    assert r.load(d.worker)["queued"] == 0
    r.finish(d)
    with pytest.raises(ValueError, match="already finished"):
        r.finish(d)
    assert r.load(d.worker) == idle_load()
    other = kvroute.Router(["a", "b"], block_size=BS)
    for call in (other.begin, other.finish, other.prefilled):
        with pytest.raises(ValueError, match="another router"):
            call(d)
    with pytest.raises(TypeError):
        r.begin("not a decision")
    # A removed worker's decisions: begin raises KeyError, finish is a no-op.
    d2, d3 = r.route(toks(41, 8), now=0.0), None
    r.begin(d2)
    d3 = r.route(toks(42, 8), exclude=[d2.worker], now=0.0)
    r.remove_worker(d2.worker)
    r.finish(d2)
    r.add_worker(d2.worker)
    assert r.load(d2.worker)["active"] == 0
    r.remove_worker(d3.worker)
    with pytest.raises(KeyError):
        r.begin(d3)


def test_begin_returns_the_prefill_queued_ahead():
    """``begin`` returns what ``load(worker)["prefill_blocks"]`` said just before it (the gateway
    times a request's prefill with it), through begins, prefills and finishes on both workers
    and one worker's requests prefilled out of order."""
    r = kvroute.Router(["a", "b"], block_size=BS, policy="round_robin")
    rng = np.random.default_rng(7)
    live, prefilled = [], set()
    for i in range(60):
        if live and rng.random() < 0.4:
            d = live.pop(int(rng.integers(len(live))))
            if id(d) not in prefilled and rng.random() < 0.5:
                r.prefilled(d)
                prefilled.add(id(d))
                live.append(d)
            else:
                r.finish(d)
            continue
        d = r.route(toks(100 + i, int(rng.integers(4, 60))), now=0.0)
        before = r.load(d.worker)["prefill_blocks"]
        assert r.begin(d) == before
        assert r.load(d.worker)["prefill_blocks"] == before + d.prompt_blocks - d.cached_blocks
        live.append(d)
    assert any(r.load(w)["prefill_blocks"] for w in ("a", "b"))


def test_unhealthy_workers_are_never_chosen():
    r = kvroute.Router(["a", "b", "c"], block_size=BS)
    t = toks(50, 40)
    home = r.route(t, now=0.0).worker
    r.set_healthy(home, False)
    assert not r.is_healthy(home)
    for i in range(20):
        assert r.route(t if i % 2 else toks(60 + i, 8), now=1.0).worker != home
    for n in r.workers:
        r.set_healthy(n, False)
    with pytest.raises(kvroute.NoWorkerError, match="no worker to route to: 3 workers, 0 healthy"):
        r.route(t, now=2.0)
    r.set_healthy(home, True)
    assert r.route(t, now=3.0).worker == home


def test_bad_input_raises_and_changes_nothing():
    r = kvroute.Router({"a": 1.0, "b": 2.0}, block_size=BS, policy="round_robin")
    r.add_endpoint("ep", pool_size=1)
    r.route(toks(1, 8), now=0.0)
    before = (r.workers, len(r.index), r.index.num_blocks("a"), r.index.num_blocks("b"))
    probe = kvroute.Router({"a": 1.0, "b": 2.0}, block_size=BS, policy="round_robin")
    probe.add_endpoint("ep", pool_size=1)
    probe.route(toks(1, 8), now=0.0)
    cases = [
        (TypeError, lambda: r.route(toks(1, 8), block_hashes=[1, 2])),
        (KeyError, lambda: r.route(toks(1, 8), endpoint="nope")),
        (KeyError, lambda: r.route(toks(1, 8), exclude=["zz"])),
        (TypeError, lambda: r.route(toks(1, 8), exclude="a")),
        (kvroute.NoWorkerError, lambda: r.route(toks(1, 8), exclude=["a", "b"])),
        (kvroute.NoWorkerError, lambda: r.route(endpoint="ep", exclude=r.endpoint_pool("ep"))),
        (ValueError, lambda: r.route([1, 2, -3, 4])),
        (ValueError, lambda: r.route(toks(1, 8), now=float("nan"))),
        (TypeError, lambda: r.route(toks(1, 8), key=1.5)),
        # A chain that contradicts the index (block 2 stored after block 1, now at the root).
        (ValueError, lambda: r.route(block_hashes=[5, 5], now=0.0)),
        (KeyError, lambda: r.remove_worker("zz")),
        (KeyError, lambda: r.set_healthy("zz", True)),
        (KeyError, lambda: r.load("zz")),
        (ValueError, lambda: r.add_worker("a")),
        (ValueError, lambda: r.add_worker("c", 0.0)),
        (ValueError, lambda: r.add_worker("c", float("inf"))),
        (ValueError, lambda: r.add_endpoint("ep", pool_size=1)),
        (ValueError, lambda: r.add_endpoint("ep3", pool_size=3)),
        (ValueError, lambda: r.add_endpoint("ep3", pool_size=0)),
        (KeyError, lambda: r.endpoint_pool("nope")),
        (KeyError, lambda: r.endpoint_salt("nope")),
        (KeyError, lambda: r.remove_endpoint("nope")),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
    assert (r.workers, len(r.index), r.index.num_blocks("a"), r.index.num_blocks("b")) == before
    # The round-robin state did not move either: the next picks agree with an untouched twin.
    for i in range(6):
        assert (
            r.route(toks(70 + i, 8), now=1.0).worker == probe.route(toks(70 + i, 8), now=1.0).worker
        )
    for kwargs in (
        {"policy": "fastest"},
        {"index": "exact"},
        {"hash_profile": "md5"},
        {"block_size": 0},
        {"load_bound": 0.5},
        {"queue_weight": -1.0},
        {"ttl": 0.0},
        {"capacity_blocks": 0},
        {"stale_half_life": 0.0},
        {"tier_weights": {"CPU": 2.0}},
    ):
        with pytest.raises(ValueError):
            kvroute.Router(["a"], **kwargs)
    with pytest.raises(ValueError):
        kvroute.Router(["a", "a"])
    with pytest.raises(TypeError):
        kvroute.Router("ab")


def test_four_threads_route_and_account_exactly():
    r = kvroute.Router([f"w{i}" for i in range(8)], block_size=16, capacity_blocks=2048)
    prompts = [toks(i % 12, 512 + 16 * (i % 5)) for i in range(48)]
    begun = [0] * 4

    def work(k: int) -> None:
        for rep in range(60):
            d = r.route(prompts[(k * 7 + rep) % len(prompts)])
            r.begin(d)
            begun[k] += 1
            if rep % 2:
                r.prefilled(d)
            r.observe(d, d.cached_tokens)
            r.finish(d)

    run_threads(*((work, (k,)) for k in range(4)))
    assert sum(begun) == 240
    for n in r.workers:
        assert r.load(n) == idle_load()
    r._check_model()


# ---- no worker, whole requests without tokens -------------------------------------------------


def test_no_worker_error_is_a_value_error_raised_only_for_no_candidate():
    assert issubclass(kvroute.NoWorkerError, ValueError)
    assert kvroute.NoWorkerError is kvroute._core.NoWorkerError
    for policy in ("random", "round_robin", "least_loaded", "power_of_two", "hash", "kv_aware"):
        empty = kvroute.Router([], policy=policy, block_size=BS)
        with pytest.raises(kvroute.NoWorkerError, match=r"0 workers, 0 healthy"):
            empty.route(toks(1, 8), now=0.0)
        r = kvroute.Router(["a", "b", "c"], policy=policy, block_size=BS)
        r.add_endpoint("ep", pool_size=2)
        pool = r.endpoint_pool("ep")
        with pytest.raises(kvroute.NoWorkerError, match='endpoint "ep" with 2 in its pool, 2 ex'):
            r.route(toks(1, 8), endpoint="ep", exclude=pool, now=0.0)
        for w in pool:
            r.set_healthy(w, False)
        (spare,) = r.endpoint_pool("ep")  # the one healthy worker stands in
        assert r.route(key="k", endpoint="ep", now=0.0).worker == spare not in pool
        r.set_healthy(spare, False)
        with pytest.raises(kvroute.NoWorkerError, match='healthy, endpoint "ep" with 0 in its'):
            r.route(key="k", endpoint="ep", now=0.0)
    # Other bad input is a plain ValueError, not "no worker" (a gateway must not answer 503).
    r = kvroute.Router(["a"], block_size=BS)
    for call in (
        lambda: r.route(toks(1, 8), now=float("nan")),
        lambda: r.route(block_hashes=[5, 5], now=0.0),
        lambda: r.route([1, 2, -3, 4]),
    ):
        with pytest.raises(ValueError) as e:
            call()
        assert not isinstance(e.value, kvroute.NoWorkerError)


def test_hash_policy_routes_a_key_without_tokens():
    weights = {f"w{i}": 1.0 + (i % 3) for i in range(6)}
    r = kvroute.Router(weights, policy="hash", block_size=BS)
    active = dict.fromkeys(weights, 0)
    for i, key in enumerate(["sess-1"] * 20 + [f"user-{i}" for i in range(20)]):
        order = kvroute.Rendezvous(weights).preference(key, len(weights))
        d = r.route(key=key, now=0.0)
        assert d.worker == bounded_pick(order, active, weights, 1.25), (i, key)
        assert (d.prompt_tokens, d.prompt_blocks, d.cached_tokens) == (0, 0, 0)
        r.begin(d)
        active[d.worker] += 1
    # With an endpoint and no key, the endpoint id is the key (within its pool).
    r.add_endpoint("ep", pool_size=6)
    order = kvroute.Rendezvous(weights).preference("ep", len(weights))
    assert r.route(endpoint="ep", now=0.0).worker == bounded_pick(order, active, weights, 1.25)


def test_every_policy_routes_a_request_without_tokens():
    weights = {"a": 5.0, "b": 1.0, "c": 1.0}
    rr = kvroute.Router(weights, policy="round_robin", block_size=BS)
    current = dict.fromkeys(weights, 0.0)
    for _ in range(14):
        for n in current:
            current[n] += weights[n]
        best = max(current, key=lambda n: (current[n], -list(weights).index(n)))
        current[best] -= sum(weights.values())
        assert rr.route().worker == best
    for policy in ("random", "least_loaded", "power_of_two", "kv_aware"):
        for index in ("approx", "events"):
            r = kvroute.Router(weights, policy=policy, index=index, block_size=BS)
            r.route(toks(1, 40), now=0.0)  # a prompt on some worker: tokenless requests ignore it
            for i in range(12):
                d = r.route(now=float(i))
                assert (d.prompt_blocks, d.cached_blocks) == (0, 0)
                if policy in ("least_loaded", "kv_aware"):
                    # No prefix: load alone decides (kv_aware's cost is its load terms).
                    low = min(d.scores.values())
                    assert d.scores[d.worker] == low
                r.begin(d)
                r.observe(d, 0)
                r.finish(d)
            assert all(r.load(n)["active"] == 0 for n in weights)
            if index == "approx":
                r._check_model()
                assert len(r.index) == 10  # only the one prompt's blocks
