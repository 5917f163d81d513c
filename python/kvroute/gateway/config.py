"""The gateway's configuration: a TOML file read into validated, immutable dataclasses.

The fleet's sections (``[[workers]]``, ``[router]``, ``[tokenizer]``, ``[events]``, the health keys)
are read by the loader every kvroute server shares (``kvroute.server.config``); this module adds
``[gateway]`` and ``[[endpoints]]``. Every value is checked when the file is loaded — an unknown
key, a wrong type, a duplicate name, an endpoint pool larger than the fleet — and the error names
the key and the bad value, so a gateway never starts half-configured. Secrets may be given as
SHA-256 digests (``api_key_sha256``) so that the file holds no plaintext key; plaintext keys are
hashed on load and only digests are kept in memory.

Example (every key shown; only ``[[workers]]`` is required)::

    [gateway]
    host = "127.0.0.1"
    port = 8000
    models = ["llama-3-8b"]          # names every worker serves, reachable directly
    api_keys = ["sk-direct"]         # keys for direct model access; none: open
    max_body_bytes = 16777216        # larger request bodies get 413
    max_attempts = 3                 # upstream attempts per request (failover), >= 1
    routing_headers = true           # x-kvroute-worker / -cached-tokens / -attempts on replies
    connect_timeout = 2.0            # seconds
    read_timeout = 300.0             # seconds between two bytes of an upstream response
    write_timeout = 30.0
    pool_timeout = 5.0               # waiting for a free upstream connection
    upstream_keepalive = 4.0         # idle upstream connections closed after (below the
                                     # upstream's own keep-alive: uvicorn's default is 5 s)
    keep_alive_timeout = 75.0        # idle client connections closed after
    health_path = "/health"          # probed on ejected workers until it answers 200
    health_interval = 1.0
    eject_seconds = 2.0              # minimum time a failed worker stays out
    eject_after = 3                  # failed requests in a row (5xx, reset) that eject a worker
    max_ejected_fraction = 0.5       # failures (not unreachability) never eject more of the fleet

    [router]                         # kvroute.Router(...)
    policy = "kv_aware"
    block_size = 16
    hash_profile = "native"
    index = "approx"                 # "events": fed by the workers' KV events
    options = { }                    # more keyword arguments for kvroute.Router, e.g.
                                     # { hash_algo = "sha256" } with hash_profile = "vllm" to
                                     # use a default vLLM engine's hashes as they are (direct)

    [tokenizer]
    model_dir = "/models/llama-3-8b"             # the served model's directory: its chat template
                                                 # and tokenizer.json give the engine's own tokens
    path = "/models/llama-3-8b/tokenizer.json"   # or only an HF `tokenizers` file (not the
                                                 # engine's tokens); neither: byte-level
    bytes_per_token = 4                          # byte-level fallback's pseudo-token width

    [events]                         # kvroute.events.KvEventSubscriber (index = "events")
    topic = ""
    mode = "rehash"

    [[workers]]
    name = "gpu-0"
    url = "http://10.0.0.1:8000"
    kind = "vllm"                    # "vllm" | "sglang" | "openai"
    weight = 1.0
    api_key = "..."                  # sent upstream as a bearer token
    max_connections = 256
    kv_events = "tcp://10.0.0.1:5557"
    kv_replay = "tcp://10.0.0.1:5558"
    kv_events_bind = false           # true: the gateway binds kv_events and the engine connects
                                     # (vLLM connects when its endpoint names a concrete host)

    [[endpoints]]
    id = "ep-acme"
    model = "llama-3-8b"             # the real model name sent upstream
    pool_size = 2
    reserved_blocks = 4096
    api_keys = ["sk-acme"]
    api_key_sha256 = ["9f86d0…"]     # hex digests, instead of or beside api_keys
    salt = "…"                       # the endpoint's block-hash salt (default: its id); a
                                     # secret salt keeps engines' caches unguessable too
    cache_salt = true                # send the endpoint's salt upstream to vllm/sglang workers
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.server.config import (
    WORKER_KINDS,
    EventsConfig,
    HealthConfig,
    RouterConfig,
    Table,
    TokenizerConfig,
    WorkerConfig,
    duplicates,
    key_digest,
    load_toml,
    parse_fleet,
    parse_health,
)

__all__ = [
    "WORKER_KINDS",
    "EndpointConfig",
    "EventsConfig",
    "GatewayConfig",
    "HealthConfig",
    "RouterConfig",
    "ServerConfig",
    "TokenizerConfig",
    "WorkerConfig",
    "key_digest",
    "load_config",
    "parse_config",
]


@dataclass(frozen=True)
class EndpointConfig:
    id: str
    model: str
    pool_size: int = 1
    reserved_blocks: int | None = None
    key_digests: tuple[bytes, ...] = ()
    salt: str | None = None
    cache_salt: bool = True

    @property
    def open(self) -> bool:
        """True when no API key is configured (anyone may call it)."""
        return not self.key_digests


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = ()
    key_digests: tuple[bytes, ...] = ()
    max_body_bytes: int = 16 * 1024 * 1024
    max_attempts: int = 3
    routing_headers: bool = True
    connect_timeout: float = 2.0
    read_timeout: float = 300.0
    write_timeout: float = 30.0
    pool_timeout: float = 5.0
    upstream_keepalive: float = 4.0
    keep_alive_timeout: float = 75.0


@dataclass(frozen=True)
class GatewayConfig:
    workers: tuple[WorkerConfig, ...]
    endpoints: tuple[EndpointConfig, ...] = ()
    server: ServerConfig = field(default_factory=ServerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def worker(self, name: str) -> WorkerConfig:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"unknown worker {name!r}")


def _endpoint(data: Any, i: int) -> EndpointConfig:
    t = Table(data, f"endpoints[{i}]")
    ep = EndpointConfig(
        id=t.require("id", str),
        model=t.require("model", str),
        pool_size=t.positive("pool_size", int, 1),
        reserved_blocks=t.positive("reserved_blocks", int, None, zero=True),
        key_digests=t.digests(),
        salt=t.get("salt", str, None) or None,
        cache_salt=t.get("cache_salt", bool, True),
    )
    if not ep.id or not ep.model:
        raise ValueError(f"{t.where}: id and model must not be empty")
    t.done()
    return ep


def _server(g: Table) -> ServerConfig:
    d = ServerConfig()
    server = ServerConfig(
        host=g.get("host", str, d.host),
        port=g.get("port", int, d.port),
        models=g.strings("models"),
        key_digests=g.digests(),
        max_body_bytes=g.positive("max_body_bytes", int, d.max_body_bytes),
        max_attempts=g.positive("max_attempts", int, d.max_attempts),
        routing_headers=g.get("routing_headers", bool, d.routing_headers),
        connect_timeout=g.positive("connect_timeout", float, d.connect_timeout),
        read_timeout=g.positive("read_timeout", float, d.read_timeout),
        write_timeout=g.positive("write_timeout", float, d.write_timeout),
        pool_timeout=g.positive("pool_timeout", float, d.pool_timeout),
        upstream_keepalive=g.positive("upstream_keepalive", float, d.upstream_keepalive),
        keep_alive_timeout=g.positive("keep_alive_timeout", float, d.keep_alive_timeout),
    )
    if not 0 <= server.port < 65536:
        raise ValueError(f"gateway.port must be in 0..65535, got {server.port!r}")
    return server


def parse_config(data: Mapping[str, Any]) -> GatewayConfig:
    """Validates a parsed TOML document (a dict) into a ``GatewayConfig``."""
    top = Table(data, "config", root=True)
    g = top.table("gateway")
    server = _server(g)
    health = parse_health(g)
    g.done()
    fleet = parse_fleet(top, health)

    endpoints = tuple(_endpoint(e, i) for i, e in enumerate(top.get("endpoints", list, [])))
    ids = [e.id for e in endpoints]
    dup = duplicates(ids)
    if dup:
        raise ValueError(f"duplicate endpoint id(s): {dup}")
    clash = sorted(set(ids) & set(server.models))
    if clash:
        raise ValueError(f"endpoint id(s) {clash} are also listed in gateway.models")
    for e in endpoints:
        if e.pool_size > len(fleet.workers):
            raise ValueError(
                f"endpoint {e.id!r}: pool_size {e.pool_size} exceeds the {len(fleet.workers)} "
                "workers"
            )
    top.done()
    return GatewayConfig(
        workers=fleet.workers,
        endpoints=endpoints,
        server=server,
        router=fleet.router,
        tokenizer=fleet.tokenizer,
        events=fleet.events,
        health=fleet.health,
    )


def load_config(path: str | Path) -> GatewayConfig:
    """Reads and validates a TOML configuration file."""
    return parse_config(load_toml(path))
