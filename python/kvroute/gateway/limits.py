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
by inventing keys. Everything runs on the gateway's event loop; no lock is taken.

Shared by ``[cluster]`` replicas (``share``): every amount a replica takes from or gives back to a
bucket is also added to its ledger, which ``kvroute.cluster.limits`` drains (``drain_spent``) and
sends to the other replicas, which apply it to their bucket of the same name (``apply_spent``):
what was given back first, then what was taken. Exchanged as they happen, the replicas' buckets
hold exactly what one gateway seeing every request would hold. While amounts are in flight
between replicas a replica's bucket may hold more than that: a peer's take has not arrived yet
(so requests reaching different replicas within one message's delay may each take the same last
unit); the bucket refilled while a peer's give-back was on its way, which one gateway's, full,
would have lost (at most its rate times that delay); and a peer's give-back applied after the
replica's own takes of the meantime may fill the bucket over them (at most the give-back). A
give-back is a request that reached no worker, so the last is rare. Amounts a replica never hears
of (NATS down) are not taken from its buckets; it then admits up to the rates on its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["LIMITS", "SCOPES", "Bucket", "Limited", "RateLimits", "Spent"]

#: What a bucket limits, and whose it is: the first two parts of a ledger entry (``Spent``).
LIMITS = ("requests", "tokens")
SCOPES = ("endpoint", "key")

#: One ledger entry: the limit (``requests`` | ``tokens``), the bucket's scope (``endpoint`` |
#: ``key``) and name (an endpoint's name, a key's digest), and the amount taken (given back:
#: negative).
Spent = tuple[str, str, object, float]


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

    def give(self, amount: float, now: float) -> float:
        """Gives back ``amount`` taken earlier, never above capacity; returns what it gave."""
        before = self.refill(now)
        self.balance = min(self.capacity, before + amount)
        return self.balance - before


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

        #: Per bucket, the amounts taken and given back since the last ``drain_spent``
        #: (``share``d limits only).
        self.ledger: dict[tuple[str, tuple[str, object]], list[float]] | None = None
        #: Called when the ledger gets its first entry since the last drain.
        self.on_spend: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        return bool(self.requests or self.tokens)

    def share(self) -> None:
        """Records every amount taken or given back from now on, for ``drain_spent``."""
        if self.ledger is None:
            self.ledger = {}

    def _spend(self, limit: str, k: tuple[str, object], amount: float) -> None:
        if self.ledger is not None and amount:
            if not self.ledger and self.on_spend is not None:
                self.on_spend()
            sums = self.ledger.setdefault((limit, k), [0.0, 0.0])
            sums[amount < 0] += abs(amount)

    def drain_spent(self) -> list[Spent]:
        """The amounts taken from each bucket since the last drain, and those given back
        (negative), each summed; the ledger is then empty. Given back and taken are not netted:
        a bucket at its capacity keeps the one but not the other (``apply_spent``)."""
        if not self.ledger:
            return []
        out: list[Spent] = []
        for (limit, (scope, name)), (taken, given) in self.ledger.items():
            if given:
                out.append((limit, scope, name, -given))
            if taken:
                out.append((limit, scope, name, taken))
        self.ledger.clear()
        return out

    def restore_spent(self, spent: list[Spent]) -> None:
        """Puts drained entries back (they could not be sent): the next drain has them again."""
        for limit, scope, name, amount in spent:
            self._spend(limit, (scope, name), amount)

    def apply_spent(self, spent: list[Spent]) -> int:
        """Takes another replica's amounts from the buckets of the same limit, scope and name,
        what it gave back first (never above capacity) and then what it took (the bounds this
        holds to: the module docs). An entry for a bucket this gateway does not have is ignored.
        Returns the number applied. Recorded in no ledger: each replica sends only what it took
        itself. ``spent`` is another replica's ``drain_spent``
        (``kvroute.cluster.limits.decode_spent`` checks what arrives)."""
        now = self.clock()
        applied = 0
        for limit, scope, name, amount in sorted(spent, key=lambda e: e[3] >= 0):
            table = self.requests if limit == "requests" else self.tokens
            bucket = table.get((scope, name))
            if bucket is None:
                continue
            if amount >= 0:
                bucket.take(amount, now)
            else:
                bucket.give(-amount, now)
            applied += 1
        return applied

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
                self._spend("requests", k, 1)
            if (b := self.tokens.get(k)) is not None:
                b.take(tokens, now)
                self._spend("tokens", k, tokens)
        return None

    def refund(self, endpoint: str | None, digest: bytes | None, tokens: int) -> None:
        """Gives back what ``admit`` took for a request that was never sent to a worker (a
        bucket refilled meanwhile stays at most full)."""
        if not self.active:
            return
        now = self.clock()
        for k in self._keys(endpoint, digest):
            # The amount given back, not the one asked: a bucket full meanwhile takes less.
            if (b := self.requests.get(k)) is not None:
                self._spend("requests", k, -b.give(1, now))
            if (b := self.tokens.get(k)) is not None:
                self._spend("tokens", k, -b.give(tokens, now))

    def charge(self, endpoint: str | None, digest: bytes | None, tokens: int) -> None:
        """Takes tokens used after admission (the completion) from the token buckets."""
        if not self.tokens or tokens <= 0:
            return
        now = self.clock()
        for k in self._keys(endpoint, digest):
            if (b := self.tokens.get(k)) is not None:
                b.take(tokens, now)
                self._spend("tokens", k, tokens)
