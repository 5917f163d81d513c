"""The configuration loader every kvroute server shares: TOML tables read into frozen dataclasses.

Every value is checked when the file is loaded — an unknown key, a wrong type, a duplicate name —
and the error names the key and the bad value, so a server never starts half-configured. A server
(``kvroute serve``, ``kvroute epp``, the event relay) reads its own section with ``Table`` and the
fleet's sections with ``parse_fleet``: ``[[workers]]``, ``[router]``, ``[tokenizer]``,
``[events]``, ``[pd]``, ``[cluster]`` (``kvroute.cluster.config``) and the worker-health keys, so
that one fleet file means the same thing to all of them; its configuration extends
``FleetConfig`` (``FleetConfig.served``). Secrets may be given as SHA-256 digests
(``api_key_sha256``) so that the file holds no plaintext key; plaintext keys are hashed on load
and only digests are kept in memory.

The sections and their keys are documented, with an example, in ``kvroute.gateway.config``.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from kvroute.cluster.config import ClusterConfig

__all__ = [
    "SALTING_KINDS",
    "WORKER_KINDS",
    "EndpointConfig",
    "EventsConfig",
    "FleetConfig",
    "HealthConfig",
    "PdConfig",
    "RouterConfig",
    "Table",
    "TokenizerConfig",
    "WorkerConfig",
    "duplicates",
    "engine_fields",
    "key_digest",
    "load_toml",
    "parse_endpoints",
    "parse_fleet",
    "parse_health",
    "pool_limit",
]

#: Upstream kinds. ``vllm`` and ``sglang`` accept ``cache_salt`` in the request body and report
#: ``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``,
#: SGLang with ``--enable-cache-report``); ``openai`` is any other OpenAI-compatible server and
#: is sent no engine-specific fields.
WORKER_KINDS = ("vllm", "sglang", "openai")
SALTING_KINDS = frozenset({"vllm", "sglang"})
#: What a worker does in a prefill/decode fleet (``kvroute.Router`` roles).
ROLES = ("prefill", "decode", "both")
#: ``[router] options`` that ``[pd]`` sets (``kvroute.server.routing``).
PD_OPTIONS = ("pd_threshold", "pd_saturation", "pd_local_prefill")
#: The prefill/decode hand-over protocols: vLLM's KV-connector proxy flow, SGLang's bootstrap.
PD_PROTOCOLS = ("vllm", "sglang")
#: SGLang's default ``--disaggregation-bootstrap-port``.
SGLANG_BOOTSTRAP_PORT = 8998


def engine_fields(kind: str, cache_salt: str | None, priority: int) -> dict[str, Any]:
    """The engine-specific body fields a kvroute server sends a worker of ``kind`` for a request
    with this ``cache_salt`` (None: none) and kvroute ``priority`` (higher is served first; 0 is
    the default): ``cache_salt`` to vllm and sglang workers; ``priority`` in the engine's own
    direction — vLLM serves *lower* values first (``--scheduling-policy priority``), so it gets
    ``-priority``; SGLang serves higher values first by default (``--enable-priority-scheduling``),
    so it gets ``priority``. Priority 0 is never sent (vLLM refuses any other value unless it
    schedules by priority); ``openai`` workers get nothing."""
    fields: dict[str, Any] = {}
    if kind not in SALTING_KINDS:
        return fields
    if cache_salt is not None:
        fields["cache_salt"] = cache_salt
    if priority:
        fields["priority"] = -priority if kind == "vllm" else priority
    return fields


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
    #: The subscriber binds ``kv_events`` and the engine connects (vLLM's publisher connects
    #: when its endpoint names a concrete host, and binds only ``*``, ``ipc://``, ``inproc://``).
    kv_events_bind: bool = False
    #: ``prefill``, ``decode`` or ``both`` (a fleet with roles needs ``[pd]``).
    role: str = "both"
    #: SGLang prefill servers: where decode servers fetch the KV (``--disaggregation-bootstrap-
    #: port``; host: the URL's unless given).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None

    @property
    def sends_cache_salt(self) -> bool:
        """Whether this upstream understands ``cache_salt``."""
        return self.kind in SALTING_KINDS


@dataclass(frozen=True)
class RouterConfig:
    """``[router]``: what the file says, None where it says nothing — the Router's own defaults
    (``router::Config::default`` in the core; ``Router.config`` shows the values in effect)."""

    policy: str | None = None
    block_size: int | None = None
    hash_profile: str | None = None
    index: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def events(self) -> bool:
        """Whether the index is fed by engine KV events (``index = "events"``)."""
        return self.index == "events"


@dataclass(frozen=True)
class TokenizerConfig:
    path: str | None = None
    #: The served model's directory: its chat template and tokenizer.json (engine-exact tokens).
    model_dir: str | None = None
    bytes_per_token: int = 4
    #: vLLM's ``--exclude-tools-when-tool-choice-none`` (default off, as vLLM's): the engines
    #: render ``tool_choice: "none"`` requests without their tools.
    exclude_tools_when_tool_choice_none: bool = False


@dataclass(frozen=True)
class EventsConfig:
    topic: str = ""
    mode: str = "rehash"


@dataclass(frozen=True)
class HealthConfig:
    """When a worker is taken out of routing and when it comes back (``kvroute.server.health``)."""

    path: str = "/health"  # probed on ejected workers until it answers 200
    interval: float = 1.0  # seconds between probe rounds
    eject_seconds: float = 2.0  # minimum time an ejected worker stays out
    eject_after: int = 3  # failures in a row (across requests) that eject a worker
    max_ejected_fraction: float = 0.5  # failure-based ejection never takes out more of the fleet


@dataclass(frozen=True)
class EndpointConfig:
    """A dedicated endpoint (``[[endpoints]]``): a sticky worker pool, its keys and its salt."""

    id: str
    model: str
    pool_size: int = 1
    reserved_blocks: int | None = None
    key_digests: tuple[bytes, ...] = ()
    salt: str | None = None
    cache_salt: bool = True
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    weight: float = 1.0
    #: Scheduling priority of its requests, higher first (see :func:`engine_fields`).
    priority: int = 0
    #: Seconds between passes that keep its shared prefix warm on every pool member
    #: (``kvroute.gateway.warm``; ``kvroute serve`` only); None: not kept warm.
    warm_interval: float | None = None

    @property
    def open(self) -> bool:
        """True when no API key is configured (anyone may call it)."""
        return not self.key_digests


@dataclass(frozen=True)
class PdConfig:
    """``[pd]``: requests are routed as prefill/decode pairs (``Router.route_pd``) and handed
    over with ``protocol``; ``threshold`` and ``saturation`` are the router's ``pd_threshold``
    and ``pd_saturation`` (None: the router's defaults)."""

    protocol: str = "vllm"
    threshold: int | None = None
    saturation: float | None = None


F = TypeVar("F", bound="FleetConfig")


@dataclass(frozen=True)
class FleetConfig:
    """The sections every server over the same fleet reads alike (``parse_fleet`` reads all but
    ``endpoints``, which each server reads against its own section's models); each
    server's configuration extends it with its own section (``kvroute.gateway.config``,
    ``kvroute.epp.config``)."""

    workers: tuple[WorkerConfig, ...]
    router: RouterConfig = field(default_factory=RouterConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    pd: PdConfig | None = None
    endpoints: tuple[EndpointConfig, ...] = ()
    cluster: ClusterConfig | None = None

    def served(self, cls: type[F], **own: Any) -> F:
        """This fleet as the configuration ``cls`` (a subclass) of one server, with that
        server's ``own`` sections (and its ``endpoints``)."""
        return cls(**{**{f.name: getattr(self, f.name) for f in fields(FleetConfig)}, **own})


class Table:
    """Reads one TOML table, tracking which keys were used so that leftovers are reported."""

    def __init__(self, data: Any, where: str, *, root: bool = False) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a table, got {type(data).__name__}")
        self.data = data
        self.where = where
        self.root = root  # the document itself: its sub-tables are named without a prefix
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
            raise ValueError(f"{self.where}.{key} must be {'>=' if zero else '>'} 0, got {value!r}")
        return value

    def port(self, key: str, default: int | None) -> int | None:
        value = self.get(key, int, default)
        if value is not None and not 0 <= value < 65536:
            raise ValueError(f"{self.where}.{key} must be in 0..65535, got {value!r}")
        return value

    def fraction(self, key: str, default: float) -> float:
        value = self.get(key, float, default)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{self.where}.{key} must be in [0, 1], got {value!r}")
        return float(value)

    def table(self, key: str) -> Table:
        """A sub-table (empty when absent)."""
        return Table(self.get(key, dict, {}), key if self.root else f"{self.where}.{key}")

    def digests(self, prefix: str = "") -> tuple[bytes, ...]:
        """``<prefix>api_keys`` (hashed here) and ``<prefix>api_key_sha256`` (hex digests),
        deduplicated."""
        digests = [key_digest(k) for k in self.strings(prefix + "api_keys")]
        for hexed in self.strings(prefix + "api_key_sha256"):
            if not re.fullmatch(r"[0-9a-fA-F]{64}", hexed):
                raise ValueError(
                    f"{self.where}.{prefix}api_key_sha256 entries must be 64 hex digits, "
                    f"got {hexed!r}"
                )
            digests.append(bytes.fromhex(hexed))
        return tuple(dict.fromkeys(digests))

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


def _url(value: str, where: str) -> str:
    """A worker's base URL: http(s), a host, a port in 1..65535 if any, a path prefix if any (a
    proxy's) but not ``/v1`` — the gateway appends the request's own path, ``/v1/...`` — and no
    query or fragment (they would be dropped)."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where} must be an http(s) URL, got {value!r}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"{where} has a port outside 1..65535: {value!r}")
    if parts.path.rstrip("/").endswith("/v1") or parts.query or parts.fragment:
        raise ValueError(
            f"{where} must be the worker's base URL (scheme, host, port, a proxy's path prefix), "
            f"got {value!r}: the request's own path (/v1/...) is appended to it"
        )
    return value.rstrip("/")


def duplicates(names: list[str]) -> list[str]:
    return sorted({n for n in names if names.count(n) > 1})


def _worker(data: Any, i: int) -> WorkerConfig:
    t = Table(data, f"workers[{i}]")
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
        kv_events_bind=t.get("kv_events_bind", bool, False),
        role=t.get("role", str, "both"),
        bootstrap_host=t.get("bootstrap_host", str, None) or None,
        bootstrap_port=t.get("bootstrap_port", int, None),
    )
    t.done()
    if w.role not in ROLES:
        raise ValueError(f"{t.where}.role must be one of {ROLES}, got {w.role!r}")
    if w.bootstrap_port is not None and not 0 < w.bootstrap_port < 65536:
        raise ValueError(f"{t.where}.bootstrap_port must be in 1..65535, got {w.bootstrap_port}")
    given = [k for k in ("bootstrap_host", "bootstrap_port") if getattr(w, k) is not None]
    if given and (w.kind, w.role) != ("sglang", "prefill"):
        # Only an SGLang prefill server publishes KV at a bootstrap address: on any other
        # worker the key would do nothing, and a wrong port would go unnoticed.
        raise ValueError(
            f"{t.where}.{given[0]} applies to SGLang prefill servers only (kind = 'sglang', "
            f"role = 'prefill'); worker {name!r} has kind = {w.kind!r}, role = {w.role!r}"
        )
    if w.kv_events_bind and kv_events is None:
        raise ValueError(f"{t.where}.kv_events_bind given without kv_events")
    return w


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
        requests_per_minute=t.positive("requests_per_minute", int, None),
        tokens_per_minute=t.positive("tokens_per_minute", int, None),
        weight=t.positive("weight", float, 1.0),
        priority=t.get("priority", int, 0),
        warm_interval=t.positive("warm_interval", float, None),
    )
    if not ep.id or not ep.model:
        raise ValueError(f"{t.where}: id and model must not be empty")
    if not -(2**31) <= ep.priority < 2**31:
        raise ValueError(f"{t.where}.priority must be in -2**31..2**31-1, got {ep.priority}")
    t.done()
    return ep


def pool_limit(workers: tuple[WorkerConfig, ...]) -> int:
    """The largest endpoint pool the workers allow: a pool has ``pool_size`` members per phase
    (prefill, decode), so its size is bounded by the phase most workers do."""
    return max(sum(w.role in (phase, "both") for w in workers) for phase in ("prefill", "decode"))


def parse_endpoints(
    top: Table, models: tuple[str, ...], models_key: str, workers: int | None
) -> tuple[EndpointConfig, ...]:
    """``[[endpoints]]``: unique ids, none also a directly served model (``models``, read from
    ``models_key``), no pool larger than ``workers`` (``pool_limit`` of the fleet; None: a fleet
    that is discovered)."""
    endpoints = tuple(_endpoint(e, i) for i, e in enumerate(top.get("endpoints", list, [])))
    ids = [e.id for e in endpoints]
    dup = duplicates(ids)
    if dup:
        raise ValueError(f"duplicate endpoint id(s): {dup}")
    clash = sorted(set(ids) & set(models))
    if clash:
        raise ValueError(f"endpoint id(s) {clash} are also listed in {models_key}")
    for e in endpoints:
        if workers is not None and e.pool_size > workers:
            raise ValueError(
                f"endpoint {e.id!r}: pool_size {e.pool_size} exceeds the {workers} workers"
                " (of a phase, when workers have roles)"
            )
    return endpoints


def parse_health(t: Table) -> HealthConfig:
    """The worker-health keys of a server's own section (``health_path``, ``eject_after`` …)."""
    d = HealthConfig()
    health = HealthConfig(
        path=t.get("health_path", str, d.path),
        interval=t.positive("health_interval", float, d.interval),
        eject_seconds=t.positive("eject_seconds", float, d.eject_seconds, zero=True),
        eject_after=t.positive("eject_after", int, d.eject_after),
        max_ejected_fraction=t.fraction("max_ejected_fraction", d.max_ejected_fraction),
    )
    if not health.path.startswith("/"):
        raise ValueError(f"{t.where}.health_path must start with '/', got {health.path!r}")
    return health


def parse_fleet(
    top: Table, health: HealthConfig | None = None, *, discovered: str | None = None
) -> FleetConfig:
    """``[[workers]]``, ``[router]``, ``[tokenizer]`` and ``[events]`` of a parsed document.

    ``discovered`` names where more workers come from at run time (``kvroute epp``'s
    ``[epp.pool]``): then ``[[workers]]`` may be empty, and ``index = "events"`` is not checked
    against the static workers' ``kv_events``."""
    workers_raw = top.get("workers", list, [])
    if not workers_raw and discovered is None:
        raise ValueError("config needs at least one [[workers]] entry")
    workers = tuple(_worker(w, i) for i, w in enumerate(workers_raw))
    dup = duplicates([w.name for w in workers])
    if dup:
        raise ValueError(f"duplicate worker name(s): {dup}")
    dup = duplicates([w.url.lower() for w in workers])
    if dup:
        raise ValueError(f"duplicate worker url(s): {dup}: each worker is one engine")

    r = top.table("router")
    router = RouterConfig(
        policy=r.get("policy", str, None),
        block_size=r.positive("block_size", int, None),
        hash_profile=r.get("hash_profile", str, None),
        index=r.get("index", str, None),
        options=dict(r.get("options", dict, {})),
    )
    r.done()
    if router.index not in (None, "approx", "events"):
        raise ValueError(f"router.index must be 'approx' or 'events', got {router.index!r}")
    reserved = {"policy", "block_size", "hash_profile", "index"} & set(router.options)
    if reserved:
        raise ValueError(f"router.options must not repeat {sorted(reserved)}: set them in [router]")
    reserved = set(PD_OPTIONS) & set(router.options)
    if reserved:
        raise ValueError(
            f"router.options must not set {sorted(reserved)}: [pd] sets them (threshold, "
            "saturation; the protocol decides whether decode workers prefill)"
        )

    tk = top.table("tokenizer")
    tokenizer = TokenizerConfig(
        path=tk.get("path", str, None),
        model_dir=tk.get("model_dir", str, None),
        bytes_per_token=tk.positive("bytes_per_token", int, TokenizerConfig.bytes_per_token),
        exclude_tools_when_tool_choice_none=tk.get(
            "exclude_tools_when_tool_choice_none", bool, False
        ),
    )
    tk.done()
    if tokenizer.bytes_per_token > 4:
        raise ValueError(
            f"tokenizer.bytes_per_token must be 1..4 (a pseudo-token is a u32), "
            f"got {tokenizer.bytes_per_token}"
        )

    ev = top.table("events")
    events = EventsConfig(
        topic=ev.get("topic", str, EventsConfig.topic), mode=ev.get("mode", str, EventsConfig.mode)
    )
    ev.done()
    pd = _pd(top, workers, discovered is not None)
    with_events = [w.name for w in workers if w.kv_events]
    if router.events and not with_events and discovered is None:
        raise ValueError("router.index = 'events' needs kv_events on at least one worker")
    if not router.events and with_events:
        raise ValueError(
            f"workers {with_events} have kv_events but router.index is not 'events': "
            "set index = 'events'"
        )
    from kvroute.cluster.config import parse_cluster  # (it reads tables with this module's)

    cluster = parse_cluster(top)
    if cluster is not None and cluster.relay and not router.events:
        raise ValueError(
            "cluster.relay = true needs router.index = 'events' (the relay's stream carries "
            f"engine KV events; index is {router.index or 'approx'!r})"
        )
    return FleetConfig(
        workers=workers,
        router=router,
        tokenizer=tokenizer,
        events=events,
        health=health if health is not None else HealthConfig(),
        pd=pd,
        cluster=cluster,
    )


def _pd(top: Table, workers: tuple[WorkerConfig, ...], discovered: bool = False) -> PdConfig | None:
    """``[pd]``, checked against the workers: roles need it, its protocol needs workers of its
    kind, and (unless more workers are ``discovered`` at run time) a fleet that can form a
    pair."""
    with_roles = [w.name for w in workers if w.role != "both"]
    if "pd" not in top.data:
        top.get("pd", dict, {})
        if with_roles:
            raise ValueError(
                f"workers {with_roles} have roles: add a [pd] section naming the hand-over "
                f"protocol (protocol = 'vllm' or 'sglang')"
            )
        return None
    t = top.table("pd")
    d = PdConfig()
    pd = PdConfig(
        protocol=t.get("protocol", str, d.protocol),
        threshold=t.positive("threshold", int, None, zero=True),
        # 0 would call every prefill side saturated: pairs never split (omit it: never).
        saturation=t.positive("saturation", float, None),
    )
    t.done()
    if pd.protocol not in PD_PROTOCOLS:
        raise ValueError(f"pd.protocol must be one of {PD_PROTOCOLS}, got {pd.protocol!r}")
    other = [w.name for w in workers if w.kind != pd.protocol]
    if other:
        raise ValueError(
            f"pd.protocol = {pd.protocol!r} hands KV over between {pd.protocol} engines: "
            f"workers {other} are of another kind"
        )
    for key in ("threshold", "saturation"):
        if pd.protocol == "sglang" and getattr(pd, key) is not None:
            raise ValueError(
                f"pd.{key} does not apply to SGLang: its decode servers take KV only from a "
                "prefill server (every request is split)"
            )
    both = [w.name for w in workers if w.role == "both"]
    if pd.protocol == "sglang" and both:
        raise ValueError(
            f"workers {both} have role = 'both' (the default), which pd.protocol = 'sglang' "
            "cannot serve: a plain SGLang server neither takes KV from a prefill server nor "
            "publishes its own, so a split pair on it would compute the whole prompt there and "
            "leave the prefill's bootstrap room untaken; give each worker role = 'prefill' or "
            "'decode' (SGLang PD-mode servers)"
        )
    if discovered:
        return pd
    roles = {w.role for w in workers}
    if not roles & {"decode", "both"}:
        raise ValueError(
            "[pd] needs a worker that decodes (role = 'decode' or 'both'): every worker has "
            "role = 'prefill', so no request could be answered"
        )
    prefills = {"prefill"} if pd.protocol == "sglang" else {"prefill", "both"}
    if not roles & prefills:
        why = (
            "SGLang's decode servers take KV only from a prefill server"
            if pd.protocol == "sglang"
            else "no pair would ever be split (every request computed whole on a decode worker)"
        )
        raise ValueError(
            f"[pd] needs a worker with role = {' or '.join(map(repr, sorted(prefills)))}: {why}"
        )
    return pd


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file parsed into a dict (``tomllib``; ``tomli`` before Python 3.11)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10
        try:
            import tomli as tomllib
        except ImportError as e:
            raise ImportError(
                "reading TOML on Python < 3.11 needs tomli: pip install 'kvroute[gateway]'"
            ) from e
    with open(path, "rb") as f:
        return tomllib.load(f)
