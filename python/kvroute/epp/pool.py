"""Workers from a Kubernetes ``InferencePool`` (``inference.networking.k8s.io/v1``): a list + watch.

The pool's ``spec.selector.matchLabels`` selects pods in its namespace; every **ready** pod (its
``Ready`` condition true, not being deleted, with a pod IP) is a worker on each of the pool's
``spec.targetPorts``: named after the pod (``pod:port`` when the pool has several ports), at
``podIP:port``, of ``[epp.pool] kind`` with its ``api_key``; with ``kv_events_port`` (and
``kv_replay_port``), ``tcp://podIP:port`` is its KV-event stream (single-port pools).

The official ``kubernetes`` client is loaded by ``start()`` off the event loop (its API classes take
seconds to import) and runs in one daemon thread: it reads the pool, lists the pods
(then calls ``on_change`` with the whole member set — the picker becomes ready), and watches from
the list's ``resourceVersion``; each change of the member set calls ``on_change`` again, on the
server's event loop. A watch that ends is resumed; one that expired (410), or any API error,
restarts from reading the pool (after ``RETRY`` seconds on errors) — so a changed selector or
port list is picked up too. Credentials: ``[epp.pool] kubeconfig`` if given, else the in-cluster
service account, else the default kubeconfig.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from ..server.config import WorkerConfig
from .config import PoolConfig
from .picker import Member

__all__ = ["GROUP", "PLURAL", "VERSION", "PoolWatch", "members_of"]

log = logging.getLogger("kvroute.epp")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
RETRY = 1.0
WATCH_SECONDS = 60


def _ready(pod: dict[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def members_of(
    pool: PoolConfig, ports: list[int], pods: dict[str, dict[str, Any]]
) -> dict[str, Member]:
    """The workers of the ready ``pods`` (by name) on ``ports``."""
    out: dict[str, Member] = {}
    for name, pod in sorted(pods.items()):
        if not _ready(pod):
            continue
        ip = pod["status"]["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        for port in ports:
            worker = name if len(ports) == 1 else f"{name}:{port}"
            events = replay = None
            if pool.kv_events_port is not None and len(ports) == 1:
                events = f"tcp://{host}:{pool.kv_events_port}"
                if pool.kv_replay_port is not None:
                    replay = f"tcp://{host}:{pool.kv_replay_port}"
            config = WorkerConfig(
                name=worker,
                url=f"http://{host}:{port}",
                kind=pool.kind,
                api_key=pool.api_key,
                kv_events=events,
                kv_replay=replay,
            )
            out[worker] = Member(worker, f"{host}:{port}", config)
    return out


class PoolWatch:
    """Follows an ``InferencePool``'s ready pods; ``on_change(members)`` on every change."""

    def __init__(
        self, pool: PoolConfig, on_change: Callable[[dict[str, Member]], Awaitable[None]]
    ) -> None:
        self.pool = pool
        self.on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self._core: Any = None
        self._custom: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last: dict[str, str] | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Off the event loop: loading the client's API classes (hundreds of models) takes
        # seconds, during which the server keeps answering health checks.
        self._core, self._custom = await asyncio.to_thread(self._client)
        self._thread = threading.Thread(target=self._run, name="kvroute-pool", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 2.0)
            self._thread = None

    def _client(self) -> tuple[Any, Any]:
        """The core and custom-objects APIs, authenticated (see the module docs)."""
        try:
            from kubernetes import client, config
        except ImportError as e:
            raise ImportError(
                "[epp.pool] needs the kubernetes client: pip install 'kvroute[kubernetes]'"
            ) from e

        if self.pool.kubeconfig:
            api = config.new_client_from_config(os.path.expanduser(self.pool.kubeconfig))
        else:
            try:
                config.load_incluster_config()
                api = client.ApiClient()
            except config.ConfigException:
                api = config.new_client_from_config()
        return client.CoreV1Api(api), client.CustomObjectsApi(api)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        core, custom = self._core, self._custom
        p = self.pool
        while not self._stop.is_set():
            try:
                obj = custom.get_namespaced_custom_object(
                    GROUP, VERSION, p.namespace, PLURAL, p.name
                )
                spec = obj.get("spec") or {}
                labels = (spec.get("selector") or {}).get("matchLabels") or {}
                ports = [int(t["number"]) for t in spec.get("targetPorts") or [] if "number" in t]
                if not labels or not ports:
                    raise ValueError(
                        f"InferencePool {p.namespace}/{p.name} has no selector or port"
                    )
                selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                listed = core.list_namespaced_pod(
                    p.namespace, label_selector=selector, _preload_content=False
                )
                data = json.loads(listed.data)
                pods = {i["metadata"]["name"]: i for i in data.get("items") or []}
                version = (data.get("metadata") or {}).get("resourceVersion")
                self._publish(ports, pods)
                while not self._stop.is_set():
                    self._watch = watch.Watch()
                    for event in self._watch.stream(
                        core.list_namespaced_pod,
                        p.namespace,
                        label_selector=selector,
                        resource_version=version,
                        timeout_seconds=WATCH_SECONDS,
                        deserialize=False,
                    ):
                        kind = event["type"]
                        pod = event.get("raw_object") or event["object"]
                        if kind == "ERROR":
                            raise ApiException(status=pod.get("code"), reason=pod.get("message"))
                        name = pod["metadata"]["name"]
                        version = pod["metadata"].get("resourceVersion", version)
                        if kind == "DELETED":
                            pods.pop(name, None)
                        else:
                            pods[name] = pod
                        self._publish(ports, pods)
                    if self._watch.resource_version:
                        version = self._watch.resource_version
            except Exception as e:  # API errors, expired watches, a bad pool: read it all again
                if self._stop.is_set():
                    return
                if not (isinstance(e, ApiException) and e.status == 410):
                    log.warning("InferencePool %s/%s: %s (retrying)", p.namespace, p.name, e)
                    self._stop.wait(RETRY)

    def _publish(self, ports: list[int], pods: dict[str, dict[str, Any]]) -> None:
        members = members_of(self.pool, ports, pods)
        summary = {n: m.address for n, m in members.items()}
        if summary == self._last or self._loop is None:
            return
        self._last = summary
        future = asyncio.run_coroutine_threadsafe(self.on_change(members), self._loop)
        try:
            future.result(30)
        except Exception:
            log.exception("applying the InferencePool's members failed")
