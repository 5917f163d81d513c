"""A test upstream that publishes its prefix cache's changes as KV events over ZMQ, like SGLang,
for the gateway's and the EPP's events-mode tests (needs pyzmq: the ``events`` extra)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import zmq

from support import events_payloads as P
from support.gateway_fleet import Fleet
from support.gateway_upstream import BLOCK, Upstream

__all__ = [
    "PublishingUpstream",
    "indexed",
    "publishing_fleet",
    "wait_subscribed",
    "with_kv_events",
]


class PublishingUpstream(Upstream):
    """An upstream that publishes its cache changes like SGLang (engine hashes = its own
    ``BlockHasher`` values as signed int64, token ids of the stored blocks, the salt)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.events_endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = itertools.count()
        self.zlock = threading.Lock()

    def wait_subscribed(self) -> None:
        self.pub.setsockopt(zmq.RCVTIMEO, 10_000)
        self.pub.recv()  # the subscriber's subscription message

    def on_cache_change(self, hashes, matched, stored, evicted, tokens, salt) -> None:
        events = []
        if len(evicted):
            events.append(P.sglang_removed([_signed(h) for h in evicted]))
        if stored > matched:
            new = [_signed(h) for h in hashes[matched:stored]]
            parent = _signed(hashes[matched - 1]) if matched else None
            events.append(
                P.sglang_stored(
                    new, parent, tokens[matched * BLOCK : stored * BLOCK], BLOCK, cache_salt=salt
                )
            )
        if events:
            with self.zlock:
                seq = next(self.seq).to_bytes(8, "big")
                self.pub.send_multipart([b"", seq, P.batch(events)])

    def close(self) -> None:
        self.pub.close(0)
        self.ctx.term()


@contextlib.contextmanager
def publishing_fleet(n: int) -> Iterator[Fleet]:
    """``n`` publishing upstreams (up-0 …), stopped and closed on exit."""
    fleet = Fleet(n, factory=PublishingUpstream)
    try:
        yield fleet
    finally:
        fleet.close()
        for u in fleet.upstreams:
            u.close()


def with_kv_events(cfg: dict[str, Any], fleet: Fleet) -> dict[str, Any]:
    """``cfg`` (a config dict of ``fleet``) with each worker's ``kv_events`` set to its
    upstream's publisher."""
    for w, u in zip(cfg["workers"], fleet.upstreams, strict=True):
        w["kv_events"] = u.events_endpoint
    return cfg


def wait_subscribed(fleet: Fleet) -> None:
    """Waits until every upstream of ``fleet`` has a subscriber (its events are then heard)."""
    for u in fleet.upstreams:
        u.wait_subscribed()


def indexed(router: Any, worker: str) -> int:
    """Blocks the router's index holds for ``worker`` (0 before its first event)."""
    return router.index.num_blocks(worker) if worker in router.index.workers else 0


def _signed(h) -> int:
    h = int(h)
    return h - (1 << 64) if h >= 1 << 63 else h
