"""The ``[cluster]`` section of a server's TOML file: router replicas sharing state over NATS.

Read with the loader every kvroute server shares (``kvroute.server.config.Table``): an unknown
key, a wrong type or a bad value is an error naming the key. Without a ``[cluster]`` table the
server runs alone, exactly as before. Example (every key shown, with its default)::

    [cluster]
    nats = "nats://127.0.0.1:4222"   # or a list of URLs of one NATS cluster (JetStream on)
    stream = "KVROUTE_SYNC"          # JetStream stream of the replicas' updates
    subject = "kvroute.sync"         # its subject
    snapshots = "kvroute-snapshots"  # object-store bucket of model snapshots
    snapshot_interval = 30.0         # seconds between snapshots written by each replica
    publish_interval = 0.005         # seconds between two drains of the router's updates
    max_age = 3600.0                 # seconds the stream keeps updates (older: snapshot only)
    max_pending = 10000              # update batches kept while NATS is unreachable
    connect_timeout = 2.0            # seconds per connection attempt
    scrape_interval = 1.0            # seconds between engine /metrics scrapes; 0: off
    scrape_timeout = 0.5
    name = ""                        # this replica's name in logs and /health (default: host-pid)
    relay = false                    # index = "events": read the engines' KV events from the
                                     # stream `kvroute relay` fills, not from each engine's ZMQ
    events_stream = "KVROUTE_EVENTS" # the relay's stream
    events_subject = "kvroute.events"
    relay_heartbeat = 0.5            # seconds between the relay's heartbeats; a follower that
                                     # hears none for 3 of the relay's intervals marks its
                                     # workers stale (fresh again at the next one)
    share_limits = true              # the gateway's rate limits hold for all replicas together
    limits_subject = "kvroute.limits"  # plain NATS subject of what each replica takes from them
    limits_interval = 0.002          # seconds at least between two of a replica's messages
                                     # there (sent as soon as it takes, coalesced meanwhile)
    share_responses = true           # each replica knows which worker holds every stored
                                     # /v1/responses response any replica served
    responses_subject = "kvroute.responses"  # plain NATS subject of those (sent at most every
                                     # limits_interval, as the limits' messages)
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvroute.server.config import Table

__all__ = ["ClusterConfig", "parse_cluster"]


@dataclass(frozen=True)
class ClusterConfig:
    """Where the replicas meet (NATS JetStream) and how often they sync (see the module docs)."""

    nats: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    stream: str = "KVROUTE_SYNC"
    subject: str = "kvroute.sync"
    snapshots: str = "kvroute-snapshots"
    snapshot_interval: float = 30.0
    publish_interval: float = 0.005
    max_age: float = 3600.0
    max_pending: int = 10_000
    connect_timeout: float = 2.0
    scrape_interval: float = 1.0
    scrape_timeout: float = 0.5
    name: str = ""
    relay: bool = False
    events_stream: str = "KVROUTE_EVENTS"
    events_subject: str = "kvroute.events"
    relay_heartbeat: float = 0.5
    share_limits: bool = True
    limits_subject: str = "kvroute.limits"
    limits_interval: float = 0.002
    share_responses: bool = True
    responses_subject: str = "kvroute.responses"

    @property
    def replica_name(self) -> str:
        """The configured name, or ``host-pid``."""
        return self.name or f"{socket.gethostname()}-{os.getpid()}"


_TOKEN = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def _token(t: Table, key: str, default: str, extra: str = "") -> str:
    value = t.get(key, str, default)
    if not value or not set(value) <= _TOKEN | set(extra):
        raise ValueError(
            f"{t.where}.{key} must be letters, digits, '-' or '_'"
            + (f" (or {extra!r})" if extra else "")
            + f", got {value!r}"
        )
    return value


def parse_cluster(top: Table) -> ClusterConfig | None:
    """``[cluster]`` of a parsed document, or None when the section is absent."""
    if "cluster" not in top.data:
        top.used.add("cluster")
        return None
    c = top.table("cluster")
    d = ClusterConfig()
    raw = c.get("nats", (str, list), list(d.nats))
    urls = [raw] if isinstance(raw, str) else raw
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"{c.where}.nats must be a URL or a list of URLs, got {raw!r}")
    for u in urls:
        if not u.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"{c.where}.nats must be nats:// URLs, got {u!r}")
        if not urlsplit(u).netloc:
            raise ValueError(f"{c.where}.nats must name a host, got {u!r}")
    config = ClusterConfig(
        nats=tuple(urls),
        stream=_token(c, "stream", d.stream),
        subject=_token(c, "subject", d.subject, "."),
        snapshots=_token(c, "snapshots", d.snapshots),
        snapshot_interval=c.positive("snapshot_interval", float, d.snapshot_interval),
        publish_interval=c.positive("publish_interval", float, d.publish_interval),
        max_age=c.positive("max_age", float, d.max_age),
        max_pending=c.positive("max_pending", int, d.max_pending),
        connect_timeout=c.positive("connect_timeout", float, d.connect_timeout),
        scrape_interval=c.positive("scrape_interval", float, d.scrape_interval, zero=True),
        scrape_timeout=c.positive("scrape_timeout", float, d.scrape_timeout),
        name=c.get("name", str, d.name),
        relay=c.get("relay", bool, d.relay),
        events_stream=_token(c, "events_stream", d.events_stream),
        events_subject=_token(c, "events_subject", d.events_subject, "."),
        relay_heartbeat=c.positive("relay_heartbeat", float, d.relay_heartbeat),
        share_limits=c.get("share_limits", bool, d.share_limits),
        limits_subject=_token(c, "limits_subject", d.limits_subject, "."),
        limits_interval=c.positive("limits_interval", float, d.limits_interval),
        share_responses=c.get("share_responses", bool, d.share_responses),
        responses_subject=_token(c, "responses_subject", d.responses_subject, "."),
    )
    c.done()
    for key in ("subject", "events_subject", "limits_subject", "responses_subject"):
        subject = getattr(config, key)
        if subject.startswith(".") or subject.endswith(".") or ".." in subject:
            raise ValueError(f"{c.where}.{key} must be dot-separated tokens, got {subject!r}")
    if config.stream == config.events_stream or config.subject == config.events_subject:
        raise ValueError(f"{c.where}: the events stream and subject must differ from the sync's")
    for key, others in (
        ("limits_subject", ("subject", "events_subject")),
        ("responses_subject", ("subject", "events_subject", "limits_subject")),
    ):
        # A stream's subject: JetStream would keep the messages, and its consumers read them.
        if getattr(config, key) in {getattr(config, o) for o in others}:
            raise ValueError(
                f"{c.where}.{key} must differ from {' and '.join(others)}, "
                f"got {getattr(config, key)!r}"
            )
    for key in (
        "snapshot_interval",
        "publish_interval",
        "max_age",
        "relay_heartbeat",
        "limits_interval",
    ):
        if not math.isfinite(getattr(config, key)):
            raise ValueError(f"{c.where}.{key} must be finite")
    return config
