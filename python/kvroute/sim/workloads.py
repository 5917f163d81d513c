"""Requests and workloads: what the simulator replays.

A :class:`Workload` is a column store of requests sorted by arrival time. Every request carries its
prompt as an array of **block hashes** (``numpy.uint64``) of one fixed ``block_size``, plus token
counts, an optional tenant (endpoint) id and an optional session (conversation) id.

Guarantees:

- Requests are sorted by arrival (a stable sort: requests that arrive together keep their input
  order), and ``workload[i].id == i``.
- Block hashes are **prefix-chained**: two requests share the block hash at position ``j`` only if
  they share every block ``0..j`` (up to 64-bit collisions). Trace loaders and synthetic
  generators both build hashes with :func:`chain_block_ids` / :mod:`kvroute.sim.synthetic`, which
  guarantee this by construction, so a cache that matches "leading blocks present" is exact.
- Cached tokens are counted as ``min(cached_blocks * block_size, input_tokens)``
  (:meth:`Request.cached_tokens`). A trace whose last block is partial (Mooncake: one id per
  512 tokens *including* the final partial block) thus earns exactly its prompt length when the
  whole chain is cached, and never more; traces that hash full blocks only (kv-cache-tester,
  :class:`kvroute.BlockHasher`) leave the partial tail uncached. The engine decides whether a fully
  cached prompt still recomputes its last token; the hit rate is measured on these counts.
- All hashes live in one concatenated ``uint64`` array with ``offsets`` (``int64``, length
  ``len(workload) + 1``); ``workload.block_hashes(i)`` is a read-only view, never a copy. For the
  Mooncake conversation trace (12,031 requests, 288,500 block references) that is 2.4 MB
  (hashes + offsets) instead of 3.8 MB as 12,031 separate arrays (measured with tracemalloc), and
  whole-workload passes (oracles, statistics) run as single NumPy operations.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Request",
    "Workload",
    "WorkloadBuilder",
    "chain_block_ids",
    "gather_spans",
    "mix64",
    "namespace_seed",
    "offsets_from_lengths",
]

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a ``uint64`` array (bijective, wraps modulo 2^64)."""
    z = np.asarray(x, dtype=_U64).copy()
    z ^= z >> _U64(30)
    z *= _U64(0xBF58476D1CE4E5B9)
    z ^= z >> _U64(27)
    z *= _U64(0x94D049BB133111EB)
    z ^= z >> _U64(31)
    return z


def namespace_seed(label: str) -> int:
    """A stable 64-bit namespace for ``label`` (BLAKE2b, 8 bytes, little-endian)."""
    return int.from_bytes(hashlib.blake2b(label.encode("utf-8"), digest_size=8).digest(), "little")


def offsets_from_lengths(lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]`` (``int64``): the offsets of back-to-back spans of ``lengths``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def gather_spans(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices of the spans ``starts[k] : starts[k] + lengths[k]``, back to back, and the
    offsets of the spans in that gathered order."""
    offsets = offsets_from_lengths(lengths)
    index = np.repeat(np.asarray(starts, dtype=np.int64) - offsets[:-1], lengths)
    return index + np.arange(offsets[-1], dtype=np.int64), offsets


def chain_block_ids(ids: np.ndarray, offsets: np.ndarray, namespace: int) -> np.ndarray:
    """Turn per-request block ids into prefix-chained 64-bit block hashes.

    ``ids`` holds every request's ids back to back; request ``r`` owns ``ids[offsets[r]:
    offsets[r+1]]``. With ``mix`` = :func:`mix64` and wrapping arithmetic, the hash at position
    ``j`` is ``mix(hash[j-1] ^ mix(mix(id[j]) + ns))``, and ``hash[-1]`` is
    ``mix(ns ^ 0x9E3779B97F4A7C15)``. Equal hashes imply equal id prefixes (up to 64-bit
    collisions), equal id prefixes under one namespace give equal hashes, and different
    namespaces never share a chain.
    For traces whose ids are already prefix-chained (Mooncake, kv-cache-tester: each id always
    follows the same parent at the same position) the equivalence classes are exactly the ids'.
    Vectorised over requests, one step per block position.
    """
    ids = np.ascontiguousarray(ids, dtype=_U64)
    offsets = np.asarray(offsets, dtype=np.int64)
    out = np.empty_like(ids)
    if ids.size == 0:
        return out
    ns = _U64(namespace & _MASK64)
    keyed = mix64(mix64(ids) + ns)
    starts = offsets[:-1]
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")  # longest first: the active set is a prefix
    starts_by_len = starts[order]
    lengths_desc = lengths[order]
    n_active_at = np.searchsorted(-lengths_desc, -np.arange(int(lengths_desc[0])), side="left")
    root = mix64(np.array([ns ^ _U64(_GOLDEN)], dtype=_U64))[0]
    prev = np.full(len(starts), root, dtype=_U64)
    for j, n_active in enumerate(n_active_at.tolist()):
        idx = starts_by_len[:n_active] + j
        cur = mix64(prev[:n_active] ^ keyed[idx])
        out[idx] = cur
        prev[:n_active] = cur
    return out


@dataclass(frozen=True)
class Request:
    """One request of a workload (a view into the workload's columns)."""

    id: int
    arrival: float  # seconds since the workload's start
    block_hashes: np.ndarray  # uint64, prefix-chained, read-only view
    input_tokens: int
    output_tokens: int
    block_size: int
    tenant: str | None = None  # endpoint / tenant id, or None for the public pool
    session: str | None = None  # conversation / session id, or None

    @property
    def num_blocks(self) -> int:
        return int(self.block_hashes.shape[0])

    def cached_tokens(self, cached_blocks: int) -> int:
        """Prompt tokens covered by the first ``cached_blocks`` blocks (see module docs)."""
        return min(int(cached_blocks) * self.block_size, self.input_tokens)


class Workload:
    """Requests sorted by arrival, sharing one block size (see the module docs for guarantees)."""

    def __init__(
        self,
        *,
        arrival: np.ndarray | Sequence[float],
        input_tokens: np.ndarray | Sequence[int],
        output_tokens: np.ndarray | Sequence[int],
        hashes: np.ndarray,
        offsets: np.ndarray | Sequence[int],
        block_size: int,
        tenant: Sequence[str | None] | None = None,
        session: Sequence[str | None] | None = None,
        name: str = "workload",
        description: str = "",
        meta: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
            raise TypeError(f"block_size must be an int, got {block_size!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        arrival = np.asarray(arrival, dtype=np.float64)
        input_tokens = np.asarray(input_tokens, dtype=np.int64)
        output_tokens = np.asarray(output_tokens, dtype=np.int64)
        hashes = np.ascontiguousarray(hashes, dtype=_U64)
        offsets = np.asarray(offsets, dtype=np.int64)
        n = arrival.shape[0]
        for label, col in (("input_tokens", input_tokens), ("output_tokens", output_tokens)):
            if col.shape != (n,):
                raise ValueError(f"{label} has shape {col.shape}, expected ({n},)")
        if offsets.shape != (n + 1,):
            raise ValueError(f"offsets has shape {offsets.shape}, expected ({n + 1},)")
        if n and (offsets[0] != 0 or offsets[-1] != hashes.shape[0]):
            raise ValueError(
                f"offsets must run from 0 to len(hashes)={hashes.shape[0]}, "
                f"got {offsets[0]}..{offsets[-1]}"
            )
        if np.any(np.diff(offsets) < 0):
            raise ValueError("offsets must be non-decreasing")
        if not np.all(np.isfinite(arrival)) or np.any(arrival < 0):
            raise ValueError("arrival times must be finite and >= 0")
        if np.any(input_tokens < 1):
            bad = int(np.flatnonzero(input_tokens < 1)[0])
            raise ValueError(f"request {bad}: input_tokens must be >= 1, got {input_tokens[bad]}")
        if np.any(output_tokens < 0):
            bad = int(np.flatnonzero(output_tokens < 0)[0])
            raise ValueError(f"request {bad}: output_tokens must be >= 0, got {output_tokens[bad]}")
        tenant_list = list(tenant) if tenant is not None else [None] * n
        session_list = list(session) if session is not None else [None] * n
        if len(tenant_list) != n or len(session_list) != n:
            raise ValueError("tenant and session must have one entry per request")

        order = np.argsort(arrival, kind="stable")
        if np.any(order != np.arange(n)):
            gather, offsets = gather_spans(offsets[:-1][order], np.diff(offsets)[order])
            hashes = hashes[gather]
            arrival = arrival[order]
            input_tokens = input_tokens[order]
            output_tokens = output_tokens[order]
            idx = order.tolist()
            tenant_list = [tenant_list[i] for i in idx]
            session_list = [session_list[i] for i in idx]

        for col in (arrival, input_tokens, output_tokens, hashes, offsets):
            col.flags.writeable = False
        self.arrival = arrival
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.hashes = hashes
        self.offsets = offsets
        self.block_size = int(block_size)
        self.tenant: list[str | None] = tenant_list
        self.session: list[str | None] = session_list
        self.name = name
        self.description = description
        self.meta: dict[str, Any] = dict(meta or {})

    # -- access -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.arrival.shape[0])

    def __getitem__(self, i: int) -> Request:
        n = len(self)
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"workload index must be an int, got {type(i).__name__}")
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"request {i} out of range for a workload of {n}")
        return Request(
            id=int(i),
            arrival=float(self.arrival[i]),
            block_hashes=self.block_hashes(i),
            input_tokens=int(self.input_tokens[i]),
            output_tokens=int(self.output_tokens[i]),
            block_size=self.block_size,
            tenant=self.tenant[i],
            session=self.session[i],
        )

    def __iter__(self) -> Iterator[Request]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return (
            f"Workload({self.name!r}, requests={len(self)}, block_size={self.block_size}, "
            f"blocks={self.hashes.shape[0]}, span={self.duration:.1f}s)"
        )

    def block_hashes(self, i: int) -> np.ndarray:
        """Request ``i``'s block hashes: a read-only view into :attr:`hashes`."""
        return self.hashes[self.offsets[i] : self.offsets[i + 1]]

    @property
    def num_blocks(self) -> np.ndarray:
        """Blocks per request (``int64``)."""
        return np.diff(self.offsets)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival (0 for fewer than two requests)."""
        return float(self.arrival[-1] - self.arrival[0]) if len(self) > 1 else 0.0

    def cached_tokens(self, cached_blocks: np.ndarray | Sequence[int]) -> np.ndarray:
        """Vectorised :meth:`Request.cached_tokens` for one cached-block count per request."""
        blocks = np.asarray(cached_blocks, dtype=np.int64)
        if blocks.shape != (len(self),):
            raise ValueError(f"need one cached-block count per request, got shape {blocks.shape}")
        return np.minimum(blocks * self.block_size, self.input_tokens)

    def tenant_mask(self, tenant: str | None) -> np.ndarray:
        """Boolean mask of the requests whose tenant is ``tenant``."""
        return np.fromiter((t == tenant for t in self.tenant), dtype=bool, count=len(self))

    def summary(self) -> dict[str, Any]:
        """Counts and rates that say how hard the workload is (for reports and logs)."""
        n = len(self)
        prompt = int(self.input_tokens.sum())
        unique_blocks = int(np.unique(self.hashes).shape[0])
        span = self.duration
        return {
            "name": self.name,
            "requests": n,
            "block_size": self.block_size,
            "span_s": span,
            "prompt_tokens": prompt,
            "output_tokens": int(self.output_tokens.sum()),
            "block_refs": int(self.hashes.shape[0]),
            "unique_blocks": unique_blocks,
            "mean_input_tokens": prompt / n if n else 0.0,
            "request_rate": (n - 1) / span if span > 0 else 0.0,
            "prompt_tokens_per_s": prompt / span if span > 0 else 0.0,
            "tenants": sorted({t for t in self.tenant if t is not None}),
        }

    # -- derived workloads --------------------------------------------------------------------
    def head(self, n: int) -> Workload:
        """The first ``n`` requests by arrival."""
        n = max(0, min(int(n), len(self)))
        end = int(self.offsets[n])
        return self._derive(
            arrival=self.arrival[:n],
            input_tokens=self.input_tokens[:n],
            output_tokens=self.output_tokens[:n],
            hashes=self.hashes[:end],
            offsets=self.offsets[: n + 1],
            tenant=self.tenant[:n],
            session=self.session[:n],
        )

    def time_scaled(self, factor: float) -> Workload:
        """Arrival times multiplied by ``factor`` (0.5 replays twice as fast)."""
        if not (factor > 0 and np.isfinite(factor)):
            raise ValueError(f"time scale factor must be positive and finite, got {factor}")
        return self._derive(arrival=self.arrival * factor)

    def spread(self, step: float) -> Workload:
        """Arrivals that share a timestamp spread evenly, in their order, over the ``step``
        seconds that follow it (the next timestamp, at most): for traces whose timestamps are
        rounded (the Mooncake trace's come in 3 s steps), so that a burst of equal timestamps is
        not replayed as simultaneous requests. Order and first arrival are kept."""
        if not (step > 0 and np.isfinite(step)):
            raise ValueError(f"spread step must be positive and finite, got {step}")
        t = np.asarray(self.arrival, dtype=np.float64)
        if t.size == 0:
            return self
        starts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
        ends = np.r_[starts[1:], t.size]
        out = t.copy()
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            span = min(step, t[e] - t[s]) if e < t.size else step
            out[s:e] = t[s] + span * np.arange(e - s) / (e - s)
        return self._derive(arrival=out)

    def _derive(self, **cols: Any) -> Workload:
        base = {
            "arrival": self.arrival,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "hashes": self.hashes,
            "offsets": self.offsets,
            "tenant": self.tenant,
            "session": self.session,
        }
        base.update(cols)
        return Workload(
            **base,
            block_size=self.block_size,
            name=self.name,
            description=self.description,
            meta=self.meta,
        )

    @classmethod
    def merge(
        cls,
        workloads: Sequence[Workload],
        *,
        name: str = "merged",
        description: str = "",
        meta: dict[str, Any] | None = None,
    ) -> Workload:
        """One workload with every request of ``workloads`` (same block size), sorted by time.

        Hashes are taken as they are: give each part its own namespace when loading (the trace
        loaders do) so that parts never share blocks by accident.
        """
        if not workloads:
            raise ValueError("merge needs at least one workload")
        sizes = {w.block_size for w in workloads}
        if len(sizes) != 1:
            raise ValueError(f"cannot merge workloads of different block sizes {sorted(sizes)}")
        offsets = offsets_from_lengths(np.concatenate([w.num_blocks for w in workloads]))
        return cls(
            arrival=np.concatenate([w.arrival for w in workloads]),
            input_tokens=np.concatenate([w.input_tokens for w in workloads]),
            output_tokens=np.concatenate([w.output_tokens for w in workloads]),
            hashes=np.concatenate([w.hashes for w in workloads]),
            offsets=offsets,
            tenant=[t for w in workloads for t in w.tenant],
            session=[s for w in workloads for s in w.session],
            block_size=sizes.pop(),
            name=name,
            description=description,
            meta=meta,
        )


@dataclass
class WorkloadBuilder:
    """Accumulates requests (in any order) and builds a :class:`Workload`."""

    block_size: int
    arrival: list[float] = field(default_factory=list)
    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    tenant: list[str | None] = field(default_factory=list)
    session: list[str | None] = field(default_factory=list)
    _parts: list[np.ndarray] = field(default_factory=list)

    def add(
        self,
        arrival: float,
        block_hashes: np.ndarray,
        input_tokens: int,
        output_tokens: int,
        *,
        tenant: str | None = None,
        session: str | None = None,
    ) -> None:
        self.arrival.append(float(arrival))
        self._parts.append(np.asarray(block_hashes, dtype=_U64))
        self.input_tokens.append(int(input_tokens))
        self.output_tokens.append(int(output_tokens))
        self.tenant.append(tenant)
        self.session.append(session)

    def __len__(self) -> int:
        return len(self.arrival)

    def build(self, *, name: str, description: str = "", meta: dict[str, Any] | None = None):
        offsets = offsets_from_lengths([p.shape[0] for p in self._parts])
        hashes = np.concatenate(self._parts) if self._parts else np.empty(0, dtype=_U64)
        return Workload(
            arrival=self.arrival,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            hashes=hashes,
            offsets=offsets,
            block_size=self.block_size,
            tenant=self.tenant,
            session=self.session,
            name=name,
            description=description,
            meta=meta,
        )
