"""jump_hash / jump_hash_many against `jump-consistent-hash` (C extension), same process."""

from __future__ import annotations

import kvroute
import numpy as np
import pytest

jump = pytest.importorskip("jump")

N_KEYS = 100_000
BUCKETS = 1024


@pytest.fixture(scope="module")
def keys() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 2**63, size=N_KEYS, dtype=np.uint64)


def test_jump_single_kvroute(benchmark, per_call):
    benchmark.group = "jump_hash per call"
    benchmark.extra_info["impl"] = "kvroute"
    assert per_call(kvroute.jump_hash, 0xDEADBEEF, BUCKETS) == jump.hash(0xDEADBEEF, BUCKETS)


def test_jump_single_peer(benchmark, per_call):
    benchmark.group = "jump_hash per call"
    benchmark.extra_info["impl"] = "jump-consistent-hash"
    per_call(jump.hash, 0xDEADBEEF, BUCKETS)


def test_jump_many_kvroute(benchmark, keys):
    benchmark.group = "jump_hash_many 100k"
    benchmark.extra_info.update(impl="kvroute", ops=N_KEYS)
    out = benchmark(kvroute.jump_hash_many, keys, BUCKETS)
    assert out[:1000].tolist() == [jump.hash(int(k), BUCKETS) for k in keys[:1000]]


def test_jump_many_peer_loop(benchmark, keys):
    benchmark.group = "jump_hash_many 100k"
    benchmark.extra_info.update(impl="jump-consistent-hash loop", ops=N_KEYS)
    as_list = keys.tolist()
    h = jump.hash
    benchmark(lambda: [h(k, BUCKETS) for k in as_list])
