"""Events mode across replicas: one relay reads the engines' KV events, every replica replays them.

With ``index = "events"`` each replica would otherwise open its own ZMQ subscription to every
engine (M engines × N replicas connections), and a replica started late would know nothing the
engines published before it. ``kvroute relay`` (:class:`EventRelay`) subscribes to each engine
once and republishes into a JetStream stream; every replica's :class:`EventFollower` applies the
stream to its router's index, from the stream's start (a late replica replays what it missed).

- **The relay** runs a :class:`kvroute.events.KvEventSubscriber` whose target is an outbox
  instead of an index: the subscriber's gap, replay, restart, disconnect and catch-up handling
  is unchanged, and what it would have done to an index — apply a batch, clear a worker, mark it
  stale or fresh — is what the relay publishes, in that order, each message awaited (JetStream's
  ack) before the next. Messages are numbered per worker (``Kvroute-Seq``, from 1) by the relay
  instance (``Kvroute-Relay``, new at every start); ``Nats-Msg-Id`` lets JetStream drop a message
  re-sent after a lost ack. While NATS is unreachable the relay keeps up to ``max_pending``
  messages and drops the oldest beyond (counted). A message NATS can never accept (above the
  server's ``max_payload``, 1 MiB by default, headers included: one very long prompt's batch)
  is dropped, counted (``kvroute_relay_oversized_total``) and logged, never retried; the
  worker's followers clear it at its next message (a gap), the other workers are unaffected.
- **A follower** applies every message once, in stream order, with the subscriber's semantics:
  a number seen before is dropped; a number past the next expected one (the relay dropped
  messages while NATS was down, or the stream aged them out) is a gap — the worker is cleared,
  never guessed about; a new relay instance clears the worker (its subscriber starts afresh and
  replays the engine's buffer from 0 when the engine has a replay socket). Each instance sends
  its start time (``Kvroute-Started``): a follower follows the newest instance it has seen for
  a worker and ignores an older one's messages (``old_relay``), so two relays running at once
  (a rolling update's overlap) cost one clear per worker, not one per alternation; an older
  instance takes over again only once the newer one is silent (3 heartbeats missed: dead,
  whatever the clocks say). While the follower
  is disconnected from NATS every worker is marked stale on the router (its overlap credit
  decays); when it is back they are fresh again, unless the relay said otherwise.
- **Heartbeats.** The relay publishes one every ``relay_heartbeat`` seconds (``[cluster]``,
  0.5 by default) into the same stream, with its interval and, per worker, the last number it
  published or dropped. A follower that hears none from the relay it follows for
  ``MISSED_HEARTBEATS`` (3) of those intervals takes the relay for dead (killed, partitioned
  from NATS, wedged) and marks that relay's workers stale on the router, as for its own lost
  connection (``relay_silent`` counted, logged); its next heartbeat marks them fresh again. A
  heartbeat's numbers also reveal messages lost at a worker's tail (dropped beyond
  ``max_pending``, or above ``max_payload``) at once: the worker is cleared (a gap). A relay
  that never sent a heartbeat (an older version) is not watched.

Run one relay per stream (a supervisor restarts it; a restart costs each replica one clear of
each worker and the engines' replay). As a Kubernetes Deployment: strategy ``Recreate``, or a
rolling update (the overlap is handed over as above, one clear per worker). ``kvroute relay
--port N`` serves ``/metrics`` (the ``kvroute_relay_*`` metrics) and ``/health`` (200 while
connected to NATS, else 503).
Configured by the server file's ``[[workers]]`` (``kv_events``, ``kv_replay``,
``kv_events_bind``), ``[events] topic`` and ``[cluster]`` (``events_stream``,
``events_subject``, ``relay_heartbeat``; replicas read it when ``relay = true``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.server.metrics import Counter, Gauge, Registry

from .bus import StreamConsumer, cancel, ensure_stream, keep_connected, unsubscribe
from .config import ClusterConfig

__all__ = ["EventFollower", "EventRelay"]

log = logging.getLogger("kvroute.cluster")

KINDS = ("batch", "clear", "stale", "fresh")
#: Heartbeats a follower may miss before it takes the relay for dead (see the module docs).
MISSED_HEARTBEATS = 3


@dataclass(frozen=True)
class _Message:
    worker: str
    seq: int
    kind: str
    data: bytes = b""


class _Outbox:
    """The relay subscriber's target: what it would do to an index, queued for JetStream.

    Called from the subscriber's poll thread; read by the relay's publishing task."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.lock = threading.Lock()
        self.queue: deque[_Message] = deque()
        self.seq: dict[str, int] = {}
        #: Per worker, the last number published or dropped (every lower one too): heartbeats
        #: carry it, so followers see a loss at the tail without waiting for the next message.
        self.settled: dict[str, int] = {}
        self.dropped = 0
        self.counts: dict[str, dict[str, int]] = {}
        self.wake: Any = None  # () -> None, set by the relay: wakes its publisher

    def _put(self, worker: str, kind: str, data: bytes = b"") -> None:
        with self.lock:
            n = self.seq.get(worker, 0) + 1
            self.seq[worker] = n
            self.queue.append(_Message(worker, n, kind, data))
            row = self.counts.setdefault(worker, dict.fromkeys(KINDS, 0))
            row[kind] += 1
            while len(self.queue) > self.max_pending:
                old = self.queue.popleft()
                self.settled[old.worker] = old.seq
                self.dropped += 1
        if self.wake is not None:
            self.wake()

    # What KvEventSubscriber calls on its target (an applier) and its freshness sink.
    def apply(self, worker: str, payload: bytes) -> int:
        self._put(worker, "batch", bytes(payload))
        return 0

    def clear(self, worker: str) -> None:
        self._put(worker, "clear")

    def mark_stale(self, worker: str) -> None:
        self._put(worker, "stale")

    def mark_fresh(self, worker: str) -> None:
        self._put(worker, "fresh")

    def settle(self, m: _Message) -> None:
        """``m`` was published or dropped: off the queue (unless dropped meanwhile)."""
        with self.lock:
            if self.queue and self.queue[0] is m:
                self.queue.popleft()
            self.settled[m.worker] = max(self.settled.get(m.worker, 0), m.seq)

    def stats(self, worker: str | None = None) -> Any:
        with self.lock:
            if worker is not None:
                return dict(self.counts.get(worker, {}))
            return {w: dict(row) for w, row in self.counts.items()}


class EventRelay:
    """Subscribes to every engine's KV events once and republishes them into JetStream.

    ``endpoints`` / ``replay`` / ``bind`` / ``topic``: as for ``KvEventSubscriber``. Runs on the
    caller's event loop (``start`` / ``stop``, or ``async with``)."""

    def __init__(
        self,
        endpoints: Mapping[str, str],
        config: ClusterConfig,
        *,
        replay: Mapping[str, str] | None = None,
        bind: bool | Mapping[str, bool] = False,
        topic: str = "",
        registry: Registry | None = None,
    ) -> None:
        from kvroute.events import KvEventSubscriber

        self.config = config
        self.relay = f"{config.replica_name}-{uuid.uuid4().hex[:8]}"
        #: This instance's start (ns since the epoch): followers follow the newest instance.
        self.started = time.time_ns()
        self.outbox = _Outbox(config.max_pending)
        self.subscriber = KvEventSubscriber(
            self.outbox, endpoints, replay=replay, bind=bind, topic=topic
        )
        reg = registry or Registry()
        self.published = reg.add(
            Counter("kvroute_relay_published_total", "Messages published, by kind.", ("kind",))
        )
        self.errors = reg.add(Counter("kvroute_relay_bus_errors_total", "NATS failures."))
        self.oversized = reg.add(
            Counter(
                "kvroute_relay_oversized_total",
                "Messages above NATS max_payload (headers included), by worker: dropped, never "
                "retried (the worker's followers see a gap and clear it).",
                ("worker",),
            )
        )
        reg.add(
            Gauge(
                "kvroute_relay_connected", "1 while connected to NATS.", (), self._gauge_connected
            )
        )
        reg.add(
            Gauge(
                "kvroute_relay_pending_messages",
                "Messages waiting for NATS (at most max_pending).",
                (),
                lambda: [((), float(self.pending))],
            )
        )
        reg.add(
            Gauge(
                "kvroute_relay_dropped_messages",
                "Messages dropped since the start while NATS was unreachable (beyond "
                "max_pending; followers see a gap and clear the worker).",
                (),
                lambda: [((), float(self.dropped))],
            )
        )
        self.connected = False
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._js: Any = None
        self._next_beat = 0.0
        self._max_payload = 1 << 20  # the connected server's (NATS' default until connected)

    def _gauge_connected(self) -> list[tuple[tuple[str, ...], float]]:
        return [((), 1.0 if self.connected else 0.0)]

    @property
    def dropped(self) -> int:
        """Messages dropped while NATS was unreachable (followers see a gap and clear)."""
        return self.outbox.dropped

    @property
    def pending(self) -> int:
        with self.outbox.lock:
            return len(self.outbox.queue)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._wakeup = wakeup = asyncio.Event()
        self.outbox.wake = lambda: loop.call_soon_threadsafe(wakeup.set)
        self._task = loop.create_task(self._run())
        await self.subscriber.__aenter__()

    async def stop(self) -> None:
        """Stops the subscriber, publishes what it can within a second, disconnects."""
        await self.subscriber.__aexit__(None, None, None)
        if self._js is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._publish_pending(), 1.0)
        task, self._task = self._task, None
        if task is not None:
            await cancel(task)

    async def __aenter__(self) -> EventRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def describe(self) -> dict[str, Any]:
        return {
            "relay": self.relay,
            "connected": self.connected,
            "pending": self.pending,
            "dropped": self.dropped,
            "oversized": int(sum(self.oversized.get(w) for w in self.subscriber.workers)),
            "last_error": self.last_error,
            "workers": self.subscriber.stats(),
        }

    async def _run(self) -> None:
        await keep_connected(
            self.config, self.relay, self._session, failed=self._failed, closed=self._closed
        )

    async def _session(self, nc: Any) -> None:
        cfg = self.config
        js = nc.jetstream(timeout=cfg.connect_timeout)
        await ensure_stream(js, cfg.events_stream, cfg.events_subject, cfg)
        self._js = js
        self._max_payload = int(nc.max_payload)
        self.connected = True
        assert self._wakeup is not None
        self._next_beat = 0.0  # one at once: followers see this instance alive
        while nc.is_connected:
            await self._publish_pending()
            await self._beat_if_due()
            wait = min(0.5, max(0.0, self._next_beat - time.monotonic()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait)
            self._wakeup.clear()

    def _failed(self, e: BaseException) -> None:
        self.errors.inc()
        self.last_error = f"{type(e).__name__}: {e}"
        log.warning("relay: NATS failed: %s", self.last_error)

    def _closed(self) -> None:
        self.connected = False
        self._js = None

    def _instance_headers(self) -> dict[str, str]:
        """The headers every message of this relay carries (``js.publish(stream=...)`` adds
        Nats-Expected-Stream: counted here, as the server counts it)."""
        return {
            "Nats-Expected-Stream": self.config.events_stream,
            "Kvroute-Relay": self.relay,
            "Kvroute-Started": str(self.started),
        }

    def _headers(self, m: _Message) -> dict[str, str]:
        """``m``'s headers, as sent."""
        return {
            **self._instance_headers(),
            "Nats-Msg-Id": f"{self.relay}-{m.worker}-{m.seq}",
            "Kvroute-Worker": m.worker,
            "Kvroute-Seq": str(m.seq),
            "Kvroute-Kind": m.kind,
        }

    def _drop_oversized(self, m: _Message, size: int, limit: int) -> None:
        """``m`` can never be accepted (NATS refuses a message above its max_payload, headers
        included): dropped and counted; the worker's next message or the next heartbeat shows
        its followers a gap, so they clear the worker (its numbering is not reused)."""
        self.outbox.settle(m)
        self.oversized.inc(m.worker)
        log.error(
            "relay: a %s of worker %s is %d bytes with headers, above NATS max_payload %d: "
            "dropped (followers clear the worker)",
            m.kind,
            m.worker,
            size,
            limit,
        )

    async def _publish_pending(self) -> None:
        import nats.errors

        box = self.outbox
        while self._js is not None:
            with box.lock:
                if not box.queue:
                    return
                m = box.queue[0]
            headers = self._headers(m)
            size = len(m.data) + header_size(headers)
            limit = self._max_payload
            if size > limit:
                self._drop_oversized(m, size, limit)
                continue
            try:
                await self._js.publish(
                    self.config.events_subject,
                    m.data,
                    timeout=self.config.connect_timeout,
                    stream=self.config.events_stream,
                    headers=headers,
                )
            except nats.errors.MaxPayloadError:  # the client's own check: never accepted either
                self._drop_oversized(m, size, limit)
                continue
            box.settle(m)
            self.published.inc(m.kind)
            await self._beat_if_due()  # on time through a long backlog too

    async def _beat_if_due(self) -> None:
        """Publishes a heartbeat every ``relay_heartbeat`` seconds: this instance, its interval
        and, per worker, the last message number published or dropped (settled)."""
        now = time.monotonic()
        if self._js is None or now < self._next_beat:
            return
        interval = self.config.relay_heartbeat
        self._next_beat = now + interval
        with self.outbox.lock:
            settled = dict(self.outbox.settled)
        await self._js.publish(
            self.config.events_subject,
            json.dumps({"workers": settled}, separators=(",", ":")).encode(),
            timeout=self.config.connect_timeout,
            stream=self.config.events_stream,
            headers={
                **self._instance_headers(),
                "Kvroute-Kind": "heartbeat",
                "Kvroute-Interval": repr(interval),
            },
        )
        self.published.inc("heartbeat")


def header_size(headers: Mapping[str, str]) -> int:
    """The bytes ``headers`` take in a NATS message (``NATS/1.0``, ``key: value`` lines, CRLFs):
    the server counts them with the payload against its max_payload."""
    return len("NATS/1.0\r\n\r\n") + sum(
        len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items()
    )


class _Source:
    __slots__ = ("marked", "next", "relay", "stale", "started")

    def __init__(self, relay: str, next_seq: int, started: int) -> None:
        self.relay = relay
        self.started = started  # the relay instance's start (0: not sent, an older relay)
        self.next = next_seq
        self.stale = False  # as the relay said (its subscriber's freshness)
        self.marked = False  # as marked on the router (fresh: the router's default)


@dataclass
class _Beat:
    last: float  # monotonic time of the last heartbeat received
    interval: float  # the relay's announced interval


class EventFollower(StreamConsumer):
    """Applies the relay's stream to ``target``'s index (see the module docs).

    ``target``: an events-mode ``kvroute.Router`` (its ``event_applier``; it is also the
    freshness sink), a ``KvEventApplier`` or a ``PrefixIndex`` (with ``mode`` etc., as for
    ``KvEventSubscriber``). Runs on the caller's event loop."""

    def __init__(
        self,
        target: Any,
        config: ClusterConfig,
        *,
        mode: str = "rehash",
        registry: Registry | None = None,
    ) -> None:
        from kvroute.events import applier_for

        self.config = config
        self.applier = applier_for(target, mode=mode)
        self.freshness = target if hasattr(target, "mark_stale") else None
        self.connected = False
        self.stream_seq = 0
        self.last_error = ""
        self._sources: dict[str, _Source] = {}
        self._beats: dict[str, _Beat] = {}  # per relay instance heard from
        self._ignored: set[str] = set()  # older relay instances whose messages were ignored
        self._task: asyncio.Task[None] | None = None
        reg = registry or Registry()
        self.applied = reg.add(
            Counter("kvroute_cluster_events_total", "Relay messages applied, by kind.", ("kind",))
        )
        self.skipped = reg.add(
            Counter(
                "kvroute_cluster_events_skipped_total",
                "Relay messages not applied or history lost: duplicate, malformed, gap "
                "(worker cleared; also found by a heartbeat), relay_restart (worker cleared), "
                "stream_reset (the stream was made anew: consumed from its start), "
                "relay_silent (heartbeats missed: the relay's workers marked stale), "
                "old_relay (from an instance older than the one followed: ignored).",
                ("reason",),
            )
        )

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel(task)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: the applier's counters, the relay's numbering and staleness (``stale``:
        as marked — the relay said so, its heartbeats stopped or this follower lost NATS)."""
        applied = self.applier.stats()
        return {
            w: {
                **applied.get(w, {}),
                "relay": s.relay,
                "last_seq": s.next - 1,
                "stale": self._stale(s),
                "relay_silent": self._silent(s.relay),
            }
            for w, s in self._sources.items()
        }

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "connected": self.connected,
            "stream_seq": self.stream_seq,
            "workers": len(self._sources),
            "last_error": self.last_error,
            # per relay instance heard from: seconds since its last heartbeat, and whether the
            # follower takes it for dead (MISSED_HEARTBEATS intervals without one)
            "relays": {
                r: {"heartbeat_age": round(now - b.last, 3), "silent": self._silent(r)}
                for r, b in self._beats.items()
            },
        }

    def _silent(self, relay: str) -> bool:
        """Whether ``relay`` missed its heartbeats (never, for one not heard from: a relay
        without heartbeats is not watched)."""
        b = self._beats.get(relay)
        return b is not None and time.monotonic() - b.last > MISSED_HEARTBEATS * b.interval

    def _stale(self, src: _Source) -> bool:
        return not self.connected or src.stale or self._silent(src.relay)

    def _refresh(self) -> None:
        """Marks each worker on the router as it now is (stale or fresh), where that changed."""
        silent = {r for r in self._beats if self._silent(r)}
        newly: dict[str, list[str]] = {}  # per silent relay, the workers it made stale now
        for w, s in self._sources.items():
            want = not self.connected or s.stale or s.relay in silent
            if want != s.marked:
                s.marked = want
                self._mark(w, want)
                if want and s.relay in silent and self.connected and not s.stale:
                    self.skipped.inc("relay_silent")
                    newly.setdefault(s.relay, []).append(w)
        for relay, workers in newly.items():
            log.warning(
                "events follower: relay %s missed %d heartbeats: its workers %s marked stale",
                relay,
                MISSED_HEARTBEATS,
                workers,
            )

    def _mark(self, worker: str, stale: bool) -> None:
        if self.freshness is not None:
            with contextlib.suppress(Exception):  # an unknown worker: nothing to mark
                (self.freshness.mark_stale if stale else self.freshness.mark_fresh)(worker)

    async def _run(self) -> None:
        await keep_connected(
            self.config,
            f"{self.config.replica_name}-events",
            self._session,
            failed=self._failed,
            closed=self._closed,
        )

    async def _session(self, nc: Any) -> None:
        from nats.js import api

        cfg = self.config
        js = nc.jetstream(timeout=cfg.connect_timeout)
        await ensure_stream(js, cfg.events_stream, cfg.events_subject, cfg)
        start = await self.resume_from(js, cfg.events_stream)
        sub = await js.subscribe(
            cfg.events_subject,
            stream=cfg.events_stream,
            cb=self._on_msg,
            ordered_consumer=True,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start
            ),
        )
        try:
            self.connected = True
            self._refresh()
            while nc.is_connected:
                await asyncio.sleep(0.2)
                self._refresh()  # a relay whose heartbeats stopped: its workers stale
        finally:
            await unsubscribe(nc, sub)

    def _failed(self, e: BaseException) -> None:
        self.last_error = f"{type(e).__name__}: {e}"
        log.warning("events follower: NATS failed: %s", self.last_error)

    def _closed(self) -> None:
        self.connected = False
        self._refresh()  # the relay's news cannot reach this replica: every worker stale

    def apply(self, headers: Mapping[str, str], data: bytes) -> None:
        """Takes one relay message (headers as published): once each, gaps clear the worker."""
        relay = headers.get("Kvroute-Relay", "")
        worker = headers.get("Kvroute-Worker", "")
        kind = headers.get("Kvroute-Kind", "")
        if kind == "heartbeat" and relay:
            self._heartbeat(relay, headers, data)
            return
        try:
            n = int(headers.get("Kvroute-Seq", "0"))
            started = int(headers.get("Kvroute-Started", "0"))
        except ValueError:
            n = started = 0
        if not relay or not worker or kind not in KINDS or n < 1 or started < 0:
            self.skipped.inc("malformed")
            return
        src = self._sources.get(worker)
        if src is None:
            # First message of this worker: what came before it aged out of the stream (or
            # there was nothing), as for a subscriber that connects late without catch-up.
            src = self._sources[worker] = _Source(relay, n, started)
        elif src.relay != relay:
            if not self._takes_over(relay, started, src):
                self.skipped.inc("old_relay")
                if relay not in self._ignored:
                    self._ignored.add(relay)
                    log.warning(
                        "events follower: relay %s (started %d) publishes for worker %s while "
                        "the newer %s (started %d) does: its messages ignored (run one relay "
                        "per stream)",
                        relay,
                        started,
                        worker,
                        src.relay,
                        src.started,
                    )
                return
            self.skipped.inc("relay_restart")
            self.applier.clear(worker)
            src.relay, src.next, src.started = relay, n, started
            self._refresh()
        if n < src.next:
            self.skipped.inc("duplicate")
            return
        if n > src.next:
            self.skipped.inc("gap")
            self.applier.clear(worker)
        src.next = n + 1
        if kind == "batch":
            try:
                self.applier.apply(worker, data)
            except ValueError:
                self.skipped.inc("malformed")  # counted by the applier too; changed nothing
                return
        elif kind == "clear":
            self.applier.clear(worker)
        else:
            src.stale = kind == "stale"
            self._refresh()
        self.applied.inc(kind)

    def _takes_over(self, relay: str, started: int, src: _Source) -> bool:
        """Whether a message of another instance than the one ``src`` follows switches to it:
        when it started later (ties: the greater name), or the one followed is silent (dead,
        whatever the clocks say). Instances that do not send their start (older relays)
        switch at every change, as before."""
        if not started or not src.started or self._silent(src.relay):
            return True
        return (started, relay) > (src.started, src.relay)

    def _heartbeat(self, relay: str, headers: Mapping[str, str], data: bytes) -> None:
        """``relay`` is alive (its workers fresh again unless it said otherwise); a worker
        whose messages up to the number it settled did not all arrive is cleared (a gap)."""
        try:
            interval = float(headers.get("Kvroute-Interval", ""))
            settled = json.loads(data)["workers"]
            ok = math.isfinite(interval) and interval > 0 and isinstance(settled, dict)
            ok = ok and all(type(v) is int for v in settled.values())
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            self.skipped.inc("malformed")
            return
        self._beats[relay] = _Beat(time.monotonic(), interval)
        for w, last in settled.items():
            src = self._sources.get(w)
            if src is not None and src.relay == relay and last >= src.next:
                self.skipped.inc("gap")  # lost at the tail (dropped, oversized)
                self.applier.clear(w)
                src.next = last + 1
        self._refresh()
        self.applied.inc("heartbeat")


def relay_from_config(data: Mapping[str, Any], registry: Registry | None = None) -> EventRelay:
    """The relay of a server file (``kvroute serve``'s): its workers' ``kv_events`` (with
    ``kv_replay``, ``kv_events_bind``), ``[events] topic`` and ``[cluster]``; other sections are
    left to their servers."""
    from kvroute.server.config import Table, parse_fleet

    top = Table(data, "config", root=True)
    fleet = parse_fleet(top)
    cluster = fleet.cluster
    if cluster is None:
        raise ValueError("kvroute relay needs a [cluster] section (where NATS is)")
    workers = [w for w in fleet.workers if w.kv_events]
    if not workers:
        raise ValueError("kvroute relay needs kv_events on at least one [[workers]] entry")
    return EventRelay(
        {w.name: w.kv_events for w in workers if w.kv_events},
        cluster,
        replay={w.name: w.kv_replay for w in workers if w.kv_replay},
        bind={w.name: w.kv_events_bind for w in workers},
        topic=fleet.events.topic,
        registry=registry,
    )


async def run_relay(
    relay: EventRelay,
    stop: asyncio.Event,
    *,
    registry: Registry | None = None,
    host: str = "0.0.0.0",
    port: int | None = None,
) -> None:
    """Runs ``relay`` until ``stop`` is set, logging its state every minute; with ``port``,
    serves ``registry``'s ``/metrics`` and ``/health`` (200 while connected to NATS, else 503;
    the body is :meth:`EventRelay.describe`) there (:mod:`.status`)."""
    from .status import serve_status

    server = None
    async with relay:
        if port is not None:
            reg = registry or Registry()
            server = await serve_status(
                host, port, reg.render, lambda: (relay.connected, relay.describe())
            )
        try:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 60.0)
                    return
                log.info("relay: %s", relay.describe())
        finally:
            if server is not None:
                server.close()
