"""Small workloads for the simulator tests."""

from __future__ import annotations

import numpy as np
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
