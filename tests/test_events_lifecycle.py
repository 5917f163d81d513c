"""KvEventSubscriber's lifecycle at its edges, over real ZMQ sockets: a ``stop`` whose poll thread
is stuck, a ``start`` that fails part-way. The rest of the lifecycle (clean stop, restart, async
with): tests/test_events_subscriber.py.
"""

from __future__ import annotations

import errno
import logging
import threading

import zmq
from kvroute import PrefixIndex
from kvroute.events import KvEventSubscriber
from support.events_engine import stored
from support.helpers import start_raising, wait_for


def test_stop_waits_at_most_its_timeout_for_a_stuck_poll_thread(engines):
    """``stop(timeout)`` joins the poll thread for at most ``timeout`` seconds: a thread stuck in
    its applier (an event sink that blocks) does not hang the caller, and the ZMQ context is
    left to it, not terminated under it. Once unstuck, the thread sees the stop and closes its
    sockets."""
    engine = engines(replay=False)
    entered, release = threading.Event(), threading.Event()

    class Blocking:
        def apply(self, worker, payload):
            entered.set()
            release.wait()

        def clear(self, worker):
            pass

        def stats(self):
            return {}

    sub = KvEventSubscriber(Blocking(), {"w": engine.endpoint}).start()
    thread, ctx = sub._thread, sub._ctx
    try:
        engine.wait_subscriber()
        engine.publish(stored([1], None, range(16)))
        assert entered.wait(10)
        stopper = threading.Thread(target=sub.stop, kwargs={"timeout": 0.1}, daemon=True)
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive()  # stop returned while the poll thread is stuck
        assert thread.is_alive() and not sub.running and not ctx.closed
    finally:
        release.set()
    thread.join(10)
    assert not thread.is_alive()
    ctx.term()


def test_a_start_that_fails_at_the_first_worker_raises_and_leaves_no_socket():
    """A bad endpoint fails ``start()`` whichever worker has it: the sockets made so far are
    closed, those of the workers not reached yet are left alone, and the error reaches the
    caller (the poll thread's clean-up must not fail on them, or ``start`` would wait forever)."""
    endpoints = {"a": "not-a-transport://x", "b": "tcp://127.0.0.1:1", "c": "tcp://127.0.0.1:2"}
    sub = KvEventSubscriber(PrefixIndex(), endpoints, replay={"b": "tcp://127.0.0.1:3"})
    raised = start_raising(sub)
    assert [type(e) for e in raised] == [zmq.ZMQError] and not sub.running
    assert all((w.sub, w.monitor, w.dealer) == (None,) * 3 for w in sub._workers.values())


class _JoinRecorded:
    """The poll thread, with the timeouts ``join`` is called with recorded."""

    def __init__(self, real: threading.Thread) -> None:
        self.real, self.joins = real, []

    def is_alive(self) -> bool:
        return self.real.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)
        self.real.join(timeout)


def test_stop_waits_five_seconds_by_default_for_the_poll_thread():
    """The documented default ``timeout`` of ``stop`` (5 s) is what the poll thread is joined
    with, read from the join itself; a timeout given is passed as is."""
    for kwargs, expected in (({}, [5.0]), ({"timeout": 0.25}, [0.25])):
        sub = KvEventSubscriber(PrefixIndex(), {"w": "tcp://127.0.0.1:1"}).start()
        ctx = sub._ctx
        thread = sub._thread = _JoinRecorded(sub._thread)
        sub.stop(**kwargs)
        assert thread.joins == expected
        assert not thread.is_alive() and not sub.running and ctx.closed


class _RefusingPairs:
    """pyzmq whose contexts refuse their first PAIR socket (the poll thread's end of the stop
    pair, the first socket ``start`` makes) as a process out of file descriptors does."""

    class Context:
        def __init__(self) -> None:
            self.ctx, self.refused = zmq.Context(), False

        def socket(self, kind: int):
            if kind == zmq.PAIR and not self.refused:
                self.refused = True
                raise zmq.ZMQError(errno.EMFILE)
            return self.ctx.socket(kind)

        def __getattr__(self, name: str):
            return getattr(self.ctx, name)

    def __getattr__(self, name: str):
        return getattr(zmq, name)


def test_a_start_that_cannot_make_its_stop_socket_raises_and_can_start_again(engines):
    """``start()`` failing at its very first socket (the poll thread's stop PAIR, before any
    worker's): the error reaches the caller — the poll thread's clean-up has no stop socket to
    close, and must not fail on it, or ``start`` would wait forever — the context is
    terminated, and the next ``start`` runs as usual."""
    engine = engines(replay=False)
    sub = KvEventSubscriber(PrefixIndex(), {"w": engine.endpoint})
    sub._zmq = _RefusingPairs()
    raised = start_raising(sub)
    assert [str(e) for e in raised] == [str(zmq.ZMQError(errno.EMFILE))] and not sub.running
    assert sub._ctx is None and sub._workers["w"].sub is None
    sub._zmq = zmq
    with sub:
        engine.wait_subscriber()
        seq = engine.publish(stored([1], None, range(16)))
        wait_for(lambda: sub.stats()["w"]["last_seq"] == seq, "the batch applied")


def test_a_clean_stop_leaves_every_worker_fresh_and_logs_nothing(engines, caplog):
    """``stop()`` ends the poll thread as asked: no worker is marked stale (that is for a
    thread ended by an error, tests/test_events_membership.py), the freshness sink is not
    called, and nothing is logged."""
    caplog.set_level(logging.INFO, logger="kvroute.events")
    engine = engines(replay=False)
    marked: list[tuple[str, str]] = []

    class Freshness:
        def mark_stale(self, worker):
            marked.append(("stale", worker))

        def mark_fresh(self, worker):
            marked.append(("fresh", worker))

    sub = KvEventSubscriber(PrefixIndex(), {"w": engine.endpoint}, freshness=Freshness())
    with sub:
        engine.wait_subscriber()
        seq = engine.publish(stored([1], None, range(16)))
        wait_for(lambda: sub.stats()["w"]["last_seq"] == seq, "the batch applied")
    assert not sub.running and not sub.is_stale("w") and not sub.stats()["w"]["stale"]
    assert marked == []
    assert [r for r in caplog.records if r.name == "kvroute.events"] == []
