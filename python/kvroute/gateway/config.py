"""The gateway's configuration: a TOML file read into validated, immutable dataclasses.

Every value is checked when the file is loaded — an unknown key, a wrong type, a duplicate name, an
endpoint whose model the fleet does not serve — and the error names the key and the bad value, so a
gateway never starts half-configured. Secrets may be given as SHA-256 digests
(``api_key_sha256``) so that the file holds no plaintext key; plaintext keys are hashed on load and
only digests are kept in memory.

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

    [router]                         # kvroute.Router(...)
    policy = "kv_aware"
    block_size = 16
    hash_profile = "native"
    index = "approx"                 # "events": fed by the workers' KV events
    options = { }                    # more keyword arguments for kvroute.Router

    [tokenizer]
    path = "/models/llama-3-8b/tokenizer.json"   # HF `tokenizers` file; absent: byte-level
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

import hashlib
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "WORKER_KINDS",
    "EndpointConfig",
    "EventsConfig",
    "GatewayConfig",
    "RouterConfig",
    "ServerConfig",
    "TokenizerConfig",
    "WorkerConfig",
    "key_digest",
    "load_config",
    "parse_config",
]

#: Upstream kinds. ``vllm`` and ``sglang`` accept ``cache_salt`` in the request body and report
#: ``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``,
#: SGLang with ``--enable-cache-report``); ``openai`` is any other OpenAI-compatible server and
#: is sent no engine-specific fields.
WORKER_KINDS = ("vllm", "sglang", "openai")
SALTING_KINDS = frozenset({"vllm", "sglang"})


def key_digest(key: str) -> bytes:
    """The SHA-256 digest under which an API key is stored and compared."""
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    url: str
    kind: str = "vllm"
    weight: float = 1.0
    api_key: str | None = None
    max_connections: int = 256
    kv_events: str | None = None
    kv_replay: str | None = None

    @property
    def sends_cache_salt(self) -> bool:
        """Whether this upstream understands ``cache_salt``."""
        return self.kind in SALTING_KINDS


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
class RouterConfig:
    policy: str = "kv_aware"
    block_size: int = 16
    hash_profile: str = "native"
    index: str = "approx"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizerConfig:
    path: str | None = None
    bytes_per_token: int = 4


@dataclass(frozen=True)
class EventsConfig:
    topic: str = ""
    mode: str = "rehash"


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
    health_path: str = "/health"
    health_interval: float = 1.0
    eject_seconds: float = 2.0
    eject_after: int = 3


@dataclass(frozen=True)
class GatewayConfig:
    workers: tuple[WorkerConfig, ...]
    endpoints: tuple[EndpointConfig, ...] = ()
    server: ServerConfig = field(default_factory=ServerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    events: EventsConfig = field(default_factory=EventsConfig)

    def worker(self, name: str) -> WorkerConfig:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"unknown worker {name!r}")


class _Table:
    """Reads one TOML table, tracking which keys were used so that leftovers are reported."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a table, got {type(data).__name__}")
        self.data = data
        self.where = where
        self.used: set[str] = set()

    def get(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        self.used.add(key)
        if key not in self.data:
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise ValueError(f"{self.where}.{key} must be {_names(kinds)}, got {value!r}")
        if not isinstance(value, kinds):
            raise ValueError(f"{self.where}.{key} must be {_names(kinds)}, got {value!r}")
        return value

    def require(self, key: str, kind: type) -> Any:
        if key not in self.data:
            raise ValueError(f"{self.where}.{key} is required")
        return self.get(key, kind, None)

    def strings(self, key: str) -> tuple[str, ...]:
        values = self.get(key, list, [])
        for v in values:
            if not isinstance(v, str) or not v:
                raise ValueError(f"{self.where}.{key} must hold non-empty strings, got {v!r}")
        return tuple(values)

    def positive(self, key: str, kind: type, default: Any, *, zero: bool = False) -> Any:
        value = self.get(key, kind, default)
        if value is not None and (
            value < 0 or (value == 0 and not zero) or (kind is float and not math.isfinite(value))
        ):
            raise ValueError(f"{self.where}.{key} must be > 0, got {value!r}")
        return value

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ValueError(f"unknown key(s) in {self.where}: {', '.join(unknown)}")


def _names(kinds: tuple[type, ...]) -> str:
    words = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        dict: "a table",
        list: "an array",
    }
    return " or ".join(words.get(k, k.__name__) for k in kinds)


def _digests(t: _Table) -> tuple[bytes, ...]:
    digests = [key_digest(k) for k in t.strings("api_keys")]
    for hexed in t.strings("api_key_sha256"):
        if not re.fullmatch(r"[0-9a-fA-F]{64}", hexed):
            raise ValueError(
                f"{t.where}.api_key_sha256 entries must be 64 hex digits, got {hexed!r}"
            )
        digests.append(bytes.fromhex(hexed))
    return tuple(dict.fromkeys(digests))


def _url(value: str, where: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{where} must be an http(s) URL, got {value!r}")
    return value.rstrip("/")


def _worker(data: Any, i: int) -> WorkerConfig:
    t = _Table(data, f"workers[{i}]")
    name = t.require("name", str)
    if not name:
        raise ValueError(f"{t.where}.name must not be empty")
    kind = t.get("kind", str, "vllm")
    if kind not in WORKER_KINDS:
        raise ValueError(f"{t.where}.kind must be one of {WORKER_KINDS}, got {kind!r}")
    kv_events = t.get("kv_events", str, None)
    kv_replay = t.get("kv_replay", str, None)
    if kv_replay is not None and kv_events is None:
        raise ValueError(f"{t.where}.kv_replay {kv_replay!r} given without kv_events")
    w = WorkerConfig(
        name=name,
        url=_url(t.require("url", str), f"{t.where}.url"),
        kind=kind,
        weight=t.positive("weight", float, 1.0),
        api_key=t.get("api_key", str, None),
        max_connections=t.positive("max_connections", int, 256),
        kv_events=kv_events,
        kv_replay=kv_replay,
    )
    t.done()
    return w


def _endpoint(data: Any, i: int) -> EndpointConfig:
    t = _Table(data, f"endpoints[{i}]")
    ep = EndpointConfig(
        id=t.require("id", str),
        model=t.require("model", str),
        pool_size=t.positive("pool_size", int, 1),
        reserved_blocks=t.positive("reserved_blocks", int, None, zero=True),
        key_digests=_digests(t),
        salt=t.get("salt", str, None) or None,
        cache_salt=t.get("cache_salt", bool, True),
    )
    if not ep.id or not ep.model:
        raise ValueError(f"{t.where}: id and model must not be empty")
    t.done()
    return ep


def parse_config(data: Mapping[str, Any]) -> GatewayConfig:
    """Validates a parsed TOML document (a dict) into a ``GatewayConfig``."""
    top = _Table(data, "config")

    workers_raw = top.get("workers", list, None)
    if not workers_raw:
        raise ValueError("config needs at least one [[workers]] entry")
    workers = tuple(_worker(w, i) for i, w in enumerate(workers_raw))
    names = [w.name for w in workers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate worker name(s): {dup}")

    g = _Table(top.get("gateway", dict, {}), "gateway")
    server = ServerConfig(
        host=g.get("host", str, "127.0.0.1"),
        port=g.get("port", int, 8000),
        models=g.strings("models"),
        key_digests=_digests(g),
        max_body_bytes=g.positive("max_body_bytes", int, ServerConfig.max_body_bytes),
        max_attempts=g.positive("max_attempts", int, 3),
        routing_headers=g.get("routing_headers", bool, True),
        connect_timeout=g.positive("connect_timeout", float, 2.0),
        read_timeout=g.positive("read_timeout", float, 300.0),
        write_timeout=g.positive("write_timeout", float, 30.0),
        pool_timeout=g.positive("pool_timeout", float, 5.0),
        upstream_keepalive=g.positive("upstream_keepalive", float, 4.0),
        keep_alive_timeout=g.positive("keep_alive_timeout", float, 75.0),
        health_path=g.get("health_path", str, "/health"),
        health_interval=g.positive("health_interval", float, 1.0),
        eject_seconds=g.positive("eject_seconds", float, 2.0, zero=True),
        eject_after=g.positive("eject_after", int, 3),
    )
    g.done()
    if not 0 <= server.port < 65536:
        raise ValueError(f"gateway.port must be in 0..65535, got {server.port!r}")
    if not server.health_path.startswith("/"):
        raise ValueError(f"gateway.health_path must start with '/', got {server.health_path!r}")

    r = _Table(top.get("router", dict, {}), "router")
    router = RouterConfig(
        policy=r.get("policy", str, "kv_aware"),
        block_size=r.positive("block_size", int, 16),
        hash_profile=r.get("hash_profile", str, "native"),
        index=r.get("index", str, "approx"),
        options=dict(r.get("options", dict, {})),
    )
    r.done()
    if router.index not in ("approx", "events"):
        raise ValueError(f"router.index must be 'approx' or 'events', got {router.index!r}")
    reserved = {"policy", "block_size", "hash_profile", "index"} & set(router.options)
    if reserved:
        raise ValueError(f"router.options must not repeat {sorted(reserved)}: set them in [router]")

    tk = _Table(top.get("tokenizer", dict, {}), "tokenizer")
    tokenizer = TokenizerConfig(
        path=tk.get("path", str, None),
        bytes_per_token=tk.positive("bytes_per_token", int, 4),
    )
    tk.done()
    if tokenizer.bytes_per_token > 4:
        raise ValueError(
            f"tokenizer.bytes_per_token must be 1..4 (a pseudo-token is a u32), "
            f"got {tokenizer.bytes_per_token}"
        )

    ev = _Table(top.get("events", dict, {}), "events")
    events = EventsConfig(topic=ev.get("topic", str, ""), mode=ev.get("mode", str, "rehash"))
    ev.done()
    with_events = [w.name for w in workers if w.kv_events]
    if router.index == "events" and not with_events:
        raise ValueError("router.index = 'events' needs kv_events on at least one worker")
    if router.index != "events" and with_events:
        raise ValueError(
            f"workers {with_events} have kv_events but router.index is {router.index!r}: "
            "set index = 'events'"
        )

    endpoints = tuple(_endpoint(e, i) for i, e in enumerate(top.get("endpoints", list, [])))
    ids = [e.id for e in endpoints]
    dup = sorted({n for n in ids if ids.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate endpoint id(s): {dup}")
    clash = sorted(set(ids) & set(server.models))
    if clash:
        raise ValueError(f"endpoint id(s) {clash} are also listed in gateway.models")
    for e in endpoints:
        if e.pool_size > len(workers):
            raise ValueError(
                f"endpoint {e.id!r}: pool_size {e.pool_size} exceeds the {len(workers)} workers"
            )
    top.done()
    return GatewayConfig(
        workers=workers,
        endpoints=endpoints,
        server=server,
        router=router,
        tokenizer=tokenizer,
        events=events,
    )


def load_config(path: str | Path) -> GatewayConfig:
    """Reads and validates a TOML configuration file."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.9/3.10
        try:
            import tomli as tomllib
        except ImportError as e:
            raise ImportError(
                "reading TOML on Python < 3.11 needs tomli: pip install 'kvroute[gateway]'"
            ) from e
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return parse_config(data)
