"""KvEventSubscriber over real ZMQ sockets on 127.0.0.1 (ephemeral ports).

The test engine publishes like vLLM's ``ZmqEventPublisher`` (frames ``[topic, seq, payload]``,
sequence numbers from 0, a replay ROUTER that answers ``[b"", start]`` with every buffered batch and
an end marker, in the >= 0.28 form with a topic frame or the <= 0.24 form without), as described in
KV_EVENTS_SPEC.md section 1. It uses an XPUB socket (wire-compatible with PUB) only so that a test
can wait until the subscriber has joined. Payloads are the vLLM 0.33 vector bytes, or built with
``msgpack`` from the spec. Expected index contents come from ``kvroute.BlockHasher`` on the same
tokens (rehash mode) or the engine's hashes (direct mode).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from kvroute import BlockHasher, KvEventApplier, PrefixIndex
from support import events_payloads as P

zmq = pytest.importorskip("zmq")
from kvroute.events import END_SEQ, KvEventSubscriber  # noqa: E402

VECTORS = Path(__file__).parent / "data" / "vectors"
VLLM = json.loads((VECTORS / "vllm_0.33.0_block_hash_and_kv_event_vectors.json").read_text())
CASES = {c["name"]: c for c in VLLM["event_cases"]}
ENGINE_HASHES = VLLM["hash_cases"][0]["block_hashes_external_u64"]
TOKENS = VLLM["hash_cases"][0]["token_ids"]


def own(tokens, **opts):
    return [int(h) for h in BlockHasher(16, **opts).hash(tokens)]


def wait_for(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


class Engine:
    """A KV-event publisher with an optional replay ROUTER, like vLLM's."""

    def __init__(self, topic="", replay=True, new_replay_form=True, answer_replays=True):
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.new_replay_form = new_replay_form
        self.replay_requests: list[list[bytes]] = []
        self.router = None
        self.replay_endpoint = None
        self._stop = threading.Event()
        self._thread = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            if answer_replays:
                self._thread = threading.Thread(target=self._serve, daemon=True)
                self._thread.start()

    def wait_subscriber(self):
        while True:  # skip unsubscriptions (a subscriber that stopped)
            assert self.pub.poll(10_000), "no subscriber joined"
            if self.pub.recv()[:1] == b"\x01":
                return

    def publish(self, payload: bytes, *, send=True) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self):
        self.seq = 0
        self.buffer = []

    def send_raw(self, frames):
        self.pub.send_multipart(frames)

    def _serve(self):
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            frames = self.router.recv_multipart()
            self.replay_requests.append(frames)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    body = [seq.to_bytes(8, "big"), payload]
                    if self.new_replay_form:
                        body = [self.topic, *body]
                    self.router.send_multipart([identity, b"", *body])
            end = [END_SEQ, b""]
            if self.new_replay_form:
                end = [b"", *end]
            self.router.send_multipart([identity, b"", *end])

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def engines():
    made = []

    def make(**kw):
        e = Engine(**kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


class Freshness:
    def __init__(self):
        self.calls = []

    def mark_stale(self, worker):
        self.calls.append(("stale", worker))

    def mark_fresh(self, worker):
        self.calls.append(("fresh", worker))


def stored(hashes, parent, tokens):
    return P.batch([P.map16(P.stored_fields(hashes, parent, tokens, 16))])


def chain_payloads(tokens, n_blocks, first=0):
    """One BlockStored per block, engine hash i+1 for block i (any engine algorithm)."""
    out = []
    for i in range(first, first + n_blocks):
        parent = None if i == 0 else i
        out.append(stored([i + 1], parent, tokens[16 * i : 16 * i + 16]))
    return out


def test_vector_frames_in_direct_mode(engines):
    engine = engines(topic="kv-events", replay=False)
    index = PrefixIndex()
    fresh = Freshness()
    sub = KvEventSubscriber(
        index,
        {"w": engine.endpoint},
        topic="kv-events",
        mode="direct",
        hash_profile="vllm",
        freshness=fresh,
    )
    with sub:
        engine.wait_subscriber()
        for name in ["batch_stored_stored", "batch_removed"]:
            frames = [bytes.fromhex(f) for f in CASES[name]["zmq_frames_hex"]]
            engine.send_raw(frames)
            engine.seq += 1
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 1, "two batches")
        assert index.match(ENGINE_HASHES) == {"w": 2}
        frames = [bytes.fromhex(f) for f in CASES["batch_cleared"]["zmq_frames_hex"]]
        engine.send_raw(frames)
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 2, "the clear")
        assert index.match(ENGINE_HASHES) == {}
        s = sub.stats()["w"]
    assert (s["batches"], s["events"], s["blocks_stored"], s["blocks_removed"]) == (3, 4, 3, 1)
    assert (s["gaps"], s["resets"], s["malformed"], s["stale"]) == (0, 0, 0, False)
    assert s["cleared_events"] == 1 and s["seconds_since_event"] >= 0
    assert fresh.calls == []
    assert not sub.running


@pytest.mark.parametrize("new_form", [True, False])
def test_gap_is_replayed_over_a_dealer(engines, new_form):
    engine = engines(new_replay_form=new_form)
    index = PrefixIndex()
    fresh = Freshness()
    tokens = list(range(1000, 1000 + 16 * 6))
    payloads = chain_payloads(tokens, 6)
    sub = KvEventSubscriber(
        index, {"w": engine.endpoint}, replay={"w": engine.replay_endpoint}, freshness=fresh
    )
    with sub:
        engine.wait_subscriber()
        engine.publish(payloads[0])
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 0, "seq 0")
        engine.publish(payloads[1], send=False)  # lost: ZMQ dropped it
        engine.publish(payloads[2], send=False)
        for p in payloads[3:]:
            engine.publish(p)
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 5, "seq 5")
        wait_for(lambda: not sub.is_stale("w"), "catch-up")
        s = sub.stats()["w"]
    assert index.match(own(tokens)) == {"w": 6}
    assert (s["gaps"], s["replays"], s["replay_failures"], s["resets"]) == (1, 1, 0, 0)
    assert s["batches"] == 6 and s["skipped_unknown_parent"] == 0
    assert fresh.calls == [("stale", "w"), ("fresh", "w")]
    request = engine.replay_requests[0]
    assert request[1:] == [b"", (1).to_bytes(8, "big")]  # DEALER: [b"", start]


def test_gap_without_replay_clears_the_worker(engines):
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = list(range(16 * 4))
    payloads = chain_payloads(tokens, 4)
    with KvEventSubscriber(index, {"w": engine.endpoint}) as sub:
        engine.wait_subscriber()
        engine.publish(payloads[0])
        engine.publish(payloads[1])
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 1, "seq 1")
        assert index.match(own(tokens)) == {"w": 2}
        engine.publish(payloads[2], send=False)
        engine.publish(payloads[3])  # its parent was in the gap
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 3, "seq 3")
        s = sub.stats()["w"]
        assert index.match(own(tokens)) == {}  # never keep guessing
        assert (s["gaps"], s["resets"], s["skipped_unknown_parent"]) == (1, 1, 1)
        # It follows the stream again afterwards.
        engine.publish(stored([50], None, tokens[:16]))
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 4, "seq 4")
        assert index.match(own(tokens)) == {"w": 1}


def test_restart_clears_the_worker(engines):
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = list(range(16 * 3))
    with KvEventSubscriber(index, {"w": engine.endpoint}) as sub:
        engine.wait_subscriber()
        for p in chain_payloads(tokens, 3):
            engine.publish(p)
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 2, "seq 2")
        assert index.match(own(tokens)) == {"w": 3}
        engine.restart()  # a new engine process numbers from 0 again
        engine.publish(stored([9], None, tokens[16:32]))
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 0, "the restarted engine")
        s = sub.stats()["w"]
    assert (s["restarts"], s["resets"]) == (1, 1)
    assert index.match(own(tokens)) == {}
    assert index.match(own(tokens[16:32])) == {"w": 1}


def test_catch_up_replays_what_was_published_before_joining(engines):
    engine = engines()
    index = PrefixIndex()
    tokens = list(range(500, 500 + 16 * 5))
    payloads = chain_payloads(tokens, 5)
    for p in payloads[:3]:
        engine.publish(p, send=False)  # before the subscriber existed
    with KvEventSubscriber(
        index, {"w": engine.endpoint}, replay={"w": engine.replay_endpoint}
    ) as sub:
        engine.wait_subscriber()
        for p in payloads[3:]:
            engine.publish(p)
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 4 and not sub.is_stale("w"), "seq 4")
        s = sub.stats()["w"]
    assert index.match(own(tokens)) == {"w": 5}
    assert (s["gaps"], s["replays"], s["resets"]) == (0, 1, 0)


def test_unanswered_replay_times_out_and_clears(engines):
    engine = engines(answer_replays=False)
    index = PrefixIndex()
    fresh = Freshness()
    tokens = list(range(16 * 4))
    payloads = chain_payloads(tokens, 4)
    sub = KvEventSubscriber(
        index,
        {"w": engine.endpoint},
        replay={"w": engine.replay_endpoint},
        replay_timeout=0.2,
        freshness=fresh,
    )
    with sub:
        engine.wait_subscriber()
        engine.publish(payloads[0])
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 0, "seq 0")
        engine.publish(payloads[1], send=False)
        engine.publish(payloads[2])
        engine.publish(payloads[3])
        wait_for(lambda: sub.stats()["w"]["replay_failures"] == 1, "the replay to time out")
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 3, "seq 3")
        s = sub.stats()["w"]
    assert (s["gaps"], s["replays"], s["resets"], s["stale"]) == (1, 1, 1, False)
    assert index.match(own(tokens)) == {}
    assert fresh.calls == [("stale", "w"), ("fresh", "w")]


def test_malformed_frames_are_counted_and_skipped(engines):
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = list(range(16 * 2))
    a, b = chain_payloads(tokens, 2)
    with KvEventSubscriber(index, {"w": engine.endpoint, "v": engine.endpoint}) as sub:
        engine.wait_subscriber()
        engine.wait_subscriber()
        engine.publish(a)
        engine.send_raw([b"", b"\x00" * 8])  # two frames
        engine.send_raw([b"", b"\x00" * 7, a])  # short sequence frame
        engine.publish(b"\x93\xcb\x00")  # a payload the decoder refuses (seq 1)
        engine.publish(b)
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 2, "seq 2")
        wait_for(lambda: sub.stats()["v"]["last_seq"] == 2, "seq 2 on v")
        s = sub.stats()["w"]
    assert (s["malformed_frames"], s["malformed_payloads"], s["malformed"]) == (2, 1, 3)
    assert (s["gaps"], s["resets"], s["errors"]) == (0, 0, 0)
    assert index.match(own(tokens)) == {"w": 2, "v": 2}


def test_several_engines_and_a_router_like_target(engines):
    class Router:
        def __init__(self):
            self.index = PrefixIndex()
            self.block_size = 16
            self.hash_profile = "native"
            self.fresh = Freshness()

        def mark_stale(self, worker):
            self.fresh.mark_stale(worker)

        def mark_fresh(self, worker):
            self.fresh.mark_fresh(worker)

    router = Router()
    e1, e2 = engines(), engines()
    tokens = list(range(16 * 3))
    sub = KvEventSubscriber(
        router, {"a": e1.endpoint, "b": e2.endpoint}, replay={"b": e2.replay_endpoint}
    )
    assert sub.index is router.index
    with sub:
        e1.wait_subscriber()
        e2.wait_subscriber()
        for p in chain_payloads(tokens, 3):
            e1.publish(p)
        e2.publish(chain_payloads(tokens, 1)[0])
        e2.publish(chain_payloads(tokens, 2)[1], send=False)
        e2.publish(chain_payloads(tokens, 3)[2])
        wait_for(lambda: sub.stats()["a"]["last_seq"] == 2, "a")
        wait_for(lambda: sub.stats()["b"]["last_seq"] == 2 and not sub.is_stale("b"), "b")
    assert router.index.match(own(tokens)) == {"a": 3, "b": 3}
    assert router.fresh.calls == [("stale", "b"), ("fresh", "b")]


def test_stop_is_clean_and_restartable(engines):
    engine = engines(replay=False)
    index = PrefixIndex()
    sub = KvEventSubscriber(index, {"w": engine.endpoint})
    before = {t.name for t in threading.enumerate()}
    sub.start()
    engine.wait_subscriber()
    assert "kvroute-kv-events" in {t.name for t in threading.enumerate()}
    sub.stop()
    sub.stop()  # idempotent
    assert {t.name for t in threading.enumerate()} == before
    with sub:
        engine.wait_subscriber()
        engine.publish(stored([1], None, range(16)))
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 0, "seq 0")
    assert not sub.running


def test_async_with(engines):
    engine = engines(replay=False)
    index = PrefixIndex()

    async def main():
        async with KvEventSubscriber(index, {"w": engine.endpoint}) as sub:
            await asyncio.get_running_loop().run_in_executor(None, engine.wait_subscriber)
            engine.publish(stored([1], None, range(16)))
            while sub.stats()["w"]["last_seq"] != 0:
                await asyncio.sleep(0.005)
        return sub

    sub = asyncio.run(main())
    assert not sub.running
    assert index.match(own(list(range(16)))) == {"w": 1}


def test_bad_arguments_and_a_bad_endpoint():
    index = PrefixIndex()
    with pytest.raises(KeyError, match="unknown workers"):
        KvEventSubscriber(index, {"w": "tcp://127.0.0.1:1"}, replay={"x": "tcp://127.0.0.1:2"})
    with pytest.raises(TypeError, match="target"):
        KvEventSubscriber(object(), {"w": "tcp://127.0.0.1:1"})
    with pytest.raises(ValueError, match="replay_timeout"):
        KvEventSubscriber(index, {"w": "tcp://127.0.0.1:1"}, replay_timeout=0)
    applier = KvEventApplier(index, mode="direct")
    assert KvEventSubscriber(applier, {}).applier is applier
    sub = KvEventSubscriber(index, {"w": "not-a-transport://x"})
    with pytest.raises(zmq.ZMQError):
        sub.start()
    assert not sub.running


def test_replay_buffer_overflow_gives_up_and_clears(engines):
    engine = engines(answer_replays=False)
    index = PrefixIndex()
    tokens = list(range(16 * 6))
    payloads = chain_payloads(tokens, 6)
    sub = KvEventSubscriber(
        index,
        {"w": engine.endpoint},
        replay={"w": engine.replay_endpoint},
        replay_timeout=60,
        max_pending=2,
    )
    with sub:
        engine.wait_subscriber()
        engine.publish(payloads[0])
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 0, "seq 0")
        engine.publish(payloads[1], send=False)
        for p in payloads[2:]:
            engine.publish(p)  # seq 2 opens the replay, 3 fills the buffer, 4 overflows it
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 5, "seq 5")
        s = sub.stats()["w"]
    assert (s["gaps"], s["replays"], s["replay_failures"], s["resets"]) == (1, 1, 1, 1)
    assert s["stale"] is False
    assert index.match(own(tokens)) == {}  # every block after the gap chains on a lost one
    assert s["skipped_unknown_parent"] == 4


def test_a_router_that_owns_its_applier():
    class Router:
        def __init__(self):
            self.index = PrefixIndex()
            self.event_applier = KvEventApplier(self.index, mode="direct", hash_profile="vllm")

    router = Router()
    sub = KvEventSubscriber(router, {"w": "tcp://127.0.0.1:1"})
    assert sub.applier is router.event_applier
    assert sub.index is router.index


def test_the_real_router_in_events_mode_and_approx_mode_refused():
    from kvroute import Router

    router = Router(["w"], index="events")
    sub = KvEventSubscriber(router, {"w": "tcp://127.0.0.1:1"})
    assert sub.applier is router.event_applier
    with pytest.raises(ValueError, match="index='events'"):
        KvEventSubscriber(Router(["w"]), {"w": "tcp://127.0.0.1:1"})


def test_a_bound_subscriber_and_an_engine_that_connects():
    """vLLM connects its publisher when the endpoint names a concrete host: the subscriber binds."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    index = PrefixIndex()
    tokens = list(range(16 * 3))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        with KvEventSubscriber(index, {"w": endpoint}, bind={"w": True}) as sub:
            pub.connect(endpoint)
            assert pub.poll(10_000), "the subscription never arrived"
            assert pub.recv()[:1] == b"\x01"
            for seq, p in enumerate(chain_payloads(tokens, 3)):
                pub.send_multipart([b"", seq.to_bytes(8, "big"), p])
            wait_for(lambda: sub.stats()["w"]["last_seq"] == 2, "seq 2")
            assert index.match(own(tokens)) == {"w": 3}
    finally:
        pub.close(linger=0)
        ctx.term()
    with pytest.raises(KeyError, match="unknown workers"):
        KvEventSubscriber(index, {"w": endpoint}, bind={"v": True})


def test_a_dropped_event_connection_clears_the_worker_at_once(engines):
    """An engine that stops publishes nothing more: its blocks are forgotten when its connection
    drops, not when a restarted engine's first event arrives (maybe long after its first
    request)."""
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = list(range(16 * 3))
    with KvEventSubscriber(index, {"w": engine.endpoint}) as sub:
        engine.wait_subscriber()
        for p in chain_payloads(tokens, 3):
            engine.publish(p)
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 2, "seq 2")
        assert index.match(own(tokens)) == {"w": 3}
        engine.pub.close(linger=0)  # the engine process is gone
        wait_for(lambda: sub.stats()["w"]["disconnects"] == 1, "the disconnect")
        s = sub.stats()["w"]
        assert index.match(own(tokens)) == {}
        assert s["resets"] == 1
    engine.pub = engine.ctx.socket(zmq.PUB)  # for the fixture's close()
