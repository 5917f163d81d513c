"""KvEventSubscriber's workers joining and leaving (``add_worker``, ``remove_worker``), while
running and while stopped, over real ZMQ sockets: the other workers keep their sockets and
sequence state, a worker that leaves is forgotten (blocks, counters, staleness)."""

from __future__ import annotations

import pytest
import zmq
from kvroute import PrefixIndex
from kvroute.events import KvEventSubscriber
from support.events_engine import stored
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
