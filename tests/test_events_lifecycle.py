"""KvEventSubscriber's lifecycle at its edges, over real ZMQ sockets: a ``stop`` whose poll thread
is stuck, a ``start`` that fails part-way. The rest of the lifecycle (clean stop, restart, async
with): tests/test_events_subscriber.py.
"""

from __future__ import annotations

import threading

import zmq
from kvroute import PrefixIndex
from kvroute.events import KvEventSubscriber
from support.events_engine import stored


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
    raised: list[BaseException] = []

    def start():
        try:
            sub.start()
        except BaseException as e:
            raised.append(e)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    starter.join(10)
    assert not starter.is_alive()  # start returned
    assert [type(e) for e in raised] == [zmq.ZMQError] and not sub.running
    assert all((w.sub, w.monitor, w.dealer) == (None,) * 3 for w in sub._workers.values())
