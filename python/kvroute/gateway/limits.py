"""Rate limits per API key and per endpoint: requests/min and tokens/min token buckets.

A bucket holds up to one minute's allowance and refills continuously at ``per_minute / 60`` per
second. A request is admitted when every bucket that applies to it holds at least 1; it then
takes 1 from each request bucket and its prompt's routing tokens from each token bucket, and the
completion tokens the upstream reports are taken when the response ends. Token balances may go
negative (a long prompt admitted on a full bucket), which delays the next requests instead of
refusing any prompt for being long. A refused request is answered 429 with ``Retry-After``: the
whole seconds until every bucket it needs holds 1 again. A request admitted here that then never
reaches a worker (the gateway sheds it — ``slo``, ``worker_queue`` —, has no worker for it, or
connects to none: unreachable, no free connection; a pair counts as sent) is given back with
``refund``: only requests sent upstream spend a caller's limits, as the fleet and
fair-share refusals (decided before the buckets) spend nothing.

Buckets exist for configured things only: each endpoint with a limit, and — with
``key_requests_per_minute`` / ``key_tokens_per_minute`` — each configured API key (by digest) and
one shared bucket for callers without a configured key, so that callers cannot create buckets
by inventing keys. Everything runs on the gateway's event loop; no lock is taken. The buckets are
this process's own: ``[cluster]`` replicas do not share them (N replicas admit N times the
configured rates; README, "Limits and admission").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Bucket", "Limited", "RateLimits"]


class Bucket:
    """A token bucket of ``per_minute`` capacity refilled at ``per_minute / 60`` per second."""

    __slots__ = ("balance", "capacity", "rate", "updated")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = self.capacity / 60.0
        self.balance = self.capacity
        self.updated = now

    def refill(self, now: float) -> float:
        if now > self.updated:
            self.balance = min(self.capacity, self.balance + (now - self.updated) * self.rate)
            self.updated = now
        return self.balance

    def wait(self, now: float) -> float:
        """Seconds until the balance is at least 1 (0 when it is)."""
        balance = self.refill(now)
        return 0.0 if balance >= 1.0 else (1.0 - balance) / self.rate

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.balance -= amount

    def give(self, amount: float, now: float) -> None:
        """Returns ``amount`` taken earlier, never above capacity."""
        self.refill(now)
        self.balance = min(self.capacity, self.balance + amount)


@dataclass(frozen=True)
class Limited:
    """A refusal: which limit, and when to try again."""

    scope: str  # "endpoint" | "key"
    limit: str  # "requests" | "tokens"
    retry_after: float

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))


class RateLimits:
    """Every configured bucket; ``admit`` before forwarding, ``charge`` when usage is known."""

    ANONYMOUS = b""  # the one bucket of callers without a configured key

    def __init__(
        self,
        endpoints: Iterable[tuple[str, int | None, int | None]],
        key_digests: Iterable[bytes],
        key_requests_per_minute: int | None,
        key_tokens_per_minute: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        now = clock()
        self.requests: dict[tuple[str, object], Bucket] = {}
        self.tokens: dict[tuple[str, object], Bucket] = {}
        for endpoint, rpm, tpm in endpoints:
            if rpm:
                self.requests["endpoint", endpoint] = Bucket(rpm, now)
            if tpm:
                self.tokens["endpoint", endpoint] = Bucket(tpm, now)
        keyed = bool(key_requests_per_minute or key_tokens_per_minute)
        self.known_digests: set[bytes | None] = set(key_digests) if keyed else set()
        for digest in (*self.known_digests, self.ANONYMOUS):
            if key_requests_per_minute:
                self.requests["key", digest] = Bucket(key_requests_per_minute, now)
            if key_tokens_per_minute:
                self.tokens["key", digest] = Bucket(key_tokens_per_minute, now)

    @property
    def active(self) -> bool:
        return bool(self.requests or self.tokens)

    def _keys(self, endpoint: str | None, digest: bytes | None) -> tuple[tuple[str, object], ...]:
        key = digest if digest in self.known_digests else self.ANONYMOUS
        return (("endpoint", endpoint), ("key", key))

    def admit(self, endpoint: str | None, digest: bytes | None, tokens: int) -> Limited | None:
        """Takes the request from its buckets, or returns why it must wait (taking nothing)."""
        if not self.active:
            return None
        now = self.clock()
        keys = self._keys(endpoint, digest)
        worst: Limited | None = None
        for table, limit in ((self.requests, "requests"), (self.tokens, "tokens")):
            for k in keys:
                bucket = table.get(k)
                if bucket is None:
                    continue
                wait = bucket.wait(now)
                if wait > 0 and (worst is None or wait > worst.retry_after):
                    worst = Limited(k[0], limit, wait)
        if worst is not None:
            return worst
        for k in keys:
            if (b := self.requests.get(k)) is not None:
                b.take(1, now)
            if (b := self.tokens.get(k)) is not None:
                b.take(tokens, now)
        return None

    def refund(self, endpoint: str | None, digest: bytes | None, tokens: int) -> None:
        """Gives back what ``admit`` took for a request that was never sent to a worker (a
        bucket refilled meanwhile stays at most full)."""
        if not self.active:
            return
        now = self.clock()
        for k in self._keys(endpoint, digest):
            if (b := self.requests.get(k)) is not None:
                b.give(1, now)
            if (b := self.tokens.get(k)) is not None:
                b.give(tokens, now)

    def charge(self, endpoint: str | None, digest: bytes | None, tokens: int) -> None:
        """Takes tokens used after admission (the completion) from the token buckets."""
        if not self.tokens or tokens <= 0:
            return
        now = self.clock()
        for k in self._keys(endpoint, digest):
            if (b := self.tokens.get(k)) is not None:
                b.take(tokens, now)
