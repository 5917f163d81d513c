"""BlockCache against a pure-Python reference model (``support.cache_model``), via Hypothesis."""

from __future__ import annotations

import re

import kvroute
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from support.cache_model import CacheModel, ModelError
from support.helpers import run_threads

# A small universe so chains share prefixes, collide and come back after eviction; two values
# above 2**63 keep the full 64-bit range honest.
UNIVERSE = [*range(30), 2**63 + 5, 2**64 - 1]
NAMES = ["a", "b", "c"]

hashes_st = st.lists(st.sampled_from(UNIVERSE), min_size=0, max_size=6)


def as_array(hashes: list[int]) -> np.ndarray:
    return np.array(hashes, dtype=np.uint64)


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(0, 14),
        shares=st.lists(st.integers(0, 4), max_size=len(NAMES)),
        track_idle=st.booleans(),
    )
    def setup(self, capacity, shares, track_idle):
        reserved, left = {}, capacity
        for name, blocks in zip(NAMES, shares, strict=False):
            blocks = min(blocks, left)
            reserved[name] = blocks
            left -= blocks
        self.cache = kvroute.BlockCache(capacity, reserved=reserved, track_idle=track_idle)
        self.model = CacheModel(capacity, reserved, track_idle)
        assert self.cache.track_idle == track_idle
        self.partitions = [None, *reserved]
        self.now = 0.0

    # -- operations ------------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5]))
    def advance_time(self, dt):
        self.now += dt

    @rule(data=st.data(), hashes=hashes_st, parent=st.none() | st.sampled_from(UNIVERSE))
    def insert(self, data, hashes, parent):
        self.check_insert(hashes, data.draw(st.sampled_from(self.partitions)), parent)

    def check_insert(self, hashes, partition, parent):
        model = self.model
        # Pinned through this call: a manual pin, or a lease that `now` does not end.
        before = {
            h: (b.partition, b.pins > 0 or (b.lease is not None and b.lease[0] > self.now))
            for h, b in model.blocks.items()
        }
        usage_before = {q: model.usage(q) for q in self.partitions}
        try:
            expected = model.insert(hashes, partition, parent, self.now)
        except ModelError as e:
            with pytest.raises(e.kind):
                self.cache.insert(
                    as_array(hashes), partition=partition, parent=parent, now=self.now
                )
            return
        stored, evicted = self.cache.insert(
            as_array(hashes), partition=partition, parent=parent, now=self.now
        )
        assert evicted.dtype == np.uint64
        assert (stored, evicted.tolist()) == expected
        evicted = evicted.tolist()
        # The evicted list is exactly what disappeared (a block may be evicted and then stored
        # again by the same chain), each block once, and no pinned block is among them.
        assert len(set(evicted)) == len(evicted)
        assert set(evicted) <= set(before)
        assert set(before) - set(model.blocks) == set(evicted) - set(hashes[:stored])
        assert not any(before[h][1] for h in evicted)
        # Other partitions lose at most what they held over their reservation.
        for q in self.partitions:
            if q != partition:
                lost = sum(before[h][0] == q for h in evicted)
                assert lost <= max(0, usage_before[q] - model.reserved[q]), q

    @precondition(lambda self: self.model.blocks)
    @rule(data=st.data(), fresh=hashes_st)
    def insert_along_a_cached_path(self, data, fresh):
        # Walks down the cached forest, then continues with `fresh` blocks, from a random
        # partition: grows trees whose branches belong to different partitions, the subtle case
        # for the eviction order.
        blocks = self.model.blocks
        path = [
            data.draw(st.sampled_from(sorted(h for h, b in blocks.items() if b.parent is None)))
        ]
        while data.draw(st.booleans()):
            children = sorted(h for h, b in blocks.items() if b.parent == path[-1])
            if not children:
                break
            path.append(data.draw(st.sampled_from(children)))
        partition = data.draw(st.sampled_from(self.partitions))
        if data.draw(st.booleans()):
            self.check_insert(path[1:] + fresh, partition, path[0])
        else:
            self.check_insert(path + fresh, partition, None)

    @rule(hashes=hashes_st)
    def match(self, hashes):
        assert self.cache.match(as_array(hashes)) == self.model.match(hashes)

    @rule(hashes=hashes_st)
    def peek(self, hashes):
        assert self.cache.peek(hashes) == self.model.match(hashes, refresh=False)

    @rule(rnd=st.randoms(use_true_random=False))
    def random_burst(self, rnd):
        # Long random runs reach states that short generated programs rarely do (several stale
        # parents waiting in one partition while another evicts); every step is still checked.
        for _ in range(40):
            if rnd.random() < 0.25:
                self.now += rnd.choice([0.5, 1.0, 2.0])
            blocks = self.model.blocks
            chain, parent = [], None
            while len(chain) < rnd.randint(1, 6):
                children = sorted(h for h, b in blocks.items() if b.parent == parent)
                step = rnd.choice(children) if children and rnd.random() < 0.7 else None
                chain.append(rnd.choice(UNIVERSE) if step is None else step)
                parent = chain[-1]
            op = rnd.random()
            if op < 0.45:
                self.check_insert(chain, rnd.choice(self.partitions), None)
            elif op < 0.6:
                self.match(chain)
            elif op < 0.7:
                self.pin(chain, None)
            elif op < 0.75:
                self.pin(chain, rnd.choice([0.0, 1.0, 3.0]))
            else:
                pinned = sorted(h for h, b in blocks.items() if b.pins)
                self.unpin(pinned[: rnd.randint(1, len(pinned))] if pinned else chain)
            self.agrees_with_the_model()

    @rule(hashes=hashes_st, ttl=st.none() | st.sampled_from([0.0, 1.0, 3.0]))
    def pin(self, hashes, ttl):
        try:
            self.model.pin(hashes, ttl, self.now)
        except ModelError as e:
            with pytest.raises(e.kind):
                self.cache.pin(as_array(hashes), ttl=ttl, now=self.now)
            return
        self.cache.pin(as_array(hashes), ttl=ttl, now=self.now)

    @precondition(lambda self: any(b.pins for b in self.model.blocks.values()))
    @rule(data=st.data())
    def unpin_pinned(self, data):
        pinned = sorted(h for h, b in self.model.blocks.items() if b.pins)
        hashes = data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=4))
        self.unpin(hashes)

    @rule(hashes=hashes_st)
    def unpin(self, hashes):
        try:
            self.model.unpin(hashes, self.now)
        except ModelError as e:
            with pytest.raises(e.kind):
                self.cache.unpin(as_array(hashes), now=self.now)
            return
        self.cache.unpin(as_array(hashes), now=self.now)

    @rule()
    def expire(self):
        assert self.cache.expire(now=self.now) == self.model.expire(self.now)

    @rule(max_idle=st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, -1.0, float("nan")]))
    def expire_idle(self, max_idle):
        try:
            want = self.model.expire_idle(self.now, max_idle)
        except ModelError as e:
            with pytest.raises(e.kind):
                self.cache.expire_idle(max_idle, now=self.now)
            return
        dropped, oldest = self.cache.expire_idle(max_idle, now=self.now)
        assert dropped.dtype == np.uint64
        assert (dropped.tolist(), oldest) == want

    @rule(name=st.sampled_from([*NAMES, "d", "e"]), blocks=st.integers(0, 6))
    def add_partition(self, name, blocks):
        try:
            self.model.add_partition(name, blocks)
        except ModelError as e:
            with pytest.raises(e.kind):
                self.cache.add_partition(name, blocks)
            return
        self.cache.add_partition(name, blocks)
        self.partitions.append(name)

    @rule(name=st.sampled_from([*NAMES, "d", "e"]), blocks=st.integers(0, 8))
    def set_reserved(self, name, blocks):
        try:
            self.model.set_reserved(name, blocks)
        except ModelError as e:
            with pytest.raises(e.kind):
                self.cache.set_reserved(name, blocks)
            return
        self.cache.set_reserved(name, blocks)

    @rule(data=st.data(), hashes=hashes_st)
    def remove(self, data, hashes):
        if data.draw(st.booleans()):
            # Leaves first, as a caller that knows the chains lists them: usually valid.
            hashes = sorted(self.model.blocks, key=lambda h: -self.depth(h))[: len(hashes) + 1]
        try:
            want = self.model.remove(hashes)
        except ModelError as e:
            with pytest.raises(e.kind):
                self.cache.remove(as_array(hashes))
            return
        assert self.cache.remove(as_array(hashes)).tolist() == want

    def depth(self, h: int) -> int:
        d = 0
        while (h := self.model.blocks[h].parent) is not None:
            d += 1
        return d

    @rule(data=st.data())
    def bad_input_changes_nothing(self, data):
        cached = sorted(self.model.blocks)
        absent = [h for h in UNIVERSE if h not in self.model.blocks]
        unpinned = [h for h in cached if not self.model.pinned(h)]
        calls = [
            (KeyError, lambda: self.cache.insert([1, 2], partition="nope", now=self.now)),
            (ValueError, lambda: self.cache.insert([1, 2], now=float("nan"))),
            (ValueError, lambda: self.cache.pin([], ttl=-1.0, now=self.now)),
            (ValueError, lambda: self.cache.unpin([], now=float("inf"))),
            (TypeError, lambda: self.cache.insert(np.zeros((2, 2), dtype=np.uint64))),
            (TypeError, lambda: self.cache.match(np.zeros(3, dtype=np.float64))),
            (TypeError, lambda: self.cache.insert([1], partition=3)),
            (ValueError, lambda: self.cache.insert([1, -(2**64)])),
            (KeyError, lambda: self.cache.set_reserved("nope", 0)),
            (ValueError, lambda: self.cache.add_partition("x", self.cache.capacity + 1)),
            (ValueError, lambda: self.cache.add_partition("y", -1)),
            (TypeError, lambda: self.cache.add_partition(3, 0)),
            (ValueError, lambda: self.cache.expire_idle(-1.0, now=self.now)),
            (ValueError, lambda: self.cache.expire_idle(1.0, now=float("nan"))),
        ]
        if absent:
            missing = data.draw(st.sampled_from(absent))
            calls += [
                (KeyError, lambda: self.cache.insert([1], parent=missing, now=self.now)),
                (KeyError, lambda: self.cache.pin([*cached, missing], now=self.now)),
                (KeyError, lambda: self.cache.unpin([missing], now=self.now)),
                (KeyError, lambda: self.cache.pins(missing)),
            ]
        if unpinned:
            free = data.draw(st.sampled_from(unpinned))
            # Listed after pinned blocks, so a half-done unpin would show.
            pinned = [x for x in cached if self.model.blocks[x].pins]
            calls.append((ValueError, lambda: self.cache.unpin([*pinned, free], now=self.now)))
        kind, call = data.draw(st.sampled_from(calls))
        with pytest.raises(kind):
            call()

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self):
        cache, model = self.cache, self.model
        assert len(cache) == len(model.blocks) <= cache.capacity
        for h in UNIVERSE:
            block = model.blocks.get(h)
            assert (h in cache) == (block is not None), h
            if block is not None:
                assert cache.last_touch(h) == model.last_touch(h), h
                assert cache.pins(h) == block.pins, h
                assert cache.lease_end(h) == (block.lease[0] if block.lease else None), h
                # A cached block's parent is cached.
                assert block.parent is None or block.parent in cache
        assert [cache.usage(q) for q in self.partitions] == [
            model.usage(q) for q in self.partitions
        ]
        assert sum(cache.usage(q) for q in self.partitions) == len(cache)
        assert cache.reserved == {q: r for q, r in model.reserved.items() if q is not None}


CacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheAgainstModel = CacheMachine.TestCase


# -- targeted behaviour ---------------------------------------------------------------------------


def test_leaf_first_and_prefix_refresh():
    c = kvroute.BlockCache(4)
    c.insert([1, 2, 3])
    c.insert([9])
    # 1 is the oldest block but holds up 2 and 3: the oldest leaf, 3, goes.
    assert c.insert([10])[1].tolist() == [3]
    # Refreshing the prefix alone leaves its descendant 2 old: 2, 9, 10 go before 1.
    assert c.match([1]) == 1
    assert c.insert([20, 21, 22])[1].tolist() == [2, 9, 10]
    assert c.peek([1, 99, 20]) == 1 and c.match([20, 21, 22, 23]) == 3


def test_longest_fitting_prefix_and_parent():
    c = kvroute.BlockCache(3)
    assert c.insert([1, 2, 3, 4, 5])[0] == 3
    c.pin([1, 2, 3])
    assert c.insert([7])[0] == 0
    with pytest.raises(KeyError, match="parent"):
        c.insert([8], parent=99)
    c.unpin([3])
    stored, evicted = c.insert([4], parent=2)
    assert (stored, evicted.tolist()) == (1, [3])
    assert c.peek([1, 2, 4]) == 3


def test_ttl_pins_on_virtual_time():
    c = kvroute.BlockCache(2)
    c.insert([1], now=0.0)
    c.insert([2], now=0.0)
    c.pin([1], ttl=10.0, now=0.0)
    c.pin([2], ttl=5.0, now=0.0)
    c.pin([1], ttl=1.0, now=4.0)  # never shortens a lease
    assert c.lease_end(1) == 10.0 and c.pins(1) == 0
    with pytest.raises(ValueError, match="not pinned"):
        c.unpin([2], now=4.0)
    assert c.insert([3], now=4.99)[0] == 0
    stored, evicted = c.insert([3], now=5.0)
    assert (stored, evicted.tolist()) == (1, [2])
    assert c.lease_end(1) == 10.0
    assert c.expire(now=9.0) == 0 and c.expire(now=10.0) == 1
    assert c.lease_end(1) is None


def test_partitions_guarantee_and_usage():
    c = kvroute.BlockCache(4, reserved={"e": 2})
    assert c.reserved == {"e": 2} and c.capacity == 4
    c.insert([1], partition="e")
    for h in (10, 11, 12):
        c.insert([h])
    # e is under its reservation: it takes its slot back from the shared pool.
    assert c.insert([2], partition="e")[1].tolist() == [10]
    # The shared pool never evicts e's two reserved blocks.
    for h in range(100, 110):
        c.insert([h])
        assert 1 in c and 2 in c
    assert (c.usage("e"), c.usage(), len(c)) == (2, 2, 4)
    with pytest.raises(KeyError, match="nope"):
        c.usage("nope")
    with pytest.raises(ValueError, match="more than the capacity"):
        kvroute.BlockCache(3, reserved={"a": 2, "b": 2})
    with pytest.raises(TypeError):
        kvroute.BlockCache(3, reserved=[("a", 1)])
    with pytest.raises(ValueError):
        kvroute.BlockCache(-1)


def test_input_forms():
    c = kvroute.BlockCache(8)
    big = 2**64 - 3
    stored, evicted = c.insert(np.array([big, 5], dtype=np.uint64))
    assert stored == 2 and evicted.dtype == np.uint64
    # Signed hashes (SGLang publishes int64) are taken as their two's-complement bits.
    assert c.match(np.array([big - 2**64, 5], dtype=np.int64)) == 2
    assert c.match([big, 5]) == 2 and c.match((big,)) == 1
    assert c.match(np.array([big, 0, 5], dtype=np.uint64)[::2]) == 2
    assert big in c and (big - 2**64) in c and 6 not in c and 2**70 not in c
    with pytest.raises(TypeError):
        "x" in c  # noqa: B015
    long = np.arange(100, 200, dtype=np.uint64)  # past the small-array fast path
    stored, evicted = c.insert(long)
    # A chain never evicts its own blocks: 8 fit, after evicting the leaf 5, then its parent.
    assert (stored, evicted.tolist()) == (8, [5, big])
    assert c.peek(long) == 8 and len(c) == 8


def test_threads_share_one_cache():
    cache = kvroute.BlockCache(500, reserved={"t0": 50})
    added: list[set[int]] = [set() for _ in range(4)]
    evicted: list[set[int]] = [set() for _ in range(4)]
    unpinned: list[list[int]] = [[] for _ in range(4)]  # blocks a pin found evicted

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        partition = "t0" if t == 0 else None
        for i in range(300):
            # Unique hashes per thread and step: nothing is stored twice.
            chain = (np.arange(1, 9, dtype=np.uint64) << np.uint64(20)) + np.uint64(
                t * 100_000 + i * 10
            )
            chain = chain[: rng.integers(1, 9)]
            stored, out = cache.insert(chain, partition=partition)
            added[t].update(chain[:stored].tolist())
            evicted[t].update(out.tolist())
            if stored:
                try:
                    cache.pin(chain[:stored])
                except KeyError as e:
                    # Another thread's inserts evicted a block between this insert and the pin
                    # (a thread descheduled long enough, as under load): the pin changed nothing.
                    unpinned[t].append(int(re.search(r"block (0x[0-9a-f]+)", str(e))[1], 16))
                    continue
                cache.match(chain)
                assert cache.peek(chain[:stored]) == stored  # pinned: still there
                cache.unpin(chain[:stored])

    run_threads(*((work, (t,)) for t in range(4)))
    everything_added = set().union(*added)
    everything_evicted = set().union(*evicted)
    assert everything_evicted <= everything_added
    # A pin refused for a missing block: that block was evicted by an insert, which reported it.
    assert set().union(*unpinned) <= everything_evicted
    survivors = everything_added - everything_evicted
    assert len(cache) == len(survivors) <= 500
    assert all(h in cache for h in survivors)
    assert cache.usage("t0") + cache.usage() == len(cache)
