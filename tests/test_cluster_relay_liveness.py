"""``kvroute relay``'s liveness as its followers see it: heartbeats (a dead relay's workers marked
stale, fresh again when it resumes; a loss at a worker's tail found by the heartbeat's numbers),
its ``/metrics`` and ``/health`` endpoint, and two relay instances at once (the followers follow
the newest). Over a real NATS server and the ``kvroute relay`` command where it matters."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvroute import KvEventApplier, PrefixIndex
from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.relay import MISSED_HEARTBEATS, EventFollower
from support import events_payloads as P
from support.events_engine import Engine
from support.gateway_fleet import wait_for
from support.nats_server import NatsServer, free_port


class Freshness:
    """A router's freshness sink: what the follower marked, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def mark_stale(self, worker: str) -> None:
        self.calls.append(("stale", worker))

    def mark_fresh(self, worker: str) -> None:
        self.calls.append(("fresh", worker))


def follower(config: ClusterConfig | None = None) -> tuple[EventFollower, Freshness]:
    f = EventFollower(
        KvEventApplier(PrefixIndex(), mode="direct", hash_profile="sglang"),
        config or ClusterConfig(),
    )
    f.freshness = sink = Freshness()
    return f, sink


def blocks(f: EventFollower, worker: str) -> int:
    index = f.applier.index
    return index.num_blocks(worker) if worker in index.workers else 0


def stored(*chain: int) -> bytes:
    return P.batch([P.sglang_stored(list(chain), None, list(range(16 * len(chain))), 16)])


def msg(relay: str, n: int, kind: str = "batch", worker: str = "e-0") -> dict[str, str]:
    return {
        "Kvroute-Relay": relay,
        "Kvroute-Worker": worker,
        "Kvroute-Seq": str(n),
        "Kvroute-Kind": kind,
    }


def beat(relay: str, settled: dict[str, int], interval: float = 0.05) -> tuple[dict, bytes]:
    headers = {
        "Kvroute-Relay": relay,
        "Kvroute-Kind": "heartbeat",
        "Kvroute-Interval": str(interval),
    }
    return headers, json.dumps({"workers": settled}).encode()


def test_a_killed_relay_marks_its_workers_stale_and_its_endpoint_answers(tmp_path: Path):
    """``kvroute relay --port`` serves /health (200 while connected to NATS) and /metrics (its
    heartbeats counted); SIGKILLed, its followers — still connected to NATS — mark its worker
    stale once MISSED_HEARTBEATS intervals pass without a heartbeat (before: fresh forever,
    review13 r14)."""
    engine = Engine(replay=False)
    with NatsServer(tmp_path / "js") as nats:
        port = free_port()  # picked while NATS holds its own: never the same
        (tmp_path / "f.toml").write_text(
            f'[router]\nindex = "events"\n[cluster]\nnats = "{nats.url}"\nrelay = true\n'
            "relay_heartbeat = 0.1\nconnect_timeout = 0.5\n"
            f'[[workers]]\nname = "e-0"\nurl = "http://127.0.0.1:1"\n'
            f'kv_events = "{engine.endpoint}"\n'
        )
        relay = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvroute.cli", "relay"),
                *("--config", str(tmp_path / "f.toml"), "--port", str(port), "--host", "127.0.0.1"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        f, sink = follower(ClusterConfig(nats=(nats.url,), connect_timeout=0.5, name="t"))
        try:

            def get(path: str) -> httpx.Response | None:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2)
                except httpx.HTTPError:
                    return None

            wait_for(lambda: (r := get("/health")) is not None and r.status_code == 200, "/health")
            health = get("/health")
            assert health is not None and health.json()["connected"] is True
            metrics = get("/metrics")
            assert metrics is not None and metrics.status_code == 200
            assert 'kvroute_relay_published_total{kind="heartbeat"}' in metrics.text
            assert "kvroute_relay_connected 1" in metrics.text
            missing = get("/nothing")
            assert missing is not None and missing.status_code == 404

            async def run() -> None:
                f.start()
                await asyncio.to_thread(engine.wait_subscriber)
                engine.publish(P.batch([P.sglang_stored([1, 2, 3], None, list(range(48)), 16)]))
                while blocks(f, "e-0") != 3:
                    await asyncio.sleep(0.02)
                assert f.stats()["e-0"]["stale"] is False and sink.calls == []
                relay.send_signal(signal.SIGKILL)
                await asyncio.to_thread(relay.wait)
                while not sink.calls:  # what the router is told
                    await asyncio.sleep(0.02)
                assert f.connected  # NATS itself never went away
                assert f.stats()["e-0"]["stale"] is True
                await f.stop()

            asyncio.run(asyncio.wait_for(run(), 30))
            assert sink.calls == [("stale", "e-0")]
            assert f.skipped.get("relay_silent") == 1
            assert all(r["silent"] for r in f.describe()["relays"].values())
        finally:
            if relay.poll() is None:
                relay.kill()
                relay.wait()
            engine.close()


def test_heartbeats_mark_fresh_again_and_find_a_lost_tail():
    """Unit rules, no NATS: a relay silent for MISSED_HEARTBEATS of its intervals has its
    workers marked stale, fresh again at its next heartbeat (and only the relay's own workers);
    a heartbeat whose settled number is past the follower's last message of a worker clears
    that worker (a gap: the tail was dropped); a worker the relay itself said stale stays
    stale through heartbeats; malformed heartbeats change nothing."""
    f, sink = follower()
    f.connected = True  # as in a session (stale otherwise: no NATS)
    f.apply(msg("a", 1), stored(1, 2))
    f.apply(msg("b", 1, worker="e-1"), stored(5))  # another relay's worker, never heartbeating
    f.apply(*beat("a", {"e-0": 1}))
    assert f.skipped.get("gap") == 0 and blocks(f, "e-0") == 2
    f._refresh()
    assert sink.calls == []
    wait_for(lambda: f._silent("a"), f"{MISSED_HEARTBEATS} heartbeats to be missed", 10)
    f._refresh()
    assert sink.calls == [("stale", "e-0")]  # not e-1: relay b is not watched
    assert f.stats()["e-0"]["stale"] and not f.stats()["e-1"]["stale"]
    f.apply(*beat("a", {"e-0": 1}, interval=60.0))
    assert sink.calls == [("stale", "e-0"), ("fresh", "e-0")]
    assert blocks(f, "e-0") == 2  # a silence loses nothing
    f.apply(*beat("a", {"e-0": 3}, interval=60.0))  # 2 and 3 were dropped by the relay
    assert f.skipped.get("gap") == 1 and blocks(f, "e-0") == 0
    f.apply(msg("a", 4), stored(7))  # continues without another gap
    assert f.skipped.get("gap") == 1 and blocks(f, "e-0") == 1
    f.apply(msg("a", 5, "stale"), b"")
    f.apply(*beat("a", {"e-0": 5}, interval=60.0))
    assert f.stats()["e-0"]["stale"] and sink.calls[-1] == ("stale", "e-0")
    for headers, data in (
        ({**beat("a", {})[0], "Kvroute-Interval": "0"}, beat("a", {})[1]),
        ({**beat("a", {})[0], "Kvroute-Interval": "nan"}, beat("a", {})[1]),
        (beat("a", {})[0], b"not json"),
        (beat("a", {})[0], b'{"workers": {"e-0": "9"}}'),
        (beat("a", {})[0], b"[]"),
    ):
        f.apply(headers, data)
    assert f.skipped.get("malformed") == 5 and blocks(f, "e-0") == 1
    assert f.applied.get("heartbeat") == 4


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "x"])
def test_relay_heartbeat_config(bad: str):
    """``[cluster] relay_heartbeat``: positive seconds (0.5 by default)."""
    from kvroute.cluster.config import parse_cluster
    from kvroute.server.config import Table

    def cluster(**kw: Any) -> ClusterConfig | None:
        return parse_cluster(Table({"cluster": kw}, "config", root=True))

    assert ClusterConfig().relay_heartbeat == 0.5
    c = cluster(relay_heartbeat=2.0)
    assert c is not None and c.relay_heartbeat == 2.0
    value: Any = float(bad) if bad != "x" else bad
    with pytest.raises(ValueError, match=r"cluster\.relay_heartbeat"):
        cluster(relay_heartbeat=value)


def test_two_relays_at_once_cost_one_clear_and_the_newest_is_followed():
    """A rolling update's overlap: the old instance A and the new B publish the same engine
    batches, interleaved. The follower switches to B once (one clear) and ignores A from then
    on: it ends holding all 6 chains (before: a clear at every alternation, 11 clears and 2 of
    12 blocks kept, review13 r8). A message of the older A arriving first is applied until B's
    first one. A silent B gives way to A (whatever the clocks), which is cleared in once."""
    f, _ = follower()
    f.connected = True

    def from_(relay: str, started: int, n: int, kind: str = "batch") -> dict[str, str]:
        return {**msg(relay, n, kind), "Kvroute-Started": str(started)}

    chains = [(10 * i + 1, 10 * i + 2) for i in range(6)]
    f.apply(from_("a", 100, 99), stored(90, 91))  # A's history before B started
    for i, chain in enumerate(chains):
        f.apply(from_("a", 100, 100 + i), stored(*chain))
        f.apply(from_("b", 200, 1 + i), stored(*chain))
    assert f.skipped.get("relay_restart") == 1 and f.skipped.get("old_relay") == 5
    assert blocks(f, "e-0") == 12  # A's 90, 91 cleared at the switch; B's 6 chains kept
    assert f.stats()["e-0"]["relay"] == "b"
    # B goes silent (its heartbeat's interval is tiny); A's next message takes over.
    f.apply(*beat("b", {"e-0": 6}, interval=0.01))
    wait_for(lambda: f._silent("b"), "b to be silent", 10)
    f.apply(from_("a", 100, 106), stored(70))
    assert f.skipped.get("relay_restart") == 2 and blocks(f, "e-0") == 1
    assert f.stats()["e-0"]["relay"] == "a"
    f.apply(from_("a", 100, 107), stored(71))
    assert f.skipped.get("gap") == 0 and blocks(f, "e-0") == 2
    # Relays that do not send their start (older versions) switch at every change, as before.
    g, _ = follower()
    for i, chain in enumerate(chains[:2]):
        g.apply(msg("a", 100 + i), stored(*chain))
        g.apply(msg("b", 1 + i), stored(*chain))
    assert g.skipped.get("relay_restart") == 3 and g.skipped.get("old_relay") == 0
    for bad in ("x", "-1"):
        f.apply({**from_("a", 100, 108), "Kvroute-Started": bad}, stored(72))
    assert f.skipped.get("malformed") == 2 and blocks(f, "e-0") == 2
