"""Cache oracles: upper references for the hit rate a routing policy can reach.

Both replay the workload in arrival order with **prefix semantics** — a request's cached blocks
are the *leading* blocks of its prompt found in the cache — and ignore load, queueing and time.

- :func:`infinite_cache`: every block ever seen stays cached. A request's cached blocks are the
  leading run of its blocks that appeared in earlier requests. No policy on any fleet can beat it.
- :func:`pooled_lru`: one LRU cache of the whole fleet's capacity (``capacity_blocks`` = workers x
  per-worker blocks), as if every request went to one giant worker with no load limits. Each
  request first matches its leading cached blocks, then inserts/refreshes its whole prompt,
  touching blocks **last to first** (so a prompt's root is its most recent block and tails are
  evicted before the prefixes they extend — what vLLM's free queue and a leaf-first LRU do), then
  evicts least recently used blocks down to capacity. A prompt longer than the capacity keeps its
  first ``capacity_blocks`` blocks.

The pooled LRU drives any cache that speaks the :class:`PrefixCache` protocol —
``match(hashes) -> int`` and ``insert(hashes) -> (stored, evicted)`` — so it can run on
``kvroute.BlockCache`` (Rust) as well as the pure-Python :class:`LRUBlockCache` here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .workloads import Workload

__all__ = [
    "LRUBlockCache",
    "OracleResult",
    "PrefixCache",
    "infinite_cache",
    "make_block_cache",
    "pooled_lru",
]


class PrefixCache(Protocol):
    """What the pooled-LRU oracle needs from a block cache (``kvroute.BlockCache`` fits)."""

    def match(self, block_hashes: np.ndarray) -> int: ...

    def insert(self, block_hashes: np.ndarray) -> tuple[int, np.ndarray]: ...


class LRUBlockCache:
    """A pure-Python LRU of block hashes with the pooled-LRU oracle's semantics.

    ``match`` counts leading blocks present (it does not refresh them: the following ``insert``
    of the same prompt does). ``insert`` touches the prompt's blocks last to first, then evicts
    the least recently used blocks while more than ``capacity`` are held, and returns
    ``(stored, evicted)``: how many leading blocks of the prompt are cached afterwards, and the
    evicted hashes (``uint64``). One ``OrderedDict`` operation per block.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be an int, got {capacity!r}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return int(h) in self._lru  # type: ignore[call-overload]

    def match(self, block_hashes: np.ndarray) -> int:
        lru = self._lru
        n = 0
        for h in np.asarray(block_hashes, dtype=np.uint64).tolist():
            if h not in lru:
                break
            n += 1
        return n

    def insert(self, block_hashes: np.ndarray) -> tuple[int, np.ndarray]:
        hashes = np.asarray(block_hashes, dtype=np.uint64).tolist()
        lru = self._lru
        move = lru.move_to_end
        for h in reversed(hashes):
            if h in lru:
                move(h)
            else:
                lru[h] = None
        evicted: list[int] = []
        while len(lru) > self.capacity:
            evicted.append(lru.popitem(last=False)[0])
        stored = 0
        if evicted:
            for h in hashes:
                if h not in lru:
                    break
                stored += 1
        else:
            stored = len(hashes)
        return stored, np.array(evicted, dtype=np.uint64)


def make_block_cache(capacity: int, impl: str = "python") -> PrefixCache:
    """A block cache for the pooled-LRU oracle: ``"python"`` (:class:`LRUBlockCache`),
    ``"rust"`` (``kvroute.BlockCache``; raises ``ImportError`` until it is built), or ``"auto"``
    (Rust when available)."""
    if impl not in ("python", "rust", "auto"):
        raise ValueError(f"impl must be 'python', 'rust' or 'auto', got {impl!r}")
    if impl != "python":
        import kvroute

        rust = getattr(kvroute, "BlockCache", None)
        if rust is not None:
            return rust(capacity)
        if impl == "rust":
            raise ImportError("kvroute.BlockCache is not available in this build")
    return LRUBlockCache(capacity)


@dataclass
class OracleResult:
    """Per-request cached blocks of an oracle, and the hit rates they give."""

    name: str
    cached_blocks: np.ndarray  # int64, one per request
    cached_tokens: np.ndarray  # int64, min(cached_blocks * block_size, input_tokens)
    prompt_tokens: int
    block_refs: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens."""
        return float(self.cached_tokens.sum()) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        """Cached block references / block references."""
        return float(self.cached_blocks.sum()) / self.block_refs if self.block_refs else 0.0

    def hit_rate_of(self, mask: np.ndarray, workload: Workload) -> float:
        """Token hit rate over the requests selected by ``mask``."""
        prompt = int(workload.input_tokens[mask].sum())
        return float(self.cached_tokens[mask].sum()) / prompt if prompt else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "hit_rate": self.hit_rate,
            "block_hit_rate": self.block_hit_rate,
            "cached_tokens": int(self.cached_tokens.sum()),
            "prompt_tokens": self.prompt_tokens,
            "cached_blocks": int(self.cached_blocks.sum()),
            "block_refs": self.block_refs,
            **self.params,
        }


def _result(name: str, workload: Workload, cached_blocks: np.ndarray, **params: Any):
    return OracleResult(
        name=name,
        cached_blocks=cached_blocks,
        cached_tokens=workload.cached_tokens(cached_blocks),
        prompt_tokens=int(workload.input_tokens.sum()),
        block_refs=int(workload.hashes.shape[0]),
        params=params,
    )


def infinite_cache(workload: Workload) -> OracleResult:
    """Hit rates with an unbounded cache (every block ever seen stays cached). Vectorised."""
    n = len(workload)
    hashes = workload.hashes
    lengths = workload.num_blocks
    if hashes.shape[0] == 0:
        return _result("infinite", workload, np.zeros(n, dtype=np.int64))
    req_of = np.repeat(np.arange(n, dtype=np.int64), lengths)
    # First request in which each hash value occurs.
    _, first_idx, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    first_req = req_of[first_idx][inverse.reshape(-1)]
    seen_before = first_req < req_of
    pos = np.arange(hashes.shape[0], dtype=np.int64) - np.repeat(workload.offsets[:-1], lengths)
    stop = np.where(seen_before, np.iinfo(np.int64).max, pos)
    nonempty = lengths > 0
    cached = np.zeros(n, dtype=np.int64)
    firsts = np.minimum.reduceat(stop, workload.offsets[:-1][nonempty])
    cached[nonempty] = np.minimum(firsts, lengths[nonempty])
    return _result("infinite", workload, cached)


def pooled_lru(
    workload: Workload,
    capacity_blocks: int,
    *,
    cache: PrefixCache | None = None,
    progress: Callable[[int], None] | None = None,
) -> OracleResult:
    """Hit rates of one LRU of ``capacity_blocks`` over all requests in arrival order.

    ``cache`` defaults to a fresh :class:`LRUBlockCache`; pass ``make_block_cache(..., "rust")`` or
    any :class:`PrefixCache` to run the same replay on another implementation. ``progress`` is
    called with the number of requests done, every 1024 requests and at the end.
    """
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, (int, np.integer)):
        raise TypeError(f"capacity_blocks must be an int, got {capacity_blocks!r}")
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if cache is None:
        cache = LRUBlockCache(int(capacity_blocks))
    n = len(workload)
    cached = np.zeros(n, dtype=np.int64)
    offsets = workload.offsets.tolist()
    hashes = workload.hashes
    for i in range(n):
        chain = hashes[offsets[i] : offsets[i + 1]]
        cached[i] = cache.match(chain)
        cache.insert(chain)
        if progress is not None and (i + 1) % 1024 == 0:
            progress(i + 1)
    if progress is not None:
        progress(n)
    return _result("pooled_lru", workload, cached, capacity_blocks=int(capacity_blocks))
