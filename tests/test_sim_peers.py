"""Peer emulations against decisions computed by hand from their published formulas
(docs/peers.md): SGLang cache_aware, Dynamo KV router, llm-d default profile."""

from __future__ import annotations

import numpy as np
import pytest
from kvroute.sim.engine import Fleet, FleetModel, run, worker_names
from kvroute.sim.peers import ActiveBlocks, DynamoKv, LlmdScheduler, SGLangCacheAware
from support.sim_helpers import make_workload


def bind(policy, workload, workers=3, capacity=10):
    fleet = Fleet(
        workload=workload,
        names=worker_names(workers),
        capacity=capacity,
        waiting=[0] * workers,
        running=[0] * workers,
        pinned=[{} for _ in range(workers)],
    )
    policy.bind(fleet)
    return fleet


def route(policy, w, i):
    return policy.route(i, w.block_hashes(i), float(w.arrival[i]))


# --------------------------------------------------------------------------------- SGLang
def test_sglang_cache_aware_decisions():
    w = make_workload(
        [
            (0, [1, 2, 3, 4], 16, 1),  # no match: least loaded, all 0 -> w0
            (1, [1, 2, 3, 9], 16, 1),  # matched 3 blocks = 12/16 = 0.75 > 0.5 -> w0
            (2, [1, 2, 5, 6], 16, 1),  # matched 2 = 0.5, not > 0.5 -> least loaded (2,0,0) -> w1
            (3, [1, 2, 5, 7], 16, 1),  # deepest match 3 blocks, on w1 -> w1
            (4, [1, 2], 8, 1),  # w0 and w1 both hold it; w1 received it last -> w1
            (5, [8], 4, 1),  # loads (2, 3, 0): least loaded -> w2
        ]
    )
    p = SGLangCacheAware()
    bind(p, w)
    assert [route(p, w, i) for i in range(6)] == [0, 0, 1, 1, 1, 2]
    assert p.load == [2, 3, 1]
    assert p.routed == [2, 3, 1]
    p.finished(0, 0, 0, 10.0)
    assert p.load == [1, 3, 1]


def test_sglang_balance_thresholds_and_tie_break():
    w = make_workload([(0, [1, 2, 3, 4], 16, 1), (1, [1, 2, 3, 4], 16, 1)])
    p = SGLangCacheAware()
    bind(p, w)
    assert route(p, w, 0) == 0
    # Imbalanced (40 - 0 > 32 and 40 > 1.1 x 0): shortest queue, despite the full match on w0.
    p.load = [40, 0, 3]
    assert route(p, w, 1) == 1
    # max - min = 32 is not > 32: balanced, the cache decides (full match on w0 and now w1).
    p.load = [33, 1, 5]
    p.routed = [0, 0, 0]
    assert route(p, w, 1) in (0, 1)
    # Least loaded ties go to the fewest routed so far, then the lowest index.
    w2 = make_workload([(0, [7], 4, 1), (0, [8], 4, 1)])
    p2 = SGLangCacheAware()
    bind(p2, w2)
    p2.load = [1, 1, 1]
    p2.routed = [2, 1, 3]
    assert route(p2, w2, 0) == 1
    p2.load, p2.routed = [1, 1, 1], [2, 2, 2]
    assert route(p2, w2, 1) == 0


def test_sglang_tree_size_limit_evicts_lru_leaves():
    # max_tree_tokens 8 = two 4-token blocks per worker: a 4-block prompt leaves only [1, 2].
    w = make_workload([(0, [1, 2, 3, 4], 16, 1), (1, [1, 2, 3, 4], 16, 1)])
    p = SGLangCacheAware(max_tree_tokens=8)
    bind(p, w)
    assert route(p, w, 0) == 0
    assert p.index.match(w.block_hashes(1)) == {"w00": 2}
    # 2 of 4 blocks = 0.5, not above the threshold: least loaded (1, 0, 0) -> w1.
    assert route(p, w, 1) == 1


# --------------------------------------------------------------------------------- Dynamo
def test_dynamo_costs_by_hand():
    w = make_workload(
        [(0, [1, 2, 3, 4], 16, 1), (1, [1, 2, 3, 4], 16, 1), (2, [1, 2, 3, 5], 16, 1)]
    )
    p = DynamoKv()
    bind(p, w)
    h0 = w.block_hashes(0)
    p.events_index.store("w00", h0[:3])  # w0 caches 3 leading blocks, w1 one, w2 none
    p.events_index.store("w01", h0[:1])
    # B = 4, isl = 16: w0: max(0, 16/4 - 3) + (0 + 4 - 0) = 5; w1: 3 + 4 = 7; w2: 4 + 4 = 8.
    assert p.costs(0, h0)[0] == [5.0, 7.0, 8.0]
    assert route(p, w, 0) == 0
    assert p.prefill_tokens == [4.0, 0.0, 0.0]  # 16 - 3 x 4 uncached tokens now queued
    # Same prompt again: w0: (4 + 16)/4 - 3 = 2, decode 4 active + (4 - 4 in flight) = 6.
    assert p.costs(1, w.block_hashes(1))[0] == [6.0, 7.0, 8.0]
    assert route(p, w, 1) == 0
    p.first_token(0, 0, 1.0)
    assert p.prefill_tokens == [4.0, 0.0, 0.0]
    # Third prompt shares 3 blocks with the two in flight (4 distinct active blocks on w0):
    # w0: (4 + 16)/4 - 3 = 2, decode 4 + (4 - 3) = 5 -> 7; w1: 3 + 4 = 7; w2: 8. A tie.
    assert p.costs(2, w.block_hashes(2))[0] == [7.0, 7.0, 8.0]
    picks = set()
    for seed in range(20):
        q = DynamoKv(seed=seed)
        bind(q, w)
        q.events_index.store("w00", h0[:3])
        q.events_index.store("w01", h0[:1])
        q.prefill_tokens = [4.0, 0.0, 0.0]
        q.blocks.add(0, h0)
        q.blocks.add(0, h0)
        picks.add(route(q, w, 2))
    assert picks == {0, 1}  # ties uniformly at random
    # Finishing releases the in-flight blocks.
    p.finished(0, 0, 12, 2.0)
    p.finished(1, 0, 12, 2.0)
    assert p.blocks.count(0) == 0


def test_active_blocks_reference_counts():
    w = make_workload([(0, [1, 2, 3], 12, 1), (1, [1, 2, 4], 12, 1)])
    a = ActiveBlocks(["x", "y"])
    a.add(0, w.block_hashes(0))
    a.add(0, w.block_hashes(1))
    assert a.count(0) == 4
    assert a.index.match(w.block_hashes(1)) == {"x": 3}
    a.release(0, w.block_hashes(0))
    assert a.count(0) == 3
    assert a.index.match(w.block_hashes(0)) == {"x": 2}
    a.release(0, w.block_hashes(1))
    assert a.count(0) == 0 and len(a.index) == 0


# --------------------------------------------------------------------------------- llm-d
def test_llmd_scores_by_hand():
    w = make_workload([(0, [1, 2, 3, 4], 16, 1), (1, [1, 2, 9], 12, 1), (2, [5], 4, 1)])
    p = LlmdScheduler()
    fleet = bind(p, w, capacity=10)
    fleet.waiting[:] = [2, 0, 1]
    fleet.pinned[0].update({k: 1 for k in range(5)})
    fleet.pinned[2].update({k: 1 for k in range(10)})
    # No prefix yet. queue: (2-2)/2 = 0, 1, 0.5; kv: 1 - 0.5, 1 - 0, 1 - 1.
    assert p.scores(w.block_hashes(0)) == pytest.approx([1.0, 4.0, 1.0])
    assert route(p, w, 0) == 1
    fleet.waiting[:] = [0, 0, 0]
    for d in fleet.pinned:
        d.clear()
    # [1, 2, 9]: blocks 1 and 2 held by w1, block 9 by no one: total 3, match_w1 = 2.
    # 3 x 2/3 + 2 x 1 + 2 x 1 = 6 for w1, 4 for the others.
    assert p.scores(w.block_hashes(1)) == pytest.approx([4.0, 6.0, 4.0])
    assert route(p, w, 1) == 1


def test_llmd_lru_is_fed_first_to_last():
    # Capacity 3: feeding [1, 2, 3, 4] first to last evicts block 1, the least recent; the
    # walk then stops at the very first block, so nobody gets prefix credit.
    w = make_workload([(0, [1, 2, 3, 4], 16, 1), (1, [1, 2, 3, 4], 16, 1)])
    p = LlmdScheduler(lru_capacity=3)
    bind(p, w)
    assert route(p, w, 0) in (0, 1, 2)
    assert p.scores(w.block_hashes(1)) == pytest.approx([4.0, 4.0, 4.0])
    # Only the first max_prefix_blocks hashes count.
    q = LlmdScheduler(max_prefix_blocks=2)
    bind(q, w)
    first = route(q, w, 0)
    expect = [4.0] * 3
    expect[first] = 7.0  # 3 x 2/2 + 2 + 2
    assert q.scores(w.block_hashes(1)) == pytest.approx(expect)


def test_llmd_random_ties_are_seeded():
    w = make_workload([(0, [1], 4, 1)])
    picks = set()
    for seed in range(30):
        p = LlmdScheduler(seed=seed)
        bind(p, w)
        picks.add(route(p, w, 0))
    assert picks == {0, 1, 2}
    a, b = LlmdScheduler(seed=3), LlmdScheduler(seed=3)
    bind(a, w), bind(b, w)
    assert route(a, w, 0) == route(b, w, 0)


# ---------------------------------------------------------------------------- in the engine
@pytest.mark.parametrize("policy", [SGLangCacheAware, DynamoKv, LlmdScheduler])
def test_peers_run_in_the_engine(policy):
    rng = np.random.default_rng(1)
    rows = []
    for k in range(200):
        family = int(rng.integers(5))
        ids = [100 + family, *rng.integers(0, 3, size=int(rng.integers(0, 5))).tolist()]
        rows.append((k * 0.05, ids, len(ids) * 4, int(rng.integers(1, 20))))
    w = make_workload(rows)
    r = run(w, policy(), FleetModel(workers=4, capacity_blocks=20, prefill_rate=200.0))
    assert np.all(np.isfinite(r["finish"]))
    assert r["cached_tokens"].sum() > 0
