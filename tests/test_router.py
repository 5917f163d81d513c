"""kvroute.Router against small pure-Python reference computations.

References: SplitMix64 and the weighted draws (random, power_of_two), nginx's smooth weighted
round robin, least-loaded with rendezvous tie-breaks, rendezvous + bounded loads (hash), the
kv_aware cost recomputed from ``router.index.match``, endpoint pools as the first healthy workers
of ``kvroute.Rendezvous(...).preference`` (rendezvous itself is checked against its own reference
in test_hashing_rendezvous.py), salted hashes from ``xxhash`` and ``BlockHasher(salt=...)``.
A Hypothesis state machine drives membership, health and load against a model.
"""

from __future__ import annotations

import math

import kvroute
import numpy as np
import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import events_payloads as P
from support.helpers import run_threads

#: No load reported for requests this router did not begin (`set_load`, replica updates).
IDLE = {"active": 0, "queued": 0, "prefill_blocks": 0, "decode_blocks": 0, "written_blocks": 0}

BS = 4
MASK = (1 << 64) - 1


def toks(seed: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) + np.uint32(seed * 100_000)).astype(np.uint32)


class SplitMix64:
    def __init__(self, seed: int) -> None:
        self.state = seed

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def uniform(self) -> float:
        return (self.next() >> 11) * 2.0**-53


def first_block(tokens: np.ndarray, block_size: int = BS) -> int:
    return int(kvroute.BlockHasher(block_size).hash(tokens)[0])


def tie_order(workers: dict[str, float], key: int) -> list[str]:
    return kvroute.Rendezvous(workers).preference(key, len(workers))


# ---- policies ---------------------------------------------------------------------------------


def test_random_matches_splitmix_weighted_draws():
    weights = {"a": 1.0, "b": 3.0, "c": 0.5}
    r = kvroute.Router(weights, policy="random", seed=42, block_size=BS)
    rng = SplitMix64(42)
    names = list(weights)
    total = sum(weights.values())
    for i in range(300):
        target = rng.uniform() * total
        acc, want = 0.0, names[-1]
        for n in names:
            acc += weights[n]
            if acc > target:
                want = n
                break
        d = r.route(toks(i, 8), now=0.0)
        assert d.worker == want
        assert d.scores == pytest.approx({n: w / total for n, w in weights.items()})


def test_round_robin_is_smooth_weighted():
    weights = {"a": 5.0, "b": 1.0, "c": 1.0}
    r = kvroute.Router(weights, policy="round_robin", block_size=BS)
    current = dict.fromkeys(weights, 0.0)
    got, want = [], []
    for i in range(21):
        for n in current:
            current[n] += weights[n]
        best = max(current, key=lambda n: (current[n], -list(weights).index(n)))
        current[best] -= sum(weights.values())
        want.append(best)
        got.append(r.route(toks(i, 8), now=0.0).worker)
    assert got == want
    assert got[:7].count("a") == 5  # nginx: a a b a c a a → a five times in seven


def test_least_loaded_and_ties_by_rendezvous_of_the_prefix():
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    r = kvroute.Router(weights, policy="least_loaded", block_size=BS)
    active = dict.fromkeys(weights, 0)
    for i in range(40):
        t = toks(i, 12)
        loads = {n: active[n] / weights[n] for n in weights}
        low = min(loads.values())
        tied = [n for n in weights if loads[n] == low]
        want = next(n for n in tie_order(weights, first_block(t)) if n in tied)
        d = r.route(t, now=0.0)
        assert d.worker == want, i
        assert d.scores == pytest.approx(loads)
        r.begin(d)
        active[d.worker] += 1
    assert {n: r.load(n)["active"] for n in weights} == active


def test_power_of_two_matches_reference():
    names = ["a", "b", "c", "d", "e"]
    r = kvroute.Router(names, policy="power_of_two", seed=7, block_size=BS)
    rng = SplitMix64(7)
    active = dict.fromkeys(names, 0)
    for i in range(60):
        n = len(names)
        x = min(int(rng.uniform() * n), n - 1)
        y = min(int(rng.uniform() * (n - 1)), n - 2)
        if y >= x:
            y += 1
        a, b = names[x], names[y]
        want = b if active[b] < active[a] else a
        d = r.route(toks(i, 8), now=0.0)
        assert d.worker == want
        assert set(d.scores) == {a, b}
        r.begin(d)
        active[want] += 1


def bounded_pick(order: list[str], active: dict[str, int], weights: dict[str, float], c: float):
    total = sum(active[n] for n in order)
    wsum = sum(weights[n] for n in order)
    for n in order:
        x = c * (total + 1) * weights[n] / wsum
        cap = math.ceil(x)
        if x - (cap - 1) <= 1e-9 * max(x, 1.0):
            cap -= 1
        if active[n] < max(cap, 1):
            return n
    raise AssertionError("a full preference order always has room")


def test_hash_policy_walks_rendezvous_with_bounded_loads():
    weights = {f"w{i}": 1.0 + (i % 3) for i in range(6)}
    r = kvroute.Router(weights, policy="hash", block_size=BS, load_bound=1.25)
    active = dict.fromkeys(weights, 0)
    keys = ["hot"] * 30 + [f"k{i}" for i in range(30)]
    for i, key in enumerate(keys):
        order = kvroute.Rendezvous(weights).preference(key, len(weights))
        want = bounded_pick(order, active, weights, 1.25)
        d = r.route(toks(i, 8), key=key, now=0.0)
        assert d.worker == want, (i, key)
        assert d.reason == ("hash" if want == order[0] else "hash_bounded")
        r.begin(d)
        active[want] += 1
    # Without a key: the endpoint, else the first block hash.
    r2 = kvroute.Router(weights, policy="hash", block_size=BS)
    t = toks(99, 8)
    order = kvroute.Rendezvous(weights).preference(first_block(t), 1)
    assert r2.route(t, now=0.0).worker == order[0]


class KvReference:
    """The kv_aware cost recomputed from ``router.index.match`` and a model of the load the
    router should account for: per worker, the chains begun and not finished (in flight), the
    requests not yet prefilled and their blocks left to prefill, the prompt blocks held."""

    def __init__(self, weights, queue_w=1.0, decode_w=0.05):
        self.weights = dict(weights)
        self.queue_w, self.decode_w = queue_w, decode_w
        self.chains = {n: {} for n in weights}  # worker -> {decision id: hashes}
        self.left = {}  # decision id -> (worker, blocks left to prefill) until prefilled
        self.held = {n: 0 for n in weights}
        self.written = {n: 0 for n in weights}
        self.wrote = {}  # decision -> blocks it adds to its worker's cache

    def inflight(self, n, hashes):
        best = 0
        for chain in self.chains[n].values():
            k = 0
            while k < min(len(chain), len(hashes)) and chain[k] == hashes[k]:
                k += 1
            best = max(best, k)
        return best

    def load(self, n):
        left = [b for (w, b) in self.left.values() if w == n]
        return {
            "queued": len(left),
            "prefill_blocks": sum(left),
            "decode_blocks": self.held[n],
            "written_blocks": self.written[n],
        }

    def costs(self, r, hashes, fresh=None):
        overlap = r.index.match(hashes) if len(hashes) else {}
        delayed = 1 + min(self.load(n)["queued"] for n in self.weights)
        out, expect = {}, {}
        for n, w in self.weights.items():
            load = self.load(n)
            got = overlap.get(n, 0)
            credit = max(got * (fresh or {}).get(n, 1.0), self.inflight(n, hashes))
            expect[n] = (got, self.inflight(n, hashes))
            work = (
                self.queue_w * load["prefill_blocks"]
                + (1 + delayed) * (len(hashes) - credit)
                + self.decode_w * load["written_blocks"]
            )
            out[n] = work / w
        return out, expect

    def begin(self, d, hashes, expect):
        self.chains[d.worker][d] = list(hashes)
        left = d.prompt_blocks - max(expect)
        self.left[d] = (d.worker, left)
        self.wrote[d] = left
        self.held[d.worker] += d.prompt_blocks
        self.written[d.worker] += left

    def prefilled(self, d):
        del self.left[d]

    def finish(self, d):
        self.left.pop(d, None)
        del self.chains[d.worker][d]
        self.held[d.worker] -= d.prompt_blocks
        self.written[d.worker] -= self.wrote.pop(d)


def test_kv_aware_cost_matches_reference_in_events_mode():
    weights = {"a": 1.0, "b": 1.0, "c": 2.0}
    r = kvroute.Router(weights, index="events", block_size=BS, queue_weight=1.5, decode_weight=0.5)
    ref = KvReference(weights, 1.5, 0.5)
    long = toks(1, 40)
    h = kvroute.BlockHasher(BS).hash(long)
    r.index.store("a", h[:8])
    r.index.store("b", h[:3])
    rng = np.random.default_rng(0)
    live = []
    for i in range(60):
        if i % 2 == 0:  # the conversation grows: its next turn extends the longest one so far
            t = np.concatenate([long, toks(1000 + i, int(rng.integers(0, 12)))])
        else:
            t = toks(i, int(rng.integers(4, 40)))
        hashes = kvroute.BlockHasher(BS).hash(t)
        want, expect = ref.costs(r, hashes)
        d = r.route(t, now=0.0)
        assert d.scores == pytest.approx(want)
        low = min(want.values())
        tied = [n for n in weights if want[n] - low <= 1e-9 * max(1.0, abs(low))]
        assert d.worker == next(n for n in tie_order(weights, int(hashes[0])) if n in tied)
        assert (d.cached_blocks, d.inflight_blocks) == expect[d.worker]
        assert d.reason == ("prefix" if max(expect[d.worker]) else "load")
        r.begin(d)
        ref.begin(d, hashes, expect[d.worker])
        live.append(d)
        if i % 3 == 0:
            r.prefilled(d)
            ref.prefilled(d)
        if i % 4 == 3:  # finish the oldest, prefilled or not
            old = live.pop(0)
            r.finish(old, now=0.0)
            ref.finish(old)
        for n in weights:
            load = r.load(n)
            assert load.pop("others") == IDLE
            assert {k: v for k, v in load.items() if k not in ("active", "weight")} == ref.load(n)
    for d in live:
        r.finish(d, now=0.0)
    for n in weights:
        assert r.load(n) == {
            "active": 0,
            "queued": 0,
            "prefill_blocks": 0,
            "decode_blocks": 0,
            "written_blocks": 0,
            "weight": weights[n],
            "others": IDLE,
        }


def test_kv_aware_trades_affinity_against_queued_work():
    r = kvroute.Router(
        ["a", "b"], index="events", block_size=BS, queue_weight=1.0, decode_weight=0.0
    )
    t = toks(2, 40)  # 10 blocks
    r.index.store("a", kvroute.BlockHasher(BS).hash(t))
    first = r.route(t, now=0.0)
    assert first.worker == "a" and first.cached_tokens == 40
    # 21 blocks queued on a: recomputing 10 on idle b costs 10 for the request and 10 for the one
    # it delays (b is idle: delayed = 1), 20 < 21, so b.
    busy = r.route(toks(3, 84), exclude=["b"], now=0.0)
    r.begin(busy)
    assert r.load("a")["prefill_blocks"] == 21 and r.load("a")["queued"] == 1
    assert r.route(t, now=0.0).scores == pytest.approx({"a": 21.0, "b": 20.0})
    assert r.route(t, now=0.0).worker == "b"
    # Once b has a request queued too, no worker is idle: each recomputed block now delays one
    # more request (delayed = 2) and b costs 1 + 3 x 10 = 31 > 21: the prefix holds.
    other = r.route(toks(4, 4), exclude=["a"], now=0.0)
    r.begin(other)
    assert r.route(t, now=0.0).scores == pytest.approx({"a": 21.0, "b": 31.0})
    assert r.route(t, now=0.0).worker == "a"
    r.prefilled(busy)
    r.prefilled(other)
    assert r.route(t, now=0.0).worker == "a"


def test_kv_aware_default_weights():
    # Defaults: queue_weight 1.0, decode_weight 0.05 (see CostWeights in rust/src/router).
    r = kvroute.Router(["a", "b"], index="events", block_size=BS)
    assert (r.config["queue_weight"], r.config["decode_weight"]) == (1.0, 0.05)
    t = toks(2, 40)  # 10 blocks, all cached on a
    r.index.store("a", kvroute.BlockHasher(BS).hash(t))
    busy = r.route(toks(3, 44), exclude=["b"], now=0.0)  # 11 blocks queued on a
    r.begin(busy)
    # a: 11 + 2 x 0 + 0.05 x 11 written = 11.55; b: 2 x 10 = 20 (b idle: delayed = 1).
    d = r.route(t, now=0.0)
    assert d.scores == pytest.approx({"a": 11.55, "b": 20.0})
    assert d.worker == "a"


def test_kv_aware_credits_prefixes_in_flight_in_events_mode():
    # No KV event has arrived yet: the first turn is queued on its worker, and its follow-up
    # goes there, expecting the first turn's blocks as hits (the issue 11 collapse, in small).
    r = kvroute.Router(["a", "b", "c", "d"], index="events", block_size=BS)
    turn = toks(9, 64)  # 16 blocks
    d1 = r.route(turn, now=0.0)
    r.begin(d1)
    follow = np.concatenate([turn, toks(10, 8)])
    d2 = r.route(follow, now=0.1)
    assert (d2.worker, d2.cached_blocks, d2.inflight_blocks, d2.reason) == (
        d1.worker,
        0,
        16,
        "prefix",
    )
    r.begin(d2)
    assert r.load(d1.worker)["prefill_blocks"] == 16 + 2  # the follow-up is counted at 2 left
    # The prefix is credited until its last holder finishes, then only events count.
    r.finish(d1, now=1.0)
    assert r.route(follow, now=1.0).inflight_blocks == 18  # d2 still in flight
    r.finish(d2, now=1.0)
    assert r.route(follow, now=1.0).inflight_blocks == 0
    # Approx mode records the prompt at routing already: the same follow-up sticks there too.
    a = kvroute.Router(["a", "b", "c", "d"], block_size=BS)
    e1 = a.route(turn, now=0.0)
    a.begin(e1)
    assert a.route(follow, now=0.1).worker == e1.worker


def test_withdrawing_a_begun_decision_takes_back_its_in_flight_prefix_and_load():
    r = kvroute.Router(["a", "b"], index="events", block_size=BS)
    turn = toks(11, 64)  # 16 blocks
    d1 = r.route(turn, now=0.0)
    r.begin(d1)
    follow = np.concatenate([turn, toks(12, 8)])
    assert r.route(follow, now=0.1).inflight_blocks == 16
    assert r.withdraw(d1)
    assert r.route(follow, now=0.1).inflight_blocks == 0
    for n in ("a", "b"):
        assert r.load(n) == {
            "active": 0,
            "queued": 0,
            "prefill_blocks": 0,
            "decode_blocks": 0,
            "written_blocks": 0,
            "weight": 1.0,
            "others": IDLE,
        }


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
    """The approx model is the router's: every write from Python raises ReadOnlyError naming why,
    and changes nothing (routing and the model stay consistent); events mode stays writable."""
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
    assert r.load(d.worker) == {
        "active": 0,
        "queued": 0,
        "prefill_blocks": 0,
        "decode_blocks": 0,
        "written_blocks": 0,
        "weight": 1.0,
        "others": IDLE,
    }
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
        assert r.load(n) == {
            "active": 0,
            "queued": 0,
            "prefill_blocks": 0,
            "decode_blocks": 0,
            "written_blocks": 0,
            "weight": 1.0,
            "others": IDLE,
        }
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
