"""``kvroute epp`` with ``[epp.pool]`` in events mode: the pool's changes reach the KV-event
subscription one worker at a time. Real ZMQ publishers (support/events_engine.py), one per pod IP
on the pool's ``kv_events_port``; the pool's changes are given to the server as its watch gives
them (``members_of`` → ``_pool_changed``; the watch itself: tests/test_epp_pool.py).

- A pod that joins, leaves or turns unready leaves the other workers' subscriptions alone: an
  engine publishing all along loses nothing, and its publisher sees no subscriber leave or join.
- A pod replaced under its name (a new address) is a new engine: the old engine's blocks and load
  are gone from the router, and the new engine's events are followed under the name.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
from kvroute.epp.config import parse_config
from kvroute.epp.pool import members_of
from kvroute.epp.server import EppServer
from support.events_engine import chain_payloads, own, stored
from support.helpers import wait_for
from support.publishing_upstream import indexed


def pod(name: str, ip: str, *, ready: bool = True) -> dict[str, Any]:
    status = "True" if ready else "False"
    return {
        "metadata": {"name": name},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": status}]},
    }


def server(port: int) -> EppServer:
    return EppServer(
        parse_config(
            {
                "router": {"policy": "kv_aware", "index": "events", "block_size": 16},
                "epp": {
                    "models": ["m"],
                    "pool": {"name": "p", "namespace": "ml", "kv_events_port": port},
                },
            }
        )
    )


def test_a_pool_change_leaves_the_other_workers_subscriptions_alone(engines):
    a = engines(replay=False, host="127.0.0.2")
    port = int(a.endpoint.rsplit(":", 1)[1])
    b = engines(replay=False, host="127.0.0.3", port=port)
    srv = server(port)
    n = 300
    toks = [list(range(16 * i, 16 * i + 16)) for i in range(n)]

    def publish() -> None:  # the only user of a's socket until it is joined
        for i in range(n):
            a.publish(stored([10_000 + i], None, toks[i]))
            time.sleep(0.002)  # spread over the pool's changes (what is checked needs no timing)

    async def main() -> None:
        def change(**pods: dict[str, Any]) -> Any:
            return srv._pool_changed(members_of(srv.config.pool, [8000], pods))

        v0 = pod("vllm-0", "127.0.0.2")
        try:
            await change(**{"vllm-0": v0})
            a.wait_subscriber()
            publisher = threading.Thread(target=publish)
            publisher.start()
            await change(**{"vllm-0": v0, "vllm-1": pod("vllm-1", "127.0.0.3")})  # scale-up
            b.wait_subscriber()
            await change(**{"vllm-0": v0, "vllm-1": pod("vllm-1", "127.0.0.3", ready=False)})
            assert "vllm-1" not in srv.subscriber.workers
            await change(**{"vllm-0": v0, "vllm-1": pod("vllm-1", "127.0.0.3")})  # ready again
            no_engine = pod("vllm-2", "127.0.0.5")  # publishes nothing: connected all the same
            await change(
                **{"vllm-0": v0, "vllm-1": pod("vllm-1", "127.0.0.3"), "vllm-2": no_engine}
            )
            b.wait_subscriber()
            b.publish(stored([1], None, range(7000, 7016)))
            await asyncio.to_thread(publisher.join)
            a.publish(stored([1], None, range(9000, 9016)))  # the last: number n
            stats = srv.subscriber.stats
            await asyncio.to_thread(
                wait_for, lambda: stats()["vllm-0"]["last_seq"] == n, "vllm-0's last batch"
            )
            await asyncio.to_thread(
                wait_for, lambda: indexed(srv.router, "vllm-1") == 1, "vllm-1's batch"
            )
            index = srv.router.index
            held = [
                i
                for i in range(n)
                if index.match(np.array(own(toks[i]), dtype=np.uint64)).get("vllm-0") == 1
            ]
            assert held == list(range(n))  # every batch vllm-0 published, none lost
            row = stats()["vllm-0"]
            assert (row["gaps"], row["resets"], row["batches"]) == (0, 0, n + 1)
            assert a.subscriptions() == []  # its subscriber never left, none joined
        finally:
            await srv._stop_events()

    asyncio.run(main())


def test_a_pod_replaced_under_its_name_is_a_new_engine(engines):
    old = engines(replay=False, host="127.0.0.2")
    port = int(old.endpoint.rsplit(":", 1)[1])
    other = engines(replay=False, host="127.0.0.3", port=port)
    new = engines(replay=False, host="127.0.0.4", port=port)
    srv = server(port)
    router = srv.router
    prompt = list(range(8 * 16))
    tokens = np.array(prompt, dtype=np.uint32)

    async def main() -> None:
        def change(ip: str) -> Any:
            pods = {"vllm-0": pod("vllm-0", ip), "vllm-1": pod("vllm-1", "127.0.0.3")}
            return srv._pool_changed(members_of(srv.config.pool, [8000], pods))

        try:
            await change("127.0.0.2")
            old.wait_subscriber()
            other.wait_subscriber()
            for payload in chain_payloads(prompt, 8):
                old.publish(payload)
            other.publish(stored([1], None, range(7000, 7016)))
            await asyncio.to_thread(
                wait_for, lambda: indexed(router, "vllm-0") == 8, "the old engine's blocks"
            )
            await asyncio.to_thread(wait_for, lambda: indexed(router, "vllm-1") == 1, "vllm-1")
            running = router.route(tokens=tokens, exclude=["vllm-1"])
            assert running.cached_tokens == len(prompt)
            router.begin(running)
            assert router.load("vllm-0")["active"] == 1

            await change("127.0.0.4")  # deleted and recreated: a new IP, an empty cache
            assert srv.picker.members["vllm-0"].address == "127.0.0.4:8000"
            assert indexed(router, "vllm-0") == 0
            assert router.load("vllm-0")["active"] == 0
            assert router.route(tokens=tokens, exclude=["vllm-1"]).cached_tokens == 0
            router.finish(running)  # the old engine's request ends: nothing of the new one's
            assert router.load("vllm-0")["active"] == 0
            assert srv.subscriber.stats()["vllm-0"]["endpoint"] == f"tcp://127.0.0.4:{port}"
            new.wait_subscriber()
            for payload in chain_payloads(prompt, 2):
                new.publish(payload)
            await asyncio.to_thread(
                wait_for, lambda: indexed(router, "vllm-0") == 2, "the new engine's blocks"
            )
            assert other.subscriptions() == []  # vllm-1, unchanged, kept its subscriber
        finally:
            await srv._stop_events()

    asyncio.run(main())


def test_the_picker_alone_forgets_a_replaced_pods_engine():
    """Without a subscriber of its own (events from ``kvroute relay``'s stream) the picker is what
    drops the old engine: its blocks in the index go with the router's worker."""
    from kvroute import BlockHasher
    from kvroute.epp.picker import Picker

    srv_config = server(5557).config
    picker = Picker(srv_config)
    router = picker.router

    def change(ip: str) -> None:
        pods = {"vllm-0": pod("vllm-0", ip), "vllm-1": pod("vllm-1", "10.0.0.6")}
        picker.set_members(members_of(srv_config.pool, [8000], pods))

    change("10.0.0.5")
    tokens = np.arange(4096, dtype=np.uint32)
    router.index.store("vllm-0", BlockHasher(router.block_size).hash(tokens))
    assert router.route(tokens=tokens, exclude=["vllm-1"]).cached_tokens == 4096
    with pytest.raises(ValueError, match="several workers have the address"):
        change("10.0.0.6")  # vllm-1's address: refused, nothing changed
    assert indexed(router, "vllm-0") == 256
    change("10.0.0.9")
    assert indexed(router, "vllm-0") == 0
    assert router.route(tokens=tokens, exclude=["vllm-1"]).cached_tokens == 0
    assert sorted(router.workers) == ["vllm-0", "vllm-1"]
