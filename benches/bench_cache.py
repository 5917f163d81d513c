"""BlockCache against `lru_dict.LRU` (C) and `cachetools.LRUCache` (pure Python), same process.

The peers are plain LRU maps: no chains, pins or partitions, so they bound what a cache model
costs from Python. Workloads, on 1e6 random 64-bit block hashes:
- `match` of one block (a one-element uint64 array) per call, 10k random cached blocks per round,
  against `LRU.get` / `LRUCache.get` of the same keys (all three refresh the entry);
- one batched `insert` of 1e6 blocks (one chain) into an empty cache, against a loop of puts;
- the same into a full cache, so that every block evicts one (kvroute evicts leaf-first).
Timed in process CPU time (see `pytestmark`).
"""

from __future__ import annotations

import time

import kvroute
import numpy as np
import pytest

lru = pytest.importorskip("lru")
cachetools = pytest.importorskip("cachetools")

# CPU time of this process: the machines these run on are shared, and wall time counts the time
# the benchmark spends descheduled (every implementation here is single-threaded).
pytestmark = pytest.mark.benchmark(timer=time.process_time)

N = 1_000_000
QUERIES = 10_000
CHAIN = 16


@pytest.fixture(scope="module")
def blocks() -> np.ndarray:
    rng = np.random.default_rng(0)
    unique = np.unique(rng.integers(0, 2**64 - 1, size=N + N // 10, dtype=np.uint64))[:N]
    return rng.permutation(unique)


@pytest.fixture(scope="module")
def other_blocks(blocks) -> np.ndarray:
    rng = np.random.default_rng(1)
    fresh = rng.integers(0, 2**64 - 1, size=N + N // 10, dtype=np.uint64)
    return rng.permutation(np.setdiff1d(fresh, blocks)[:N])


@pytest.fixture(scope="module")
def queries(blocks) -> np.ndarray:
    return blocks[np.random.default_rng(2).integers(0, N, size=QUERIES)]


def full_kvroute(blocks: np.ndarray) -> kvroute.BlockCache:
    cache = kvroute.BlockCache(N)
    for start in range(0, N, CHAIN):
        cache.insert(blocks[start : start + CHAIN])
    assert len(cache) == N
    return cache


# Each peer: an empty cache of N entries, and the rounds a 1e6-key loop of puts gets.
PEERS = {
    "lru_dict.LRU": (lambda: lru.LRU(N), 5),
    "cachetools.LRUCache": (lambda: cachetools.LRUCache(maxsize=N), 2),
}


def put_all(cache, keys: list[int]):
    for k in keys:
        cache[k] = k
    return cache


def full_peer(peer: str, blocks: np.ndarray):
    make, _ = PEERS[peer]
    return put_all(make(), blocks.tolist())


# -- match / get per call ------------------------------------------------------------------------

MATCH = "cache: match 1 block per call (1e6 entries)"


def test_match_kvroute(benchmark, blocks, queries):
    benchmark.group = MATCH
    benchmark.extra_info.update(impl="kvroute", ops=QUERIES)
    cache = full_kvroute(blocks)
    arrays = [queries[i : i + 1].copy() for i in range(QUERIES)]
    match = cache.match

    def run():
        for a in arrays:
            match(a)

    benchmark(run)
    assert sum(match(a) for a in arrays) == QUERIES and len(cache) == N


@pytest.mark.parametrize("peer", PEERS)
def test_match_peer(benchmark, blocks, queries, peer):
    benchmark.group = MATCH
    benchmark.extra_info.update(impl=f"{peer}.get", ops=QUERIES)
    cache = full_peer(peer, blocks)
    keys = queries.tolist()
    get = cache.get

    def run():
        for k in keys:
            get(k)

    benchmark(run)
    assert all(get(k) == k for k in keys)


# -- batched insert into an empty cache ----------------------------------------------------------

INSERT = "cache: insert 1e6 blocks into an empty cache"


def test_insert_kvroute(benchmark, blocks):
    benchmark.group = INSERT
    benchmark.extra_info.update(impl="kvroute", ops=N)

    def run(cache):
        return cache.insert(blocks)

    stored, evicted = benchmark.pedantic(
        run, setup=lambda: ((kvroute.BlockCache(N),), {}), rounds=7, iterations=1
    )
    assert stored == N and evicted.size == 0


@pytest.mark.parametrize("peer", PEERS)
def test_insert_peer(benchmark, blocks, peer):
    benchmark.group = INSERT
    benchmark.extra_info.update(impl=f"{peer} loop", ops=N)
    keys = blocks.tolist()
    make, rounds = PEERS[peer]
    cache = benchmark.pedantic(
        put_all, setup=lambda: ((make(), keys), {}), rounds=rounds, iterations=1
    )
    assert len(cache) == N


# -- batched insert into a full cache: every block evicts one ------------------------------------

EVICT = "cache: insert 1e6 new blocks into a full cache (1e6 evictions)"


def test_insert_evicting_kvroute(benchmark, blocks, other_blocks):
    benchmark.group = EVICT
    benchmark.extra_info.update(impl="kvroute", ops=N)

    def run(cache):
        return cache.insert(other_blocks)

    stored, evicted = benchmark.pedantic(
        run, setup=lambda: ((full_kvroute(blocks),), {}), rounds=3, iterations=1
    )
    # Every old block went, each chain's blocks leaf-first (deepest first).
    assert stored == N and evicted.size == N
    assert np.array_equal(np.sort(evicted), np.sort(blocks))
    assert np.array_equal(evicted[:CHAIN], blocks[:CHAIN][::-1])


def test_insert_evicting_lru_dict(benchmark, blocks, other_blocks):
    benchmark.group = EVICT
    benchmark.extra_info.update(impl="lru_dict.LRU loop", ops=N)
    keys = other_blocks.tolist()
    cache = benchmark.pedantic(
        put_all,
        setup=lambda: ((full_peer("lru_dict.LRU", blocks), keys), {}),
        rounds=3,
        iterations=1,
    )
    assert len(cache) == N and keys[0] in cache
