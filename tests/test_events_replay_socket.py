"""A replay DEALER that ZMQ cannot make mid-run (out of sockets or file descriptors), at each place
the subscriber replaces one: a replay timed out (``_replay_failed``), a replay past the live head
(``_finish_replay``), a disconnect during a replay (``_on_monitor``).

Over real ZMQ sockets; the one fault a real engine cannot be made to show — ``Context.socket``
refusing a DEALER — is injected by a wrapper around the subscriber's real context. Each case
ends with the worker followed without replay (fresh, never left stale, its index exact or
cleared), the failures counted and logged once, and a new DEALER made by the retry serving the
next gap's replay.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

import zmq
from kvroute import PrefixIndex
from kvroute.events import KvEventSubscriber
from support.events_engine import own
from support.helpers import start_raising, wait_for
from test_events_replay import (
    chain,
    counters,
    freshness,
    open_gap,
    rebind,
    subscriber,
)


class RefusingDealers:
    """The subscriber's ZMQ context, refusing its next ``refusals`` DEALERs as a process out of
    file descriptors does (``EMFILE``); every other call goes to the real context."""

    def __init__(self, ctx: zmq.Context, refusals: int) -> None:
        self.ctx = ctx
        self.refusals = refusals
        self.made = 0  # DEALERs made since
        self.lock = threading.Lock()

    def socket(self, kind: int):
        if kind == zmq.DEALER:
            with self.lock:
                if self.refusals:
                    self.refusals -= 1
                    raise zmq.ZMQError(errno.EMFILE)
                self.made += 1
        return self.ctx.socket(kind)

    def __getattr__(self, name: str):
        return getattr(self.ctx, name)


def refuse_dealers(sub: KvEventSubscriber, refusals: int) -> RefusingDealers:
    ctx = RefusingDealers(sub._ctx, refusals)
    sub._ctx = ctx  # read by the poll thread each time it makes a DEALER
    return ctx


def replays_again(sub, engine, payloads, ctx: RefusingDealers, caplog) -> dict:
    """After three refused DEALERs (the first refused where one was replaced, two retries): the
    third retry makes one, the first failure and the recovery logged, and the next gap is
    replayed over it; returns the stats at the end."""
    wait_for(lambda: ctx.made == 1, "the retry's DEALER")
    wait_for(lambda: sub._workers["w"].dealer is not None, "the DEALER in use")
    # logged by the poll thread after it put the DEALER in use
    wait_for(lambda: "made again" in caplog.text, "the recovery's log line")
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvroute.events"]
    assert records == [
        (
            logging.ERROR,
            f"worker w: cannot make its replay socket ({zmq.ZMQError(errno.EMFILE)}): until one "
            "is made, a gap in its events clears it instead of being replayed; retrying every 1 s",
        ),
        (logging.INFO, "worker w: its replay socket is made again"),
    ]
    assert sub.stats()["w"]["replay_socket_failures"] == 3
    seq = engine.publish(payloads[engine.seq], send=False)  # lost: a gap
    engine.publish(payloads[engine.seq])
    identity, start = engine.take_replay_request()
    assert start == seq
    engine.answer(identity, engine.buffered_from(start))
    wait_for(lambda: sub.stats()["w"]["last_seq"] == seq + 1, "the replayed gap")
    wait_for(lambda: not sub.is_stale("w"), "the replay's end")
    return sub.stats()["w"]


def test_a_replay_timed_out_goes_on_without_a_dealer_zmq_refuses(engines, caplog):
    caplog.set_level(logging.INFO, logger="kvroute.events")
    engine, router, tokens, payloads = chain(engines, 6)
    with subscriber(router, engine, replay_timeout=0.2) as sub:
        ctx = refuse_dealers(sub, 3)
        open_gap(sub, engine, payloads, sent=2)  # 1 lost; 2 shows the gap, 3 buffered
        engine.take_replay_request()  # never answered: the replay times out
        wait_for(lambda: sub.stats()["w"]["replay_failures"] == 1, "the replay to time out")
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 3, "the buffered batches followed")
        s = sub.stats()["w"]
        assert counters(s) == (1, 1, 1, 1, 0)
        assert (s["stale"], s["errors"], s["pending"]) == (False, 0, 0)
        assert freshness(router, "w") == 1.0
        assert router.index.match(own(tokens)) == {}  # cleared: 2 and 3 chain on the lost 1
        sub._replay_timeout = 60.0  # the next replay is answered, however loaded the machine
        s = replays_again(sub, engine, payloads, ctx, caplog)
    assert counters(s) == (2, 2, 1, 1, 0)
    assert (s["stale"], s["errors"], s["replay_socket_failures"]) == (False, 0, 3)
    assert freshness(router, "w") == 1.0


def test_a_replay_past_the_live_head_goes_on_without_a_dealer_zmq_refuses(engines, caplog):
    caplog.set_level(logging.INFO, logger="kvroute.events")
    engine, router, tokens, payloads = chain(engines, 6)
    with subscriber(router, engine) as sub:
        ctx = refuse_dealers(sub, 3)
        open_gap(sub, engine, payloads, sent=1)  # 1 lost, 2 shows the gap: live head 2
        identity, start = engine.take_replay_request()
        engine.publish(payloads[3], send=False)  # published, not yet delivered live
        engine.answer(identity, engine.buffered_from(start), end=False)  # 1-3: past the head
        wait_for(lambda: sub.stats()["w"]["replay_socket_failures"] >= 1, "the refused DEALER")
        wait_for(lambda: not sub.is_stale("w"), "the replay to end at seq 3")
        s = sub.stats()["w"]
        assert counters(s) == (1, 1, 0, 0, 0)
        assert (s["errors"], s["pending"], s["last_seq"]) == (0, 0, 2)
        assert router.index.match(own(tokens)) == {"w": 3}  # exact: 0-2 (3 not yet live)
        engine.send_buffered(3)
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 3, "seq 3 live")
        s = replays_again(sub, engine, payloads, ctx, caplog)
    assert counters(s) == (2, 2, 0, 0, 0)
    assert (s["stale"], s["errors"], s["skipped_unknown_parent"]) == (False, 0, 0)
    assert router.index.match(own(tokens)) == {"w": 6}


def test_a_disconnect_during_a_replay_goes_on_without_a_dealer_zmq_refuses(engines, caplog):
    caplog.set_level(logging.INFO, logger="kvroute.events")
    engine, router, tokens, payloads = chain(engines, 6)
    with subscriber(router, engine) as sub:
        ctx = refuse_dealers(sub, 3)
        open_gap(sub, engine, payloads)
        engine.take_replay_request()
        wait_for(lambda: sub.stats()["w"]["pending"] == 4, "the buffered batches")
        engine.pub.close(linger=0)
        wait_for(lambda: sub.stats()["w"]["disconnects"] == 1, "the disconnect")
        s = sub.stats()["w"]
        assert (s["stale"], s["pending"], s["resets"], s["errors"]) == (False, 0, 1, 0)
        assert s["replay_socket_failures"] >= 1
        assert router.index.match(own(tokens)) == {}
        rebind(engine)  # the engine is back (a new process: numbering from 0)
        engine.restart()
        engine.publish(payloads[0])
        wait_for(lambda: sub.stats()["w"]["batches"] == 2, "the new engine's seq 0")
        s = replays_again(sub, engine, payloads, ctx, caplog)
    assert counters(s) == (2, 2, 0, 1, 0)
    assert (s["stale"], s["errors"]) == (False, 0)
    assert router.index.match(own(tokens)) == {"w": 3}  # the new engine's 0-2, 1 replayed


def test_a_refused_dealer_is_tried_again_a_second_later(monkeypatch):
    """Each refusal sets the next try ``_DEALER_RETRY`` (1 s) ahead, and the poll wakes for it;
    once made, no try is pending. On a clock that stands still, without the poll thread."""
    now = 1000.0
    monkeypatch.setattr(time, "monotonic", lambda: now)
    sub = KvEventSubscriber(
        PrefixIndex(), {"w": "tcp://127.0.0.1:1"}, replay={"w": "tcp://127.0.0.1:2"}
    )
    sub._ctx = RefusingDealers(zmq.Context(), 2)
    sub._poller = zmq.Poller()
    w = sub._workers["w"]
    try:
        for failures in (1, 2):
            sub._replace_dealer(w)
            assert (w.dealer, w.dealer_retry) == (None, now + 1.0)
            assert sub.stats()["w"]["replay_socket_failures"] == failures
            assert sub._poll_timeout() == 1001  # until the try, rounded up to the next ms
            now += 0.25
        sub._replace_dealer(w)
        assert w.dealer is not None and w.dealer_retry is None
        assert sub._poll_timeout() == 1000  # nothing to wait for
    finally:
        if w.dealer is not None:
            w.dealer.close(linger=0)
        sub._ctx.term()


def test_a_start_whose_replay_endpoint_is_refused_raises_and_leaves_no_socket():
    """A DEALER made but refused its endpoint is closed before the error reaches ``start``: a
    socket left open would make the context's ``term`` in ``start``'s clean-up wait forever."""
    sub = KvEventSubscriber(
        PrefixIndex(), {"w": "tcp://127.0.0.1:1"}, replay={"w": "not-a-transport://x"}
    )
    raised = start_raising(sub)
    assert [type(e) for e in raised] == [zmq.ZMQError] and not sub.running
    assert (sub._workers["w"].dealer, sub._owner) == (None, {})
