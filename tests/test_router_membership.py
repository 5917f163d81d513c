"""kvroute.Router's endpoints and membership: pools as the first healthy workers of
``kvroute.Rendezvous(...).preference`` (rendezvous itself is checked against its own reference in
test_hashing_rendezvous.py), salted hashes from ``xxhash`` and ``BlockHasher(salt=...)``, reserved
blocks, churn at scale, and a Hypothesis state machine driving membership, health and load
against a model.
"""

from __future__ import annotations

import kvroute
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.router_reference import (
    BS,
    first_block,
    tie_order,
    toks,
)

# ---- endpoints --------------------------------------------------------------------------------


def expected_pool(workers: dict[str, float], healthy: set[str], endpoint: str, k: int) -> set[str]:
    order = kvroute.Rendezvous(workers).preference(endpoint, len(workers))
    return set([n for n in order if n in healthy][:k])


def test_endpoint_pool_is_stable_under_membership_and_health_changes():
    workers = {f"w{i}": 1.0 for i in range(10)}
    r = kvroute.Router(workers, block_size=BS)
    r.add_endpoint("ep", pool_size=3)
    pool = set(r.endpoint_pool("ep"))
    assert pool == expected_pool(workers, set(workers), "ep", 3)
    outside = next(n for n in workers if n not in pool)
    r.remove_worker(outside)
    del workers[outside]
    assert set(r.endpoint_pool("ep")) == pool
    inside = sorted(pool)[0]
    r.remove_worker(inside)
    del workers[inside]
    after = set(r.endpoint_pool("ep"))
    assert len(after & pool) == 2 and len(after) == 3
    assert after == expected_pool(workers, set(workers), "ep", 3)
    # Unhealthy member: replaced by the next in rendezvous order; back: the pool is restored.
    member = sorted(after)[0]
    r.set_healthy(member, False)
    assert set(r.endpoint_pool("ep")) == expected_pool(workers, set(workers) - {member}, "ep", 3)
    r.set_healthy(member, True)
    assert set(r.endpoint_pool("ep")) == after
    # Requests stay inside the pool.
    for i in range(20):
        assert r.route(toks(i, 12), endpoint="ep", now=0.0).worker in after


def test_endpoint_salting_isolates_tenants():
    r = kvroute.Router(["a", "b", "c"], block_size=BS, index="events")
    r.add_endpoint("ep1", pool_size=2)
    r.add_endpoint("ep2", pool_size=2, salt="secret-2")
    r.add_endpoint("open", pool_size=2, isolate=False)
    assert (r.endpoint_salt("ep1"), r.endpoint_salt("ep2"), r.endpoint_salt("open")) == (
        "ep1",
        "secret-2",
        None,
    )
    t = toks(11, 32)
    # The index holds ep1's blocks on every worker: only ep1's requests match them.
    salted = kvroute.BlockHasher(BS, salt="ep1").hash(t)
    for w in ("a", "b", "c"):
        r.index.store(w, salted)
    assert r.route(t, endpoint="ep1", now=0.0).cached_blocks == 8
    assert r.route(t, endpoint="ep2", now=0.0).cached_blocks == 0
    assert r.route(t, now=0.0).cached_blocks == 0
    assert r.route(t, endpoint="open", now=0.0).cached_blocks == 0
    # Given block hashes are salted per block: XXH3-64(h LE, seed=XXH3-64(salt)).
    plain = kvroute.BlockHasher(BS).hash(t)
    derived = [
        xxhash.xxh3_64_intdigest(int(h).to_bytes(8, "little"), seed=kvroute.hash_key("ep1"))
        for h in plain
    ]
    r.index.store("a", np.array(derived, dtype=np.uint64))
    d = r.route(block_hashes=plain, endpoint="ep1", now=0.0)
    assert d.cached_blocks == (8 if d.worker == "a" else 0)
    assert r.route(block_hashes=plain, now=0.0).cached_blocks == 0


@pytest.mark.parametrize(
    ("endpoint_id", "kw", "message"),
    [
        ("t", {"salt": ""}, 'endpoint "t": salt "" is no salt'),
        ("", {}, 'endpoint "": an isolated endpoint is salted with its id'),
        ("u", {"salt": "s", "isolate": False}, 'endpoint "u": salt "s" given with isolate=False'),
    ],
)
def test_endpoint_salt_never_empty_nor_dropped(endpoint_id, kw, message):
    """An empty salt hashed tokens unsalted (sharing untenanted blocks) but given block hashes
    salted; a salt with isolate=False was dropped. Both raise naming the endpoint, add nothing."""
    r = kvroute.Router(["a", "b"], block_size=BS, index="events")
    with pytest.raises(ValueError) as e:
        r.add_endpoint(endpoint_id, pool_size=2, **kw)
    assert str(e.value).startswith(message)
    assert r.endpoints == []


def test_worker_weight_and_freshness_now_are_checked():
    """add_worker's weight refuses bool (True was weight 1.0) as the constructor's does;
    freshness(now) refuses a now that is not finite (NaN answered 1.0 for a stale worker)."""
    r = kvroute.Router(["a"], index="events")
    with pytest.raises(TypeError, match="weight must be a number, got bool"):
        r.add_worker("x", True)
    with pytest.raises(ValueError, match=f"weight is too large: {2**60}"):
        r.add_worker("x", 2**60)
    assert r.workers == ["a"]
    r.add_worker("x", np.float32(2.0))
    assert r.load("x")["weight"] == 2.0
    r.mark_stale("a", 100.0)
    for now, shown in ((float("nan"), "NaN"), (float("inf"), "inf")):
        with pytest.raises(ValueError, match=f"now must be a finite number, got {shown}"):
            r.freshness("a", now)
    assert 0.0 < r.freshness("a", 110.0) < 1.0


def test_endpoint_priority_goes_on_its_decisions():
    r = kvroute.Router(["a", "b", "c"], block_size=BS)
    r.add_endpoint("gold", pool_size=2, priority=5)
    r.add_endpoint("plain", pool_size=1, isolate=None, priority=None)  # None: the defaults
    assert (r.endpoint_priority("gold"), r.endpoint_priority("plain")) == (5, 0)
    assert r.endpoint_salt("plain") == "plain"
    assert r.route(toks(40, 12), endpoint="gold", now=0.0).priority == 5
    assert r.route(toks(40, 12), endpoint="plain", now=0.0).priority == 0
    assert r.route(toks(40, 12), now=0.0).priority == 0
    # Bad priorities raise, naming the value, and add nothing.
    with pytest.raises(ValueError, match=r"priority = 2147483648 is outside"):
        r.add_endpoint("x", pool_size=1, priority=2**31)
    with pytest.raises(TypeError, match="priority must be an int"):
        r.add_endpoint("x", pool_size=1, priority=True)
    with pytest.raises(TypeError, match="priority must be an int"):
        r.add_endpoint("x", pool_size=1, priority=1.5)
    assert r.endpoints == ["gold", "plain"]
    with pytest.raises(KeyError, match="x"):
        r.endpoint_priority("x")


def test_reserved_blocks_protect_an_endpoint_from_noisy_neighbours():
    r = kvroute.Router(["a", "b"], block_size=BS, capacity_blocks=30)
    r.add_endpoint("ep", pool_size=1, reserved_blocks=12)
    (member,) = r.endpoint_pool("ep")
    system = toks(20, 40)  # 10 blocks
    r.route(system, endpoint="ep", now=0.0)
    # Other tenants fill the member's cache many times over.
    for i in range(20):
        r.route(toks(100 + i, 40), exclude=[n for n in r.workers if n != member], now=1.0 + i)
    assert r.route(system, endpoint="ep", now=30.0).cached_blocks == 10
    r._check_model()
    with pytest.raises(ValueError, match="does not fit"):
        r.add_endpoint("big", pool_size=2, reserved_blocks=25)
    assert r.endpoints == ["ep"]


# ---- membership at scale ----------------------------------------------------------------------


def check_pools(r, weights: dict[str, float], healthy: set[str], pools: dict[str, int]) -> None:
    order_of = kvroute.Rendezvous(weights) if weights else None
    for ep, k in pools.items():
        order = order_of.preference(ep, len(weights)) if order_of else []
        want = [n for n in order if n in healthy][:k]
        assert set(r.endpoint_pool(ep)) == set(want), ep
        # The pool lists its members in the order they were added.
        assert r.endpoint_pool(ep) == [n for n in weights if n in set(want)]


def test_pools_follow_membership_churn_and_compaction():
    """Pools against the first healthy workers of kvroute.Rendezvous' order, through joins,
    departures (past half the fleet: the table compacts), health flaps and weight mixes."""
    rng = np.random.default_rng(7)
    weights = {f"w{i}": 1.0 for i in range(300)}
    healthy = set(weights)
    r = kvroute.Router(weights, block_size=BS, capacity_blocks=64)
    pools = {"ep-a": 1, "ep-b": 3, "ep-c": 8}
    for ep, k in pools.items():
        r.add_endpoint(ep, pool_size=k, reserved_blocks=4)
    begun = []
    for i in range(12):
        d = r.route(toks(i, 16), now=0.0)
        r.begin(d)
        begun.append(d)
    check_pools(r, weights, healthy, pools)
    next_name = 300
    for step in range(500):
        names = list(weights)
        # Mostly departures first (down to ~60 workers: compaction), then mostly joins.
        p_remove = 0.8 if step < 250 else 0.15
        x = rng.random()
        if x < p_remove and len(weights) > 10:
            # Pool members leave more often than their share: the head of the order runs out.
            members = [n for ep in pools for n in r.endpoint_pool(ep)]
            w = str(rng.choice(members if rng.random() < 0.5 else names))
            r.remove_worker(w)
            del weights[w]
            healthy.discard(w)
        elif x < p_remove + 0.5 * (1 - p_remove):
            name = f"w{next_name}"
            next_name += 1
            weight = float(rng.choice([1.0, 1.0, 1.0, 2.0]))  # weights mix, then all equal again
            r.add_worker(name, weight)
            weights[name] = weight
            healthy.add(name)
        else:
            w = str(rng.choice(names))
            ok = bool(rng.random() < 0.6)
            r.set_healthy(w, ok)
            (healthy.add if ok else healthy.discard)(w)
        check_pools(r, weights, healthy, pools)
        assert r.workers == list(weights)
    # Decisions made before the churn still finish where their worker is left.
    for d in begun:
        r.finish(d, now=1.0)
    for n in weights:
        assert r.load(n)["active"] == 0
    for ep in pools:
        for _ in range(3):
            assert r.route(toks(5, 16), endpoint=ep, now=2.0).worker in r.endpoint_pool(ep)
    r._check_model()


def test_uniform_weights_flip_keeps_pools_exact():
    weights = {f"w{i}": 1.0 for i in range(40)}
    r = kvroute.Router(weights, block_size=BS)
    pools = {f"ep{i}": 1 + i % 4 for i in range(10)}
    for ep, k in pools.items():
        r.add_endpoint(ep, pool_size=k)
    for name, weight in (("big", 3.0), ("small", 0.5)):
        r.add_worker(name, weight)  # the fleet's weights stop being equal
        weights[name] = weight
        check_pools(r, weights, set(weights), pools)
    for name in ("big", "small"):
        r.remove_worker(name)  # and become equal again
        del weights[name]
        check_pools(r, weights, set(weights), pools)


def test_a_pool_whose_head_is_all_unhealthy_takes_the_next_healthy_worker():
    """Pool size 1 over 20 workers: every worker but the last of the endpoint's order unhealthy
    (more than the head the router keeps) — the pool is that last worker, not empty."""
    weights = {f"w{i}": 1.0 for i in range(20)}
    r = kvroute.Router(weights, block_size=BS)
    r.add_endpoint("ep", pool_size=1)
    order = kvroute.Rendezvous(weights).preference("ep", len(weights))
    for w in order[:-1]:
        r.set_healthy(w, False)
    check_pools(r, weights, {order[-1]}, {"ep": 1})
    assert r.route(toks(1, 16), endpoint="ep", now=0.0).worker == order[-1]
    r.set_healthy(order[-1], False)  # none healthy: routing fails
    with pytest.raises(kvroute.NoWorkerError):
        r.route(toks(1, 16), endpoint="ep", now=0.0)
    for w in reversed(order):  # back one by one, from the end of the order
        r.set_healthy(w, True)
        healthy = set(order[order.index(w) :])
        check_pools(r, weights, healthy, {"ep": 1})


@settings(max_examples=150)
@given(
    n=st.integers(2, 30),
    pools=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    ops=st.lists(
        st.tuples(st.sampled_from("ppphuar"), st.integers(0, 10**6)), min_size=10, max_size=80
    ),
)
def test_pools_under_any_health_and_membership(n, pools, ops):
    """Pools against the reference through health flaps that take out most of the fleet (the
    router keeps only a head of each endpoint's order), joins and departures."""
    weights = {f"w{i}": 1.0 for i in range(n)}
    healthy = set(weights)
    r = kvroute.Router(weights, block_size=BS)
    sizes = {f"ep{i}": k for i, k in enumerate(pools) if k <= n}
    for ep, k in sizes.items():
        r.add_endpoint(ep, pool_size=k)
    fresh = n
    for op, x in ops:
        names = list(weights)
        w = names[x % len(names)]
        members = [m for ep in sorted(sizes) for m in r.endpoint_pool(ep)]
        if op == "p" and members:  # a pool member goes down: the next one takes its place
            w = members[x % len(members)]
            r.set_healthy(w, False)
            healthy.discard(w)
        elif op in "hu":  # mostly down: unhealthy workers pile up
            ok = op == "h" and x % 3 == 0
            r.set_healthy(w, ok)
            (healthy.add if ok else healthy.discard)(w)
        elif op == "a":
            r.add_worker(f"w{fresh}", 1.0 + x % 2)
            weights[f"w{fresh}"] = 1.0 + x % 2
            healthy.add(f"w{fresh}")
            fresh += 1
        elif len(weights) > max(sizes.values(), default=1):
            r.remove_worker(w)
            del weights[w]
            healthy.discard(w)
        check_pools(r, weights, healthy, sizes)


def test_a_100k_worker_fleet_builds_and_stays_correct():
    """No timing here (benches/bench_router_fleet.py measures): a fleet of 100,000 workers
    builds, takes membership changes at that size, and agrees with the references."""
    n = 100_000
    names = [f"gpu-{i:06d}" for i in range(n)]
    r = kvroute.Router(names, block_size=BS, capacity_blocks=256)
    assert len(r) == n
    pools = {f"tenant-{i}": 4 for i in range(5)}
    for ep, k in pools.items():
        r.add_endpoint(ep, pool_size=k, reserved_blocks=16)
    weights = dict.fromkeys(names, 1.0)
    check_pools(r, weights, set(names), pools)
    d = r.route(toks(1, 64), endpoint="tenant-0", now=0.0)
    r.begin(d)
    # Six in ten leave (the table compacts on the way), members included; a few join back.
    rng = np.random.default_rng(3)
    leaving = set(rng.choice(n, size=60_000, replace=False).tolist())
    leaving |= {names.index(w) for ep in pools for w in r.endpoint_pool(ep)[:2]}
    for i in sorted(leaving):
        if names[i] != d.worker:
            r.remove_worker(names[i])
            del weights[names[i]]
    for i in range(1_000):
        r.add_worker(f"new-{i}")
        weights[f"new-{i}"] = 1.0
    unhealthy = set(list(weights)[::7])
    for w in unhealthy:
        r.set_healthy(w, False)
    assert r.workers == list(weights)
    check_pools(r, weights, set(weights) - unhealthy, pools)
    r.finish(d, now=1.0)
    assert r.load(d.worker)["active"] == 0
    hashed = kvroute.Router(list(weights)[:5_000], policy="hash", block_size=BS)
    order = kvroute.Rendezvous(dict.fromkeys(list(weights)[:5_000], 1.0)).preference("s", 1)
    assert hashed.route(key="s").worker == order[0]


# ---- state machine ----------------------------------------------------------------------------


class RouterMachine(RuleBasedStateMachine):
    """least_loaded routing, membership, health and load accounting against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = {"w0": 1.0, "w1": 2.0, "w2": 1.0}
        self.healthy = set(self.weights)
        self.router = kvroute.Router(self.weights, policy="least_loaded", block_size=BS)
        self.active: dict[str, list] = {n: [] for n in self.weights}
        self.routed: list = []
        self.next_name = 3

    @rule(seed=st.integers(0, 50), n=st.integers(0, 24))
    def route(self, seed, n):
        t = toks(seed, n)
        if not self.healthy:
            with pytest.raises(kvroute.NoWorkerError, match="0 healthy"):
                self.router.route(t, now=0.0)
            return
        loads = {w: len(self.active[w]) / self.weights[w] for w in self.healthy}
        low = min(loads.values())
        tied = {w for w in self.healthy if loads[w] == low}
        key = first_block(t) if n >= BS else 0
        want = next(w for w in tie_order(self.weights, key) if w in tied)
        d = self.router.route(t, now=0.0)
        assert d.worker == want
        self.routed.append(d)

    @precondition(lambda self: self.routed)
    @rule(i=st.integers(0, 100))
    def begin(self, i):
        d = self.routed.pop(i % len(self.routed))
        if d.worker not in self.weights:
            with pytest.raises(KeyError):
                self.router.begin(d)
            return
        self.router.begin(d)
        self.active[d.worker].append(d)

    @precondition(lambda self: any(self.active.values()))
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        live = [w for w in self.active if self.active[w]]
        w = live[i % len(live)]
        d = self.active[w].pop(0)
        self.router.finish(d, now=0.0)
        with pytest.raises(ValueError):
            self.router.finish(d, now=0.0)

    @rule(i=st.integers(0, 100), ok=st.booleans())
    def health(self, i, ok):
        names = sorted(self.weights)
        w = names[i % len(names)]
        self.router.set_healthy(w, ok)
        (self.healthy.add if ok else self.healthy.discard)(w)

    @rule(weight=st.sampled_from([0.5, 1.0, 3.0]))
    def add(self, weight):
        name = f"w{self.next_name}"
        self.next_name += 1
        self.router.add_worker(name, weight)
        self.weights[name] = weight
        self.healthy.add(name)
        self.active[name] = []

    @precondition(lambda self: len(self.weights) > 1)
    @rule(i=st.integers(0, 100))
    def remove(self, i):
        names = sorted(self.weights)
        w = names[i % len(names)]
        self.router.remove_worker(w)
        for d in self.active.pop(w):
            self.router.finish(d, now=0.0)  # a removed worker's decisions finish quietly
        del self.weights[w]
        self.healthy.discard(w)

    @invariant()
    def loads_match(self):
        for w, ds in self.active.items():
            load = self.router.load(w)
            assert load["active"] == len(ds)
            assert load["decode_blocks"] == sum(d.prompt_blocks for d in ds)
            assert load["prefill_blocks"] == sum(d.prompt_blocks - d.cached_blocks for d in ds)
        assert self.router.workers == list(self.weights)


TestRouterMachine = RouterMachine.TestCase
TestRouterMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
