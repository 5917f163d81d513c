"""Router membership at fleet scale: building ``Router(workers)`` and changing membership.

Workload: fleets of 1,000, 10,000 and 100,000 workers (approx mode, the default). ``build`` times
``Router(names)`` (per worker); ``churn`` times one membership change on a fleet with 100
dedicated endpoints of 4 workers each, cycling through ``remove_worker`` + ``add_worker`` of a
pool member and ``set_healthy`` off and on of another (per change). No peer library builds a
router, so the summary compares each size with the 1,000-worker fleet in the same run: a ratio
near 1 means linear building and O(1) changes; the code before kvroute#14 was quadratic (8,000
workers took 3.3 s, 100,000 did not finish).

Run pinned, e.g. ``taskset -c 1 .venv/bin/python -m pytest benches/bench_router_fleet.py -s``.
"""

from __future__ import annotations

import kvroute
import pytest

SIZES = [1_000, 10_000, 100_000]
ENDPOINTS = 100
_per_op: dict[tuple[str, int], float] = {}


def _names(n: int) -> list[str]:
    return [f"gpu-{i:06d}" for i in range(n)]


def _record(kind: str, n: int, benchmark, ops: int) -> None:
    _per_op[(kind, n)] = benchmark.stats.stats.median / ops
    base = _per_op.get((kind, SIZES[0]))
    if base:
        print(
            f"\n{kind} at {n:,} workers: {_per_op[(kind, n)] * 1e9:,.0f} ns per op, "
            f"{_per_op[(kind, n)] / base:.2f}x the {SIZES[0]:,}-worker fleet's"
        )


@pytest.mark.parametrize("n", SIZES)
def test_build(benchmark, n):
    names = _names(n)
    benchmark.group = "Router(workers) build, per worker"
    benchmark.extra_info.update(impl="kvroute", ops=n, workers=n)
    r = benchmark.pedantic(kvroute.Router, args=(names,), rounds=3, iterations=1)
    assert len(r) == n and r.workers == names
    _record("build", n, benchmark, n)


@pytest.mark.parametrize("n", SIZES)
def test_churn(benchmark, n):
    r = kvroute.Router(_names(n))
    for e in range(ENDPOINTS):
        r.add_endpoint(f"ep-{e}", pool_size=4)
    members = [r.endpoint_pool(f"ep-{e}") for e in range(ENDPOINTS)]
    step = [0]

    def change() -> None:
        pool = members[step[0] % ENDPOINTS]
        step[0] += 1
        leaving, flapping = pool[0], pool[1]
        r.remove_worker(leaving)
        r.add_worker(leaving)
        r.set_healthy(flapping, False)
        r.set_healthy(flapping, True)

    benchmark.group = f"membership change with {ENDPOINTS} endpoints, per change"
    benchmark.extra_info.update(impl="kvroute", ops=4, workers=n)
    benchmark.pedantic(change, rounds=400, iterations=1, warmup_rounds=10)
    assert len(r) == n
    # Cross-check: every pool is still the first healthy workers of its rendezvous order.
    ring = kvroute.Rendezvous(r.workers)
    for e in range(0, ENDPOINTS, 25):
        assert set(r.endpoint_pool(f"ep-{e}")) == set(ring.preference(f"ep-{e}", 4))
    _record("churn", n, benchmark, 4)
