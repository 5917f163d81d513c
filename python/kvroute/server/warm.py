"""What a dedicated endpoint keeps warm: the rule that learns it from the endpoint's requests,
one place for ``kvroute serve`` (``kvroute.gateway.warm``, on routing tokens) and the simulator
(``kvroute.sim.warm``, on block-hash chains).

Guarantees (``unit`` is a block: tokens per block on tokens, 1 on chains of block hashes):

- :func:`shared_prefix` is the length of the whole units two sequences share from their start.
- :class:`WarmPrefix` holds the prefix to keep warm: after each request, the whole units it
  shares with the request before it, at most ``max_len``, when that is at least one unit; a
  request that shares less changes nothing. ``learn`` says whether the prefix was the first one
  learnt (the warmer starts a pass at once), a new one (warmed at the next pass), or unchanged.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = ["WarmPrefix", "shared_prefix"]


def shared_prefix(a: np.ndarray, b: np.ndarray, unit: int) -> int:
    """The length of the whole units ``a`` and ``b`` share from their start."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    common = int(differ[0]) if differ.size else n
    return common // unit * unit


class WarmPrefix:
    """An endpoint's prefix to keep warm, learnt from its requests (module docs)."""

    __slots__ = ("last", "max_len", "prefix", "unit")

    def __init__(self, unit: int, max_len: int | None = None) -> None:
        self.unit = unit
        #: The longest prefix kept, in whole units (None: no bound).
        self.max_len = None if max_len is None else max_len // unit * unit
        self.last: np.ndarray | None = None
        self.prefix: np.ndarray | None = None

    def learn(self, seq: np.ndarray) -> Literal["first", "new", "same"]:
        """A request of the endpoint: ``seq`` (kept until the next request, not copied)."""
        last, self.last = self.last, seq
        if last is None:
            return "same"
        n = shared_prefix(last, seq, self.unit)
        if self.max_len is not None:
            n = min(n, self.max_len)
        if n == 0:
            return "same"
        prefix = seq[:n]
        if self.prefix is not None and np.array_equal(self.prefix, prefix):
            return "same"
        first = self.prefix is None
        self.prefix = prefix.copy()
        return "first" if first else "new"
