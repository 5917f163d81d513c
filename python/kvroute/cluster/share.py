"""A replica's own state sent to the other replicas on a plain NATS subject (not JetStream: what
is sent is worth having only while it is recent), and theirs applied: the base of
:class:`~kvroute.cluster.limits.LimitShare` and :class:`~kvroute.cluster.responses.ResponseShare`.

Guarantees (each subclass says what its entries are and what applying them does):

- As soon as the replica has something to send (``wake``), what it has (``drain``) is published,
  at most one message per ``interval`` (what comes meanwhile goes in the next), at most
  ``max_entries`` entries a message (more in several, well below NATS' ``max_payload``). What a
  publish fails to send goes back (``restore``) for the next message.
- A replica's own messages are not delivered back to it (``no_echo``) and, should one come, not
  applied (each names its sender). A message another replica cannot read (``decode`` raises
  ``ValueError`` naming the fault) is counted as ``malformed``, logged, and changes nothing.
- Nothing on the request path waits for NATS. While not connected nothing is sent: what was
  drained meanwhile is dropped at the reconnection (counted as ``unsent``), and what the others
  sent meanwhile never arrives (NATS keeps no copy).
- Anyone who can publish on the subject can change every replica's copy: restrict it to the
  gateways with NATS permissions, as the sync's subjects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

from kvroute.server.metrics import Counter, Gauge, Registry

from .bus import cancel, keep_connected
from .config import ClusterConfig

__all__ = ["Share", "read_message", "write_message"]

log = logging.getLogger("kvroute.cluster")

#: Seconds between two checks of the connection while nothing is sent.
CHECK_CONNECTED = 1.0


def write_message(replica: str, key: str, entries: list[Any]) -> bytes:
    """One message: its sender and its entries (JSON, ``{"replica": …, key: [...]}``)."""
    return json.dumps({"replica": replica, key: entries}, separators=(",", ":")).encode()


def read_message(data: bytes, key: str) -> tuple[str, list[Any]]:
    """A message's sender and its entries, not yet checked; ``ValueError`` naming what is
    wrong otherwise."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"not JSON: {type(e).__name__}: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("replica"), str):
        raise ValueError("no 'replica' string")
    entries = msg.get(key)
    if not isinstance(entries, list):
        raise ValueError(f"no {key!r} list")
    return msg["replica"], entries


class Share:
    """One replica's side of a state shared on ``subject`` (see the module docs)."""

    #: What is shared, in logs ("rate limits"), and one message of it ("rate-limit").
    label = ""
    item = ""
    #: Entries per message.
    max_entries = 2000

    def __init__(
        self,
        config: ClusterConfig,
        subject: str,
        interval: float,
        registry: Registry | None,
        *,
        messages: tuple[str, str],
        connected: tuple[str, str],
    ) -> None:
        self.config = config
        self.subject = subject
        self.interval = interval
        self.replica = f"{config.replica_name}-{uuid.uuid4().hex[:8]}"
        self.connected = False
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None
        self._nc: Any = None
        self._pending = asyncio.Event()  # something to send
        reg = registry or Registry()
        self.messages = reg.add(Counter(messages[0], messages[1], ("op",)))
        reg.add(
            Gauge(
                connected[0],
                connected[1],
                (),
                lambda: [((), 1 if self.connected else 0)],
            )
        )

    # ---- what a subclass defines ---------------------------------------------------------

    def drain(self) -> list[Any]:
        """The entries to send now (taken: ``restore`` puts back what could not be sent)."""
        raise NotImplementedError

    def restore(self, entries: list[Any]) -> None:
        raise NotImplementedError

    def encode(self, entries: list[Any]) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes) -> tuple[str, list[Any]]:
        """The sender and entries of a message; ``ValueError`` naming the fault otherwise."""
        raise NotImplementedError

    def apply(self, entries: list[Any]) -> None:
        raise NotImplementedError

    # ---- the loop --------------------------------------------------------------------------

    def wake(self) -> None:
        """Something is there to send."""
        self._pending.set()

    def start(self) -> None:
        """Starts sharing in the background (returns at once; NATS may be down)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                keep_connected(
                    self.config,
                    f"{self.replica}-{self.subject}",
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
        """What ``/health`` shows for it under ``cluster``."""
        return {"connected": self.connected, "last_error": self.last_error}

    async def _session(self, nc: Any) -> None:
        self._nc = nc
        await nc.subscribe(self.subject, cb=self._received)
        await nc.flush()
        if self.drain():  # taken while not connected: never sent (see the module docs)
            self.messages.inc("unsent")
        self.connected = True
        log.info("cluster: sharing %s on %s as %s", self.label, self.subject, self.replica)
        while nc.is_connected:
            with contextlib.suppress(asyncio.TimeoutError):
                # Woken by the first entry since the last message; else now and then, to notice
                # a connection lost while nothing was sent.
                await asyncio.wait_for(self._pending.wait(), CHECK_CONNECTED)
            self._pending.clear()
            await self._send(nc)
            await asyncio.sleep(self.interval)  # what comes meanwhile goes in the next

    async def _send(self, nc: Any) -> None:
        entries = self.drain()
        for at in range(0, len(entries), self.max_entries):
            part = entries[at : at + self.max_entries]
            try:
                await nc.publish(self.subject, self.encode(part))
            except BaseException:
                # Not sent (nats-py raises before queueing): with the next message instead,
                # or never if the connection is gone (see the module docs).
                self.restore(entries[at:])
                raise
            self.messages.inc("sent")

    async def _received(self, msg: Any) -> None:
        try:
            sender, entries = self.decode(msg.data)
        except ValueError as e:
            self.messages.inc("malformed")
            log.warning("cluster: a %s message on %s is malformed: %s", self.item, self.subject, e)
            return
        if sender == self.replica:
            return
        self.apply(entries)
        self.messages.inc("applied")

    def _failed(self, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        log.warning("cluster: %s not shared (%s); retrying", self.label, self.last_error)

    def _closed(self) -> None:
        self.connected = False
        self._nc = None
