"""Engine KV events over ZMQ (vLLM, SGLang) → the router's prefix index.

``KvEventSubscriber`` connects one SUB socket per engine (frames ``[topic, seq (8-byte big-endian),
msgpack payload]``), hands every payload to a ``kvroute.KvEventApplier`` (decoding and index
updates run in Rust with the GIL released) and keeps each worker's index **sound** across lost
messages and restarts:

- **Sequence tracking.** Each publisher numbers its batches 0, 1, 2, … A jump forward (ZMQ dropped
  messages at its high-water mark, or the subscriber was slow) is a *gap*: with a replay endpoint
  the subscriber asks the engine's ROUTER socket for everything from the first missing number over
  a DEALER socket (a REQ socket would receive only the first replayed batch), buffers live
  messages meanwhile, applies the replayed batches in order, then the buffered ones; the worker is
  reported stale until then. Without a replay endpoint — or when the replay does not reach back
  far enough, ends without filling the gap, stalls, or overflows the buffer — the worker's blocks
  are cleared: the index never keeps guessing about a worker whose history it lost.
- **A replay is bounded.** Only replayed batches the live stream has already numbered (sequence
  numbers up to the last one received live) are applied: later ones are still on their way over
  the live connection (ZMQ does not order two sockets), and a number the engine has not reached
  is not believed. The replay's deadline (``replay_timeout``) is extended only by a batch that
  advances it — a replay repeating old numbers times out — and the live messages buffered
  meanwhile are bounded by count (``max_pending``) and by bytes (``max_pending_bytes``).
- **Restarts.** A sequence number that goes back means the engine restarted (its cache is empty):
  the worker is cleared, and its numbering is followed afresh.
- **Catch-up.** When the first message seen from an engine is not number 0 and a replay endpoint
  is known, the subscriber replays from 0 to learn the blocks stored before it connected
  (``catch_up=False`` turns this off).
- **Disconnects.** When an engine's event connection drops (the engine stopped or crashed), the
  worker is cleared at once: a restarted engine's cache is empty, and it publishes nothing before
  its first request — waiting for its numbering to start again would credit it, meanwhile, with
  blocks it lost. A ZMQ socket monitor reports the drop.
- ``AllBlocksCleared`` clears the worker (done by the applier).
- **Workers joining and leaving.** ``add_worker`` / ``remove_worker`` change the subscribed engines
  before ``start()`` or while running (the poll thread makes or closes that worker's sockets); every
  other worker keeps its sockets and sequence state. A worker that leaves is forgotten: nothing of
  it is applied afterwards, its blocks and counters are dropped, a stale one is marked fresh.
- **Block sizes.** The first store of each engine (and again after every reset) is checked against
  the router's block size: one the applier cannot use (direct mode: not equal; rehash: not a
  multiple) is logged as an error naming both sizes — every store of that engine is skipped, its
  index stays empty. A multiple in rehash mode is indexed in the router's finer blocks: a router
  fed by its own ``event_applier`` learns each engine's size and counts the worker's matches in
  whole engine blocks (logged at info); an index read directly does not (a warning: its matches
  may exceed the engine's by less than one engine block). vLLM ≥ 0.34 uses 64-token blocks on
  GPU by default (16 before).
- **Replay socket failures.** When ZMQ cannot make a worker's new replay DEALER mid-run (out of
  sockets or file descriptors), the worker goes on without replay — a gap clears it, as for an
  engine without a replay endpoint, and it is never left stale — and a new DEALER is tried every
  second until one is made; each failure is counted (``replay_socket_failures``), the first of
  a run logged as an error and the recovery at info.
- **Malformed input** — wrong frame count, a sequence frame that is not 8 bytes, a payload the
  decoder refuses — is counted and skipped; nothing crashes and nothing else changes.

Replay protocol (vLLM ``ZmqEventPublisher``): send ``[b"", start_seq (8-byte BE)]`` from a DEALER;
the ROUTER answers ``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start``
(``[b"", seq, payload]`` from vLLM ≤ 0.24, without the topic frame), then the end marker
``[b"", b"", 0xff×8, b""]`` (``[b"", 0xff×8, b""]``).

Freshness: the target's (or ``freshness=``'s) ``mark_stale(worker)`` / ``mark_fresh(worker)`` are
called when a worker goes stale (replay started) and when it has caught up; ``stats()`` also gives
each worker's seconds since its last message. One background thread polls every socket, reading
at most 1,024 messages of one before it serves the other sockets ready and checks the replay
deadlines (a flooded engine starves neither); ``stop()`` wakes it at once through an inproc
socket, joins it and closes every socket and the ZMQ context. A thread ended by an error its
handlers do not catch (a ``BaseException`` from the sink) logs it and marks every worker stale:
no event reaches the index any more; ``stop()`` still returns.

Requires ``pyzmq`` (``pip install kvroute[events]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from ._core import KvEventApplier, PrefixIndex
from ._events_diagnostics import check_block_size, check_hashes
from ._events_membership import Change, Membership

__all__ = ["END_SEQ", "Freshness", "KvEventSubscriber", "applier_for"]

log = logging.getLogger("kvroute.events")

#: The sequence number of the replay end marker (``-1`` as a signed 8-byte big-endian int).
END_SEQ = b"\xff" * 8

_ids = itertools.count()

#: Seconds between attempts to make a worker's replay DEALER again after ZMQ failed to.
_DEALER_RETRY = 1.0


class Freshness(Protocol):
    """What the subscriber tells the router about a worker's index freshness."""

    def mark_stale(self, worker: str) -> None: ...

    def mark_fresh(self, worker: str) -> None: ...


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("kvroute.events needs pyzmq: pip install 'kvroute[events]'") from e
    return zmq


def applier_for(
    target: Any,
    *,
    mode: str = "rehash",
    block_size: int | None = None,
    hash_profile: str | None = None,
    seed: str | None = None,
    group_idx: int = 0,
    hash_algo: str | None = None,
    vllm_version: str | None = None,
) -> Any:
    """What a KV-event stream is applied with, for ``target`` (see ``KvEventSubscriber``): a
    ``KvEventApplier`` as is, a router's own applier, one built over a ``PrefixIndex`` or a
    router's index — or any sink with ``apply(worker, payload)``, ``clear(worker)`` and
    ``stats()`` (``kvroute relay``'s outbox). An approx-mode router is refused."""
    if isinstance(target, KvEventApplier):
        return target
    own = getattr(target, "event_applier", None)  # a router that owns its applier (tiers)
    if isinstance(own, KvEventApplier):
        return own
    if getattr(target, "mode", None) == "approx":
        # An approx-mode router's index is its own prediction, kept equal to its cache model:
        # engine events written into it would silently corrupt both.
        raise ValueError(
            "this router predicts its index (index='approx'); create it with "
            "index='events' to feed it engine KV events"
        )
    if isinstance(target, PrefixIndex):
        index = target
    elif isinstance(getattr(target, "index", None), PrefixIndex):
        index = target.index
        block_size = block_size if block_size is not None else getattr(target, "block_size", None)
        if hash_profile is None:
            hash_profile = getattr(target, "hash_profile", None)
    elif all(callable(getattr(target, m, None)) for m in ("apply", "clear", "stats")):
        return target
    else:
        raise TypeError(
            "target must be a PrefixIndex, a KvEventApplier, a router with an .index or an "
            "event sink, "
            f"got {type(target).__name__}"
        )
    return KvEventApplier(
        index,
        mode=mode,
        block_size=16 if block_size is None else block_size,
        hash_profile=hash_profile or "native",
        seed=seed,
        group_idx=group_idx,
        hash_algo=hash_algo,
        vllm_version=vllm_version,
    )


class _Worker:
    """One engine: its sockets, sequence state and counters (touched by the poll thread only,
    read under the subscriber's lock)."""

    def __init__(self, name: str, endpoint: str, replay: str | None, bind: bool) -> None:
        self.name = name
        self.endpoint = endpoint
        self.bind = bind
        self.replay_endpoint = replay
        self.sub: Any = None
        self.dealer: Any = None
        self.dealer_retry: float | None = None  # when to try again to make a DEALER ZMQ refused
        self.monitor: Any = None
        self.disconnects = 0
        self.expected: int | None = None  # next sequence number expected
        self.replaying = False
        self.replay_deadline = 0.0
        self.pending: list[tuple[int, bytes]] = []
        self.pending_bytes = 0
        self.live_seq: int | None = None  # the last sequence number received on the live stream
        self.replay_lost = False  # this replay did not reach back (counted once per replay)
        self.stale = False
        self.gaps = 0
        self.replays = 0
        self.replay_failures = 0
        self.replay_socket_failures = 0
        self.resets = 0
        self.restarts = 0
        self.malformed_frames = 0
        self.errors = 0
        self.last_seq: int | None = None
        self.last_message: float | None = None
        self.block_size_checked = False  # the engine's block size compared since the last reset
        self.refusal_logged = False  # a refused frame or payload logged since the last reset
        self.foreign_logged = False  # direct mode: foreign block hashes logged since the reset


class KvEventSubscriber(Membership):
    """Subscribes to engines' KV events and keeps ``target``'s prefix index in step.

    ``target``: a ``kvroute.PrefixIndex`` (a ``KvEventApplier`` is built for it with ``mode``,
    ``block_size``, ``hash_profile``, ``seed``, ``group_idx``, ``hash_algo``, ``vllm_version``), a
    ``KvEventApplier`` (used as
    is), or a router-like object: its ``event_applier`` (a ``KvEventApplier``) if it has one,
    else its ``index`` with its ``block_size`` and ``hash_profile`` attributes as defaults; it is
    the freshness sink when it has ``mark_stale``/``mark_fresh``. ``endpoints``:
    ``{worker: "tcp://host:5557"}``; ``replay``: ``{worker: "tcp://host:5558"}`` for the engines
    that run a replay socket. ``topic`` is the
    SUB prefix filter (vLLM's default topic is ``""``). ``bind`` (for all workers, or
    ``{worker: bool}``): the SUB socket binds the endpoint instead of connecting to it — vLLM's
    publisher binds only an endpoint with a wildcard host (``tcp://*:5557``), ``ipc://`` or
    ``inproc://``, and *connects* to one with a concrete host (``tcp://10.0.0.5:5557``), where
    the subscriber must bind. The replay socket is always bound by the engine.

    Bounds: a replay is given up after ``replay_timeout`` seconds without progress (default 5)
    or when the live messages buffered meanwhile exceed ``max_pending`` (default 100,000) or
    ``max_pending_bytes`` (default 64 MiB); ``rcvhwm`` (default 100,000 messages) is each SUB
    socket's receive high-water mark — past it ZMQ drops messages, which shows as a gap.
    """

    def __init__(
        self,
        target: Any,
        endpoints: Mapping[str, str],
        *,
        replay: Mapping[str, str] | None = None,
        topic: str = "",
        mode: str = "rehash",
        block_size: int | None = None,
        hash_profile: str | None = None,
        seed: str | None = None,
        group_idx: int = 0,
        hash_algo: str | None = None,
        vllm_version: str | None = None,
        bind: bool | Mapping[str, bool] = False,
        freshness: Freshness | None = None,
        catch_up: bool = True,
        replay_timeout: float = 5.0,
        max_pending: int = 100_000,
        max_pending_bytes: int = 64 << 20,
        rcvhwm: int = 100_000,
    ) -> None:
        replay = dict(replay or {})
        unknown = sorted(set(replay) - set(endpoints))
        if unknown:
            raise KeyError(f"replay endpoints given for unknown workers {unknown}")
        for name, endpoint in endpoints.items():
            if not isinstance(name, str) or not isinstance(endpoint, str):
                raise TypeError(f"endpoints must map str to str, got {name!r}: {endpoint!r}")
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be > 0, got {replay_timeout!r}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending!r}")
        if max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes must be >= 1, got {max_pending_bytes!r}")
        self._zmq = _zmq()
        binds = {name: bind for name in endpoints} if isinstance(bind, bool) else dict(bind)
        unknown = sorted(set(binds) - set(endpoints))
        if unknown:
            raise KeyError(f"bind given for unknown workers {unknown}")
        self.applier = applier_for(
            target,
            mode=mode,
            block_size=block_size,
            hash_profile=hash_profile,
            seed=seed,
            group_idx=group_idx,
            hash_algo=hash_algo,
            vllm_version=vllm_version,
        )
        # Direct mode stores the engine's hashes: the applier counts roots hashed otherwise.
        self._direct = isinstance(self.applier, KvEventApplier) and self.applier.mode == "direct"
        # A router fed by its own applier counts each worker's matches in whole engine blocks.
        self._router_counts_engine_blocks = isinstance(
            getattr(target, "event_applier", None), KvEventApplier
        )
        if freshness is None and hasattr(target, "mark_stale") and hasattr(target, "mark_fresh"):
            freshness = target
        self._freshness = freshness
        self._topic = topic.encode()
        self._catch_up = catch_up
        self._replay_timeout = float(replay_timeout)
        self._max_pending = int(max_pending)
        self._max_pending_bytes = int(max_pending_bytes)
        self._rcvhwm = int(rcvhwm)
        self._workers = {
            name: _Worker(name, endpoint, replay.get(name), bool(binds.get(name, False)))
            for name, endpoint in endpoints.items()
        }
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ctx: Any = None
        self._stop_addr = f"inproc://kvroute-events-stop-{next(_ids)}"
        self._stop_sock: Any = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        # Membership changes while running: queued here and made by the poll thread, woken
        # through the stop socket. ``_control`` guards the queue, that socket's sends and
        # ``_accepting`` (True while a poll thread will take queued changes).
        self._control = threading.Lock()
        self._changes: list[Change] = []
        self._accepting = False
        self._poller: Any = None  # the poll thread's own
        # socket -> (worker, handler of its frames)
        self._owner: dict[Any, tuple[_Worker, Any]] = {}

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True between ``start()`` and ``stop()``."""
        return self._thread is not None

    def start(self) -> KvEventSubscriber:
        """Connects the sockets and starts the poll thread (returns once it is polling)."""
        if self._thread is not None:
            return self
        zmq = self._zmq
        self._ctx = zmq.Context()
        self._ready.clear()
        self._failure = None
        thread = threading.Thread(target=self._run, name="kvroute-kv-events", daemon=True)
        thread.start()
        self._ready.wait()
        if self._failure is not None:
            thread.join()
            self._ctx.term()
            self._ctx = None
            raise self._failure
        stop = self._ctx.socket(zmq.PAIR)
        stop.setsockopt(zmq.LINGER, 0)
        stop.connect(self._stop_addr)
        self._stop_sock = stop
        self._thread = thread
        with self._control:
            self._accepting = True
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the poll thread and closes every socket; idempotent. Waits at most ``timeout``
        seconds (default 5) for the poll thread: one stuck in the event sink is left the ZMQ
        context, which it closes once it sees the stop."""
        thread = self._thread
        if thread is None:
            return
        try:
            with self._control:
                self._accepting = False  # later changes are made by their caller
                if thread.is_alive():  # a dead thread's end of the pair is closed: never wait
                    with contextlib.suppress(self._zmq.ZMQError):
                        self._stop_sock.send(b"stop", self._zmq.NOBLOCK)
        finally:
            thread.join(timeout)
            self._stop_sock.close(linger=0)
            self._stop_sock = None
            self._thread = None
            if not thread.is_alive():
                self._ctx.term()
            self._ctx = None

    def __enter__(self) -> KvEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> KvEventSubscriber:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.start)

    async def __aexit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.stop)

    # ---- inspection -----------------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        """The subscribed workers."""
        return list(self._workers)

    @property
    def index(self) -> PrefixIndex:
        """The GPU prefix index being fed."""
        return self.applier.index

    def is_stale(self, worker: str) -> bool:
        """True while ``worker`` is waiting for a replay to fill a gap."""
        with self._lock:
            return self._workers[worker].stale

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: the applier's counters (batches, events, blocks_stored, blocks_removed,
        skipped_*, …, foreign_hashes (direct mode) and engine_block_size: the largest block size of
        the engine's GPU stores since its last reset) plus gaps, replays, replay_failures,
        replay_socket_failures (replay DEALERs ZMQ failed to make), resets (clears for lost
        history: unrecoverable gaps, restarts and disconnects), restarts, disconnects, malformed
        (frames and payloads), errors (exceptions caught in the poll thread, the freshness sink's
        included), last_seq (the last batch applied: its blocks are in the index once it shows),
        stale, pending and pending_bytes (live messages buffered during a replay) and
        seconds_since_event (``None`` before the first message)."""
        now = time.monotonic()
        applied = self.applier.stats()
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            for name, w in self._workers.items():
                row: dict[str, Any] = dict(applied.get(name, {}))
                payload_malformed = int(row.get("malformed", 0))
                row.update(
                    endpoint=w.endpoint,
                    replay_endpoint=w.replay_endpoint,
                    gaps=w.gaps,
                    replays=w.replays,
                    replay_failures=w.replay_failures,
                    replay_socket_failures=w.replay_socket_failures,
                    resets=w.resets,
                    restarts=w.restarts,
                    disconnects=w.disconnects,
                    malformed=payload_malformed + w.malformed_frames,
                    malformed_frames=w.malformed_frames,
                    malformed_payloads=payload_malformed,
                    errors=w.errors,
                    pending=len(w.pending),
                    pending_bytes=w.pending_bytes,
                    last_seq=w.last_seq,
                    stale=w.stale,
                    seconds_since_event=None
                    if w.last_message is None
                    else max(0.0, now - w.last_message),
                )
                out[name] = row
        return out

    # ---- poll thread ----------------------------------------------------------------------

    def _run(self) -> None:
        zmq = self._zmq
        ctx = self._ctx
        self._poller = poller = zmq.Poller()
        self._owner = owner = {}
        stop = None
        try:
            stop = ctx.socket(zmq.PAIR)
            stop.setsockopt(zmq.LINGER, 0)
            stop.bind(self._stop_addr)
            poller.register(stop, zmq.POLLIN)
            for w in self._workers.values():
                self._open(w)
        except BaseException as e:
            self._failure = e
            self._close_all(stop)
            self._ready.set()
            return
        self._ready.set()
        stopped = False
        try:
            while True:
                ready = dict(poller.poll(self._poll_timeout()))
                if stop in ready:
                    if stop.recv() == b"stop":
                        stopped = True
                        break
                    self._take_changes()  # b"change": add_worker / remove_worker
                for sock in ready:
                    for _ in range(1024):
                        entry = owner.get(sock)  # a dealer may be replaced meanwhile
                        if entry is None:
                            break
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.ZMQError:
                            break
                        w, handler = entry
                        self._guarded(handler, w, frames)
                now = time.monotonic()
                for w in self._workers.values():
                    if w.replaying and now >= w.replay_deadline:
                        self._guarded(self._replay_failed, w)
                    if w.dealer_retry is not None and now >= w.dealer_retry:
                        self._guarded(self._replace_dealer, w)
        finally:
            self._close_all(stop)
            with self._control:  # changes queued before the stop: made without sockets
                self._accepting = False
                changes, self._changes = self._changes, []
                for change in changes:
                    self._make(change, live=False)
            if not stopped:  # ended by an error its handlers do not catch: events stop here
                log.error("KV event subscriber: the poll thread ended unasked; workers stale")
                for w in list(self._workers.values()):
                    self._notify(w, True)

    def _open(self, w: _Worker) -> None:
        """Makes the worker's sockets and puts them on the poller (the poll thread); on failure
        closes those made and raises."""
        zmq = self._zmq
        try:
            sub = self._ctx.socket(zmq.SUB)
            w.sub = sub
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            if w.bind:
                sub.bind(w.endpoint)
            else:
                sub.connect(w.endpoint)
            self._poller.register(sub, zmq.POLLIN)
            self._owner[sub] = (w, self._on_frames)
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            w.monitor = monitor
            self._poller.register(monitor, zmq.POLLIN)
            self._owner[monitor] = (w, self._on_monitor)
            if w.replay_endpoint is not None:
                self._new_dealer(w)
        except BaseException:
            self._close(w)
            raise

    def _close(self, w: _Worker) -> None:
        """Closes the worker's sockets and takes them off the poller."""
        if w.monitor is not None and w.sub is not None:
            w.sub.disable_monitor()
        for s in (w.monitor, w.sub, w.dealer):
            if s is not None:
                if self._owner.pop(s, None) is not None:
                    self._poller.unregister(s)
                s.close(linger=0)
        w.sub = w.dealer = w.monitor = None
        w.dealer_retry = None

    def _close_all(self, stop: Any) -> None:
        for w in list(self._workers.values()):
            self._close(w)
        if stop is not None:
            stop.close(linger=0)
        self._owner = {}

    def _new_dealer(self, w: _Worker) -> None:
        """(Re)creates the worker's replay DEALER; replacing it drops late replies to an
        abandoned request along with the old socket. A ``zmq.ZMQError`` (no socket made, or not
        connected) leaves the worker without one."""
        zmq = self._zmq
        old = w.dealer
        if old is not None:
            self._poller.unregister(old)
            self._owner.pop(old, None)
            old.close(linger=0)
            w.dealer = None
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(w.replay_endpoint)
        except BaseException:
            dealer.close(linger=0)
            raise
        w.dealer = dealer
        self._poller.register(dealer, zmq.POLLIN)
        self._owner[dealer] = (w, self._on_replay_frames)

    def _replace_dealer(self, w: _Worker) -> None:
        """A new replay DEALER mid-run (``_new_dealer``). When ZMQ cannot make one, the worker
        goes on without (a gap clears it) and another is tried ``_DEALER_RETRY`` seconds later:
        the callers finish their work either way, so the worker is never left stale."""
        try:
            self._new_dealer(w)
        except self._zmq.ZMQError as e:
            if w.dealer_retry is None:
                log.error(
                    "worker %s: cannot make its replay socket (%s): until one is made, a gap "
                    "in its events clears it instead of being replayed; retrying every %g s",
                    w.name,
                    e,
                    _DEALER_RETRY,
                )
            w.dealer_retry = time.monotonic() + _DEALER_RETRY
            with self._lock:
                w.replay_socket_failures += 1
            return
        if w.dealer_retry is not None:
            w.dealer_retry = None
            log.info("worker %s: its replay socket is made again", w.name)

    def _poll_timeout(self) -> int:
        workers = self._workers.values()
        deadlines = [w.replay_deadline for w in workers if w.replaying]
        deadlines += [w.dealer_retry for w in workers if w.dealer_retry is not None]
        if not deadlines:
            return 1000
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # never let one bad message stop the thread
            w = args[0]
            with self._lock:
                w.errors += 1

    def _notify(self, w: _Worker, stale: bool) -> None:
        with self._lock:
            w.stale = stale
        sink = self._freshness
        if sink is None:
            return
        try:
            (sink.mark_stale if stale else sink.mark_fresh)(w.name)
        except Exception:
            with self._lock:
                w.errors += 1

    # ---- sequence logic (poll thread) -----------------------------------------------------

    def _on_monitor(self, w: _Worker, frames: list[bytes]) -> None:
        """The event stream's connection dropped (the engine stopped or crashed): what it holds
        from now on is unknown until its events say, so its blocks are forgotten at once —
        before a restarted engine's first event, which may come long after its first request."""
        if len(frames) != 2 or len(frames[0]) < 2:
            return
        if int.from_bytes(frames[0][:2], "little") != self._zmq.EVENT_DISCONNECTED:
            return
        with self._lock:
            w.disconnects += 1
        if w.replaying:
            w.replaying = False
            self._take_pending(w)
            self._replace_dealer(w)
            self._notify(w, False)
        self._reset(w)

    def _on_frames(self, w: _Worker, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            with self._lock:
                w.malformed_frames += 1
            self._refused(
                w,
                f"a live message of frames {[len(f) for f in frames]} bytes long (engines send 3: "
                "topic, 8-byte sequence, payload)",
            )
            return
        seq = int.from_bytes(frames[1], "big")
        w.live_seq = seq
        self._on_live(w, seq, frames[2])

    def _on_live(self, w: _Worker, seq: int, payload: bytes, catch_up: bool = True) -> None:
        if w.replaying:
            if (
                len(w.pending) < self._max_pending
                and w.pending_bytes + len(payload) <= self._max_pending_bytes
            ):
                w.pending.append((seq, payload))
                w.pending_bytes += len(payload)
                return
            self._replay_failed(w)  # too much buffered: give up, follow the live stream
            self._on_live(w, seq, payload, catch_up=False)
            return
        if w.expected is not None and seq < w.expected:
            with self._lock:
                w.restarts += 1
            self._reset(w)
        if w.expected is None:
            if seq > 0 and catch_up and self._catch_up and w.dealer is not None:
                self._start_replay(w, 0, seq, payload)
                return
            w.expected = seq
        if seq > w.expected:
            with self._lock:
                w.gaps += 1
            if w.dealer is not None:
                self._start_replay(w, w.expected, seq, payload)
                return
            self._reset(w)
            w.expected = seq
        self._apply(w, seq, payload)

    def _apply(self, w: _Worker, seq: int, payload: bytes) -> None:
        w.expected = seq + 1
        try:
            self.applier.apply(w.name, payload)
        except ValueError as e:  # counted by the applier as a malformed payload
            self._refused(w, f"the payload of message {seq}: {e}")
        finally:  # after the batch: a reader seeing ``last_seq`` sees its blocks in the index
            with self._lock:
                w.last_seq = seq
                w.last_message = time.monotonic()
        if not w.block_size_checked:
            counts = self._router_counts_engine_blocks
            w.block_size_checked = check_block_size(self.applier, w.name, counts)
        if not w.foreign_logged and self._direct:
            w.foreign_logged = check_hashes(self.applier, w.name)

    def _refused(self, w: _Worker, what: str) -> None:
        """Logs a frame or payload refused (counted in ``malformed``; nothing of it applied): the
        first since the worker's last reset as a warning — an engine whose every message is
        refused (a format this version cannot read) is otherwise seen only in the counters —
        later ones at debug."""
        level = logging.DEBUG if w.refusal_logged else logging.WARNING
        w.refusal_logged = True
        log.log(
            level, "worker %s: refused %s; nothing of it applied (stats: malformed)", w.name, what
        )

    def _reset(self, w: _Worker) -> None:
        """Forgets the worker's blocks and its numbering (history lost)."""
        self.applier.clear(w.name)
        w.expected = None
        w.block_size_checked = False  # a restarted engine may run with another block size
        w.refusal_logged = False
        w.foreign_logged = False
        with self._lock:
            w.resets += 1

    def _take_pending(self, w: _Worker) -> list[tuple[int, bytes]]:
        pending, w.pending, w.pending_bytes = w.pending, [], 0
        return pending

    def _start_replay(self, w: _Worker, start: int, seq: int, payload: bytes) -> None:
        """Asks for everything from ``start`` on; the live message ``(seq, payload)`` that
        showed the gap is the first buffered one."""
        zmq = self._zmq
        w.pending.append((seq, payload))
        w.pending_bytes += len(payload)
        w.replaying = True
        w.replay_lost = False
        w.expected = start
        w.replay_deadline = time.monotonic() + self._replay_timeout
        with self._lock:
            w.replays += 1
        self._notify(w, True)
        try:
            w.dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError:
            self._replay_failed(w)

    def _on_replay_frames(self, w: _Worker, frames: list[bytes]) -> None:
        # [b"", topic, seq, payload] (vLLM >= 0.28) or [b"", seq, payload] (<= 0.24).
        if len(frames) == 4 and frames[0] == b"":
            seq_frame, payload = frames[2], frames[3]
        elif len(frames) == 3 and frames[0] == b"":
            seq_frame, payload = frames[1], frames[2]
        else:
            seq_frame = payload = b""
        if len(seq_frame) != 8:
            with self._lock:
                w.malformed_frames += 1
            self._refused(
                w,
                f"a replay reply of frames {[len(f) for f in frames]} bytes long (engines send "
                "3: empty, 8-byte sequence, payload)",
            )
            return
        if not w.replaying:
            return  # a reply to a request given up on (the dealer is replaced then; be safe)
        if seq_frame == END_SEQ:
            self._finish_replay(w)
            return
        seq = int.from_bytes(seq_frame, "big")
        expected = w.expected if w.expected is not None else 0
        if seq < expected:
            return  # already applied: no progress, the deadline stands
        if w.live_seq is None or seq > w.live_seq:
            # Past the live stream's head: the rest is still on its way over the live connection
            # (applied when it arrives), or numbers the engine never reached. Either way the
            # replay has given what it can; a new dealer drops the rest of its answer.
            self._finish_replay(w, drop_rest=True)
            return
        if seq > expected:
            # The engine's buffer does not reach back to what we missed: that history is lost.
            self._replay_lost(w)
        w.replay_deadline = time.monotonic() + self._replay_timeout  # progress
        self._apply(w, seq, payload)

    def _replay_lost(self, w: _Worker) -> None:
        if not w.replay_lost:
            w.replay_lost = True
            with self._lock:
                w.replay_failures += 1
        self._reset(w)

    def _finish_replay(self, w: _Worker, drop_rest: bool = False) -> None:
        """The replay has given what it can (its end marker, or ``drop_rest``: it went past the
        live stream's head, and a new dealer drops the rest of its answer)."""
        gap_end = w.pending[0][0]  # never empty: a replay starts with the message showing the gap
        if w.expected is None or w.expected < gap_end:
            # The replay ended before the batch that showed the gap: what was missed is lost.
            self._replay_failed(w, counted=w.replay_lost)
            return
        if drop_rest:
            self._replace_dealer(w)
        w.replaying = False
        pending = self._take_pending(w)
        previous = -1
        for i, (seq, payload) in enumerate(pending):
            if w.replaying:  # a new gap inside the buffered messages started another replay
                rest = pending[i:]
                w.pending.extend(rest)
                w.pending_bytes += sum(len(p) for _, p in rest)
                return
            if seq < previous:  # the engine restarted while we were replaying
                with self._lock:
                    w.restarts += 1
                self._reset(w)
            previous = seq
            if w.expected is not None and seq < w.expected:
                continue  # the replay already delivered it
            self._on_live(w, seq, payload)
        if not w.replaying:
            self._notify(w, False)

    def _replay_failed(self, w: _Worker, counted: bool = False) -> None:
        """The replay cannot be completed (timeout, send failure, buffer overflow, a gap left
        unfilled): clear the worker and follow the live stream from the messages buffered
        meanwhile. ``counted``: this replay's failure is already in ``replay_failures``."""
        w.replaying = False
        if not counted:
            with self._lock:
                w.replay_failures += 1
        if w.dealer is not None:
            self._replace_dealer(w)
        self._reset(w)
        pending = self._take_pending(w)
        for seq, payload in pending:
            self._on_live(w, seq, payload, catch_up=False)
        if not w.replaying:
            self._notify(w, False)
