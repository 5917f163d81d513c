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

import asyncio
import contextlib
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from kvroute.gateway.limits import LIMITS, SCOPES
from kvroute.server.metrics import Counter, Gauge, Registry

from .bus import cancel, keep_connected
from .config import ClusterConfig

if TYPE_CHECKING:
    from kvroute.gateway.limits import RateLimits, Spent

__all__ = ["LimitShare", "decode_spent", "encode_spent"]

log = logging.getLogger("kvroute.cluster")

#: Seconds between two checks of the connection while nothing is sent.
CHECK_CONNECTED = 1.0
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
    return json.dumps({"replica": replica, "spent": entries}, separators=(",", ":")).encode()


def decode_spent(data: bytes) -> tuple[str, list[Spent]]:
    """The sender and entries of a message; ``ValueError`` naming what is wrong otherwise."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"not JSON: {type(e).__name__}: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("replica"), str):
        raise ValueError("no 'replica' string")
    entries = msg.get("spent")
    if not isinstance(entries, list):
        raise ValueError("no 'spent' list")
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
    return msg["replica"], out


class LimitShare:
    """Shares ``limits`` (a gateway's ``RateLimits``) with the other replicas (module docs)."""

    def __init__(
        self, limits: RateLimits, config: ClusterConfig, *, registry: Registry | None = None
    ) -> None:
        self.limits = limits
        self.config = config
        self.subject = config.limits_subject
        self.interval = config.limits_interval
        self.replica = f"{config.replica_name}-{uuid.uuid4().hex[:8]}"
        self.connected = False
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None
        self._nc: Any = None
        self._spent = asyncio.Event()  # the ledger has something to send
        limits.share()
        limits.on_spend = self._spent.set
        reg = registry or Registry()
        self.messages = reg.add(
            Counter(
                "kvroute_cluster_limit_messages_total",
                "Shared rate-limit messages: sent, applied (another replica's), malformed; "
                "unsent: what was taken while not connected, dropped at the reconnection.",
                ("op",),
            )
        )
        reg.add(
            Gauge(
                "kvroute_cluster_limits_connected",
                "1 while rate limits are shared with the other replicas (0: this replica's own).",
                (),
                lambda: [((), 1 if self.connected else 0)],
            )
        )

    def start(self) -> None:
        """Starts sharing in the background (returns at once; NATS may be down)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                keep_connected(
                    self.config,
                    f"{self.replica}-limits",
                    self._session,
                    failed=self._failed,
                    closed=self._closed,
                    no_echo=True,  # its own messages never come back to be decoded and dropped
                )
            )

    async def stop(self) -> None:
        """Sends what is left within a second, then disconnects."""
        task, self._task = self._task, None
        if task is None:
            return
        nc = self._nc
        if nc is not None and self.connected:
            with contextlib.suppress(Exception):  # stopping: nothing left to do with a failure
                await asyncio.wait_for(self._send(nc), 1.0)
                # Written out now: closing the connection only signals its flusher.
                await asyncio.wait_for(nc.flush(), 1.0)
        await cancel(task)

    def describe(self) -> dict[str, Any]:
        """What ``/health`` shows under ``cluster.limits``."""
        return {"connected": self.connected, "last_error": self.last_error}

    async def _session(self, nc: Any) -> None:
        self._nc = nc
        await nc.subscribe(self.subject, cb=self._received)
        await nc.flush()
        self._unsent()  # taken while not connected: never sent (see the module docs)
        self.connected = True
        log.info("cluster: sharing rate limits on %s as %s", self.subject, self.replica)
        while nc.is_connected:
            with contextlib.suppress(asyncio.TimeoutError):
                # Woken by the first amount taken since the last message; else now and then, to
                # notice a connection lost while nothing was sent.
                await asyncio.wait_for(self._spent.wait(), CHECK_CONNECTED)
            self._spent.clear()
            await self._send(nc)
            await asyncio.sleep(self.interval)  # what comes meanwhile goes in the next

    async def _send(self, nc: Any) -> None:
        spent = self.limits.drain_spent()
        for at in range(0, len(spent), MAX_ENTRIES):
            part = spent[at : at + MAX_ENTRIES]
            try:
                await nc.publish(self.subject, encode_spent(self.replica, part))
            except BaseException:
                # Not sent (nats-py raises before queueing): with the next message instead,
                # or never if the connection is gone (see the module docs).
                self.limits.restore_spent(spent[at:])
                raise
            self.messages.inc("sent")

    def _unsent(self) -> None:
        """Drops what the ledger holds, counted: amounts that were not sent while connected."""
        if self.limits.drain_spent():
            self.messages.inc("unsent")

    async def _received(self, msg: Any) -> None:
        try:
            sender, spent = decode_spent(msg.data)
        except ValueError as e:
            self.messages.inc("malformed")
            log.warning("cluster: a rate-limit message on %s is malformed: %s", self.subject, e)
            return
        if sender == self.replica:
            return
        self.limits.apply_spent(spent)
        self.messages.inc("applied")

    def _failed(self, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        log.warning("cluster: rate limits not shared (%s); retrying", self.last_error)

    def _closed(self) -> None:
        self.connected = False
        self._nc = None
