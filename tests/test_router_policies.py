"""kvroute.Router's policies and the kv_aware cost against small pure-Python references.

References: SplitMix64 and the weighted draws (random, power_of_two), nginx's smooth weighted
round robin, least-loaded with rendezvous tie-breaks, rendezvous + bounded loads (hash), the
kv_aware cost recomputed from ``router.index.match`` (events mode, in-flight prefixes included).
"""

from __future__ import annotations

import kvroute
import numpy as np
import pytest
from support.router_reference import (
    BS,
    IDLE,
    SplitMix64,
    bounded_pick,
    first_block,
    idle_load,
    tie_order,
    toks,
)

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
        assert r.load(n) == idle_load(weights[n])


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
        assert r.load(n) == idle_load()
