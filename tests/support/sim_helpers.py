"""Small workloads for the simulator tests."""

from __future__ import annotations

import numpy as np
from kvroute.sim.report import PolicyMetrics
from kvroute.sim.workloads import Workload, chain_block_ids, offsets_from_lengths


def make_workload(rows, block_size=4, tenant=None):
    """rows: (arrival, block ids, input tokens, output tokens)."""
    offsets = offsets_from_lengths([len(r[1]) for r in rows])
    ids = np.array([i for r in rows for i in r[1]], dtype=np.uint64)
    return Workload(
        arrival=[r[0] for r in rows],
        input_tokens=[r[2] for r in rows],
        output_tokens=[r[3] for r in rows],
        hashes=chain_block_ids(ids, offsets, 7),
        offsets=offsets,
        block_size=block_size,
        tenant=tenant,
    )


def family_trace(
    n: int,
    seed: int,
    *,
    families: int,
    first: int,
    ids: int,
    extra: tuple[int, int],
    gap: float,
    out: int,
) -> Workload:
    """``n`` requests ``gap`` seconds apart: each one of ``families`` prompts (first block id
    ``first + family``) then a drawn number (``extra``: low, high) of blocks with ids below
    ``ids``, and 1 to ``out`` - 1 output tokens."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        family = int(rng.integers(families))
        more = rng.integers(0, ids, size=int(rng.integers(*extra))).tolist()
        block_ids = [first + family, *more]
        rows.append((k * gap, block_ids, len(block_ids) * 4 - 1, int(rng.integers(1, out))))
    return make_workload(rows)


def metrics(hit=0.5, mean=1.0, p50=1.0, p90=1.0, p99=1.0, requests=10) -> PolicyMetrics:
    """A summary with the given hit rate and TTFT figures (seconds), the rest neutral."""
    return PolicyMetrics(
        requests=requests,
        unfinished=0,
        prompt_tokens=100,
        cached_tokens=int(100 * hit),
        hit_rate=hit,
        ttft_p50=p50,
        ttft_p99=p99,
        ttft_mean=mean,
        ttft_p90=p90,
        queue_p50=0.0,
        queue_p99=0.0,
        imbalance=1.0,
        makespan_s=1.0,
        throughput_rps=1.0,
        prompt_tokens_per_s=1.0,
    )
