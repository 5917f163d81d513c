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
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from kvroute import KvEventApplier, PrefixIndex, Router
from kvroute.events import KvEventSubscriber, applier_for
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
        assert (sub.stats()["w"]["restarts"], sub.stats()["w"]["resets"]) == (1, 1)
        assert index.match(own(tokens)) == {}
        assert index.match(own(tokens[16:32])) == {"w": 1}
        engine.publish(stored([10], None, tokens[:16]))
        engine.restart()  # and again: each restart counts
        engine.publish(stored([11], None, tokens[32:]))
        wait_for(lambda: sub.stats()["w"]["restarts"] == 2, "the second restart")
        s = sub.stats()["w"]
    assert (s["restarts"], s["resets"], s["last_seq"], s["errors"]) == (2, 2, 0, 0)
    assert index.match(own(tokens[:16])) == {}
    assert index.match(own(tokens[32:])) == {"w": 1}


def test_malformed_frames_are_counted_and_skipped(engines, caplog):
    """Each refusal is counted; the first of each worker is logged as a warning naming what was
    refused (an engine whose every message is refused would be seen in no log otherwise), the
    rest at debug, the payload's with the decoder's reason."""
    caplog.set_level(logging.DEBUG, logger="kvroute.events")
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
    refusals = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "kvroute.events" and "refused" in r.getMessage()
    ]
    for name in ("w", "v"):
        mine = [(level, m) for level, m in refusals if m.startswith(f"worker {name}: ")]
        assert [level for level, _ in mine] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
        assert mine[0][1] == (
            f"worker {name}: refused a live message of frames [0, 8] bytes long (engines send 3: "
            "topic, 8-byte sequence, payload); nothing of it applied (stats: malformed)"
        )
        assert "frames [0, 7, " in mine[1][1]
        assert mine[2][1].startswith(f"worker {name}: refused the payload of message 1: ")
        assert "malformed KV event payload" in mine[2][1]


def test_the_first_refusal_after_a_reset_is_a_warning_again(engines, caplog):
    """A reset starts a new engine run (here the engine restarts: its numbering goes back): its
    first refused message is logged as a warning again, the later ones at debug."""
    caplog.set_level(logging.DEBUG, logger="kvroute.events")
    engine = engines(replay=False)
    a, b = chain_payloads(list(range(16 * 2)), 2)
    with KvEventSubscriber(PrefixIndex(), {"w": engine.endpoint}) as sub:
        engine.wait_subscriber()
        for restart in (False, True):
            if restart:
                engine.restart()  # numbering from 0 again: a restart, the worker reset
            engine.publish(a)
            engine.send_raw([b"", b"\x00" * 8])  # two frames: refused
            engine.send_raw([b"", b"\x00" * 8])
            engine.publish(b)
        wait_for(lambda: sub.stats()["w"]["malformed"] == 4, "four refusals")
        wait_for(lambda: sub.stats()["w"]["batches"] == 4, "four batches")
        s = sub.stats()["w"]
    assert (s["restarts"], s["resets"], s["errors"]) == (1, 1, 0)
    levels = [
        r.levelno
        for r in caplog.records
        if r.name == "kvroute.events" and "refused" in r.getMessage()
    ]
    assert levels == [logging.WARNING, logging.DEBUG, logging.WARNING, logging.DEBUG]


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

    class IndexOnly:  # neither attribute: the applier's defaults, as for a bare PrefixIndex
        index = PrefixIndex()

    applier = KvEventSubscriber(IndexOnly(), {"w": "tcp://127.0.0.1:1"}).applier
    assert (applier.mode, applier.block_size, applier.hash_profile) == ("rehash", 16, "native")


def test_stop_is_clean_and_restartable(engines):
    engine = engines(replay=False)
    index = PrefixIndex()
    sub = KvEventSubscriber(index, {"w": engine.endpoint})
    before = {t.name for t in threading.enumerate()}
    sub.start()
    engine.wait_subscriber()
    (thread,) = (t for t in threading.enumerate() if t.name == "kvroute-kv-events")
    daemon, ctx = thread.daemon, sub._ctx
    sub.stop()
    assert daemon  # a program that never calls stop() still exits
    assert ctx.closed  # the ZMQ context (its I/O threads) is terminated
    sub.stop()  # idempotent
    assert {t.name for t in threading.enumerate()} == before
    with sub:  # started again: a gap is cleared as before (no replay endpoint, no DEALER)
        engine.wait_subscriber()
        engine.publish(stored([1], None, range(16)))
        engine.publish(stored([2], 1, range(16, 32)), send=False)
        engine.publish(stored([3], 2, range(32, 48)))
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 2, "seq 2")
        s = sub.stats()["w"]
    assert not sub.running
    assert (s["gaps"], s["replays"], s["resets"], s["errors"], s["stale"]) == (1, 0, 1, 0, False)


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


def test_last_seq_shows_once_its_batch_is_in_the_index(engines):
    """``stats()["last_seq"]`` is the last batch applied: a reader that waits for it (as every
    test here does) finds the batch's blocks in the index — while the applier still holds the
    batch, the number is not out yet."""
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = list(range(16))
    entered, release = threading.Event(), threading.Event()

    class Held(FailingOnce):
        def apply(self, worker, payload):
            entered.set()
            assert release.wait(20)
            self.real.apply(worker, payload)

    with KvEventSubscriber(index, {"w": engine.endpoint}) as sub:
        sub.applier = Held(sub.applier)
        engine.wait_subscriber()
        engine.publish(chain_payloads(tokens, 1)[0])
        assert entered.wait(20), "the batch never reached the applier"
        s = sub.stats()["w"]
        release.set()
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 0, "seq 0")
        assert index.match(own(tokens)) == {"w": 1}
    assert (s["last_seq"], s["seconds_since_event"]) == (None, None)


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


def test_every_argument_error_is_named_whole():
    """Each refused argument's message, whole: what was wrong and the value given."""
    index = PrefixIndex()
    one = {"w": "tcp://127.0.0.1:1"}
    cases = [
        (
            {"target": index, "endpoints": one, "replay": {"x": "tcp://127.0.0.1:2"}},
            KeyError,
            "replay endpoints given for unknown workers ['x']",
        ),
        (
            {"target": index, "endpoints": one, "bind": {"v": True}},
            KeyError,
            "bind given for unknown workers ['v']",
        ),
        (
            {"target": index, "endpoints": {"w": 5}},
            TypeError,
            "endpoints must map str to str, got 'w': 5",
        ),
        (
            {"target": index, "endpoints": {5: "tcp://127.0.0.1:1"}},
            TypeError,
            "endpoints must map str to str, got 5: 'tcp://127.0.0.1:1'",
        ),
        (
            {"target": index, "endpoints": one, "replay_timeout": 0},
            ValueError,
            "replay_timeout must be > 0, got 0",
        ),
        (
            {"target": index, "endpoints": one, "replay_timeout": -1.5},
            ValueError,
            "replay_timeout must be > 0, got -1.5",
        ),
        (
            {"target": index, "endpoints": one, "max_pending": 0},
            ValueError,
            "max_pending must be >= 1, got 0",
        ),
        (
            {"target": index, "endpoints": one, "max_pending_bytes": 0},
            ValueError,
            "max_pending_bytes must be >= 1, got 0",
        ),
        (
            {"target": object(), "endpoints": one},
            TypeError,
            "target must be a PrefixIndex, a KvEventApplier, a router with an .index or an "
            "event sink, got object",
        ),
        (
            {"target": Router(["w"]), "endpoints": one},
            ValueError,
            "this router predicts its index (index='approx'); create it with index='events' to "
            "feed it engine KV events",
        ),
    ]
    for kwargs, kind, message in cases:
        target, endpoints = kwargs.pop("target"), kwargs.pop("endpoints")
        with pytest.raises(kind) as raised:
            KvEventSubscriber(target, endpoints, **kwargs)
        assert raised.value.args == (message,), kwargs
    KvEventSubscriber(index, one, replay_timeout=1e-9)  # any positive timeout


def test_the_subscribers_block_size_and_group_idx_reach_the_applier():
    """``block_size`` hashes a PrefixIndex's blocks (and overrides a router-like target's own);
    ``group_idx`` picks the KV-cache group followed — the default, 0, skips other groups'
    events. Blocks are indexed under ``BlockHasher``'s hashes of the same tokens."""
    tokens = list(range(64))
    one = {"w": "tcp://127.0.0.1:1"}
    big = P.batch([P.map16(P.stored_fields([1, 2], None, tokens, 32))])
    index = PrefixIndex()
    KvEventSubscriber(index, one, block_size=32).applier.apply("w", big)
    assert index.match(own(tokens, block_size=32)) == {"w": 2}

    class Target:
        index = PrefixIndex()
        block_size = 16
        hash_profile = "native"

    target = Target()
    KvEventSubscriber(target, one, block_size=32).applier.apply("w", big)
    assert target.index.match(own(tokens, block_size=32)) == {"w": 2}

    group1 = P.batch([P.map16(P.stored_fields([1], None, tokens[:16], 16, group_idx=1))])
    default, chosen = PrefixIndex(), PrefixIndex()
    sub = KvEventSubscriber(default, one)
    sub.applier.apply("w", group1)
    assert default.match(own(tokens[:16])) == {}
    assert sub.applier.stats("w")["skipped_other_group"] == 1
    KvEventSubscriber(chosen, one, group_idx=1).applier.apply("w", group1)
    assert chosen.match(own(tokens[:16])) == {"w": 1}


def test_seconds_since_event_is_the_time_since_the_last_message(engines):
    """``seconds_since_event`` lies between 0 and the time since the test published the message
    (both read from the same monotonic clock): not a duration the test waits for."""
    engine = engines(replay=False)
    with KvEventSubscriber(PrefixIndex(), {"w": engine.endpoint}) as sub:
        assert sub.stats()["w"]["seconds_since_event"] is None
        engine.wait_subscriber()
        before = time.monotonic()
        engine.publish(stored([1], None, range(16)))
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 0, "seq 0")
        since = sub.stats()["w"]["seconds_since_event"]
        assert 0.0 <= since <= time.monotonic() - before


def test_rcvhwm_and_its_default_reach_the_sub_socket(engines):
    """The SUB socket's receive high-water mark: ``rcvhwm``, by default 100,000 messages (the
    default stated in the docstring of ``KvEventSubscriber.__init__``'s ``rcvhwm``)."""
    engine = engines(replay=False)
    for kwargs, expected in (({}, 100_000), ({"rcvhwm": 7}, 7)):
        with KvEventSubscriber(PrefixIndex(), {"w": engine.endpoint}, **kwargs) as sub:
            engine.wait_subscriber()
            assert sub._workers["w"].sub.getsockopt(zmq.RCVHWM) == expected


def test_the_poll_waits_until_the_earliest_replay_deadline(monkeypatch):
    """The poll thread's wait: a second when no replay runs; else until the earliest replay
    deadline, rounded up to the next millisecond (so it never wakes before it, nor more than
    1 ms after), and 0 once a deadline has passed. Bounds from the test's own readings of the
    same monotonic clock, then exact on a clock that stands still, at distances up to an hour."""
    sub = KvEventSubscriber(PrefixIndex(), {"a": "tcp://127.0.0.1:1", "b": "tcp://127.0.0.1:2"})
    a, b = sub._workers["a"], sub._workers["b"]
    assert sub._poll_timeout() == 1000
    b.replay_deadline = time.monotonic() - 1.0  # not replaying: its deadline does not count
    assert sub._poll_timeout() == 1000
    a.replaying = b.replaying = True
    for soon, later in ((0.25, 0.5), (0.5, 0.25)):
        before = time.monotonic()
        a.replay_deadline, b.replay_deadline = before + soon, before + later
        waited = sub._poll_timeout()
        after = time.monotonic()
        first = before + 0.25
        assert int((first - after) * 1000) + 1 <= waited <= int((first - before) * 1000) + 1
    a.replay_deadline = time.monotonic() - 0.5  # passed
    assert sub._poll_timeout() == 0
    now = 1000.0
    monkeypatch.setattr(time, "monotonic", lambda: now)
    for soon in (0.0005, 0.25, 0.2505, 5.0, 7.4999, 60.0, 3600.0):
        a.replay_deadline, b.replay_deadline = now + soon + 1.0, now + soon
        ms = (b.replay_deadline - now) * 1000
        assert ms <= sub._poll_timeout() <= ms + 1, soon


def test_stats_over_an_event_sink_are_the_subscribers_own(engines):
    """Over ``kvroute relay``'s outbox — an event sink whose stats are its own message counts,
    with none of the applier's counters — a worker's row still holds the subscriber's: a gap
    without replay and a restart each clear the worker (``resets``), a short sequence frame is
    malformed; the outbox's counts (batches and clears it queued) are passed through."""
    from kvroute.cluster.relay import _Outbox

    engine = engines(replay=False)
    outbox = _Outbox(max_pending=100)
    payloads = chain_payloads(list(range(48)), 3)
    with KvEventSubscriber(outbox, {"w": engine.endpoint}) as sub:
        assert sub.applier is outbox
        engine.wait_subscriber()
        engine.publish(payloads[0])
        engine.publish(payloads[1], send=False)
        engine.publish(payloads[2])  # a gap, no replay endpoint: cleared
        wait_for(lambda: sub.stats()["w"]["last_seq"] == 2, "seq 2")
        engine.restart()
        engine.publish(payloads[0])  # number 0 again: a restart, cleared
        wait_for(lambda: sub.stats()["w"]["restarts"] == 1, "the restart")
        engine.send_raw([b"", b"\x00" * 7, payloads[0]])
        wait_for(lambda: sub.stats()["w"]["malformed"] == 1, "the malformed frame")
        s = sub.stats()["w"]
    assert s.pop("stale") is False and s.pop("seconds_since_event") >= 0
    assert s == {
        **{"batch": 3, "clear": 2, "fresh": 0},  # the outbox's own counts
        **{"endpoint": engine.endpoint, "replay_endpoint": None, "last_seq": 0},
        **{"gaps": 1, "replays": 0, "replay_failures": 0, "resets": 2, "restarts": 1},
        **{"disconnects": 0, "errors": 0, "pending": 0, "pending_bytes": 0},
        **{"replay_socket_failures": 0},
        **{"malformed": 1, "malformed_frames": 1, "malformed_payloads": 0},
    }


def test_the_default_replay_buffer_bounds():
    """The defaults the class docstring states: during a replay up to 100,000 live messages
    (``max_pending``) and 64 MiB (``max_pending_bytes``) are buffered; one message more gives
    the replay up — the worker is cleared and follows the live stream from the buffered
    messages. Driven through the poll thread's live handler without sockets (100,001 ZMQ
    messages would take seconds); the payloads are empty batches, or malformed ones."""
    empty = P.batch([])
    sub = KvEventSubscriber(PrefixIndex(), {"w": "tcp://127.0.0.1:1"})
    w = sub._workers["w"]
    w.replaying, w.expected = True, 0  # a replay from 0, no DEALER to replace
    for seq in range(1, 100_001):
        sub._on_live(w, seq, empty)
    assert (len(w.pending), w.replaying) == (100_000, True)
    sub._on_live(w, 100_001, empty)
    s = sub.stats()["w"]
    assert (s["pending"], s["stale"], s["replay_failures"], s["resets"]) == (0, False, 1, 1)
    assert (s["batches"], s["last_seq"]) == (100_001, 100_001)

    sub = KvEventSubscriber(PrefixIndex(), {"w": "tcp://127.0.0.1:1"})
    w = sub._workers["w"]
    w.replaying, w.expected = True, 0
    sub._on_live(w, 1, bytes(64 << 20))  # exactly the bound
    assert (w.pending_bytes, w.replaying) == (64 << 20, True)
    sub._on_live(w, 2, b"x")
    s = sub.stats()["w"]
    assert (s["pending_bytes"], s["replay_failures"], s["malformed"], s["last_seq"]) == (0, 1, 2, 2)


def test_applier_for_defaults():
    """``applier_for(index)`` with nothing else: rehashed 16-token blocks of the native profile,
    KV-cache group 0 — the applier's own defaults, read back from it."""
    applier = applier_for(PrefixIndex())
    assert (applier.mode, applier.block_size, applier.hash_profile) == ("rehash", 16, "native")
    assert applier.group_idx == 0


def test_workers_a_bind_or_replay_mapping_leaves_out_connect_without_replay(engines):
    """``bind`` and ``replay`` given as mappings apply to the workers they name; every other
    worker keeps the defaults: its SUB socket connects (to an engine that binds its endpoint)
    and it has no replay endpoint — a gap clears it."""
    import socket

    engine = engines()  # binds its endpoint and its replay ROUTER
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bound = f"tcp://127.0.0.1:{port}"  # the subscriber binds it, a publisher connects
    index = PrefixIndex()
    tokens = list(range(16 * 3))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoints = {"a": engine.endpoint, "b": bound}
    sub = KvEventSubscriber(
        index, endpoints, bind={"b": True}, replay={"b": engine.replay_endpoint}
    )
    try:
        with sub:
            engine.wait_subscriber()
            pub.connect(bound)
            assert pub.poll(10_000), "the subscription never arrived"
            payloads = chain_payloads(tokens, 3)
            engine.publish(payloads[0])
            engine.publish(payloads[1], send=False)  # lost: "a" has no replay endpoint
            engine.publish(payloads[2])
            pub.send_multipart([b"", (0).to_bytes(8, "big"), payloads[0]])
            wait_for(lambda: sub.stats()["a"]["last_seq"] == 2, "a's seq 2")
            wait_for(lambda: sub.stats()["b"]["last_seq"] == 0, "b's seq 0")
            s = sub.stats()
    finally:
        pub.close(linger=0)
        ctx.term()
    assert (s["a"]["replay_endpoint"], s["b"]["replay_endpoint"]) == (None, engine.replay_endpoint)
    assert (s["a"]["gaps"], s["a"]["replays"], s["a"]["resets"]) == (1, 0, 1)
    assert engine.replay_requests == []
    assert index.match(own(tokens)) == {"b": 1}  # "a"'s chain lost its parent in the gap


class _FakeSocket:
    """A socket of ``_FakeZmq``: a queue of messages, read without blocking."""

    def __init__(self, monitor: _FakeSocket | None = None) -> None:
        self.queue: list[list[bytes]] = []
        self.monitor = monitor

    def setsockopt(self, *args):
        pass

    def bind(self, endpoint):
        pass

    connect = bind

    def get_monitor_socket(self, events):
        return self.monitor

    def disable_monitor(self):
        pass

    def close(self, linger=None):
        pass

    def recv_multipart(self, flags=0):
        if not self.queue:
            raise zmq.ZMQError(zmq.EAGAIN)
        return self.queue.pop(0)

    def recv(self, flags=0):  # the stop socket, reported once every queue is empty
        return b"stop"


class _FakeZmq:
    """What the poll thread uses of pyzmq, over ``_FakeSocket`` queues: a poll reports every
    registered socket holding messages, in registration order (as libzmq's ``zmq_poll`` does),
    and the stop socket once none does."""

    def __init__(self) -> None:
        for name in ("PAIR", "SUB", "DEALER", "LINGER", "RCVHWM", "SUBSCRIBE", "POLLIN"):
            setattr(self, name, getattr(zmq, name))
        self.NOBLOCK, self.EVENT_DISCONNECTED, self.ZMQError = (
            zmq.NOBLOCK,
            zmq.EVENT_DISCONNECTED,
            zmq.ZMQError,
        )
        self.subs: list[_FakeSocket] = []
        fake = self

        class Context:
            def socket(self, kind):
                s = _FakeSocket(_FakeSocket()) if kind == zmq.SUB else _FakeSocket()
                if kind == zmq.SUB:
                    fake.subs.append(s)
                return s

        class Poller:
            def __init__(self) -> None:
                self.sockets: list[_FakeSocket] = []

            def register(self, sock, flags=0):
                self.sockets.append(sock)

            def unregister(self, sock):
                self.sockets.remove(sock)

            def poll(self, timeout=None):
                ready = [(s, zmq.POLLIN) for s in self.sockets if s.queue]
                return ready or [(self.sockets[0], zmq.POLLIN)]  # nothing left: stop

        self.Context, self.Poller = Context, Poller


def test_a_flooded_engine_yields_to_the_others_after_1024_messages():
    """The poll thread reads at most 1,024 messages of one socket before it serves the other
    sockets ready (the module docs): a flooded engine does not starve the others. Driven over
    fake sockets (the order of a real poll's arrivals is not the test's to choose)."""
    applied = []

    class Sink:
        def apply(self, worker, payload):
            applied.append((worker, int(payload)))

        def clear(self, worker):
            applied.append((worker, "clear"))

        def stats(self):
            return {}

    def frames(k):
        return [b"", k.to_bytes(8, "big"), str(k).encode()]

    fake = _FakeZmq()

    class Filled(fake.Poller):
        def register(self, sock, flags=0):
            super().register(sock, flags)
            if len(fake.subs) == 2 and sock is fake.subs[1].monitor:  # every socket made
                fake.subs[0].queue += [frames(k) for k in range(1030)]
                fake.subs[1].queue.append(frames(0))

    fake.Poller = Filled
    sub = KvEventSubscriber(Sink(), {"a": "tcp://127.0.0.1:1", "b": "tcp://127.0.0.1:2"})
    sub._zmq, sub._ctx = fake, fake.Context()
    sub._run()  # returns at the first poll that finds every queue empty
    assert applied == [
        *(("a", k) for k in range(1024)),
        ("b", 0),
        *(("a", k) for k in range(1024, 1030)),
    ]
