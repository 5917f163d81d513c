"""``[epp.pool]``: workers from a Kubernetes ``InferencePool``, through the official client.

No Kubernetes API server can be installed here, so ``FakeKube`` serves the three API calls the
picker makes, in the API server's wire format: ``GET`` the pool
(``inference.networking.k8s.io/v1``),
list pods by label selector (a ``PodList`` with ``resourceVersion``), and watch them (a chunked
stream of ``{"type", "object"}`` lines). The ``kubernetes`` client reaches it through a kubeconfig
file. The pods are test upstreams on 127.0.0.2… (one IP per pod, the pool's one target port).
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from support.epp_client import EnvoyClient, EppThread
from support.gateway_upstream import Upstream
from support.helpers import wait_for

LABELS = {"app": "vllm-llama"}
# Deadline for a condition this test waits on: generous, since on a loaded box the EPP's first
# listing follows loading the kubernetes client (seconds of imports); a met condition ends the wait.
DEADLINE = 120.0


class Served:
    """An ASGI app under uvicorn on ``host:port`` in a daemon thread."""

    def __init__(self, app: Any, host: str, port: int = 0) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        self.sock = sock
        wait_for(lambda: self.server.started, "uvicorn to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def pod(
    name: str, ip: str, *, ready: bool = True, labels: dict[str, str] = LABELS
) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "ml", "labels": labels, "resourceVersion": "1"},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeKube:
    """The Kubernetes API calls ``kvroute.epp.pool`` makes (see the module docs)."""

    def __init__(self, port: int) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.listed = threading.Event()
        self.release = threading.Event()
        self.selectors: list[str] = []
        self.reads = self.lists = 0  # GETs of the pool, pod lists (watches aside)
        self.version = 100
        self.target_port = port
        app = Starlette(
            routes=[
                Route(
                    "/apis/inference.networking.k8s.io/v1/namespaces/ml/inferencepools/llama",
                    self._pool,
                ),
                Route("/api/v1/namespaces/ml/pods", self._pods),
            ]
        )
        self.server = Served(app, "127.0.0.1")

    async def _pool(self, request: Request) -> Response:
        self.reads += 1
        return JSONResponse(
            {
                "apiVersion": "inference.networking.k8s.io/v1",
                "kind": "InferencePool",
                "metadata": {"name": "llama", "namespace": "ml"},
                "spec": {
                    "selector": {"matchLabels": LABELS},
                    "targetPorts": [{"number": self.target_port}],
                    "endpointPickerRef": {"name": "kvroute-epp", "port": {"number": 9002}},
                },
            }
        )

    async def _pods(self, request: Request) -> Response:
        self.selectors.append(request.query_params.get("labelSelector", ""))
        if request.query_params.get("watch") in ("true", "1", "True"):
            seconds = int(request.query_params.get("timeoutSeconds", 1800))
            return StreamingResponse(self._watch(seconds), media_type="application/json")
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        self.lists += 1
        self.listed.set()
        items = [p for p in self.pods.values() if p["metadata"]["labels"] == LABELS]
        return JSONResponse(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _watch(self, seconds: int):
        deadline = time.monotonic() + seconds  # the API server ends a watch after timeoutSeconds
        while time.monotonic() < deadline:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.01)
                continue
            if event is None:
                return
            yield (json.dumps(event) + "\n").encode()

    def emit(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.pods.pop(obj["metadata"]["name"], None)
        else:
            self.pods[obj["metadata"]["name"]] = obj
        self.events.put({"type": kind, "object": obj})

    def stop(self) -> None:
        self.events.put(None)
        self.server.stop()


@pytest.fixture
def pods():
    port = Served(Starlette(), "127.0.0.1").port  # a port free on 127.0.0.1 …
    ups, servers = [], []
    for i in range(3):
        u = Upstream(f"pod-{i}")
        ups.append(u)
        servers.append(Served(u.app, f"127.0.0.{i + 2}", port))  # … reused on 127.0.0.2-4
    yield port, ups
    for s in servers:
        s.stop()


def test_workers_follow_the_inference_pools_ready_pods(pods, tmp_path):
    port, ups = pods
    kube = FakeKube(port)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{kube.server.port}"}}
                ],
                "users": [{"name": "fake", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    kube.pods = {
        "pod-0": pod("pod-0", "127.0.0.2"),
        "pod-1": pod("pod-1", "127.0.0.3"),
        "pod-2": pod("pod-2", "127.0.0.4", ready=False),
        "other": pod("other", "127.0.0.9", labels={"app": "other"}),
    }
    config = {
        "endpoints": [
            {"id": "ep-acme", "model": "llama", "pool_size": 2},
            {"id": "ep-big", "model": "llama", "pool_size": 3},
        ],
        "epp": {
            "models": ["llama"],
            "pool": {"name": "llama", "namespace": "ml", "kubeconfig": str(kubeconfig)},
        },
    }
    epp = EppThread(config)
    try:

        async def health(client: EnvoyClient) -> int:
            stub = health_pb2_grpc.HealthStub(client.channel)
            return (await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))).status

        async def picks(client: EnvoyClient, n: int, **kw: Any) -> list[str]:
            out = []
            for i in range(n):
                body = {"model": "llama", "messages": [{"role": "user", "content": f"t{i} " * 100}]}
                r = await client.exchange(body, **kw)
                assert r.status == 200, r.body
                out.append(r.picked)
            return out

        def run(fn: Any, *a: Any, **kw: Any) -> Any:
            async def main() -> Any:
                client = EnvoyClient(epp.port)
                try:
                    return await fn(client, *a, **kw)
                finally:
                    await client.close()

            return asyncio.run(main())

        assert run(health) == health_pb2.HealthCheckResponse.NOT_SERVING  # not listed yet
        kube.release.set()
        wait_for(lambda: epp.server.ready, "the first listing", DEADLINE)
        assert run(health) == health_pb2.HealthCheckResponse.SERVING
        assert kube.selectors[0] == "app=vllm-llama"
        assert sorted(epp.server.picker.members) == ["pod-0", "pod-1"]
        got = run(picks, 8)
        assert set(got) == {f"127.0.0.2:{port}", f"127.0.0.3:{port}"}
        assert sorted(epp.router.endpoint_pool("ep-acme")) == ["pod-0", "pod-1"]
        big = {"model": "ep-big", "messages": [{"role": "user", "content": "hi"}]}
        early = run(lambda c: c.exchange(big))
        assert early.status == 503 and "fewer workers than its pool_size" in early.body.decode()

        kube.emit("MODIFIED", pod("pod-2", "127.0.0.4"))  # becomes ready
        wait_for(lambda: "pod-2" in epp.server.picker.members, "pod-2 to join", DEADLINE)
        assert run(lambda c: c.exchange(big)).status == 200  # three workers: ep-big exists now
        before = len(ups[0].records)
        kube.emit("DELETED", pod("pod-0", "127.0.0.2"))
        wait_for(lambda: "pod-0" not in epp.server.picker.members, "pod-0 to leave", DEADLINE)
        assert "pod-0" not in epp.router.workers
        got = run(picks, 8)
        assert set(got) == {f"127.0.0.3:{port}", f"127.0.0.4:{port}"}
        served = {u.name: len(u.records) for u in ups}
        assert served["pod-2"] > 0 and served["pod-0"] == before  # nothing reached the gone pod
        assert (kube.reads, kube.lists) == (1, 1)  # no error made it start over (a watch that
        # timed out is resumed without a new list)
    finally:
        kube.events.put(None)  # ends the watch, so the picker's watch thread stops at once
        epp.stop()
        kube.stop()


LOADING_CHILD = """
import importlib.abc, importlib.machinery, os, sys, threading, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

loading = threading.Event()
gate = threading.Event()


class Gate(importlib.abc.MetaPathFinder):  # holds ``import kubernetes`` until the check is done
    def find_spec(self, name, path, target=None):
        if name != "kubernetes":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        run = spec.loader.exec_module

        def exec_module(module):  # runs under the module's own lock only
            loading.set()
            gate.wait()
            run(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Gate())
from kvroute.epp import EppServer
from kvroute.epp.config import parse_config

server = EppServer(parse_config({"epp": {"port": 0, "metrics_port": 0, "models": ["m"],
                                          "pool": {"name": "p", "kubeconfig": sys.argv[1]}}}))


def check():
    loading.wait()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        answers = [
            health_pb2.HealthCheckResponse.ServingStatus.Name(
                stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=20).status
            )
            for s in ("liveness", "readiness")
        ]
    except grpc.RpcError as e:
        answers = [e.code().name]
    print(*answers, flush=True)
    os._exit(0)


threading.Thread(target=check, daemon=True).start()
import asyncio
asyncio.run(server.start())
time.sleep(60)
"""


def test_the_server_answers_health_checks_while_the_kubernetes_client_loads(tmp_path):
    """Loading the client takes seconds (hundreds of API classes): not on the event loop."""
    kubeconfig = tmp_path / "kubeconfig"  # never read: the child ends before the client loads
    kubeconfig.write_text("{}")
    proc = subprocess.run(
        [sys.executable, "-c", LOADING_CHILD, str(kubeconfig)],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert proc.stdout.split() == ["SERVING", "NOT_SERVING"], proc.stderr[-2000:]


def test_a_pool_config_is_validated():
    from kvroute.epp.config import parse_config

    with pytest.raises(ValueError, match=r"epp\.pool\.name is required"):
        parse_config({"epp": {"pool": {}}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) in epp.pool: nme"):
        parse_config({"epp": {"pool": {"name": "x", "nme": "y"}}})
    with pytest.raises(ValueError, match="at least one \\[\\[workers\\]\\]"):
        parse_config({"epp": {}})
    with pytest.raises(ValueError, match=r"epp\.objectives must map names to integer"):
        parse_config(
            {
                "workers": [{"name": "a", "url": "http://127.0.0.1:1"}],
                "epp": {"objectives": {"x": "high"}},
            }
        )
    # one file for both servers: each skips the other's section
    from kvroute.gateway.config import parse_config as parse_gateway

    shared = {
        "workers": [{"name": "a", "url": "http://127.0.0.1:1"}],
        "gateway": {"models": ["m"]},
        "epp": {"models": ["m"], "objectives": {"batch": -1}},
    }
    assert parse_config(shared).server.objectives == {"batch": -1}
    assert parse_gateway(shared).server.models == ("m",)
    with pytest.raises(ValueError, match="must have an IP address"):
        from kvroute.epp import EppServer

        EppServer(parse_config({"workers": [{"name": "a", "url": "http://gpu-0:8000"}]}))
