"""Replica sync: every replica's router updates, shared over a NATS JetStream stream.

One :class:`ReplicaSync` per router replica. The router (``Router(..., updates=True)``) keeps
an outbox of what its decisions change — in approx mode the blocks each route newly predicts on
its worker (anchored at the last block already known there, never the whole prompt again),
touches and corrections; in both modes its load changes — and knows how to apply another
replica's batch (``Router.apply_updates``, ``Router.dump_model``/``load_model``; see the
router's ``sync`` module). This class only moves bytes:

- **Publish.** Every ``publish_interval`` the outbox is drained into batches of at most
  ``MAX_BATCH`` bytes, each numbered by this replica (``Kvroute-Replica``/``Kvroute-Seq``
  headers, and ``Nats-Msg-Id`` so JetStream drops a batch re-sent after a lost ack), and
  published in order to the stream, each awaited (JetStream's ack) before the next.
- **Apply.** An ordered push consumer delivers the stream from where this replica stands, in
  stream order. Each publisher's batches are applied once and in its own numbering order: a
  batch seen before (a duplicate, a replay) is dropped, one that arrives ahead of a missing one
  is held until the missing one comes (up to ``MAX_HELD``, then the gap is given up, counted),
  and a malformed one is counted and dropped (it changes nothing). A replica's own batches come
  back too and are applied again, without their load changes: its own updates took effect when
  it made them, and applying them again in stream order makes every replica's last application
  of every update happen in the same order — so replicas whose updates crossed (one forgot a
  block the engine lacked while another recorded it) agree once the stream is applied. Exactly
  so while no model evicts; a full model's LRU order may still differ between replicas.
- **Snapshots.** Every ``snapshot_interval`` each replica writes its model (``dump_model``) and
  the last stream sequence it reflects to the object store. A new or restarted replica loads
  the newest snapshot, re-applies whatever it routed before it could connect, and consumes the
  stream from the snapshot's sequence on; without a snapshot, from the stream's start. Its model
  is then the others' within the updates still in flight.
- **One hash space.** A block hash means something only under the block size and hash
  settings that made it. Every batch names its publisher's (``Kvroute-Hashing``: block size,
  hash profile and algorithm, vLLM version, and a digest of the hash seed and salt — never the
  secrets themselves), and so does every snapshot: a replica configured otherwise skips the
  batch (``hashing_mismatch``) and refuses the snapshot (``kvroute_cluster_snapshots_total{op=
  "refused"}``), logging both settings once per publisher, and routes on what it sees itself.
  A batch without the header (an older replica) is applied as before.
- **Faults.** NATS unreachable, down or restarted: the replica keeps routing on its own state
  (nothing on the request path waits for NATS), keeps its outbox in up to ``max_pending``
  batches (the oldest are dropped beyond, counted), reconnects with backoff, publishes what it
  kept in order, and resumes consuming after the last sequence it handled — the others'
  batches sent meanwhile arrive then, so the models converge again. Every batch published after
  a drop names the last batch dropped (``Kvroute-Gone``): the others then know the missing
  numbers up to it never come, and apply what follows at once instead of holding it. Each of
  these is counted in ``/metrics`` (``kvroute_cluster_*``) and shown in ``/health``
  (``cluster``). A replica that dies loses only its unpublished outbox (at most
  ``publish_interval`` of updates); what it published stays in the stream and in the snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Mapping
from typing import Any

from kvroute.server.metrics import Counter, Gauge, Registry
from kvroute.server.tasks import cancel_tasks

from .bus import StreamConsumer, cancel, connect, ensure_stream, unsubscribe
from .config import ClusterConfig

__all__ = ["MAX_BATCH", "MAX_HELD", "ReplicaSync", "hashing_of"]

log = logging.getLogger("kvroute.cluster")

#: Largest batch published (NATS refuses messages over the server's max_payload, 1 MiB by
#: default); a single larger update is sent alone.
MAX_BATCH = 512 * 1024
#: The snapshot object's name in the bucket.
SNAPSHOT = "model"
P = "kvroute_cluster_"


class _Publisher:
    """Another replica's batches: applied in its numbering order, each once.

    ``upto``: every batch up to it was applied (or given up); ``held``: batches that arrived
    ahead of a missing one, applied as soon as it arrives. The first batch seen from a publisher
    starts its numbering (its earlier ones are in the snapshot, or gone with the stream's age).
    """

    __slots__ = ("held", "resync", "upto")

    def __init__(self) -> None:
        self.upto = -1
        self.held: dict[int, bytes] = {}
        #: The stream was made anew: batches it lost never come, so the next batch after
        #: ``upto`` is taken at once (a gap), not held for a missing one.
        self.resync = False


#: Batches held back per publisher waiting for a missing one; past this the gap is given up.
MAX_HELD = 256


def hashing_of(router: Any) -> str:
    """What ``router``'s block hashes depend on, as one header-safe line: replicas exchange
    updates and snapshots only when theirs are equal. The hash seed and salt appear as a digest
    (a replica's peers need to know they are equal, not what they are)."""
    c = router.config
    secret = hashlib.sha256(repr((c.get("hash_seed"), c.get("salt"))).encode()).hexdigest()
    return (
        f"block_size={c.get('block_size')} profile={c.get('hash_profile')} "
        f"algo={c.get('hash_algo')} vllm={c.get('vllm_version')} seeds={secret[:12]}"
    )


def _number(value: str | None) -> int:
    """A batch number header's value; 0 when absent or not a number."""
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


class ReplicaSync(StreamConsumer):
    """Shares ``router``'s updates with the other replicas over NATS (see the module docs).

    ``registry``: where the ``kvroute_cluster_*`` series go (a server's metrics registry).
    """

    def __init__(
        self, router: Any, config: ClusterConfig, *, registry: Registry | None = None
    ) -> None:
        if not router.config.get("updates"):
            raise ValueError("replica sync needs a Router built with updates=True")
        self.router = router
        self.config = config
        self.hashing = hashing_of(router)
        self._mismatched: set[str] = set()  # publishers logged for another hash space
        # Unique per process: a restarted replica is a new publisher.
        self.replica = f"{config.replica_name}-{uuid.uuid4().hex[:8]}"
        self.connected = False
        self.loaded_snapshot: int | None = None  # stream sequence of the snapshot loaded
        self.stream_seq = 0  # last stream sequence handled
        self._seq = 0  # batches numbered by this replica
        self._pending: deque[tuple[int, bytes]] = deque()
        self._gone = 0  # the last of its own batches dropped unpublished (0: none)
        self._seen: dict[str, _Publisher] = {}
        self._task: asyncio.Task[None] | None = None
        self._drainer: asyncio.Task[None] | None = None
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None
        self._objects: Any = None
        self._started = False
        self.last_error = ""
        reg = registry or Registry()
        self.published = reg.add(Counter(P + "published_total", "Update batches published."))
        self.applied = reg.add(
            Counter(P + "applied_total", "Updates applied from other replicas.", ("kind",))
        )
        self.skipped = reg.add(
            Counter(
                P + "skipped_total",
                "Batches or updates not applied: duplicate, malformed, gap (batches given up), "
                "unanchored, unknown_worker, inconsistent; stream_reset (the stream was made "
                "anew: consumed from its start); hashing_mismatch (a batch hashed under other "
                "settings).",
                ("reason",),
            )
        )
        self.dropped = reg.add(
            Counter(P + "dropped_total", "Own batches dropped while NATS was unreachable.")
        )
        self.errors = reg.add(
            Counter(P + "bus_errors_total", "NATS failures (connect, publish, snapshot).", ("op",))
        )
        self.snapshots = reg.add(
            Counter(
                P + "snapshots_total",
                "Model snapshots written, loaded, and refused (hashed under other settings).",
                ("op",),
            )
        )
        self.disconnected_seconds = 0.0
        self._down_since: float | None = time.monotonic()
        reg.add(
            Gauge(
                P + "connected",
                "1 while this replica is connected to NATS (0: routing on local state).",
                (),
                lambda: [((), 1 if self.connected else 0)],
            )
        )
        reg.add(
            Gauge(
                P + "pending_batches",
                "Own update batches not yet acknowledged by JetStream.",
                (),
                lambda: [((), len(self._pending))],
            )
        )
        reg.add(
            Gauge(
                P + "local_only_seconds",
                "Seconds spent disconnected from NATS (routing on local state), in total.",
                (),
                lambda: [((), self._local_seconds())],
            )
        )

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts syncing in the background (returns at once; NATS may be down)."""
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run())
            self._drainer = loop.create_task(self._drain_forever())

    async def stop(self) -> None:
        """Publishes what it can within a second, then disconnects."""
        task, self._task = self._task, None
        drainer, self._drainer = self._drainer, None
        await cancel_tasks(drainer)
        if task is not None:
            self._drain()
            if self.connected:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._publish_pending(), 1.0)
            await cancel(task)
        await self._close()

    def describe(self) -> dict[str, Any]:
        """What ``/health`` shows under ``cluster``."""
        return {
            "replica": self.replica,
            "connected": self.connected,
            "nats": list(self.config.nats),
            "stream_seq": self.stream_seq,
            "pending_batches": len(self._pending),
            "publishers_seen": len(self._seen),
            "snapshot_loaded_at_seq": self.loaded_snapshot,
            "hashing": self.hashing,
            "local_only_seconds": round(self._local_seconds(), 3),
            "last_error": self.last_error,
        }

    def _local_seconds(self) -> float:
        down = self._down_since
        return self.disconnected_seconds + (time.monotonic() - down if down is not None else 0.0)

    # ---- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                await self._connect()
                backoff = 0.05
                await self._pump()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any NATS failure: route locally, retry
                self._failed("connect" if not self.connected else "bus", e)
            await self._close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _drain_forever(self) -> None:
        """Keeps the router's outbox moving into ``pending`` (bounded), connected or not."""
        while True:
            self._drain()
            await asyncio.sleep(self.config.publish_interval)

    def _failed(self, op: str, e: BaseException) -> None:
        self.errors.inc(op)
        self.last_error = f"{op}: {type(e).__name__}: {e}"
        log.warning("cluster %s failed: %s", op, self.last_error)

    async def _connect(self) -> None:
        from nats.js import api

        cfg = self.config
        nc = await connect(cfg, self.replica, self._on_error)
        self._nc = nc
        js = nc.jetstream(timeout=cfg.connect_timeout)
        self._js = js
        await ensure_stream(js, cfg.stream, cfg.subject, cfg)
        try:
            self._objects = await js.object_store(cfg.snapshots)
        except Exception:
            self._objects = await js.create_object_store(cfg.snapshots)
        if not self._started:
            await self._load_snapshot()
            self._started = True
        start = await self.resume_from(js, cfg.stream)
        self._sub = await js.subscribe(
            cfg.subject,
            stream=cfg.stream,
            cb=self._on_msg,
            ordered_consumer=True,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start
            ),
        )
        self.connected = True
        if self._down_since is not None:
            self.disconnected_seconds += time.monotonic() - self._down_since
            self._down_since = None
        log.info("cluster: replica %s connected, consuming from %d", self.replica, start)

    async def _on_error(self, e: Exception) -> None:
        self.last_error = f"nats: {type(e).__name__}: {e}"

    async def _close(self) -> None:
        if self.connected:
            self.connected = False
            self._down_since = time.monotonic()
        sub = self._sub
        nc, self._nc, self._js, self._sub, self._objects = self._nc, None, None, None, None
        if nc is not None:
            await unsubscribe(nc, sub)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 1.0)

    async def _pump(self) -> None:
        cfg = self.config
        next_snapshot = time.monotonic() + cfg.snapshot_interval
        while True:
            if self._nc is None or not self._nc.is_connected:
                raise ConnectionError("NATS connection lost")
            await self._publish_pending()
            if time.monotonic() >= next_snapshot:
                await self.save_snapshot()
                next_snapshot = time.monotonic() + cfg.snapshot_interval
            await asyncio.sleep(cfg.publish_interval)

    # ---- publishing --------------------------------------------------------------------------

    def _drain(self) -> None:
        """Moves the router's outbox into numbered batches, dropping the oldest past the bound."""
        while True:
            batch = self.router.take_updates(max_bytes=MAX_BATCH)
            if not batch:
                break
            self._seq += 1
            self._pending.append((self._seq, batch))
        while len(self._pending) > self.config.max_pending:
            self._gone = self._pending.popleft()[0]
            self.dropped.inc()

    async def _publish_pending(self) -> None:
        while self._pending and self._js is not None:
            n, batch = self._pending[0]
            headers = {
                "Nats-Msg-Id": f"{self.replica}-{n}",
                "Kvroute-Replica": self.replica,
                "Kvroute-Seq": str(n),
                "Kvroute-Hashing": self.hashing,
            }
            if self._gone:
                headers["Kvroute-Gone"] = str(self._gone)
            await self._js.publish(
                self.config.subject,
                batch,
                timeout=self.config.connect_timeout,
                stream=self.config.stream,
                headers=headers,
            )
            self._pending.popleft()
            self.published.inc()

    # ---- applying ----------------------------------------------------------------------------

    def apply(self, headers: Mapping[str, str], data: bytes) -> None:
        """Takes one batch from the stream: applied in its publisher's order, once (see the
        module docs and :class:`_Publisher`)."""
        publisher = headers.get("Kvroute-Replica", "")
        n = _number(headers.get("Kvroute-Seq"))
        if not publisher or n < 1:
            self.skipped.inc("malformed")
            return
        theirs = headers.get("Kvroute-Hashing")
        if theirs is not None and theirs != self.hashing:
            self.skipped.inc("hashing_mismatch")
            self._mismatch(f"batch {publisher}/{n}", publisher, theirs)
            return
        pub = self._seen.setdefault(publisher, _Publisher())
        if pub.upto < 0:
            pub.upto = n - 1
        if n <= pub.upto or n in pub.held:
            self.skipped.inc("duplicate")
            return
        gone = _number(headers.get("Kvroute-Gone"))
        if pub.upto < gone < n:
            # Up to `gone`, what has not come never will (dropped unpublished): what is held
            # there is applied, and the numbering goes on after it.
            self.skipped.inc("gap")
            for m in sorted(k for k in pub.held if k <= gone):
                self._apply_batch(publisher, m, pub.held.pop(m))
            pub.upto = gone
        if pub.resync:
            pub.resync = False
            if n != pub.upto + 1:
                self.skipped.inc("gap")
                pub.upto = n - 1
        pub.held[n] = data
        if n != pub.upto + 1 and len(pub.held) <= MAX_HELD:
            return  # ahead of a missing batch: wait for it
        if n != pub.upto + 1:
            self.skipped.inc("gap")  # given up: go on from the oldest batch held
            pub.upto = min(pub.held) - 1
        while pub.upto + 1 in pub.held:
            pub.upto += 1
            self._apply_batch(publisher, pub.upto, pub.held.pop(pub.upto))

    def _mismatch(self, what: str, publisher: str, theirs: str) -> None:
        self.last_error = f"{what} hashed with {theirs}; this replica hashes with {self.hashing}"
        if publisher not in self._mismatched:
            self._mismatched.add(publisher)
            log.error("cluster: %s: not applied (another hash space)", self.last_error)

    def on_stream_reset(self) -> None:
        for pub in self._seen.values():
            pub.resync = True

    def _apply_batch(self, publisher: str, n: int, data: bytes) -> None:
        own = publisher == self.replica
        try:
            # Its own batches (already applied when made) again, in stream order: every
            # replica's last application of every update is then in the same order, so the
            # models agree once all is applied. Its own load changes are in its own counters.
            stats = self.router.apply_updates(data, loads=not own)
        except ValueError as e:
            self.skipped.inc("malformed")
            self.last_error = f"batch {publisher}/{n}: {e}"
            return
        for kind in ("records", "forgets", "loads"):
            if stats[kind]:
                self.applied.inc(kind, by=stats[kind])
        for reason, key in (
            ("unanchored", "unanchored"),
            ("unknown_worker", "unknown_workers"),
            ("inconsistent", "inconsistent"),
        ):
            if stats[key]:
                self.skipped.inc(reason, by=stats[key])

    # ---- snapshots ---------------------------------------------------------------------------

    async def save_snapshot(self) -> None:
        """Writes this replica's model and stream position (approx mode; nothing otherwise)."""
        if self._objects is None or self.router.mode != "approx":
            return
        from nats.js import api

        data = self.router.dump_model()
        meta = {
            "seq": self.stream_seq,
            "replica": self.replica,
            "time": time.time(),
            "hashing": self.hashing,
        }
        try:
            await self._objects.put(
                SNAPSHOT, data, meta=api.ObjectMeta(name=SNAPSHOT, description=json.dumps(meta))
            )
        except Exception as e:
            self._failed("snapshot", e)
            if self._nc is None or not self._nc.is_connected:
                raise
            return
        self.snapshots.inc("written")

    async def _load_snapshot(self) -> None:
        """Starts from the newest snapshot, if any, keeping what this replica routed before."""
        if self.router.mode != "approx":
            return
        from nats.js.errors import NotFoundError, ObjectNotFoundError

        try:
            result = await self._objects.get(SNAPSHOT)
        except (NotFoundError, ObjectNotFoundError):
            return
        meta = json.loads(result.info.description or "{}")
        theirs = meta.get("hashing")
        if theirs is not None and theirs != self.hashing:
            # Consumed from the stream's start instead, whose batches of that space are skipped.
            self.snapshots.inc("refused")
            self._mismatch(f"the snapshot of {meta.get('replica')}", "snapshot", theirs)
            return
        seq = int(meta.get("seq", 0))
        self.router.load_model(result.data)
        # What this replica routed before it could connect is not in the snapshot.
        self._drain()
        for _, batch in self._pending:
            self.router.apply_updates(batch, loads=False)
        self.stream_seq = seq
        self.loaded_snapshot = seq
        self.snapshots.inc("loaded")
        log.info(
            "cluster: loaded the snapshot of %s at stream sequence %d", meta.get("replica"), seq
        )
