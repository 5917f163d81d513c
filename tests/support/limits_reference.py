"""One gateway's token bucket, written from the documentation of ``kvroute.gateway.limits``:
the reference the rate-limit tests hold the buckets to (one gateway, and replicas sharing
theirs)."""

from __future__ import annotations


class ReferenceBucket:
    """Capacity per_minute, refill per_minute/60 per second up to it, admitted while it holds at
    least 1; balances may go negative."""

    def __init__(self, per_minute: int) -> None:
        self.cap = per_minute
        self.balance = float(per_minute)
        self.t = 0.0

    def at(self, t: float) -> float:
        self.balance = min(self.cap, self.balance + (t - self.t) * (self.cap / 60))
        self.t = t
        return self.balance
