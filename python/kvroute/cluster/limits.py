"""Rate limits shared by the replicas: what each takes from its buckets, sent to the others.

One :class:`LimitShare` per gateway replica with rate limits (``[cluster] share_limits``, on by
default). As soon as the gateway takes from or gives back to a bucket, it drains the gateway's
ledger (``RateLimits.drain_spent``: per bucket, the amounts taken and given back since the last
drain) and publishes it on ``limits_subject`` (plain NATS, not JetStream: an amount is worth
sending only while it is recent), at most one message per ``limits_interval`` (what comes
meanwhile goes in the next); every other replica's message is applied to the buckets of the same
name (``RateLimits.apply_spent``). So N replicas admit, together, the configured rates — what one
gateway seeing every request would admit — within the bounds ``RateLimits`` states for amounts in
flight between them (a message's delay: up to ``limits_interval`` plus NATS' delivery).

Guarantees:

- A replica's own messages are not delivered back to it (its connection is ``no_echo``) and,
  should one come, not applied again (each names its sender); a message another
  replica cannot read — not JSON, nested too deep, an entry naming no bucket, an amount not a
  finite number of at most ``MAX_AMOUNT`` — is counted
  (``kvroute_cluster_limit_messages_total{op="malformed"}``), logged, and changes nothing; an
  entry for a bucket a replica does not have (configured otherwise) is skipped. A message holds
  at most ``MAX_ENTRIES`` entries (more are sent in several, well below NATS' ``max_payload``).
- Nothing on the request path waits for NATS. While a replica is not connected, what it takes is
  not sent: its peers would take the whole outage's admissions at once on its return, and refuse
  everyone for as long (counted as ``op="unsent"``, the connection's lost messages included). What
  the others send meanwhile never reaches it (NATS keeps no copy). So during an outage each replica
  admits up to the configured rates on its own, as without sharing, and is even with the others
  again once their buckets have refilled. A replica that starts (or restarts) starts with full
  buckets: a rolling restart may admit up to one bucket more per replica restarted.
- Anyone who can publish on ``limits_subject`` can take from (or, up to its capacity, refill) every
  replica's buckets: restrict it to the gateways with NATS permissions, as the sync's subjects.
- In-flight bounds (``max_in_flight``, ``max_in_flight_per_worker``) and fair share stay each
  replica's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.gateway.limits import LIMITS, SCOPES
from kvroute.server.metrics import Registry

from .config import ClusterConfig
from .share import Share, read_message, write_message

if TYPE_CHECKING:
    from kvroute.gateway.limits import RateLimits, Spent

__all__ = ["LimitShare", "decode_spent", "encode_spent"]

#: The largest amount one entry may carry: far above what a replica takes between two messages
#: (prompts' tokens); past it, an entry is malformed.
MAX_AMOUNT = 1e12
#: Entries per message (each well under 200 bytes): far below NATS' 1 MiB ``max_payload``.
MAX_ENTRIES = 2000


def encode_spent(replica: str, spent: list[Spent]) -> bytes:
    """One message: the sender and its entries (a key's digest in hex)."""
    entries = [
        [limit, scope, name.hex() if isinstance(name, bytes) else name, amount]
        for limit, scope, name, amount in spent
    ]
    return write_message(replica, "spent", entries)


def decode_spent(data: bytes) -> tuple[str, list[Spent]]:
    """The sender and entries of a message; ``ValueError`` naming what is wrong otherwise."""
    replica, entries = read_message(data, "spent")
    out: list[Spent] = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4):
            raise ValueError(f"entry {e!r:.80} is not [limit, scope, name, amount]")
        limit, scope, name, amount = e
        if limit not in LIMITS or scope not in SCOPES or not isinstance(name, str):
            raise ValueError(f"entry {e!r:.80} names no bucket")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"entry {e!r:.80} has no numeric amount")
        if not abs(amount) <= MAX_AMOUNT:  # NaN too; an int compared exactly, never converted
            raise ValueError(f"entry {e!r:.80}: the amount is not a finite number <= {MAX_AMOUNT}")
        key: object = name
        if scope == "key":
            try:
                key = bytes.fromhex(name)
            except ValueError:
                raise ValueError(f"entry {e!r:.80}: a key's digest must be hex") from None
        out.append((limit, scope, key, float(amount)))
    return replica, out


class LimitShare(Share):
    """Shares ``limits`` (a gateway's ``RateLimits``) with the other replicas (module docs)."""

    label = "rate limits"
    item = "rate-limit"
    max_entries = MAX_ENTRIES

    def __init__(
        self, limits: RateLimits, config: ClusterConfig, *, registry: Registry | None = None
    ) -> None:
        super().__init__(
            config,
            config.limits_subject,
            config.limits_interval,
            registry,
            messages=(
                "kvroute_cluster_limit_messages_total",
                "Shared rate-limit messages: sent, applied (another replica's), malformed; "
                "unsent: what was taken while not connected, dropped at the reconnection.",
            ),
            connected=(
                "kvroute_cluster_limits_connected",
                "1 while rate limits are shared with the other replicas (0: this replica's own).",
            ),
        )
        self.limits = limits
        limits.share()
        limits.on_spend = self.wake

    def drain(self) -> list[Any]:
        return self.limits.drain_spent()

    def restore(self, entries: list[Any]) -> None:
        self.limits.restore_spent(entries)

    def encode(self, entries: list[Any]) -> bytes:
        return encode_spent(self.replica, entries)

    def decode(self, data: bytes) -> tuple[str, list[Any]]:
        return decode_spent(data)

    def apply(self, entries: list[Any]) -> None:
        self.limits.apply_spent(entries)
