"""KvEventSubscriber over real ZMQ sockets on 127.0.0.1 (ephemeral ports): decoding, several
engines, restarts, malformed frames, disconnects, lifecycle and targets.

The test engine (support/events_engine.py) publishes like vLLM's ``ZmqEventPublisher``. Payloads
are the vLLM 0.33 vector bytes, or built with ``msgpack`` from the spec. Expected index contents
come from ``kvroute.BlockHasher`` on the same tokens (rehash mode) or the engine's hashes (direct
mode). Replays of lost batches: tests/test_events_replay.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from kvroute import KvEventApplier, PrefixIndex, Router
from kvroute.events import KvEventSubscriber
from support import events_payloads as P
from support.events_engine import chain_payloads, own, stored
from support.helpers import wait_for

VECTORS = Path(__file__).parent / "data" / "vectors"
VLLM = json.loads((VECTORS / "vllm_0.33.0_block_hash_and_kv_event_vectors.json").read_text())
CASES = {c["name"]: c for c in VLLM["event_cases"]}
ENGINE_HASHES = VLLM["hash_cases"][0]["block_hashes_external_u64"]


def test_vector_frames_in_direct_mode(engines):
    engine = engines(topic="kv-events", replay=False)
    router = Router(["w"], index="events", hash_profile="vllm", event_mode="direct")
    sub = KvEventSubscriber(router, {"w": engine.endpoint}, topic="kv-events")
    index = router.index
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
    assert (s["gaps"], s["replays"], s["resets"], s["malformed"], s["stale"]) == (0, 0, 0, 0, False)
    assert s["cleared_events"] == 1 and s["seconds_since_event"] >= 0 and s["errors"] == 0
    assert router.freshness("w", now=time.monotonic() + 3600) == 1.0  # never marked stale
    assert not sub.running


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


def test_several_engines_feed_one_router(engines):
    router = Router(["a", "b"], index="events")
    e1, e2 = engines(), engines()
    tokens = list(range(16 * 3))
    sub = KvEventSubscriber(
        router, {"a": e1.endpoint, "b": e2.endpoint}, replay={"b": e2.replay_endpoint}
    )
    assert sub.index is router.index and sub.applier is router.event_applier
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
        s = sub.stats()
    assert router.index.match(own(tokens)) == {"a": 3, "b": 3}
    assert [(s[w]["gaps"], s[w]["replays"], s[w]["resets"], s[w]["errors"]) for w in "ab"] == [
        (0, 0, 0, 0),
        (1, 1, 0, 0),
    ]
    later = time.monotonic() + 3600
    assert router.freshness("a", now=later) == router.freshness("b", now=later) == 1.0


def test_a_router_like_target_lends_its_index_block_size_and_profile():
    """Any object with a PrefixIndex ``index`` (and ``block_size`` / ``hash_profile``) can be
    fed: blocks are hashed with its block size."""

    class Target:
        index = PrefixIndex()
        block_size = 32
        hash_profile = "native"

    target = Target()
    sub = KvEventSubscriber(target, {"w": "tcp://127.0.0.1:1"})
    assert sub.index is target.index and sub._freshness is None
    tokens = list(range(64))
    sub.applier.apply("w", P.batch([P.map16(P.stored_fields([1, 2], None, tokens, 32))]))
    assert target.index.match(own(tokens, block_size=32)) == {"w": 2}
    assert target.index.match(own(tokens)) == {}  # not 16-token blocks


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


class FailingOnce:
    """The subscriber's applier, raising once: a bug in a handler, not a malformed payload (a
    ValueError, which the applier counts itself)."""

    def __init__(self, real: KvEventApplier) -> None:
        self.real = real
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def apply(self, worker: str, payload: bytes) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug")
        self.real.apply(worker, payload)


def test_an_exception_in_a_handler_is_counted_and_the_thread_goes_on(engines):
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = list(range(32))
    payloads = chain_payloads(tokens, 2)
    with KvEventSubscriber(index, {"w": engine.endpoint}) as sub:
        assert sub.stats()["w"]["endpoint"] == engine.endpoint
        assert sub.stats()["w"]["last_seq"] is None  # nothing received yet
        sub.applier = FailingOnce(sub.applier)
        engine.wait_subscriber()
        engine.publish(payloads[0])  # its handler raises: counted, the message lost
        engine.publish(stored([9], None, tokens[16:]))  # the next is applied
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 1, "seq 1")
        s = sub.stats()["w"]
    assert (s["errors"], s["batches"]) == (1, 1)
    assert index.match(own(tokens[16:])) == {"w": 1}


def thread_cpu_seconds(name: str) -> float:
    """User + system CPU time of this process's thread ``name`` (Linux: /proc)."""
    (thread,) = (t for t in threading.enumerate() if t.name == name)
    stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()  # fields 3.. of proc(5): utime is 14, stime 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_subscriber_waits_in_poll(engines):
    """With nothing to read the poll thread sleeps in zmq's poll (its one-second timeout): every
    socket is polled for input only. One polled for output too — a connected replay DEALER is
    always writable — would return every poll at once, a loop burning a core while idle."""
    engine = engines()
    with KvEventSubscriber(
        PrefixIndex(), {"w": engine.endpoint}, replay={"w": engine.replay_endpoint}
    ):
        engine.wait_subscriber()
        time.sleep(0.2)  # the DEALER's connection is up
        before = thread_cpu_seconds("kvroute-kv-events")
        time.sleep(2.0)
        used = thread_cpu_seconds("kvroute-kv-events") - before
    assert used < 0.1, f"the idle poll thread used {used:.2f} s of CPU in 2 s"


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


def test_a_target_lends_its_hash_profile_and_the_subscriber_its_hash_options():
    """A target with an ``index`` but no ``block_size`` gets 16-token blocks and its
    ``hash_profile``; the subscriber's own ``seed`` and ``hash_algo`` reach the applier. Blocks
    are indexed under the hashes ``BlockHasher`` (vLLM's, bit-exact) gives those options."""

    class Target:  # no block_size
        index = PrefixIndex()
        hash_profile = "vllm"

    tokens = list(range(32))
    payload = P.batch([P.map16(P.stored_fields([1, 2], None, tokens, 16))])
    target = Target()
    KvEventSubscriber(target, {"w": "tcp://127.0.0.1:1"}).applier.apply("w", payload)
    assert target.index.match(own(tokens, profile="vllm")) == {"w": 2}
    index = PrefixIndex()
    opts = {"profile": "vllm", "seed": "s", "hash_algo": "sha256"}
    sub = KvEventSubscriber(
        index, {"w": "tcp://127.0.0.1:1"}, hash_profile="vllm", seed="s", hash_algo="sha256"
    )
    sub.applier.apply("w", payload)
    assert index.match(own(tokens, **opts)) == {"w": 2}
    assert index.match(own(tokens, profile="vllm")) == {}  # another seed and algorithm
    direct = PrefixIndex()  # mode="direct": the engine's own hashes, as they come
    KvEventSubscriber(direct, {"w": "tcp://127.0.0.1:1"}, mode="direct").applier.apply("w", payload)
    assert direct.match([1, 2]) == {"w": 2}


def test_the_subscribers_vllm_version_reaches_the_applier():
    """``vllm_version`` selects the release's hashing: vLLM <= 0.28 draws NONE_HASH at random
    unless PYTHONHASHSEED is set, so without ``seed`` the applier for it is refused (naming
    why), and with the engines' seed it is built; 0.29 needs none."""
    endpoints = {"w": "tcp://127.0.0.1:1"}
    with pytest.raises(ValueError, match=r"vLLM 0\.28 draws its NONE_HASH at random"):
        KvEventSubscriber(PrefixIndex(), endpoints, hash_profile="vllm", vllm_version="0.28")
    KvEventSubscriber(PrefixIndex(), endpoints, hash_profile="vllm", vllm_version="0.28", seed="0")
    KvEventSubscriber(PrefixIndex(), endpoints, hash_profile="vllm", vllm_version="0.29")


def test_an_event_sink_is_fed_as_it_is():
    """Any object with ``apply(worker, payload)``, ``clear(worker)`` and ``stats()`` (``kvroute
    relay``'s outbox) is the applier itself."""

    class Sink:
        def apply(self, worker, payload):
            pass

        def clear(self, worker):
            pass

        def stats(self):
            return {}

    sink = Sink()
    assert KvEventSubscriber(sink, {"w": "tcp://127.0.0.1:1"}).applier is sink


def test_without_pyzmq_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq raises ImportError
    with pytest.raises(
        ImportError, match=r"^kvroute.events needs pyzmq: pip install 'kvroute\[events\]'$"
    ):
        KvEventSubscriber(PrefixIndex(), {"w": "tcp://127.0.0.1:1"})


def test_bad_arguments_and_a_bad_endpoint():
    index = PrefixIndex()
    with pytest.raises(KeyError, match="unknown workers"):
        KvEventSubscriber(index, {"w": "tcp://127.0.0.1:1"}, replay={"x": "tcp://127.0.0.1:2"})
    with pytest.raises(TypeError, match=r"a router with an \.index or an event sink, got object"):
        KvEventSubscriber(object(), {"w": "tcp://127.0.0.1:1"})
    with pytest.raises(TypeError, match="endpoints must map str to str, got 'w': 5"):
        KvEventSubscriber(index, {"w": 5})
    KvEventSubscriber(index, {"w": "tcp://127.0.0.1:1"}, max_pending=1, max_pending_bytes=1)
    for bad in ("max_pending", "max_pending_bytes"):
        with pytest.raises(ValueError, match=f"^{bad} must be >= 1, got 0$"):
            KvEventSubscriber(index, {"w": "tcp://127.0.0.1:1"}, **{bad: 0})
    with pytest.raises(ValueError, match="replay_timeout"):
        KvEventSubscriber(index, {"w": "tcp://127.0.0.1:1"}, replay_timeout=0)
    applier = KvEventApplier(index, mode="direct")
    assert KvEventSubscriber(applier, {}).applier is applier
    sub = KvEventSubscriber(index, {"w": "not-a-transport://x"})
    with pytest.raises(zmq.ZMQError):
        sub.start()
    assert not sub.running


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
