"""KvEventSubscriber's workers joining and leaving (``add_worker``, ``remove_worker``), while
running and while stopped, over real ZMQ sockets: the other workers keep their sockets and
sequence state, a worker that leaves is forgotten (blocks, counters, staleness)."""

from __future__ import annotations

import logging
import re
import socket
import threading

import pytest
import zmq
from kvroute import PrefixIndex
from kvroute import _events_membership as membership
from kvroute.events import KvEventSubscriber
from support.events_engine import chain_payloads, own, stored
from support.helpers import wait_for


def batch(i: int) -> bytes:
    return stored([100 + i], None, range(16 * i, 16 * i + 16))


def blocks(index: PrefixIndex, worker: str) -> int:
    return index.num_blocks(worker) if worker in index.workers else 0


def test_workers_join_and_leave_a_running_subscriber_the_others_untouched(engines):
    a, b, c = engines(replay=False), engines(replay=False), engines(replay=False)
    index = PrefixIndex()
    sub = KvEventSubscriber(index, {"a": a.endpoint}).start()
    try:
        a.wait_subscriber()
        a.publish(batch(0))
        wait_for(lambda: blocks(index, "a") == 1, "a's first batch")

        sub.add_worker("b", b.endpoint)
        b.wait_subscriber()
        b.publish(batch(1))
        b.publish(batch(2))
        wait_for(lambda: blocks(index, "b") == 2, "b's batches")
        assert sub.workers == ["a", "b"] and sub.stats()["b"]["batches"] == 2
        a.publish(batch(3))
        wait_for(lambda: blocks(index, "a") == 2, "a's second batch")

        sub.remove_worker("b")
        assert sub.workers == ["a"] and "b" not in sub.stats()
        assert blocks(index, "b") == 0  # what it held is forgotten with it
        assert sub.applier.workers == ["a"] and "b" not in sub.applier.stats()  # counters too
        seen: list[bytes] = []
        wait_for(
            lambda: seen.extend(b.subscriptions()) or b"\x00" in [m[:1] for m in seen],
            "b's subscriber to leave",
        )
        with pytest.raises(KeyError, match="not subscribed"):
            sub.remove_worker("b")
        with pytest.raises(KeyError, match="subscribed already"):
            sub.add_worker("a", c.endpoint)
        with pytest.raises(zmq.ZMQError):
            sub.add_worker("c", "not-a-transport://x")
        assert sub.workers == ["a"]

        sub.add_worker("c", c.endpoint)  # a name refused before is free
        c.wait_subscriber()
        c.publish(batch(4))
        a.publish(batch(5))
        wait_for(lambda: blocks(index, "c") == 1 and blocks(index, "a") == 3, "c's and a's")
        row = sub.stats()["a"]
        assert (row["batches"], row["gaps"], row["resets"], row["last_seq"]) == (3, 0, 0, 2)
        assert a.subscriptions() == []  # a's subscriber never left, none joined
    finally:
        sub.stop()


def test_workers_join_and_leave_a_stopped_subscriber(engines):
    a, b = engines(replay=False), engines(replay=False)
    index = PrefixIndex()
    sub = KvEventSubscriber(index, {"a": a.endpoint})
    sub.add_worker("b", b.endpoint)  # before start: subscribed at start
    sub.remove_worker("a")
    assert sub.workers == ["b"]
    with sub:
        b.wait_subscriber()
        b.publish(batch(0))
        wait_for(lambda: blocks(index, "b") == 1, "b's batch")
    sub.remove_worker("b")  # after stop: forgotten at once
    assert sub.workers == [] and blocks(index, "b") == 0
    assert sub.applier.workers == [] and sub.applier.stats() == {}
    sub.add_worker("a", a.endpoint)
    with sub:
        a.wait_subscriber()
        a.publish(batch(1))
        wait_for(lambda: blocks(index, "a") == 1, "a's batch")


def test_a_worker_that_leaves_while_waiting_for_a_replay_is_marked_fresh(engines):
    e = engines(answer_replays=False)
    marks: list[tuple[str, str]] = []

    class Sink:
        def mark_stale(self, worker: str) -> None:
            marks.append(("stale", worker))

        def mark_fresh(self, worker: str) -> None:
            marks.append(("fresh", worker))

    index = PrefixIndex()
    sub = KvEventSubscriber(
        index, {"w": e.endpoint}, replay={"w": e.replay_endpoint}, freshness=Sink()
    ).start()
    try:
        e.wait_subscriber()
        e.publish(batch(0))
        e.publish(batch(1), send=False)  # lost on the way: the next shows a gap
        e.publish(batch(2))
        e.take_replay_request()  # never answered: the worker stays stale
        assert sub.is_stale("w") and marks == [("stale", "w")]
        sub.remove_worker("w")
        assert marks == [("stale", "w"), ("fresh", "w")]
        assert blocks(index, "w") == 0 and sub.workers == []
    finally:
        sub.stop()


def test_add_worker_refuses_each_argument_of_the_wrong_type_whole():
    """Each of ``name``, ``endpoint`` and ``replay`` checked alone, the message whole; nothing is
    added."""
    sub = KvEventSubscriber(PrefixIndex(), {"a": "tcp://127.0.0.1:1"})
    cases = [
        (
            (5, "tcp://127.0.0.1:2"),
            {},
            "worker and endpoint must be str, got 5: 'tcp://127.0.0.1:2'",
        ),
        (("b", None), {}, "worker and endpoint must be str, got 'b': None"),
        (("b", "tcp://127.0.0.1:2"), {"replay": 7}, "replay must be a str or None, got 7"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            sub.add_worker(*args, **kwargs)
    assert sub.workers == ["a"]


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("running", [True, False], ids=["running", "before-start"])
def test_every_add_worker_argument_reaches_the_new_worker(engines, running):
    """``bind=True``: the new worker's SUB socket binds its endpoint and an engine that connects
    is heard; ``replay``: its gaps are filled by a catch-up from that endpoint. Added while
    running (the poll thread opens its sockets) and before ``start()``."""
    engine = engines()  # binds its live endpoint and its replay ROUTER
    bound = free_endpoint()
    index = PrefixIndex()
    tokens = list(range(16 * 3))
    payloads = chain_payloads(tokens, 3)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    sub = KvEventSubscriber(index, {})
    try:
        if running:
            sub.start()
        sub.add_worker("b", bound, bind=True)
        sub.add_worker("r", engine.endpoint, replay=engine.replay_endpoint)
        if not running:
            sub.start()
        pub.connect(bound)  # only a bound subscriber hears an engine that connects
        assert pub.poll(10_000), "the bound worker's subscription never arrived"
        assert pub.recv()[:1] == b"\x01"
        pub.send_multipart([b"", (0).to_bytes(8, "big"), payloads[0]])
        engine.wait_subscriber()
        engine.publish(payloads[0])
        engine.publish(payloads[1], send=False)  # lost: the replay endpoint gives it back
        engine.publish(payloads[2])
        wait_for(lambda: sub.stats()["r"]["replays"] == 1 and not sub.is_stale("r"), "r's replay")
        wait_for(lambda: sub.stats()["b"]["last_seq"] == 0, "b's batch")
        stats = sub.stats()
    finally:
        sub.stop()
        pub.close(linger=0)
        ctx.term()
    assert (stats["r"]["replay_endpoint"], stats["b"]["replay_endpoint"]) == (
        engine.replay_endpoint,
        None,
    )
    assert (stats["r"]["gaps"], stats["r"]["resets"]) == (1, 0)
    assert index.match(own(tokens)) == {"r": 3, "b": 1}


class Blocking:
    """An event sink whose ``apply`` holds the poll thread until ``release`` (at most 30 s: a
    change waited for without bound then comes back without its ``TimeoutError``)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.cleared: list[str] = []

    def apply(self, worker, payload):
        self.entered.set()
        self.release.wait(30)

    def clear(self, worker):
        self.cleared.append(worker)

    def stats(self):
        return {}


def test_a_change_the_stuck_poll_thread_has_not_made_in_time_raises_and_is_made_once_it_frees(
    engines,
):
    """``timeout`` bounds the wait for the poll thread (stuck in an event sink's ``apply``):
    ``TimeoutError`` with its whole message, for a join and for a leave; once freed the thread
    makes both — the joining worker's socket opened, the leaving one's sink state cleared (a
    sink has no ``remove_worker``: its ``clear``)."""
    w, y, x = engines(replay=False), engines(replay=False), engines(replay=False)
    sink = Blocking()
    sub = KvEventSubscriber(sink, {"w": w.endpoint, "y": y.endpoint}).start()
    try:
        w.wait_subscriber()
        w.publish(batch(0))
        assert sink.entered.wait(10)
        for call, name, timeout in (
            (lambda: sub.add_worker("x", x.endpoint, timeout=0.2), "x", "0.2"),
            (lambda: sub.remove_worker("y", timeout=0.3), "y", "0.3"),
        ):
            message = (
                f"the KV-event poll thread did not make the change of worker {name!r} within "
                f"{timeout} s (it is stuck in the applier; the change is made once it frees)"
            )
            with pytest.raises(TimeoutError, match=f"^{re.escape(message)}$"):
                call()
        assert sub.workers == ["w", "y"] and sink.cleared == []
        sink.release.set()
        wait_for(lambda: sub.workers == ["w", "x"], "the queued changes")
        x.wait_subscriber()
        assert sink.cleared == ["y"]
    finally:
        sink.release.set()
        sub.stop()


def test_changes_after_stop_are_made_by_their_caller_while_the_thread_is_still_stuck(engines):
    """``stop`` that returned before its stuck poll thread ended: later joins and leaves are
    made at once by their caller (no socket), never queued for that thread nor sent to its
    closed wake-up socket."""
    w, x = engines(replay=False), engines(replay=False)
    sink = Blocking()
    sub = KvEventSubscriber(sink, {"w": w.endpoint}).start()
    thread, ctx = sub._thread, sub._ctx
    try:
        w.wait_subscriber()
        w.publish(batch(0))
        assert sink.entered.wait(10)
        sub.stop(timeout=0.1)
        assert thread.is_alive() and not sub.running
        sub.add_worker("x", x.endpoint, timeout=0.2)
        sub.remove_worker("w", timeout=0.2)
        assert sub.workers == ["x"] and sink.cleared == ["w"]
    finally:
        sink.release.set()
    thread.join(10)
    assert not thread.is_alive()
    ctx.term()  # left to the stuck thread by stop


def test_add_and_remove_worker_wait_ten_seconds_by_default(monkeypatch):
    """The documented default ``timeout`` (10 s) is what a change is waited for, read from the
    wait itself."""
    waited: list[float | None] = []

    class Recording(threading.Event):
        def wait(self, timeout=None):
            waited.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(membership, "threading", type("T", (), {"Event": Recording}))
    sub = KvEventSubscriber(PrefixIndex(), {})
    sub.add_worker("a", "tcp://127.0.0.1:1")
    sub.remove_worker("a")
    assert waited == [10.0, 10.0] and sub.workers == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_changes_queued_when_the_poll_thread_dies_are_made_without_sockets(engines, caplog):
    """A poll thread ended by an error its handlers do not catch (a ``BaseException`` from the
    sink) with changes still queued: its clean-up makes them as a stopped subscriber does —
    the joining worker added without a socket, the leaving one removed and cleared — says so
    in one error line, and leaves no socket open (the ZMQ context terminates)."""
    caplog.set_level(logging.INFO, logger="kvroute.events")
    w, x = engines(replay=False), engines(replay=False)

    class Dying(Blocking):
        def apply(self, worker, payload):
            super().apply(worker, payload)
            raise SystemExit("the sink ends the thread")

    sink = Dying()
    sub = KvEventSubscriber(sink, {"w": w.endpoint}).start()
    thread, ctx = sub._thread, sub._ctx
    try:
        w.wait_subscriber()
        w.publish(batch(0))
        assert sink.entered.wait(10)
        with pytest.raises(TimeoutError):
            sub.add_worker("x", x.endpoint, timeout=0.1)
        with pytest.raises(TimeoutError):
            sub.remove_worker("w", timeout=0.1)
    finally:
        sink.release.set()
    thread.join(10)
    assert not thread.is_alive()
    assert sub.workers == ["x"] and sink.cleared == ["w"]
    assert all((v.sub, v.monitor, v.dealer) == (None,) * 3 for v in sub._workers.values())
    assert sub.stats()["x"]["stale"]  # no event reaches the index any more: said so
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvroute.events"] == [
        (logging.ERROR, "KV event subscriber: the poll thread ended unasked; workers stale")
    ]
    # stop() returns (it blocked sending to the dead thread's closed end), the context ends —
    # also when the thread dies between stop's look at it and its send: a double of the thread
    # (alive at the look, gone at the send: a race the real one shows only by chance). The
    # send's error there (no peer: EAGAIN) is stop's own business, not raised to the caller.
    sub._thread = _AliveAtFirst(thread)
    raised: list[BaseException] = []

    def stop():
        try:
            sub.stop(timeout=5)
        except BaseException as e:
            raised.append(e)

    stopped = threading.Thread(target=stop, daemon=True)
    stopped.start()
    stopped.join(10)
    assert not stopped.is_alive() and raised == []
    assert sub._ctx is None and ctx.closed  # no socket left open: the context terminated
    assert x.subscriptions() == []  # x never had a subscriber


class _AliveAtFirst:
    """A thread that says it is alive once (then as the real, ended one)."""

    def __init__(self, real: threading.Thread) -> None:
        self.real, self.asked = real, 0

    def is_alive(self) -> bool:
        self.asked += 1
        return self.asked == 1 or self.real.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.real.join(timeout)


def test_a_worker_that_leaves_a_running_subscriber_is_taken_off_its_poller(engines):
    """Its SUB, monitor and replay DEALER are closed and unregistered: the poller holds only
    the stop socket and the sockets of the workers still subscribed, none closed (pyzmq polls a
    closed socket as fd 0: a poll that returns at once, a loop burning a core)."""
    a, b = engines(), engines()
    sub = KvEventSubscriber(
        PrefixIndex(),
        {"a": a.endpoint, "b": b.endpoint},
        replay={"a": a.replay_endpoint, "b": b.replay_endpoint},
    ).start()
    try:
        a.wait_subscriber()
        b.wait_subscriber()
        polled = [s for s, _ in sub._poller.sockets]
        assert len(polled) == 1 + 3 * 2  # the stop socket; each worker's SUB, monitor, DEALER
        sub.remove_worker("b")
        polled = [s for s, _ in sub._poller.sockets]
        assert len(polled) == 1 + 3 and not any(s.closed for s in polled)
    finally:
        sub.stop()
