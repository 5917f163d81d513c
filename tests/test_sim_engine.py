"""The fleet engine against hand-computed timings and a naive reference simulation.

The reference (:func:`reference_run`) re-implements the engine's documented model in the most
literal way: a scan for the next event instead of a heap, the pinned set recomputed from the
running requests instead of reference counts, a sort of the waiting requests by (priority,
arrival) instead of a heap, and ``tests/support/cache_model.CacheModel`` (a transcription of the
BlockCache semantics, reserved partitions included) instead of ``kvroute.BlockCache``. It runs
the same :class:`Scenario`: reservations, partitions, engine-side (salted) hashes, priorities.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute import PrefixIndex
from kvroute.sim.engine import Fleet, FleetModel, Policy, run, worker_names
from kvroute.sim.scenario import Scenario
from support.cache_model import CacheModel
from support.sim_helpers import make_workload


class Fixed(Policy):
    """Sends request i to ``assign[i]``; records what its KV-event index said at each arrival."""

    name = "fixed"

    def __init__(self, assign, events=True):
        self.assign = list(assign)
        self.index = PrefixIndex() if events else None
        self.seen: list[dict[str, int]] = []
        self.hooks: list[tuple[str, int, int, float]] = []
        self.calls: list[tuple] = []  # every call with all its arguments

    def bind(self, fleet):
        super().bind(fleet)
        if self.index is not None:
            fleet.subscribe(self.index)

    def route(self, request, chain, now):
        self.calls.append(("route", request, now))
        if self.index is not None:
            self.seen.append(self.index.match(chain) if chain.shape[0] else {})
        return self.assign[request]

    def prefill_started(self, request, worker, cached_blocks, now):
        self.hooks.append(("start", request, worker, now))
        self.calls.append(("start", request, worker, cached_blocks, now))

    def first_token(self, request, worker, now):
        self.hooks.append(("first", request, worker, now))
        self.calls.append(("first", request, worker, now))

    def finished(self, request, worker, cached_tokens, now):
        self.hooks.append(("finish", request, worker, now))
        self.calls.append(("finish", request, worker, cached_tokens, now))


# ---------------------------------------------------------------------------------------------
def test_single_worker_fifo_by_hand():
    # rate 100 tokens/s, overhead 0.5 s, 0.1 s per output token, 4-token blocks.
    model = FleetModel(
        workers=1,
        capacity_blocks=100,
        prefill_rate=100.0,
        prefill_overhead=0.5,
        decode_time_per_token=0.1,
    )
    rows = [
        (0.0, [1, 2, 3], 12, 5),  # 12 tokens: 0.5 + 0.12 = 0.62 s
        (0.1, [1, 2, 3, 4], 15, 1),  # queues until 0.62; 3 blocks cached -> 3 tokens: 0.53 s
        (0.2, [9], 2, 3),  # queues until 1.15; nothing cached: 0.52 s
        (5.0, [1, 2, 3, 4], 16, 2),  # idle worker; 4 blocks = 16 tokens cached: 1 token computed
    ]
    w = make_workload(rows)
    p = Fixed([0, 0, 0, 0])
    r = run(w, p, model)
    assert r["cached_tokens"].tolist() == [0, 12, 0, 16]

    # The policy is told each step with the by-hand values: routed at arrival, admitted with
    # the blocks cached then, its first token, its end with the tokens cached (and the times).
    def called(kind):
        calls = sorted(c[1:] for c in p.calls if c[0] == kind)
        return [c[:-1] for c in calls], [c[-1] for c in calls]

    assert called("route") == ([(0,), (1,), (2,), (3,)], pytest.approx([0.0, 0.1, 0.2, 5.0]))
    assert called("start") == (
        [(0, 0, 0), (1, 0, 3), (2, 0, 0), (3, 0, 4)],
        pytest.approx([0.0, 0.62, 1.15, 5.0]),
    )
    assert called("first") == ([(i, 0) for i in range(4)], pytest.approx([0.62, 1.15, 1.67, 5.51]))
    assert called("finish") == (
        [(0, 0, 0), (1, 0, 12), (2, 0, 0), (3, 0, 16)],
        pytest.approx([1.02, 1.15, 1.87, 5.61]),
    )
    assert r["prefill_start"] == pytest.approx([0.0, 0.62, 1.15, 5.0])
    assert r["first_token"] == pytest.approx([0.62, 1.15, 1.67, 5.51])
    # finish = first token + (output - 1) * 0.1
    assert r["finish"] == pytest.approx([1.02, 1.15, 1.87, 5.61])
    assert r["worker"].tolist() == [0, 0, 0, 0]
    assert (r["first_token"] - r["arrival"]) == pytest.approx([0.62, 1.05, 1.47, 0.51])


def test_cached_prefix_is_decided_at_admission_not_at_routing():
    # Request 1 arrives while request 0 (same prefix) is still prefilling: at routing nothing is
    # cached, but at its admission request 0's blocks are in.
    model = FleetModel(workers=1, capacity_blocks=50, prefill_rate=10.0, prefill_overhead=0.0)
    w = make_workload([(0.0, [1, 2], 8, 1), (0.1, [1, 2, 3], 12, 1)])
    p = Fixed([0, 0])
    r = run(w, p, model)
    assert p.seen == [{}, {}]  # the exact index had nothing at either arrival
    assert r["cached_tokens"].tolist() == [0, 8]
    assert r["prefill_start"][1] == pytest.approx(0.8)


def test_at_one_instant_events_come_before_an_arrival():
    """A request finishing at the instant another arrives has finished when the policy routes
    the newcomer (and a prefill ending then has ended): events at time t before arrivals at t.
    Times are exact in binary: 0.5 s overhead + 1 token at 2 tokens/s = 1.0 s, one output token."""
    model = FleetModel(workers=1, capacity_blocks=10, prefill_rate=2.0, prefill_overhead=0.5)
    w = make_workload([(0.0, [1], 1, 1), (1.0, [2], 1, 1)])
    p = Fixed([0, 0])
    run(w, p, model)
    assert [c[:2] for c in p.calls] == [
        ("route", 0),
        ("start", 0),
        ("first", 0),
        ("finish", 0),
        ("route", 1),
        ("start", 1),
        ("first", 1),
        ("finish", 1),
    ]
    assert [c[-1] for c in p.calls] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0]


def test_memory_gates_admission():
    # Capacity 4 blocks. Request 0 holds 3 blocks while decoding until t = 0.4 + 10 = 10.4;
    # request 1 needs 2 new blocks: 3 + 2 > 4, so it waits for request 0 to finish.
    model = FleetModel(
        workers=1,
        capacity_blocks=4,
        prefill_rate=10.0,
        prefill_overhead=0.0,
        decode_time_per_token=1.0,
    )
    w = make_workload([(0.0, [1, 2, 3], 4, 11), (1.0, [5, 6], 8, 1)])
    r = run(w, Fixed([0, 0]), model)
    assert r["first_token"][0] == pytest.approx(0.4)
    assert r["finish"][0] == pytest.approx(10.4)
    assert r["prefill_start"][1] == pytest.approx(10.4)
    # A request alone larger than the cache still runs, caching what fits.
    w = make_workload([(0.0, list(range(1, 8)), 28, 1), (5.0, list(range(1, 8)), 28, 1)])
    r = run(w, Fixed([0, 0]), model)
    assert r["cached_tokens"].tolist() == [0, 16]


def test_hooks_order_and_partitions():
    model = FleetModel(workers=2, capacity_blocks=8, prefill_rate=10.0, prefill_overhead=0.0)
    scenario = Scenario(reserved={1: {"t": 3}}, partitions=("t", None, "t"))
    w = make_workload([(0.0, [1, 2], 8, 2), (0.0, [3], 4, 2), (0.0, [4], 4, 2)])
    p = Fixed([1, 1, 0])
    r = run(w, p, model, scenario=scenario)
    assert r["worker"].tolist() == [1, 1, 0]
    for i in range(3):
        events = [h[0] for h in p.hooks if h[1] == i]
        assert events == ["start", "first", "finish"]
    ref, seen = reference_run(w, [1, 1, 0], model, scenario)
    assert r["cached_tokens"].tolist() == ref["cached"]
    assert p.seen == seen


# One worker with a 4-block cache, no decode (nothing stays pinned). The tenant's 2-block prompt
# is cached at t = 0; a noisy neighbour's 3-block prompt at t = 1 needs a block back; the
# tenant returns at t = 2 with the same 2 blocks and a third.
NOISE_ROWS = [(0.0, [1, 2], 8, 1), (1.0, [5, 6, 7], 12, 1), (2.0, [1, 2, 3], 12, 1)]
NOISE_MODEL = FleetModel(
    workers=1,
    capacity_blocks=4,
    prefill_rate=1e6,
    prefill_overhead=0.0,
    decode_time_per_token=0.0,
)


@pytest.mark.parametrize(
    ("scenario", "tenant_cached"),
    [
        # Shared LRU: the neighbour evicts the tenant's older leaf, block 2 (1 is its parent).
        (Scenario(), 4),
        # A partition without a reservation does not protect anything.
        (Scenario(reserved={0: {"t": 0}}, partitions=("t", None, "t")), 4),
        # 2 reserved blocks: the neighbour may not evict them; its insert keeps what fits.
        (Scenario(reserved={0: {"t": 2}}, partitions=("t", None, "t")), 8),
        # Reserved, but the tenant's requests are not put into the partition: no protection.
        (Scenario(reserved={0: {"t": 2}}), 4),
    ],
)
def test_noise_evicts_the_tenant_unless_reserved(scenario, tenant_cached):
    w = make_workload(NOISE_ROWS)
    r = run(w, Fixed([0, 0, 0]), NOISE_MODEL, scenario=scenario)
    assert r["cached_tokens"].tolist() == [0, 0, tenant_cached]
    ref, _ = reference_run(w, [0, 0, 0], NOISE_MODEL, scenario)
    assert ref["cached"] == r["cached_tokens"].tolist()


def test_priority_requests_jump_the_queue_but_not_the_running_prefill():
    # Rate 10 tokens/s: request 0 prefills 0..4 s; 1 and 2 arrive while it runs. Request 2 has
    # priority 1: it is admitted at 4 s, before request 1, which arrived first.
    model = FleetModel(workers=1, capacity_blocks=50, prefill_rate=10.0, prefill_overhead=0.0)
    w = make_workload([(0.0, [1] * 10, 40, 1), (1.0, [2], 4, 1), (2.0, [3], 4, 1)])
    fifo = run(w, Fixed([0, 0, 0]), model)
    assert fifo["prefill_start"] == pytest.approx([0.0, 4.0, 4.4])
    scenario = Scenario(priority=np.array([0, 0, 1]))
    prio = run(w, Fixed([0, 0, 0]), model, scenario=scenario)
    assert prio["prefill_start"] == pytest.approx([0.0, 4.4, 4.0])
    ref, _ = reference_run(w, [0, 0, 0], model, scenario)
    np.testing.assert_allclose(prio["prefill_start"], ref["start"], atol=1e-9)


def test_a_newcomer_outranking_a_head_that_waits_for_memory_is_admitted_if_it_fits():
    # Capacity 4 blocks, 4-token blocks, 10 tokens/s, 1 s per output token. Request 0 holds
    # blocks 1-3 while it decodes, 1.2 .. 11.2 s. Each of the admission's triggers, by hand:
    # - 1 (2.0 s, blocks 5, 6) needs 3 + 2 > 4 blocks: its head waits for memory;
    # - 2 (3.0 s, priority 1, block 1: pinned already, so 3 + 0 <= 4) outranks it and fits:
    #   admitted at its arrival, 1 token computed (0.1 s);
    # - 3 (4.0 s, priority 2, blocks 7, 8) outranks 1 but does not fit: both wait for request
    #   0's end (11.2 s), when 3 goes first (prefill 0.8 s), then 1 at 3's prefill end (12.0 s:
    #   3 pins 2 blocks, 1 needs 2 more).
    model = FleetModel(
        workers=1,
        capacity_blocks=4,
        prefill_rate=10.0,
        prefill_overhead=0.0,
        decode_time_per_token=1.0,
    )
    w = make_workload(
        [(0.0, [1, 2, 3], 12, 11), (2.0, [5, 6], 8, 1), (3.0, [1], 4, 1), (4.0, [7, 8], 8, 1)]
    )
    scenario = Scenario(priority=np.array([0, 0, 1, 2]))
    r = run(w, Fixed([0, 0, 0, 0]), model, scenario=scenario)
    assert r["prefill_start"] == pytest.approx([0.0, 12.0, 3.0, 11.2])
    assert r["cached_tokens"].tolist() == [0, 0, 4, 0]
    ref, _ = reference_run(w, [0, 0, 0, 0], model, scenario)
    np.testing.assert_allclose(r["prefill_start"], ref["start"], atol=1e-9)


def test_progress_is_reported_every_256_arrivals_and_at_the_end():
    # As `run` documents: the number of requests routed so far, each 256th, then all of them.
    w = make_workload([(float(k), [k % 7], 4, 1) for k in range(600)])
    seen = []
    run(w, Fixed([0] * 600, events=False), FleetModel(workers=1), progress=seen.append)
    assert seen == [256, 512, 600]


def test_kv_events_carry_the_engine_hashes():
    # The scenario's chains are what the engine caches and announces: a subscriber matches them,
    # not the workload's hashes the policy routes with.
    model = FleetModel(workers=1, capacity_blocks=10, prefill_rate=1e6, prefill_overhead=0.0)
    w = make_workload([(0.0, [1, 2], 8, 1), (1.0, [1, 2], 8, 1)])
    salted = w.hashes ^ np.uint64(0xABCDEF)
    p = Fixed([0, 0])
    r = run(w, p, model, scenario=Scenario(chains=(salted, w.offsets)))
    assert r["cached_tokens"].tolist() == [0, 8]  # the engine hits its own (salted) blocks
    assert p.seen == [{}, {}]  # routing hashes are not what the engine announced
    assert p.index.match(salted[:2]) == {"w00": 2}


def test_scenario_validation():
    w = make_workload([(0.0, [1], 4, 1), (0.1, [2], 4, 1)])
    model = FleetModel(workers=2)
    with pytest.raises(ValueError, match="partitions needs one entry per request"):
        run(w, Fixed([0, 0]), model, scenario=Scenario(partitions=("t",)))
    with pytest.raises(ValueError, match="reserved names workers"):
        run(w, Fixed([0, 0]), model, scenario=Scenario(reserved={2: {"t": 1}}))
    with pytest.raises(ValueError, match="chains offsets need 3 entries"):
        run(w, Fixed([0, 0]), model, scenario=Scenario(chains=(w.hashes, w.offsets[:2])))
    with pytest.raises(ValueError, match="undeclared endpoints"):
        run(w, Fixed([0, 0]), model, scenario=Scenario(endpoint_of=("ep", None)))


# ---------------------------------------------------------------------------------------------
def reference_run(workload, assign, model, scenario=None):
    """The engine's model, transcribed naively (see the module docs)."""
    scenario = scenario or Scenario()
    n = len(workload)
    cap = model.capacity(workload.block_size)
    num_workers = model.workers
    reserved = {w: dict(scenario.reserved.get(w, {})) for w in range(num_workers)}
    caches = [CacheModel(cap, reserved[w]) for w in range(num_workers)]
    routed = [workload.block_hashes(i).tolist() for i in range(n)]
    if scenario.chains is None:
        chains = routed
    else:
        hashes, offsets = scenario.chains
        chains = [hashes[offsets[i] : offsets[i + 1]].tolist() for i in range(n)]
    priority = [0] * n if scenario.priority is None else list(scenario.priority)

    def partition(i, w):
        q = None if scenario.partitions is None else scenario.partitions[i]
        return q if q in reserved[w] else None

    queue = [[] for _ in range(num_workers)]
    prefill = [None] * num_workers  # (request, end time, event number)
    running = [[] for _ in range(num_workers)]  # admitted, unfinished requests
    finish_at = {}  # request -> (finish time, event number), once its prefill is done
    events = iter(range(10**9))  # simultaneous events run in the order they were created
    stored = {}
    matched = {}
    out = {
        "cached": [0] * n,
        "start": [math.nan] * n,
        "first": [math.nan] * n,
        "finish": [math.nan] * n,
    }
    index_seen = []
    block = workload.block_size

    def pinned_set(w):
        s = set()
        for i in running[w]:
            s.update(chains[i][: matched[i]] if i not in stored else chains[i][: stored[i]])
        return s

    def admit(w, now):
        while prefill[w] is None and queue[w]:
            queue[w].sort(key=lambda k: (-priority[k], k))
            i = queue[w][0]
            pins = pinned_set(w)
            if running[w] and len(pins | set(chains[i])) > cap:
                return
            queue[w].pop(0)
            m = caches[w].match(chains[i])
            if m:
                caches[w].pin(chains[i][:m], None, 0.0)
            matched[i] = m
            c = min(m * block, int(workload.input_tokens[i]))
            out["cached"][i] = c
            out["start"][i] = now
            running[w].append(i)
            compute = max(int(workload.input_tokens[i]) - c, 1)
            prefill[w] = (
                i,
                now + model.prefill_overhead + compute / model.prefill_rate,
                next(events),
            )

    nxt = 0
    while True:
        cands = []
        for w in range(num_workers):
            if prefill[w] is not None:
                cands.append((prefill[w][1], prefill[w][2], 0, w))
        for i, (t, e) in finish_at.items():
            cands.append((t, e, 1, i))
        t_arr = float(workload.arrival[nxt]) if nxt < n else math.inf
        if cands and min(cands)[0] <= t_arr:
            t, _, kind, x = min(cands)
            if kind == 0:
                i, _, _ = prefill[x]
                prefill[x] = None
                if chains[i]:
                    s, _ev = caches[x].insert(chains[i], partition(i, x), None, 0.0)
                    if s > matched[i]:
                        caches[x].pin(chains[i][matched[i] : s], None, 0.0)
                    stored[i] = s
                else:
                    stored[i] = 0
                out["first"][i] = t
                decode = max(int(workload.output_tokens[i]) - 1, 0) * model.decode_time_per_token
                finish_at[i] = (t + decode, next(events))
                admit(x, t)
            else:
                del finish_at[x]
                w = assign[x]
                if stored[x]:
                    caches[w].unpin(chains[x][: stored[x]], 0.0)
                running[w].remove(x)
                out["finish"][x] = t
                admit(w, t)
            continue
        if nxt >= n:
            break
        i = nxt
        nxt += 1
        w = assign[i]
        index_seen.append(
            {
                name: caches[k].match(routed[i], refresh=False)
                for k, name in enumerate(worker_names(num_workers))
                if routed[i] and caches[k].match(routed[i], refresh=False)
            }
        )
        queue[w].append(i)
        admit(w, t_arr)
    return out, index_seen


request_rows = st.lists(
    st.tuples(
        st.floats(0.0, 20.0, allow_nan=False),
        st.lists(st.integers(0, 2), min_size=0, max_size=6),
        st.integers(0, 3),  # tokens missing from the last block
        st.integers(1, 30),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=40,
)


@st.composite
def scenarios(draw, n, workers, capacity, hashes, offsets):
    """Tenant requests (partition "t", salted engine hashes, a priority) and reservations of
    "t" on some workers — or the public fleet."""
    if not draw(st.booleans()):
        return Scenario()
    tenant = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    reserved = {
        w: {"t": draw(st.integers(0, capacity))} for w in range(workers) if draw(st.booleans())
    }
    salted = hashes.copy()
    for i in range(n):
        if tenant[i]:
            salted[offsets[i] : offsets[i + 1]] ^= np.uint64(0x5A17)
    priority = np.array([draw(st.integers(0, 2)) if t else 0 for t in tenant])
    return Scenario(
        reserved=reserved,
        partitions=tuple("t" if t else None for t in tenant),
        chains=(salted, offsets) if draw(st.booleans()) else None,
        priority=priority if draw(st.booleans()) else None,
    )


@settings(max_examples=200, deadline=None)
@given(
    rows=request_rows,
    workers=st.integers(1, 3),
    capacity=st.integers(1, 12),
    rate=st.sampled_from([8.0, 20.0, 100.0]),
    data=st.data(),
)
def test_engine_matches_reference(rows, workers, capacity, rate, data):
    model = FleetModel(
        workers=workers,
        capacity_blocks=capacity,
        prefill_rate=rate,
        prefill_overhead=0.05,
        decode_time_per_token=0.1,
    )
    # A request's ids form a path in a small tree (alphabet 0..2): prefixes are shared often.
    spec = [(t, ids, max(1, len(ids) * 4 - short), out) for t, ids, short, out, _ in rows]
    w = make_workload(spec)
    order = np.argsort([r[0] for r in rows], kind="stable")
    assign = [rows[k][4] % workers for k in order.tolist()]
    scenario = data.draw(scenarios(len(w), workers, capacity, w.hashes, w.offsets))
    policy = Fixed(assign)
    r = run(w, policy, model, scenario=scenario)
    ref, seen = reference_run(w, assign, model, scenario)
    assert r["cached_tokens"].tolist() == ref["cached"]
    np.testing.assert_allclose(r["prefill_start"], ref["start"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(r["first_token"], ref["first"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(r["finish"], ref["finish"], rtol=0, atol=1e-9)
    # The KV-event index the engine fed equals the caches' contents at every arrival.
    assert policy.seen == seen
    # Invariants: TTFT covers the own prefill; per worker prefills do not overlap, and requests
    # of equal priority start in routing order.
    own = model.prefill_overhead + np.maximum(r["prompt_tokens"] - r["cached_tokens"], 1) / rate
    assert np.all(r["first_token"] - r["arrival"] >= own - 1e-9)
    prio = np.zeros(len(w)) if scenario.priority is None else scenario.priority
    for k in range(workers):
        mine = np.flatnonzero(r["worker"] == k)
        by_start = mine[np.argsort(r["prefill_start"][mine], kind="stable")]
        starts, ends = r["prefill_start"][by_start], r["first_token"][by_start]
        assert np.all(starts[1:] >= ends[:-1] - 1e-9)
        for p in set(prio[mine].tolist()):
            same = mine[prio[mine] == p]
            assert np.all(np.diff(r["prefill_start"][same]) >= 0)


def test_fleet_view_for_policies():
    model = FleetModel(workers=2, capacity_blocks=10, prefill_rate=10.0, prefill_overhead=0.0)
    snapshots = []

    class Watch(Fixed):
        def route(self, request, chain, now):
            f: Fleet = self.fleet
            snapshots.append((list(f.waiting), list(f.running), [len(p) for p in f.pinned]))
            # What an LRU emulation or an approx Router sizes itself by: blocks per worker.
            assert (f.capacity, f.block_size, f.names) == (10, 4, ["w00", "w01"])
            return super().route(request, chain, now)

    # Request 0 prefills 0..0.8 then decodes to 0.8 + 9 × 1.0; requests 1 and 2 arrive while
    # it prefills (1 waits at worker 0), and 2 goes to worker 1 (prefill 0.2..0.6); 3 waits at
    # worker 0 too, so 4 sees two waiting there.
    rows = [(0.0, [1, 2], 8, 10), (0.1, [1, 3], 8, 1), (0.2, [4], 4, 1), (0.3, [5], 4, 1)]
    w = make_workload([*rows, (0.4, [6], 4, 1)])
    model = FleetModel(
        workers=2,
        capacity_blocks=10,
        prefill_rate=10.0,
        prefill_overhead=0.0,
        decode_time_per_token=1.0,
    )
    run(w, Watch([0, 0, 1, 0, 0]), model)
    assert snapshots[0] == ([0, 0], [0, 0], [0, 0])
    assert snapshots[1] == ([0, 0], [1, 0], [0, 0])  # request 0 prefilling: running, no pins yet
    assert snapshots[2] == ([1, 0], [1, 0], [0, 0])
    assert snapshots[3] == ([1, 0], [1, 1], [0, 0])
    assert snapshots[4] == ([2, 0], [1, 1], [0, 0])


@pytest.mark.parametrize("choice", [5, 2, -1])  # 2: one past the last of two workers
def test_bad_policy_choice_raises(choice):
    w = make_workload([(0.0, [1], 4, 1)])
    with pytest.raises(ValueError, match=f"chose worker {choice} of 2"):
        run(w, Fixed([choice]), FleetModel(workers=2))


@pytest.mark.parametrize(
    ("field", "smallest", "bad", "error"),
    [
        ("workers", 1, 0, ValueError),
        ("workers", 1, True, TypeError),
        ("workers", 1, 2.0, TypeError),
        ("capacity_blocks", 1, 0, ValueError),
        ("kv_tokens", 1, 0, ValueError),
        ("prefill_rate", 1e-9, 0.0, ValueError),
        ("prefill_rate", 1e-9, math.inf, ValueError),
        ("prefill_rate", 1e-9, math.nan, ValueError),
        ("prefill_overhead", 0.0, -1e-9, ValueError),
        ("prefill_overhead", 0.0, math.inf, ValueError),
        ("decode_time_per_token", 0.0, -1e-9, ValueError),
        ("decode_time_per_token", 0.0, math.nan, ValueError),
    ],
)
def test_model_validation(field, smallest, bad, error):
    """The smallest valid value of each field is accepted; the first invalid one is refused with
    an error naming the field and the value."""
    assert getattr(FleetModel(**{field: smallest}), field) == smallest
    with pytest.raises(error, match=rf"^{field} must be .*, got {re.escape(repr(bad))}$"):
        FleetModel(**{field: bad})


def test_model_capacity():
    assert FleetModel().capacity(512) == 864
    assert FleetModel().capacity(16) == 27648
    assert FleetModel(capacity_blocks=7).capacity(512) == 7
    # At least one block (the docs), and whole blocks only.
    assert [FleetModel(kv_tokens=t).capacity(16) for t in (1, 15, 16, 31, 32)] == [1, 1, 1, 1, 2]
