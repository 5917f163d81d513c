"""A small, deliberately naive reference model of ``kvroute.BlockCache`` (O(n) per step).

It transcribes the documented semantics literally and shares no structure with the Rust code:
every block stores its last-touch tick; the victim is found by scanning all blocks for the
evictable leaf with the smallest tick among the partitions the inserter may evict.
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
    pins: int = 0
    lease: tuple[float, int] | None = None  # (end, sequence number of the extension)


class CacheModel:
    def __init__(self, capacity: int, reserved: dict[str, int] | None = None):
        self.capacity = capacity
        self.reserved: dict[str | None, int] = {None: 0, **(reserved or {})}
        self.blocks: dict[int, Block] = {}
        self.clock = 0
        self.lease_seq = 0

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
        self.release_leases(now)
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
        self.release_leases(now)
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
        self.release_leases(now)
        for h in hashes:
            block = self.blocks[h]
            block.pins -= 1
            if block.pins == 0 and block.lease is None:
                self.touch(h)

    def expire(self, now: float) -> int:
        self.check_time(now)
        return self.release_leases(now)
