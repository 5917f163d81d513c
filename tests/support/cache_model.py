"""A small, deliberately naive reference model of ``kvroute.BlockCache`` (O(n) per step).

It transcribes the documented semantics literally and shares no structure with the Rust code:
every block stores its last-touch tick (and, with ``track_idle``, the cache's clock at that touch:
the largest ``now`` passed so far); the victim is found by scanning all blocks for the evictable
leaf with the smallest tick among the partitions the inserter may evict. Partitions can be
declared and resized later, blocks removed explicitly and idle blocks expired.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ModelError(Exception):
    """The model refused the call; the cache must raise ``kind`` and change nothing."""

    def __init__(self, kind: type[Exception]):
        super().__init__(kind.__name__)
        self.kind = kind


@dataclass
class Block:
    parent: int | None
    partition: str | None
    tick: int
    touched: float = -math.inf  # the clock at the last touch (tracked with track_idle)
    pins: int = 0
    lease: tuple[float, int] | None = None  # (end, sequence number of the extension)


class CacheModel:
    def __init__(
        self, capacity: int, reserved: dict[str, int] | None = None, track_idle: bool = False
    ):
        self.capacity = capacity
        # The shared pool first, then the partitions in declaration order.
        self.reserved: dict[str | None, int] = {None: 0, **(reserved or {})}
        self.blocks: dict[int, Block] = {}
        self.clock = 0
        self.lease_seq = 0
        self.track_idle = track_idle
        self.time = -math.inf  # the cache's clock: the largest `now` passed so far

    # -- helpers ---------------------------------------------------------------------------------

    def usage(self, partition: str | None = None) -> int:
        return sum(b.partition == partition for b in self.blocks.values())

    def has_child(self, h: int) -> bool:
        return any(b.parent == h for b in self.blocks.values())

    def pinned(self, h: int) -> bool:
        b = self.blocks[h]
        return b.pins > 0 or b.lease is not None

    def touch(self, h: int) -> None:
        self.clock += 1
        self.blocks[h].tick = self.clock
        self.blocks[h].touched = self.time

    def advance(self, now: float) -> None:
        """A call taking `now` passed validation: the clock moves on, ended leases go."""
        self.time = max(self.time, now)
        self.release_leases(now)

    def release_leases(self, now: float) -> int:
        released = 0
        while True:
            due = [
                (b.lease, h)
                for h, b in self.blocks.items()
                if b.lease is not None and b.lease[0] <= now
            ]
            if not due:
                return released
            _, h = min(due)
            block = self.blocks[h]
            block.lease = None
            released += 1
            if block.pins == 0:
                self.touch(h)

    def victim(self, partition: str | None, protect_from: int) -> int | None:
        def oldest(allowed) -> int | None:
            candidates = [
                (b.tick, h)
                for h, b in self.blocks.items()
                if allowed(b.partition)
                and not self.pinned(h)
                and b.tick < protect_from
                and not self.has_child(h)
            ]
            return min(candidates)[1] if candidates else None

        def over(q) -> bool:
            return self.usage(q) > self.reserved[q]

        borrowed = oldest(lambda q: q != partition and over(q))
        if self.usage(partition) < self.reserved[partition] and borrowed is not None:
            return borrowed
        return oldest(lambda q: q == partition or over(q))

    @staticmethod
    def check_time(now: float) -> None:
        if not math.isfinite(now):
            raise ModelError(ValueError)

    # -- the API ---------------------------------------------------------------------------------

    def insert(
        self, hashes: list[int], partition: str | None, parent: int | None, now: float
    ) -> tuple[int, list[int]]:
        self.check_time(now)
        if partition not in self.reserved:
            raise ModelError(KeyError)
        if parent is not None and parent not in self.blocks:
            raise ModelError(KeyError)
        self.advance(now)
        protect_from = self.clock + 1
        if parent is not None:
            self.touch(parent)
        prev = parent
        evicted: list[int] = []
        for k, h in enumerate(hashes):
            if h in self.blocks:
                if partition is not None:
                    self.blocks[h].partition = partition
                self.touch(h)
                prev = h
                continue
            if len(self.blocks) >= self.capacity:
                v = self.victim(partition, protect_from)
                if v is None:
                    return k, evicted
                del self.blocks[v]
                evicted.append(v)
            self.blocks[h] = Block(parent=prev, partition=partition, tick=0)
            self.touch(h)
            prev = h
        return len(hashes), evicted

    def match(self, hashes: list[int], refresh: bool = True) -> int:
        for k, h in enumerate(hashes):
            if h not in self.blocks:
                return k
            if refresh:
                self.touch(h)
        return len(hashes)

    def pin(self, hashes: list[int], ttl: float | None, now: float) -> None:
        self.check_time(now)
        if ttl is not None and not (math.isfinite(ttl) and ttl >= 0):
            raise ModelError(ValueError)
        if any(h not in self.blocks for h in hashes):
            raise ModelError(KeyError)
        self.advance(now)
        for h in hashes:
            block = self.blocks[h]
            if ttl is None:
                block.pins += 1
            elif block.lease is None or block.lease[0] < now + ttl:
                self.lease_seq += 1
                block.lease = (now + ttl, self.lease_seq)

    def unpin(self, hashes: list[int], now: float) -> None:
        self.check_time(now)
        if any(h not in self.blocks for h in hashes):
            raise ModelError(KeyError)
        left: dict[int, int] = {}
        for h in hashes:
            left.setdefault(h, self.blocks[h].pins)
            if left[h] == 0:
                raise ModelError(ValueError)
            left[h] -= 1
        self.advance(now)
        for h in hashes:
            block = self.blocks[h]
            block.pins -= 1
            if block.pins == 0 and block.lease is None:
                self.touch(h)

    def expire(self, now: float) -> int:
        self.check_time(now)
        self.time = max(self.time, now)
        return self.release_leases(now)

    def last_touch(self, h: int) -> float | None:
        if h not in self.blocks:
            raise ModelError(KeyError)
        return self.blocks[h].touched if self.track_idle else None

    def expire_idle(self, now: float, max_idle: float) -> tuple[list[int], float | None]:
        """Drops the evictable leaves last touched before `now - max_idle`, per partition (in
        declaration order, the shared pool first), least recently used first, until the least
        recently used one left is recent enough; returns (dropped, that one's last touch)."""
        self.check_time(now)
        if not self.track_idle or math.isnan(max_idle) or max_idle < 0:
            raise ModelError(ValueError)
        self.expire(now)
        cutoff = now - max_idle
        dropped: list[int] = []
        oldest: float | None = None
        for q in self.reserved:
            while True:
                leaves = [
                    (b.tick, h)
                    for h, b in self.blocks.items()
                    if b.partition == q and not self.pinned(h) and not self.has_child(h)
                ]
                if not leaves:
                    break
                h = min(leaves)[1]
                t = self.blocks[h].touched
                if t >= cutoff:
                    oldest = t if oldest is None else min(oldest, t)
                    break
                del self.blocks[h]
                dropped.append(h)
        return dropped, oldest

    def add_partition(self, name: str, reserved: int) -> None:
        if name in self.reserved or sum(self.reserved.values()) + reserved > self.capacity:
            raise ModelError(ValueError)
        self.reserved[name] = reserved

    def set_reserved(self, name: str, blocks: int) -> None:
        if name is None or name not in self.reserved:
            raise ModelError(KeyError)
        if sum(self.reserved.values()) - self.reserved[name] + blocks > self.capacity:
            raise ModelError(ValueError)
        self.reserved[name] = blocks

    def remove(self, hashes: list[int]) -> list[int]:
        """Removes the listed cached blocks in order: each unpinned, without a lease and with
        no cached child left when its turn comes; else nothing changes. Not a touch."""
        removed: list[int] = []
        for h in hashes:
            if h not in self.blocks or h in removed:
                continue
            children = [c for c, b in self.blocks.items() if b.parent == h and c not in removed]
            if self.pinned(h) or children:
                raise ModelError(ValueError)
            removed.append(h)
        for h in removed:
            del self.blocks[h]
        return removed
