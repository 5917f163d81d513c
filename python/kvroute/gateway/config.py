"""The gateway's configuration: a TOML file read into validated, immutable dataclasses.

The fleet's sections (``[[workers]]``, ``[router]``, ``[tokenizer]``, ``[events]``, the health keys)
are read by the loader every kvroute server shares (``kvroute.server.config``); this module adds
``[gateway]`` and ``[[endpoints]]``; ``[cluster]`` is ``kvroute.cluster.config``'s. Every value
is checked when the file is loaded — an unknown
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
    header_timeout = 10.0            # a request's line and headers must arrive within (else 408)
    body_timeout = 30.0              # a request's body must arrive within (else 408)
    client_write_timeout = 60.0      # a client that reads nothing of its response for this
                                     # long is disconnected (499; its upstream request
                                     # cancelled, its slots freed), as nginx's send_timeout
    max_connections = 1024           # open client connections (past it the longest-waiting idle
                                     # one is closed; none idle: the new one is refused)
    max_response_bytes = 33554432    # a larger non-streamed upstream reply is answered 502
    max_event_bytes = 8388608        # a larger SSE event (no blank line) ends the stream with an
                                     # error event
    admin_host = "127.0.0.1"         # the admin listener (/metrics, /health with worker names) …
    admin_port = 9100                # … only when a port is given
    admin_api_keys = ["sk-admin"]    # bearer keys for /metrics and /health details (any listener)
    key_requests_per_minute = 600    # per configured API key (callers without one share one)
    key_tokens_per_minute = 2000000  # prompt routing tokens + reported completion tokens
    max_in_flight = 1024             # fleet bound; past it tenants get their weighted fair share
    max_in_flight_per_worker = 64    # default: the worker's max_connections; above a
                                     # worker's max_connections the file is refused
    prefill_tokens_per_second = 20000  # for x-slo-ttft-ms shedding; default: learned from streams
                                       # (with a fixed base per request: gateway/admission.py)
    cache_usage_fields = true        # add prompt_cache_hit_tokens / _miss_tokens to usage
    health_path = "/health"          # probed on ejected workers until it answers 200
    health_interval = 1.0
    eject_seconds = 2.0              # minimum time a failed worker stays out
    eject_after = 3                  # failed requests in a row (5xx, reset) that eject a worker
    max_ejected_fraction = 0.5       # failures (not unreachability) never eject more of the fleet

    [router]                         # kvroute.Router(...); a key left out takes the Router's
                                     # default (shown here; Router.config has those in effect)
    policy = "kv_aware"
    block_size = 16                  # the engines' KV block size (vLLM >= 0.34 on GPU: 64), or
                                     # a divisor of each (its cached prefixes are then counted
                                     # in whole blocks of its own size, learnt from events or
                                     # each vLLM worker's /metrics)
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
    exclude_tools_when_tool_choice_none = false  # as the engines' vLLM flag of that name

    [events]                         # kvroute.events.KvEventSubscriber (index = "events")
    topic = ""
    mode = "rehash"

    [cluster]                        # replicas sharing routing state over NATS JetStream and
    nats = "nats://127.0.0.1:4222"   # reading the engines' /metrics: every key is in
    scrape_interval = 1.0            # kvroute.cluster.config (absent: this gateway runs alone)

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
    role = "both"                    # "prefill" | "decode" | "both" (roles need [pd];
                                     # under protocol "sglang" only "prefill" | "decode")
    bootstrap_port = 8998            # SGLang prefill servers' --disaggregation-bootstrap-port
    bootstrap_host = "10.0.0.1"      # default: the url's host

    [pd]                             # route every request as a prefill/decode pair
    protocol = "vllm"                # KV hand-over: "vllm" (KV connector, e.g. NIXL) | "sglang"
    threshold = 2048                 # Router pd_threshold: prefill on the decode worker when it
                                     # lacks at most this many prompt tokens (vllm only)
    saturation = 2.0                 # Router pd_saturation, > 0 (default: never saturated;
                                     # vllm only)

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
    requests_per_minute = 120        # the endpoint's own limits (token buckets, 429 + Retry-After)
    tokens_per_minute = 500000
    weight = 1.0                     # its fair share of the fleet under overload
    warm_interval = 60.0             # keep the pool's shared prefix warm: every 60 s (the
                                     # first one learnt from two requests: at once) each pool
                                     # member gets it as a 1-token request (needs [tokenizer]
                                     # model_dir; at most reserved_blocks of it)
    priority = 1                     # engine scheduling priority of its requests, higher first
                                     # (others: 0); sent to vllm workers as -1 (vLLM: lower
                                     # first; needs --scheduling-policy priority) and to sglang
                                     # workers as 1 (needs --enable-priority-scheduling)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.server.config import (
    WORKER_KINDS,
    EndpointConfig,
    EventsConfig,
    FleetConfig,
    HealthConfig,
    PdConfig,
    RouterConfig,
    Table,
    TokenizerConfig,
    WorkerConfig,
    key_digest,
    load_toml,
    parse_endpoints,
    parse_fleet,
    parse_health,
    pool_limit,
)

__all__ = [
    "WORKER_KINDS",
    "EndpointConfig",
    "EventsConfig",
    "GatewayConfig",
    "HealthConfig",
    "PdConfig",
    "RouterConfig",
    "ServerConfig",
    "TokenizerConfig",
    "WorkerConfig",
    "key_digest",
    "load_config",
    "parse_config",
]


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
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    client_write_timeout: float = 60.0
    max_connections: int = 1024
    max_response_bytes: int = 32 * 1024 * 1024
    max_event_bytes: int = 8 * 1024 * 1024
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    admin_key_digests: tuple[bytes, ...] = ()
    key_requests_per_minute: int | None = None
    key_tokens_per_minute: int | None = None
    max_in_flight: int | None = None
    max_in_flight_per_worker: int | None = None
    prefill_tokens_per_second: float | None = None
    cache_usage_fields: bool = True


@dataclass(frozen=True)
class GatewayConfig(FleetConfig):
    server: ServerConfig = field(default_factory=ServerConfig)

    def worker(self, name: str) -> WorkerConfig:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"unknown worker {name!r}")


def _server(g: Table) -> ServerConfig:
    d = ServerConfig()
    server = ServerConfig(
        host=g.get("host", str, d.host),
        port=g.port("port", d.port),
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
        header_timeout=g.positive("header_timeout", float, d.header_timeout),
        body_timeout=g.positive("body_timeout", float, d.body_timeout),
        client_write_timeout=g.positive("client_write_timeout", float, d.client_write_timeout),
        max_connections=g.positive("max_connections", int, d.max_connections),
        max_response_bytes=g.positive("max_response_bytes", int, d.max_response_bytes),
        max_event_bytes=g.positive("max_event_bytes", int, d.max_event_bytes),
        admin_host=g.get("admin_host", str, d.admin_host),
        admin_port=g.port("admin_port", None),
        admin_key_digests=g.digests("admin_"),
        key_requests_per_minute=g.positive("key_requests_per_minute", int, None),
        key_tokens_per_minute=g.positive("key_tokens_per_minute", int, None),
        max_in_flight=g.positive("max_in_flight", int, None),
        max_in_flight_per_worker=g.positive("max_in_flight_per_worker", int, None),
        prefill_tokens_per_second=g.positive("prefill_tokens_per_second", float, None),
        cache_usage_fields=g.get("cache_usage_fields", bool, d.cache_usage_fields),
    )
    return server


def parse_config(data: Mapping[str, Any]) -> GatewayConfig:
    """Validates a parsed TOML document (a dict) into a ``GatewayConfig``."""
    top = Table(data, "config", root=True)
    g = top.table("gateway")
    server = _server(g)
    health = parse_health(g)
    g.done()
    fleet = parse_fleet(top, health)
    bound = server.max_in_flight_per_worker
    for w in fleet.workers:
        if bound is not None and bound > w.max_connections:
            # Requests past the pool would wait pool_timeout for a connection and fail 503,
            # never shed 429 worker_queue: the bound would not be the one in force.
            raise ValueError(
                f"gateway.max_in_flight_per_worker {bound} exceeds the max_connections "
                f"{w.max_connections} of worker {w.name!r}: requests past {w.max_connections} "
                f"would wait pool_timeout and fail 503 instead of being shed 429; lower "
                f"max_in_flight_per_worker or raise that worker's max_connections"
            )

    endpoints = parse_endpoints(top, server.models, "gateway.models", pool_limit(fleet.workers))
    warm = [ep.id for ep in endpoints if ep.warm_interval is not None]
    if warm and fleet.tokenizer.model_dir is None:
        raise ValueError(
            f"endpoint(s) {warm} set warm_interval, which needs [tokenizer] model_dir: a warm "
            "request sends the prefix as the engine's own token ids, which only the served "
            "model's tokenizer and chat template give"
        )
    if warm and fleet.pd is not None:
        raise ValueError(
            f"endpoint(s) {warm} set warm_interval, which [pd] does not support yet: a pair's "
            "prefill may run on either side of it"
        )
    top.get("epp", dict, {})  # kvroute epp's section of a shared file (kvroute.epp.config)
    top.done()
    return fleet.served(GatewayConfig, endpoints=endpoints, server=server)


def load_config(path: str | Path) -> GatewayConfig:
    """Reads and validates a TOML configuration file."""
    return parse_config(load_toml(path))
