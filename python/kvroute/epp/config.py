"""``kvroute epp``'s configuration: the fleet's TOML sections, ``[[endpoints]]``, and ``[epp]``.

The fleet (``[[workers]]``, ``[router]``, ``[tokenizer]``, ``[events]``) and ``[[endpoints]]``
are read by the loader every kvroute server shares (``kvroute.server.config``), so one file can
serve ``kvroute serve`` and ``kvroute epp`` alike (each skips the other's section). Every value is
checked on load; the error names the key and the bad value. A worker's ``url`` must have an IP
address as host: the proxy connects to the picked ``ip:port``.

``[epp]`` (every key shown; none is required)::

    [epp]
    host = "127.0.0.1"
    port = 9002                      # gRPC: ext_proc + grpc.health.v1 (liveness, readiness)
    metrics_port = 9090              # HTTP: GET /metrics, GET /health
    models = ["llama-3-8b"]          # model names served directly (as gateway.models)
    api_keys = ["sk-direct"]         # keys for them (api_key_sha256 too); none: open
    max_body_bytes = 16777216        # larger request bodies get 413
    routing_headers = true           # x-kvroute-worker / -cached-tokens on responses
    default_priority = 0             # requests naming no (or an unknown) objective
    objectives = { batch = -1 }      # x-gateway-inference-objective -> priority (< 0: sheddable)
    saturation_active = 32           # a worker with this many requests in flight is saturated …
    saturation_prefill_tokens = 65536  # … or with this many prompt tokens queued for prefill
    prefill_tokens_per_second = 9000.0 # estimates time to first token for x-slo-ttft-ms
    fallbacks = 0                    # endpoints listed after the pick, for the proxy's retries
    health_path = "/health"          # the health model's keys, as in [gateway]
    health_interval = 1.0
    eject_seconds = 2.0
    eject_after = 3                  # 5xx responses in a row that eject a worker
    max_ejected_fraction = 0.5

    [epp.pool]                       # workers: a Kubernetes InferencePool's ready pods
    name = "vllm-llama3"
    namespace = "default"
    kubeconfig = "~/.kube/config"    # absent: in-cluster, else the default kubeconfig
    kind = "vllm"                    # as workers[].kind, for every pod
    api_key = "..."
    kv_events_port = 5557            # the pods' KV-event ports (router.index = "events")
    kv_replay_port = 5558

``[cluster]`` (``kvroute.cluster.config``) works as for ``kvroute serve``: several pickers share
their routing state over NATS JetStream, each reads the engines' ``/metrics`` (the pool's pods
too), and ``relay = true`` takes KV events from ``kvroute relay``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..server.config import (
    WORKER_KINDS,
    FleetConfig,
    Table,
    load_toml,
    parse_endpoints,
    parse_fleet,
    parse_health,
)

__all__ = ["EppConfig", "PickerConfig", "PoolConfig", "load_config", "parse_config"]

log = logging.getLogger("kvroute.epp")


@dataclass(frozen=True)
class PoolConfig:
    """A Kubernetes ``InferencePool`` whose ready pods are the workers."""

    name: str
    namespace: str = "default"
    kubeconfig: str | None = None
    kind: str = "vllm"
    api_key: str | None = None
    kv_events_port: int | None = None
    kv_replay_port: int | None = None


@dataclass(frozen=True)
class PickerConfig:
    """``[epp]``: where the picker listens, what it accepts, and when it sheds."""

    host: str = "127.0.0.1"
    port: int = 9002
    metrics_port: int = 9090
    models: tuple[str, ...] = ()
    key_digests: tuple[bytes, ...] = ()
    admin_key_digests: tuple[bytes, ...] = ()  # (none: the picker has no admin routes)
    max_body_bytes: int = 16 * 1024 * 1024
    routing_headers: bool = True
    default_priority: int = 0
    objectives: Mapping[str, int] = field(default_factory=dict)
    saturation_active: int | None = None
    saturation_prefill_tokens: int | None = None
    prefill_tokens_per_second: float | None = None
    fallbacks: int = 0


@dataclass(frozen=True)
class EppConfig(FleetConfig):
    """The fleet's sections (``pd`` always None: the picker refuses pairs) and ``[epp]``."""

    server: PickerConfig = field(default_factory=PickerConfig)
    pool: PoolConfig | None = None


def _pool(t: Table) -> PoolConfig:
    pool = PoolConfig(
        name=t.require("name", str),
        namespace=t.get("namespace", str, "default"),
        kubeconfig=t.get("kubeconfig", str, None),
        kind=t.get("kind", str, "vllm"),
        api_key=t.get("api_key", str, None),
        kv_events_port=t.port("kv_events_port", None),
        kv_replay_port=t.port("kv_replay_port", None),
    )
    t.done()
    if not pool.name or not pool.namespace:
        raise ValueError(f"{t.where}: name and namespace must not be empty")
    if pool.kind not in WORKER_KINDS:
        raise ValueError(f"{t.where}.kind must be one of {WORKER_KINDS}, got {pool.kind!r}")
    if pool.kv_replay_port is not None and pool.kv_events_port is None:
        raise ValueError(f"{t.where}.kv_replay_port given without kv_events_port")
    return pool


def _picker(t: Table) -> PickerConfig:
    d = PickerConfig()
    objectives = t.get("objectives", dict, {})
    for name, priority in objectives.items():
        if not name or isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(
                f"{t.where}.objectives must map names to integer priorities, "
                f"got {name!r} = {priority!r}"
            )
    return PickerConfig(
        host=t.get("host", str, d.host),
        port=t.port("port", d.port),
        metrics_port=t.port("metrics_port", d.metrics_port),
        models=t.strings("models"),
        key_digests=t.digests(),
        max_body_bytes=t.positive("max_body_bytes", int, d.max_body_bytes),
        routing_headers=t.get("routing_headers", bool, d.routing_headers),
        default_priority=t.get("default_priority", int, d.default_priority),
        objectives=dict(objectives),
        saturation_active=t.positive("saturation_active", int, None),
        saturation_prefill_tokens=t.positive("saturation_prefill_tokens", int, None),
        prefill_tokens_per_second=t.positive("prefill_tokens_per_second", float, None),
        fallbacks=t.positive("fallbacks", int, d.fallbacks, zero=True),
    )


def parse_config(data: Mapping[str, Any]) -> EppConfig:
    """Validates a parsed TOML document (a dict) into an ``EppConfig``."""
    top = Table(data, "config", root=True)
    e = top.table("epp")
    server = _picker(e)
    health = parse_health(e)
    pool = _pool(e.table("pool")) if "pool" in e.data else None
    e.done()
    discovered = "epp.pool" if pool is not None else None
    fleet = parse_fleet(top, health, discovered=discovered)
    if fleet.pd is not None:
        raise ValueError(
            "kvroute epp does not route prefill/decode pairs: serve a [pd] fleet with "
            "kvroute serve (the EPP would send whole requests to its decode workers)"
        )
    if pool is not None and pool.kv_events_port is not None and not fleet.router.events:
        raise ValueError(
            "epp.pool.kv_events_port is set but router.index is not 'events': set index = 'events'"
        )
    if fleet.router.events and pool is not None and pool.kv_events_port is None:
        if not any(w.kv_events for w in fleet.workers):
            raise ValueError("router.index = 'events' needs epp.pool.kv_events_port")
    workers = None if pool is not None else len(fleet.workers)
    endpoints = parse_endpoints(top, server.models, "epp.models", workers)
    for ep in endpoints:
        if ep.warm_interval is not None:
            log.warning(
                "endpoints %r: warm_interval is kept by kvroute serve only; kvroute epp sends no "
                "requests of its own, so this endpoint is not kept warm here",
                ep.id,
            )
    top.get("gateway", dict, {})  # kvroute serve's section of a shared file
    top.done()
    return fleet.served(EppConfig, endpoints=endpoints, server=server, pool=pool)


def load_config(path: str | Path) -> EppConfig:
    """Reads and validates a TOML configuration file."""
    return parse_config(load_toml(path))
