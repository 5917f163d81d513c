"""KvRequestRouter inside a real local Ray Serve (CPU only, replicas with ``num_cpus=0``).

The replicas model an engine's prefix cache (``support.ray_replicas.CacheReplica``) and report
the cached tokens of every request; hit rates are what the replicas reported, latencies what the
caller saw.
Ray's default router and ``PrefixCacheAffinityRouter`` serve the same requests in the same run.
One Ray instance serves the whole module.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
from kvroute.integrations.ray_serve import KvRequestRouter
from ray import serve
from ray.serve.config import RequestRouterConfig
from support.helpers import hit_rate, tenant_requests, tenant_system_prompts

TESTS = Path(__file__).resolve().parent
KV = "kvroute.integrations.ray_serve:KvRequestRouter"
DEFAULT = "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"
# The public path (ray.serve.llm.request_router) imports vLLM; the class itself does not.
PREFIX = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
    ":PrefixCacheAffinityRouter"
)
REPLICAS = 3
CAPACITY = 800  # blocks per replica: ~7 of the 20 tenants' system prompts, the fleet holds all
PREFILL_S = 20e-6  # seconds per uncached token


@dataclass
class Chat:
    """An OpenAI-style chat request object (what PrefixCacheAffinityRouter reads: ``.messages``)."""

    messages: list[dict[str, Any]]
    model: str = "tiny"


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
    except Exception as e:  # pragma: no cover - Ray starts on this machine
        pytest.skip(f"a local Ray cannot start in this sandbox: {e!r}")
    yield
    serve.shutdown()
    ray.shutdown()


def deploy(name: str, router: str, **kwargs: Any):
    """The app ``name``: ``REPLICAS`` cache replicas behind ``router`` (``kwargs``)."""
    from support.ray_replicas import CacheReplica

    config = RequestRouterConfig(
        request_router_class=router,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=0.2,
    )
    app = CacheReplica.options(
        name=name,
        num_replicas=REPLICAS,
        request_router_config=config,
    ).bind(CAPACITY, PREFILL_S)
    return serve.run(app, name=name, route_prefix=None)


def kv_router(handle: Any) -> KvRequestRouter:
    """The handle's KvRequestRouter (Ray builds it inside the handle on first use)."""
    handle.remote(Chat([{"role": "user", "content": "warm up"}])).result(timeout_s=120)
    router = handle._router._asyncio_router.request_router  # Ray 2.60 internals
    assert isinstance(router, KvRequestRouter)
    return router


def drive(handle: Any, jobs: list[tuple[int, str]], *, threads: int = 6, on_done=None):
    """Sends ``jobs`` through the handle from ``threads`` callers; returns (answers, latencies,
    seconds). ``on_done(n)`` runs after the n-th answer."""
    prompts = tenant_system_prompts()
    answers: list[dict[str, Any]] = []
    latencies: list[float] = []
    lock = threading.Lock()
    todo = iter(jobs)

    def caller() -> None:
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            tenant, question = job
            body = Chat(
                [
                    {"role": "system", "content": prompts[tenant]},
                    {"role": "user", "content": question},
                ]
            )
            started = time.perf_counter()
            answer = handle.remote(body).result(timeout_s=120)
            with lock:
                latencies.append(time.perf_counter() - started)
                answers.append(answer)
                n = len(answers)
            if on_done is not None:
                on_done(n)

    # One call first: the handle builds its router on first use, racily when threads start at once.
    handle.remote(Chat([{"role": "user", "content": "warm up"}])).result(timeout_s=120)
    started = time.perf_counter()
    pool = [threading.Thread(target=caller) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return answers, sorted(latencies), time.perf_counter() - started


def wait_idle(router: KvRequestRouter) -> None:
    """Waits until Ray has reported every answered request completed (its callbacks run on the
    router's event loop shortly after the caller got the answer)."""
    deadline = time.monotonic() + 30
    while router._requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not router._requests  # every routed request was completed
    assert all(router.router.load(w)["active"] == 0 for w in router.router.workers)


def summary(name: str, answers: list[dict[str, Any]], latencies: list[float], seconds: float):
    rate = hit_rate([a["usage"] for a in answers])
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(
        f"{name:>28}: hit {rate:6.1%}  p50 {p50 * 1e3:5.0f} ms  p99 {p99 * 1e3:5.0f} ms  "
        f"{len(answers) / seconds:5.1f} req/s"
    )
    return rate, p50


def test_hit_rate_and_latency_against_rays_routers(cluster):
    jobs = tenant_requests(300)
    results = {}
    for name, router, kwargs in [
        ("kvroute", KV, {"capacity_blocks": CAPACITY}),
        ("ray-default", DEFAULT, {}),
        ("ray-prefix-cache-affinity", PREFIX, {}),
    ]:
        handle = deploy(name, router, **kwargs)
        answers, latencies, seconds = drive(handle, jobs)
        assert len(answers) == len(jobs)
        results[name] = summary(name, answers, latencies, seconds)
        if name == "kvroute":
            router = kv_router(handle)
            wait_idle(router)
            served = {a["replica"] for a in answers}
            assert served == set(router.router.workers)
        serve.delete(name)
    assert results["kvroute"][0] >= 1.5 * results["ray-default"][0]


def test_replica_published_unhealthy_gets_no_traffic(cluster):
    from support.ray_replicas import SICK

    handle = deploy("stats", KV)
    router = kv_router(handle)
    sick = handle.remote(Chat([{"role": "user", "content": SICK}])).result(timeout_s=60)["replica"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = {r.replica_id.unique_id: r.routing_stats for r in router._replicas_list}
        if stats.get(sick) == {"healthy": False}:
            break
        time.sleep(0.1)
    answers, _, _ = drive(handle, tenant_requests(60, seed=1), threads=3)
    assert len(answers) == 60
    assert sick not in {a["replica"] for a in answers}
    assert not router.router.is_healthy(sick)
    serve.delete("stats")


def test_replica_killed_mid_run_loses_no_request(cluster):
    handle = deploy("killed", KV, capacity_blocks=CAPACITY)
    router = kv_router(handle)
    jobs = tenant_requests(200, seed=2)
    victim: dict[str, str] = {}

    def kill_one(n: int) -> None:
        if n == 50:
            name = sorted(router.router.workers)[0]
            actors = ray.util.list_named_actors(all_namespaces=True)
            actor = next(a for a in actors if a["name"].endswith(f"#{name}"))
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            victim["name"] = name

    answers, _, _ = drive(handle, jobs, on_done=kill_one)
    assert len(answers) == len(jobs)
    late = answers[60:]
    assert victim["name"] not in {a["replica"] for a in late}
    assert victim["name"] not in router.router.workers
    wait_idle(router)
    serve.delete("killed")
