"""Shared pieces of the Router tests: token arrays, SplitMix64 (the router's random stream),
the first block's hash and the rendezvous order that break ties, the hash policy's bounded pick.
"""

from __future__ import annotations

import math

import kvroute
import numpy as np

#: No load reported for requests this router did not begin (`set_load`, replica updates).
IDLE = {"active": 0, "queued": 0, "prefill_blocks": 0, "decode_blocks": 0, "written_blocks": 0}

BS = 4
MASK = (1 << 64) - 1


def toks(seed: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) + np.uint32(seed * 100_000)).astype(np.uint32)


class SplitMix64:
    def __init__(self, seed: int) -> None:
        self.state = seed

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def uniform(self) -> float:
        return (self.next() >> 11) * 2.0**-53


def first_block(tokens: np.ndarray, block_size: int = BS) -> int:
    return int(kvroute.BlockHasher(block_size).hash(tokens)[0])


def tie_order(workers: dict[str, float], key: int) -> list[str]:
    return kvroute.Rendezvous(workers).preference(key, len(workers))


def bounded_pick(order: list[str], active: dict[str, int], weights: dict[str, float], c: float):
    """The hash policy's pick: the first worker in `order` under its bounded load."""
    total = sum(active[n] for n in order)
    wsum = sum(weights[n] for n in order)
    for n in order:
        x = c * (total + 1) * weights[n] / wsum
        cap = math.ceil(x)
        if x - (cap - 1) <= 1e-9 * max(x, 1.0):
            cap -= 1
        if active[n] < max(cap, 1):
            return n
    raise AssertionError("a full preference order always has room")


def idle_load(weight: float = 1.0) -> dict:
    """``Router.load(name)`` of a worker with no request in flight and no others' load."""
    return {
        "active": 0,
        "queued": 0,
        "prefill_blocks": 0,
        "decode_blocks": 0,
        "written_blocks": 0,
        "weight": weight,
        "others": IDLE,
    }
