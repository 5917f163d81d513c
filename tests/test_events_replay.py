"""KvEventSubscriber's replay of lost batches, over real ZMQ sockets on 127.0.0.1.

A gap in an engine's numbering is filled by a replay over a DEALER (support/events_engine.py's
engine answers like vLLM's ROUTER); the worker's index is then exactly what the engine holds.
Everything that can go wrong with a replay is played here, with the engine's answers sent by the
test at the moment that matters: the replay hands over batches the live stream has not delivered
yet (ZMQ orders each socket, not the two), does not reach back to the gap, ends before it,
stalls, repeats old numbers, claims numbers the engine never reached, the engine restarts during
it, or live messages pile up meanwhile. Each ends with the worker either exact or cleared — never
guessing — and following its live stream again. The freshness sink is a real
``Router(index="events")``: its freshness falls while a replay runs and recovers after.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from kvroute import Router
from kvroute.events import KvEventSubscriber
from support.events_engine import chain_payloads, own, stored
from support.helpers import wait_for

FAR = 3600.0  # seconds: a stale worker's freshness is ~0 by then, a fresh one's still 1


def freshness(router: Router, worker: str) -> float:
    return router.freshness(worker, now=time.monotonic() + FAR)


def events_router(*workers: str) -> Router:
    return Router(list(workers) or ["w"], index="events")


def subscriber(router, engine, **kw) -> KvEventSubscriber:
    kw.setdefault("replay_timeout", 60.0)  # only the tests of timeouts may time out, load or not
    return KvEventSubscriber(
        router, {"w": engine.endpoint}, replay={"w": engine.replay_endpoint}, **kw
    )


def start_with_seq0(sub, engine, payload) -> None:
    engine.wait_subscriber()
    engine.publish(payload)
    wait_for(lambda: sub.stats()["w"]["last_seq"] == 0, "seq 0")


def rebind(engine) -> None:
    """The engine's publisher is back on the same port (after ``engine.pub.close()``)."""
    engine.pub = engine.ctx.socket(zmq.XPUB)
    engine.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    engine.pub.bind(engine.endpoint)
    engine.wait_subscriber()


def counters(s) -> tuple:
    return (s["gaps"], s["replays"], s["replay_failures"], s["resets"], s["restarts"])


def chain(engines, blocks: int, *, first: int = 0, **engine_kw):
    """``(engine, router, tokens, payloads)``: an engine that answers replays only when the test
    says so (unless ``answer_replays=True``), a fresh events router for worker "w", and
    ``blocks`` chained blocks of tokens from ``first`` with their payloads (seq i stores
    block i)."""
    engine_kw.setdefault("answer_replays", False)
    tokens = list(range(first, first + 16 * blocks))
    return engines(**engine_kw), events_router(), tokens, chain_payloads(tokens, blocks)


def open_gap(sub, engine, payloads, *, lost: int = 1, sent: int | None = None) -> None:
    """Seq 0 is delivered, the next ``lost`` batches are published but lost, then ``sent`` more
    (default: all the rest) are delivered: the first of them shows the gap."""
    start_with_seq0(sub, engine, payloads[0])
    for p in payloads[1 : 1 + lost]:
        engine.publish(p, send=False)
    rest = payloads[1 + lost :]
    for p in rest if sent is None else rest[:sent]:
        engine.publish(p)


@pytest.mark.parametrize("new_form", [True, False])
def test_gap_is_replayed_over_a_dealer(engines, new_form):
    engine, router, tokens, payloads = chain(engines, 6, first=1000, new_replay_form=new_form)
    sub = subscriber(router, engine)
    with sub:
        start_with_seq0(sub, engine, payloads[0])
        assert freshness(router, "w") == 1.0
        engine.publish(payloads[1], send=False)  # lost: ZMQ dropped them
        engine.publish(payloads[2], send=False)
        for p in payloads[3:]:
            engine.publish(p)
        identity, start = engine.take_replay_request()
        assert engine.replay_requests[0][1:] == [b"", (1).to_bytes(8, "big")]  # [b"", start]
        wait_for(lambda: sub.stats()["w"]["pending"] == 3, "the live batches to be buffered")
        # During the replay: stale in the subscriber and in the router, nothing past the gap.
        assert sub.is_stale("w") and freshness(router, "w") < 0.01
        assert router.index.match(own(tokens)) == {"w": 1}
        assert sub.stats()["w"]["pending_bytes"] == sum(len(p) for p in payloads[3:])
        engine.answer(identity, engine.buffered_from(start))
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        s = sub.stats()["w"]
    assert freshness(router, "w") == 1.0
    assert router.index.match(own(tokens)) == {"w": 6}
    assert counters(s) == (1, 1, 0, 0, 0)
    assert (s["batches"], s["skipped_unknown_parent"], s["errors"]) == (6, 0, 0)
    assert (s["pending"], s["pending_bytes"], s["malformed"]) == (0, 0, 0)
    assert s["stale"] is False


def test_a_replay_ahead_of_the_live_stream_is_not_a_restart(engines):
    """The replay can give batches that are still on their way over the live connection: they
    arrive after the replay and are not a restart (under load this once cleared the worker and
    replayed everything again)."""
    engine, router, tokens, payloads = chain(engines, 6)
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads, sent=1)  # 1 lost, 2 shows the gap
        engine.publish(payloads[3], send=False)  # published, not yet delivered live
        engine.publish(payloads[4], send=False)
        identity, start = engine.take_replay_request()
        engine.answer(identity, engine.buffered_from(start))  # 1, 2, 3, 4 and the end marker
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        engine.send_buffered(3)  # the live stream catches up
        engine.send_buffered(4)
        engine.publish(payloads[5])
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 5 and not sub.is_stale("w"), "seq 5")
        s = sub.stats()["w"]
    assert router.index.match(own(tokens)) == {"w": 6}
    assert counters(s) == (1, 1, 0, 0, 0)
    assert (s["batches"], s["errors"]) == (6, 0)
    assert freshness(router, "w") == 1.0


def test_a_replay_that_does_not_reach_back_clears_the_worker(engines):
    """The engine's replay buffer starts after the gap: what was lost stays lost, so the worker
    is cleared (its later batches chain on the lost one and are skipped)."""
    engine, router, tokens, payloads = chain(engines, 4)
    with subscriber(router, engine) as sub:
        start_with_seq0(sub, engine, payloads[0])
        assert router.index.match(own(tokens)) == {"w": 1}
        engine.publish(payloads[1], send=False)
        engine.publish(payloads[2])
        engine.publish(payloads[3])
        identity, start = engine.take_replay_request()
        assert start == 1
        wait_for(lambda: sub.stats()["w"]["pending"] == 2, "two buffered batches")
        engine.answer(identity, engine.buffered_from(2))  # seq 1 fell out of its buffer
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        s = sub.stats()["w"]
    assert router.index.match(own(tokens)) == {}
    assert counters(s) == (1, 1, 1, 1, 0)
    assert (s["skipped_unknown_parent"], s["errors"]) == (2, 0)
    assert freshness(router, "w") == 1.0


def test_a_replay_that_ends_before_the_gap_clears_the_worker(engines):
    """An end marker with nothing before it (the engine's buffer is empty): the gap stays
    unfilled, the worker is cleared and follows its live stream — no replay after replay."""
    engine = engines(answer_replays=False)
    router = events_router()
    tokens = list(range(16 * 3))
    payloads = [*chain_payloads(tokens, 2), stored([77], None, tokens[32:48])]
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads)  # 2 is a new chain: applied once the worker follows live
        identity, _ = engine.take_replay_request()
        engine.answer(identity, [])
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        s = sub.stats()["w"]
    assert router.index.match(own(tokens[:32])) == {}
    assert router.index.match(own(tokens[32:48])) == {"w": 1}
    assert counters(s) == (1, 1, 1, 1, 0)
    assert len(engine.replay_requests) == 1 and s["errors"] == 0


def test_a_restart_seen_during_a_replay_clears_the_worker(engines):
    """The replay fills the gap, but the buffered live messages show the engine restarted
    meanwhile (its numbering went back): its old blocks are gone, its new ones are indexed. Each
    restart counts, the one seen on the live stream before and the one seen during the replay."""
    engine, router, tokens, payloads = chain(engines, 3)
    fresh_tokens = list(range(5000, 5016))
    with subscriber(router, engine) as sub:
        start_with_seq0(sub, engine, payloads[0])
        engine.restart()
        engine.publish(payloads[0])  # a restart on the live stream: seq 0 again
        wait_for(lambda: sub.stats()["w"]["restarts"] == 1, "the first restart")
        engine.publish(payloads[1], send=False)
        engine.publish(payloads[2])
        identity, start = engine.take_replay_request()
        engine.answer(identity, engine.buffered_from(start)[:1], end=False)  # seq 1
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 1, "the replayed seq 1")
        assert router.index.match(own(tokens)) == {"w": 2}
        engine.restart()
        engine.publish(stored([9], None, fresh_tokens))  # the new process's seq 0
        wait_for(lambda: sub.stats()["w"]["pending"] == 2, "the restarted engine's batch")
        engine.answer(identity, [])
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        s = sub.stats()["w"]
    assert router.index.match(own(tokens)) == {}
    assert router.index.match(own(fresh_tokens)) == {"w": 1}
    assert counters(s) == (1, 1, 0, 2, 2)
    assert (s["last_seq"], s["errors"]) == (0, 0)


def test_a_replay_repeating_old_numbers_times_out(engines):
    """Only progress extends a replay's deadline: an endpoint repeating a number already applied
    cannot keep the worker stale (issue 14 item 7)."""
    engine, router, tokens, payloads = chain(engines, 3)
    done = threading.Event()
    with subscriber(router, engine, replay_timeout=0.5) as sub:
        open_gap(sub, engine, payloads)
        identity, _ = engine.take_replay_request()

        def repeat():
            while not done.is_set():
                engine.answer(identity, [(0, payloads[0])], end=False)
                done.wait(0.02)

        repeater = threading.Thread(target=repeat)
        repeater.start()
        try:
            wait_for(lambda: sub.stats()["w"]["replay_failures"] == 1, "the replay to time out")
        finally:
            done.set()
            repeater.join()
        wait_for(lambda: not sub.is_stale("w"), "the worker to follow its live stream")
        s = sub.stats()["w"]
    assert router.index.match(own(tokens)) == {}
    assert counters(s) == (1, 1, 1, 1, 0)
    assert freshness(router, "w") == 1.0


def test_a_replay_claiming_numbers_never_reached_is_not_believed(engines):
    """A replay answering seq 2**64-2 (past anything the live stream has numbered): not applied,
    the gap stays unfilled and the worker is cleared — and the buffered and later live batches
    are applied, not dropped as "already delivered" (issue 14 item 7)."""
    engine = engines(answer_replays=False)
    router = events_router()
    tokens = list(range(16 * 5))
    blocks = [tokens[16 * i : 16 * i + 16] for i in range(5)]
    payloads = chain_payloads(tokens, 2) + [stored([50 + i], None, blocks[i]) for i in (2, 3, 4)]
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads, sent=2)
        identity, _ = engine.take_replay_request()
        wait_for(lambda: sub.stats()["w"]["pending"] == 2, "two buffered batches")
        engine.answer(identity, [(2**64 - 2, payloads[1])])
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        engine.publish(payloads[4])
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 4, "seq 4")
        s = sub.stats()["w"]
    assert router.index.match(own(blocks[0])) == {}
    for i in (2, 3, 4):
        assert router.index.match(own(blocks[i])) == {"w": 1}, i
    assert counters(s) == (1, 1, 1, 1, 0)
    assert s["errors"] == 0


def test_live_messages_buffered_during_a_replay_are_bounded_by_bytes(engines):
    """The buffer holds at most ``max_pending_bytes``: one message more and the replay is given
    up, the worker cleared, and the live stream followed (issue 14 item 7)."""
    engine, router, tokens, payloads = chain(engines, 5)
    limit = len(payloads[2]) + len(payloads[3])
    with subscriber(router, engine, max_pending_bytes=limit) as sub:
        open_gap(sub, engine, payloads, sent=2)
        wait_for(lambda: sub.stats()["w"]["pending_bytes"] == limit, "a full buffer")
        assert sub.is_stale("w")
        engine.publish(payloads[4])
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 4, "seq 4")
        s = sub.stats()["w"]
    assert counters(s) == (1, 1, 1, 1, 0)
    assert (s["stale"], s["pending"], s["pending_bytes"]) == (False, 0, 0)
    assert router.index.match(own(tokens)) == {}
    assert s["skipped_unknown_parent"] == 3  # 2, 3 and 4 chain on the lost seq 1
    with pytest.raises(ValueError, match="max_pending_bytes"):
        subscriber(router, engine, max_pending_bytes=0)


def test_replay_buffer_overflow_gives_up_and_clears(engines):
    engine, router, tokens, payloads = chain(engines, 6)
    with subscriber(router, engine, max_pending=2) as sub:
        open_gap(sub, engine, payloads)  # seq 2 opens the replay, 3 fills the buffer, 4 overflows
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 5, "seq 5")
        s = sub.stats()["w"]
    assert counters(s) == (1, 1, 1, 1, 0)
    assert s["stale"] is False
    assert router.index.match(own(tokens)) == {}  # every block after the gap chains on a lost one
    assert s["skipped_unknown_parent"] == 4


def test_unanswered_replay_times_out_and_clears(engines):
    engine, router, tokens, payloads = chain(engines, 4)
    with subscriber(router, engine, replay_timeout=0.2) as sub:
        open_gap(sub, engine, payloads)
        wait_for(lambda: sub.stats()["w"]["replay_failures"] == 1, "the replay to time out")
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 3, "seq 3")
        s = sub.stats()["w"]
    assert counters(s) == (1, 1, 1, 1, 0)
    assert (s["stale"], s["errors"]) == (False, 0)
    assert router.index.match(own(tokens)) == {}
    assert freshness(router, "w") == 1.0


@pytest.mark.parametrize("before", [1, 3])
def test_catch_up_replays_what_was_published_before_joining(engines, before):
    """The first message seen is number ``before`` (1: only number 0 was missed)."""
    engine, router, tokens, payloads = chain(engines, 5, first=500, answer_replays=True)
    for p in payloads[:before]:
        engine.publish(p, send=False)  # before the subscriber existed
    with subscriber(router, engine) as sub:
        engine.wait_subscriber()
        for p in payloads[before:]:
            engine.publish(p)
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 4 and not sub.is_stale("w"), "seq 4")
        s = sub.stats()["w"]
    assert router.index.match(own(tokens)) == {"w": 5}
    assert counters(s) == (0, 1, 0, 0, 0)
    assert engine.replay_requests[0][1:] == [b"", (0).to_bytes(8, "big")]


def test_freshness_sink_errors_are_counted_and_change_nothing_else(engines):
    """A sink that raises (here a router that does not know the worker) is counted in
    ``errors``; the replay goes on and the index is still exact."""
    engine = engines()
    router = events_router("v")  # no "w"
    tokens = list(range(16 * 3))
    payloads = chain_payloads(tokens, 3)
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads)
        wait_for(lambda: sub.stats()["w"]["errors"] == 2, "mark_stale and mark_fresh to fail")
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        s = sub.stats()["w"]
    with pytest.raises(KeyError):
        router.mark_stale("w")
    assert router.index.match(own(tokens)) == {"w": 3}
    assert counters(s) == (1, 1, 0, 0, 0)
    assert s["errors"] == 2


def test_a_replay_with_holes_is_one_failure(engines):
    """A replay that starts after the gap and skips again later: the worker is cleared at each
    hole, but it is one failed replay."""
    engine = engines(answer_replays=False)
    router = events_router()
    tokens = list(range(16 * 6))
    blocks = [tokens[16 * i : 16 * i + 16] for i in range(6)]
    payloads = [stored([60 + i], None, blocks[i]) for i in range(6)]  # independent blocks
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads, lost=4)
        identity, start = engine.take_replay_request()
        assert start == 1
        replay = dict(engine.buffered_from(start))
        engine.answer(identity, [(2, replay[2]), (4, replay[4]), (5, replay[5])])
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        s = sub.stats()["w"]
    assert counters(s) == (1, 1, 1, 2, 0)
    held = {i for i in range(6) if router.index.match(own(blocks[i]))}
    assert held == {4, 5}  # cleared at the second hole; nothing guessed


def test_replay_failures_and_disconnects_are_counted_each_time(engines):
    engine, router, _, payloads = chain(engines, 7)
    with subscriber(router, engine, replay_timeout=0.2) as sub:
        start_with_seq0(sub, engine, payloads[0])
        for round_ in (1, 2):
            engine.publish(payloads[engine.seq], send=False)
            engine.publish(payloads[engine.seq])
            wait_for(lambda r=round_: sub.stats()["w"]["replay_failures"] == r, "a timeout")
            wait_for(lambda: not sub.is_stale("w"), "the live stream followed")
        s = sub.stats()["w"]
        assert counters(s) == (2, 2, 2, 2, 0)
        engine.pub.close(linger=0)
        wait_for(lambda: sub.stats()["w"]["disconnects"] == 1, "the disconnect")
        rebind(engine)
        engine.pub.close(linger=0)
        wait_for(lambda: sub.stats()["w"]["disconnects"] == 2, "the second disconnect")
        s = sub.stats()["w"]
    assert (s["disconnects"], s["resets"]) == (2, 4)
    engine.pub = engine.ctx.socket(zmq.PUB)  # for the fixture's close()


def test_a_disconnect_during_a_replay_abandons_it(engines):
    """The engine goes away while its replay is pending: the worker is cleared, the buffered
    messages dropped, and it is fresh again (it holds nothing, which is known)."""
    engine, router, tokens, payloads = chain(engines, 3)
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads)
        engine.take_replay_request()
        wait_for(lambda: sub.stats()["w"]["pending"] == 1, "the buffered batch")
        assert freshness(router, "w") < 0.01
        engine.pub.close(linger=0)
        wait_for(lambda: sub.stats()["w"]["disconnects"] == 1, "the disconnect")
        s = sub.stats()["w"]
        assert (s["stale"], s["pending"], s["pending_bytes"], s["resets"], s["errors"]) == (
            False,
            0,
            0,
            1,
            0,
        )
        assert router.index.match(own(tokens)) == {}
        # The engine comes back (a new process: numbering from 0): followed at once, not buffered.
        rebind(engine)
        engine.restart()
        engine.publish(payloads[0])
        wait_for(lambda: sub.stats()["w"]["batches"] == 2, "the new engine's seq 0")
        assert router.index.match(own(tokens)) == {"w": 1}
        assert (sub.stats()["w"]["pending"], sub.stats()["w"]["replays"]) == (0, 1)
    assert freshness(router, "w") == 1.0


def test_late_answers_to_an_abandoned_replay_are_dropped(engines):
    """A replay given up on (here: live messages overflowed its buffer) is abandoned with its
    DEALER: when the engine answers it late, during the next replay, that answer is not taken for
    the new one's. (No replay times out here: the test holds on any machine load.)"""
    engine, router, tokens, payloads = chain(engines, 6)
    with subscriber(router, engine, max_pending=1) as sub:
        open_gap(sub, engine, payloads, sent=1)  # the gap: a replay from 1, 2 buffered
        first, _ = engine.take_replay_request()
        engine.publish(payloads[3])  # one buffered message too many: the replay is given up
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 3, "the live stream followed again")
        assert sub.stats()["w"]["replay_failures"] == 1 and not sub.is_stale("w")
        engine.publish(payloads[4], send=False)
        engine.publish(payloads[5])
        second, start = engine.take_replay_request()
        assert second != first and start == 4
        engine.answer(first, [])  # late: an end marker that would end the second replay early
        assert sub.is_stale("w")
        engine.answer(second, engine.buffered_from(start))
        wait_for(lambda: not sub.is_stale("w"), "the second replay to end")
        s = sub.stats()["w"]
    assert counters(s) == (2, 2, 1, 1, 0)
    # The worker was cleared at the first failure and followed seq 2 (its parent lost); 3-5 chain
    # on 2. Seq 1 never arrived: 5 batches.
    assert (s["skipped_unknown_parent"], s["batches"], s["errors"]) == (4, 5, 0)
    assert router.index.match(own(tokens)) == {}


def test_a_replay_past_the_live_head_drops_the_rest_of_its_answer(engines):
    """A replay that gives a batch past the live stream's head has given what it can: it ends
    there and its DEALER is replaced, so the rest of that answer (here its end marker, sent
    during the next replay) is never taken for the next replay's."""
    engine, router, tokens, payloads = chain(engines, 6)
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads, sent=1)  # 1 lost, 2 shows the gap: live head 2
        first, start = engine.take_replay_request()
        engine.publish(payloads[3], send=False)  # published, not yet delivered live
        engine.answer(first, engine.buffered_from(start), end=False)  # 1, 2, 3: past the head
        wait_for(lambda: not sub.is_stale("w"), "the replay to end at seq 3")
        w = sub._workers["w"]  # the old DEALER is closed and forgotten, not kept in the poll map
        assert set(sub._owner) == {w.sub, w.monitor, w.dealer}
        engine.send_buffered(3)  # the live stream catches up: already applied
        engine.publish(payloads[4], send=False)
        engine.publish(payloads[5])  # a second gap
        second, start = engine.take_replay_request()
        assert second != first and start == 4  # a new DEALER asks
        engine.answer(first, [])  # the first answer's end: would end the second replay early
        engine.answer(second, engine.buffered_from(start))
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 5 and not sub.is_stale("w"), "seq 5")
        s = sub.stats()["w"]
    assert counters(s) == (2, 2, 0, 0, 0)
    assert (s["batches"], s["errors"], s["skipped_unknown_parent"]) == (6, 0, 0)
    assert router.index.match(own(tokens)) == {"w": 6}


def test_a_malformed_replay_reply_is_counted_and_skipped(engines):
    """A reply of neither vLLM form (``[b"", topic, seq, payload]`` or ``[b"", seq, payload]``)
    is counted as malformed, not as an error, and the replay goes on."""
    engine, router, tokens, payloads = chain(engines, 4)
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads)
        identity, start = engine.take_replay_request()
        one = (1).to_bytes(8, "big")  # the batch the replay is waiting for
        malformed = [
            [b"", b"neither form"],
            [b"x", one, payloads[1]],  # the old form without its empty first frame
            [b"x", b"", one, payloads[1]],  # the new form without it
            [b"", b"", one[1:], payloads[1]],  # a 7-byte sequence frame
            [b"", b"", one, payloads[1], b""],  # five frames
        ]
        for n, frames in enumerate(malformed, 1):
            engine.router.send_multipart([identity, *frames])
            wait_for(lambda n=n: sub.stats()["w"]["malformed"] == n, f"malformed reply {n}")
            assert sub.stats()["w"]["batches"] == 1  # nothing applied
        engine.answer(identity, engine.buffered_from(start))
        wait_for(lambda: not sub.is_stale("w"), "the replay to end")
        s = sub.stats()["w"]
        assert s["replay_endpoint"] == engine.replay_endpoint
    assert (s["malformed"], s["errors"], s["batches"]) == (len(malformed), 0, 4)
    assert counters(s) == (1, 1, 0, 0, 0)
    assert router.index.match(own(tokens)) == {"w": 4}


def test_buffered_messages_after_a_replay(engines):
    """When a replay ends, the buffered live messages it already delivered are skipped and the
    others applied in order; a new gap among them starts the next replay, which keeps the rest
    buffered."""
    engine, router, tokens, payloads = chain(engines, 7)
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads, sent=2)  # 2 shows the gap: a replay from 1
        engine.publish(payloads[4], send=False)
        engine.publish(payloads[5])
        engine.publish(payloads[6])
        first, start = engine.take_replay_request()
        assert start == 1
        wait_for(lambda: sub.stats()["w"]["pending"] == 4, "2, 3, 5 and 6 to be buffered")
        engine.answer(first, engine.buffered_from(1)[:2])  # 1 and 2, then the end marker
        # 2 was delivered by the replay, 3 is applied, 5 shows a new gap: a replay from 4.
        second, start = engine.take_replay_request()
        assert start == 4
        wait_for(lambda: sub.stats()["w"]["pending"] == 2, "5 and 6 to stay buffered")
        s = sub.stats()["w"]
        assert (s["last_seq"], s["pending_bytes"]) == (3, len(payloads[5]) + len(payloads[6]))
        assert router.index.match(own(tokens)) == {"w": 4} and sub.is_stale("w")
        engine.answer(second, engine.buffered_from(4))
        wait_for(lambda: not sub.is_stale("w"), "the second replay to end")
        s = sub.stats()["w"]
    assert router.index.match(own(tokens)) == {"w": 7}
    assert counters(s) == (2, 2, 0, 0, 0)
    assert (s["batches"], s["pending"], s["pending_bytes"], s["errors"]) == (7, 0, 0, 0)


def test_each_replay_that_loses_history_is_one_failure(engines):
    """A replay that starts after the gap and also ends before the batch that showed it is one
    failure, not two; a later replay that starts after its gap is one more."""
    engine = engines(answer_replays=False)
    router = events_router()
    tokens = list(range(16 * 8))
    blocks = [tokens[16 * i : 16 * i + 16] for i in range(8)]
    payloads = [stored([80 + i], None, blocks[i]) for i in range(8)]  # independent blocks
    with subscriber(router, engine) as sub:
        open_gap(sub, engine, payloads, lost=3, sent=1)  # 1-3 lost, 4 shows the gap
        identity, start = engine.take_replay_request()
        assert start == 1
        engine.answer(identity, [(2, payloads[2])])  # starts after the gap, ends before 4
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 4, "the live stream followed")
        assert counters(sub.stats()["w"]) == (1, 1, 1, 2, 0)
        engine.publish(payloads[5], send=False)
        engine.publish(payloads[6], send=False)
        engine.publish(payloads[7])  # 5 and 6 lost
        identity, start = engine.take_replay_request()
        assert start == 5
        engine.answer(identity, engine.buffered_from(6))  # 5 fell out of the engine's buffer
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 7 and not sub.is_stale("w"), "seq 7")
        s = sub.stats()["w"]
    assert counters(s) == (2, 2, 2, 3, 0)
    held = {i for i in range(8) if router.index.match(own(blocks[i]))}
    assert held == {6, 7}  # cleared at each hole; nothing guessed


def test_a_replays_deadline_is_replay_timeout_after_it_starts(engines):
    """The deadline of a replay without progress: ``replay_timeout`` seconds after it starts,
    5 by default (the class docstring's bound). Read between two readings of the same monotonic
    clock taken before the gap is shown and after the replay started — no waiting on time."""
    for kwargs, timeout in (({}, 5.0), ({"replay_timeout": 42.0}, 42.0)):
        engine, router, _, payloads = chain(engines, 3)
        sub = KvEventSubscriber(
            router, {"w": engine.endpoint}, replay={"w": engine.replay_endpoint}, **kwargs
        )
        with sub:
            start_with_seq0(sub, engine, payloads[0])
            engine.publish(payloads[1], send=False)
            before = time.monotonic()
            engine.publish(payloads[2])  # shows the gap: the replay starts
            engine.take_replay_request()
            after = time.monotonic()
            deadline = sub._workers["w"].replay_deadline
        assert before + timeout <= deadline <= after + timeout, kwargs


def test_a_freshness_sink_given_is_told_instead_of_the_target(engines):
    """``freshness=`` is the sink even when the target (a router) has ``mark_stale`` /
    ``mark_fresh`` of its own: the router is never marked stale."""

    class Sink:
        def __init__(self):
            self.calls = []

        def mark_stale(self, worker):
            self.calls.append(("stale", worker))

        def mark_fresh(self, worker):
            self.calls.append(("fresh", worker))

    engine, router, tokens, payloads = chain(engines, 3)
    sink = Sink()
    with subscriber(router, engine, freshness=sink) as sub:
        open_gap(sub, engine, payloads)
        identity, start = engine.take_replay_request()
        wait_for(lambda: sink.calls == [("stale", "w")], "the sink told: stale")
        assert sub.is_stale("w") and freshness(router, "w") == 1.0  # the router is not told
        engine.answer(identity, engine.buffered_from(start))
        wait_for(lambda: sink.calls == [("stale", "w"), ("fresh", "w")], "then fresh")
    assert router.index.match(own(tokens)) == {"w": 3}


def test_a_restarted_subscriber_replays_over_a_new_dealer(engines):
    """Stopped and started again, the subscriber has a replay DEALER again: a gap is replayed."""
    engine, router, tokens, payloads = chain(engines, 4, answer_replays=True)
    sub = subscriber(router, engine)
    with sub:
        start_with_seq0(sub, engine, payloads[0])
    with sub:
        engine.wait_subscriber()
        engine.publish(payloads[1])
        engine.publish(payloads[2], send=False)
        engine.publish(payloads[3])
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 3 and not sub.is_stale("w"), "seq 3")
        s = sub.stats()["w"]
    assert router.index.match(own(tokens)) == {"w": 4}
    assert counters(s) == (1, 1, 0, 0, 0) and s["errors"] == 0
