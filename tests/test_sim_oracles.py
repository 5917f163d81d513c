"""Oracles against brute-force references, and the Mooncake figure they must reproduce."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvroute.sim import (
    LRUBlockCache,
    Workload,
    chain_block_ids,
    infinite_cache,
    make_block_cache,
    pooled_lru,
)

BS = 4


def _workload(prompts: list[list[int]], *, chained: bool, partial: list[int] | None = None):
    lengths = [len(p) for p in prompts]
    offsets = np.cumsum([0, *lengths])
    ids = np.array([i for p in prompts for i in p], dtype=np.uint64)
    hashes = chain_block_ids(ids, offsets, 1) if chained else ids
    tokens = [max(1, n * BS - (partial[k] if partial else 0)) for k, n in enumerate(lengths)]
    return Workload(
        arrival=np.arange(len(prompts), dtype=np.float64),
        input_tokens=tokens,
        output_tokens=[1] * len(prompts),
        hashes=hashes,
        offsets=offsets,
        block_size=BS,
        name="t",
    )


prompts_st = st.lists(st.lists(st.integers(0, 4), max_size=7), min_size=1, max_size=25)


# -- brute-force references --------------------------------------------------------------------
def _infinite_ref(w: Workload) -> list[int]:
    seen: set[int] = set()
    out = []
    for r in w:
        hs = r.block_hashes.tolist()
        k = 0
        while k < len(hs) and hs[k] in seen:
            k += 1
        out.append(k)
        seen.update(hs)
    return out


class ListLRU:
    """Reference LRU: a Python list, most recent last."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: list[int] = []

    def match(self, hs: list[int]) -> int:
        k = 0
        while k < len(hs) and hs[k] in self.items:
            k += 1
        return k

    def insert(self, hs: list[int]) -> tuple[int, list[int]]:
        for h in reversed(hs):
            if h in self.items:
                self.items.remove(h)
            self.items.append(h)
        evicted = []
        while len(self.items) > self.capacity:
            evicted.append(self.items.pop(0))
        return self.match(hs), evicted


def _pooled_ref(w: Workload, capacity: int) -> list[int]:
    lru = ListLRU(capacity)
    out = []
    for r in w:
        hs = r.block_hashes.tolist()
        out.append(lru.match(hs))
        lru.insert(hs)
    return out


# -- properties ---------------------------------------------------------------------------------
@settings(max_examples=200)
@given(prompts_st, st.booleans())
def test_infinite_cache_matches_reference(prompts, chained):
    w = _workload(prompts, chained=chained)
    got = infinite_cache(w)
    assert got.cached_blocks.tolist() == _infinite_ref(w)
    assert got.hit_rate == pytest.approx(
        w.cached_tokens(got.cached_blocks).sum() / w.input_tokens.sum()
    )


@settings(max_examples=200)
@given(prompts_st, st.booleans(), st.integers(0, 12))
def test_pooled_lru_matches_reference(prompts, chained, capacity):
    w = _workload(prompts, chained=chained)
    got = pooled_lru(w, capacity)
    assert got.cached_blocks.tolist() == _pooled_ref(w, capacity)
    assert got.params == {"capacity_blocks": capacity}


@settings(max_examples=100)
@given(prompts_st, st.integers(0, 10))
def test_pooled_lru_is_monotone_in_capacity_and_bounded_by_infinite(prompts, capacity):
    w = _workload(prompts, chained=True)
    small = pooled_lru(w, capacity).cached_blocks
    big = pooled_lru(w, capacity + 3).cached_blocks
    inf = infinite_cache(w).cached_blocks
    assert np.all(small <= big) and np.all(big <= inf)
    assert pooled_lru(w, 10_000).cached_blocks.tolist() == inf.tolist()


def test_partial_last_block_is_credited_up_to_the_prompt_length():
    w = _workload([[1, 2, 3], [1, 2, 3], [1, 2]], chained=True, partial=[3, 3, 0])
    r = infinite_cache(w)
    assert r.cached_blocks.tolist() == [0, 3, 2]
    assert r.cached_tokens.tolist() == [0, 9, 8]  # 3 blocks of 4 tokens hold a 9-token prompt
    assert r.hit_rate == pytest.approx(17 / (9 + 9 + 8))
    assert r.block_hit_rate == pytest.approx(5 / 8)
    assert r.hit_rate_of(np.array([False, True, False]), w) == 1.0


class LRUMachine(RuleBasedStateMachine):
    """LRUBlockCache against ListLRU under arbitrary interleavings of match and insert."""

    def __init__(self) -> None:
        super().__init__()
        self.cap = 6
        self.real = LRUBlockCache(self.cap)
        self.model = ListLRU(self.cap)

    @rule(hs=st.lists(st.integers(0, 9), max_size=8))
    def insert(self, hs):
        stored, evicted = self.real.insert(np.array(hs, dtype=np.uint64))
        want_stored, want_evicted = self.model.insert(hs)
        assert (stored, evicted.tolist()) == (want_stored, want_evicted)

    @rule(hs=st.lists(st.integers(0, 9), max_size=8))
    def match(self, hs):
        assert self.real.match(np.array(hs, dtype=np.uint64)) == self.model.match(hs)

    @precondition(lambda self: self.model.items)
    @rule(data=st.data())
    def contains(self, data):
        h = data.draw(st.sampled_from(self.model.items))
        assert h in self.real

    @invariant()
    def same_size(self):
        assert len(self.real) == len(self.model.items) <= self.cap


TestLRUMachine = LRUMachine.TestCase


def test_lru_block_cache_rejects_bad_capacity_and_factory_choices():
    with pytest.raises(ValueError, match=">= 0"):
        LRUBlockCache(-1)
    with pytest.raises(TypeError, match="int"):
        LRUBlockCache(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="impl"):
        make_block_cache(4, "java")
    assert isinstance(make_block_cache(4), LRUBlockCache)
    w = _workload([[1]], chained=True)
    with pytest.raises(ValueError, match=">= 0"):
        pooled_lru(w, -3)


def test_pooled_lru_runs_any_prefix_cache_and_reports_progress():
    w = _workload([[1, 2], [1, 2, 3], [1, 2]], chained=True)
    seen = []
    r = pooled_lru(w, 2, cache=make_block_cache(2, "auto"), progress=seen.append)
    assert r.cached_blocks.tolist() == _pooled_ref(w, 2)
    assert seen == [3]
    # Every 1,024 requests too (its docs), then all of them.
    w = _workload([[k % 5] for k in range(2500)], chained=False)
    seen = []
    pooled_lru(w, 2, progress=seen.append)
    assert seen == [1024, 2048, 2500]


# -- the real trace (the `mooncake` fixture: conftest.py) --------------------------------------
def test_infinite_cache_reproduces_the_published_mooncake_ratio(mooncake):
    r = infinite_cache(mooncake)
    # SOURCES.md: 36.6 % of the 288,500 block references repeat an earlier id.
    assert r.block_hit_rate == pytest.approx(0.366, abs=0.0005)
    assert r.block_refs == 288_500
    # Token-weighted it is slightly higher (long prompts share more): pinned from this trace.
    assert r.hit_rate == pytest.approx(0.3736, abs=0.0001)


def test_pooled_lru_on_mooncake_approaches_the_infinite_cache(mooncake):
    inf = infinite_cache(mooncake)
    small = pooled_lru(mooncake, 16 * 2_000)
    big = pooled_lru(mooncake, 400_000)  # more than the trace's 182,790 distinct blocks
    assert small.hit_rate < big.hit_rate
    assert big.cached_blocks.tolist() == inf.cached_blocks.tolist()
