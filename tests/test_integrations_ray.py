"""KvRequestRouter inside a real local Ray Serve (CPU only, replicas with ``num_cpus=0``).

The replicas model an engine's prefix cache (``support.ray_replicas.CacheReplica``) and report
the cached tokens of every request; hit rates are what the replicas reported, latencies what the
caller saw.
Ray's default router and ``PrefixCacheAffinityRouter`` serve the same requests in the same run.
One Ray instance serves the whole module.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
from kvroute.integrations.ray_serve import KvRequestRouter, ResubmittingHandle, replica_died
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.config import RequestRouterConfig
from support.helpers import hit_rate, tenant_requests, tenant_system_prompts

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "README.md"
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
PROMPTS = tenant_system_prompts()


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


#: The module's cache-replica apps: name -> (request router, its kwargs). ``kvroute`` serves the
#: hit-rate comparison first, then the tests of replica stats and of a replica killed (last).
APPS = {
    "kvroute": (KV, {"capacity_blocks": CAPACITY}),
    "ray-default": (DEFAULT, {}),
    "ray-prefix-cache-affinity": (PREFIX, {}),
}


def readme_example() -> dict[str, Any]:
    """The namespace the README's Ray Serve example leaves."""
    text = README.read_text()
    section = text[text.index("### Ray Serve") :]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    ns: dict[str, Any] = {}
    exec(compile(block, str(README), "exec"), ns)
    return ns


@pytest.fixture(scope="module")
def apps(cluster) -> dict[str, Any]:
    """Every app of the module, deployed at once so their replicas start side by side (starting
    replicas is most of this module's time): name -> handle. ``readme`` is the README's example on
    this small cluster (2 replicas, no CPUs reserved)."""
    from support.ray_replicas import CacheReplica

    targets = []
    for name, (router, kwargs) in APPS.items():
        config = RequestRouterConfig(
            request_router_class=router,
            request_router_kwargs=kwargs,
            request_routing_stats_period_s=0.2,
        )
        app = CacheReplica.options(
            name=name, num_replicas=REPLICAS, request_router_config=config
        ).bind(CAPACITY, PREFILL_S)
        targets.append(serve.RunTarget(app, name=name, route_prefix=None))
    engine = readme_example()["Engine"]
    app = engine.options(num_replicas=2, ray_actor_options={"num_cpus": 0}).bind()
    targets.append(serve.RunTarget(app, name="readme", route_prefix=None))
    handles = serve.run_many(targets)
    return dict(zip([*APPS, "readme"], handles, strict=True))


def kv_router(handle: Any) -> KvRequestRouter:
    """The handle's KvRequestRouter (Ray builds it inside the handle on first use)."""
    handle.remote(Chat([{"role": "user", "content": "warm up"}])).result(timeout_s=120)
    router = handle._router._asyncio_router.request_router  # Ray 2.60 internals
    assert isinstance(router, KvRequestRouter)
    return router


@dataclass
class Run:
    """What ``drive`` saw: per answer, when its call was sent (perf_counter) and the answer."""

    sent: list[float]
    answers: list[dict[str, Any]]
    latencies: list[float]  # sorted
    seconds: float


def chat(tenant: int, question: str) -> Chat:
    return Chat(
        [
            {"role": "system", "content": PROMPTS[tenant]},
            {"role": "user", "content": question},
        ]
    )


def drive(handle: Any, jobs: list[tuple[int, str]], *, threads: int = 6, on_done=None) -> Run:
    """Sends ``jobs`` through the handle from ``threads`` callers. ``on_done(n)`` runs in the
    caller of the n-th answer, after it."""
    run = Run([], [], [], 0.0)
    lock = threading.Lock()
    todo = iter(jobs)

    def caller() -> None:
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            sent = time.perf_counter()
            answer = handle.remote(chat(*job)).result(timeout_s=120)
            with lock:
                run.latencies.append(time.perf_counter() - sent)
                run.sent.append(sent)
                run.answers.append(answer)
                n = len(run.answers)
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
    run.seconds = time.perf_counter() - started
    run.latencies.sort()
    return run


def wait_idle(router: KvRequestRouter) -> None:
    """Waits until Ray has reported every answered request completed (its callbacks run on the
    router's event loop shortly after the caller got the answer)."""
    deadline = time.monotonic() + 30
    while router._requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not router._requests  # every routed request was completed
    assert all(router.router.load(w)["active"] == 0 for w in router.router.workers)


def summary(name: str, run: Run) -> float:
    rate = hit_rate([a["usage"] for a in run.answers])
    lat = run.latencies
    p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99)]
    print(
        f"{name:>28}: hit {rate:6.1%}  p50 {p50 * 1e3:5.0f} ms  p99 {p99 * 1e3:5.0f} ms  "
        f"{len(lat) / run.seconds:5.1f} req/s"
    )
    return rate


def test_hit_rate_and_latency_against_rays_routers(apps):
    jobs = tenant_requests(300)
    runs = {
        name: drive(apps[name], jobs)
        for name in ("kvroute", "ray-default", "ray-prefix-cache-affinity")
    }
    rates = {name: summary(name, run) for name, run in runs.items()}
    assert all(len(run.answers) == len(jobs) for run in runs.values())
    router = kv_router(apps["kvroute"])
    wait_idle(router)
    assert {a["replica"] for a in runs["kvroute"].answers} == set(router.router.workers)
    assert rates["kvroute"] >= 1.5 * rates["ray-default"]


def test_replica_published_unhealthy_gets_no_traffic(apps):
    from support.ray_replicas import SICK

    handle = apps["kvroute"]
    router = kv_router(handle)
    sick = handle.remote(Chat([{"role": "user", "content": SICK}])).result(timeout_s=60)["replica"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = {r.replica_id.unique_id: r.routing_stats for r in router._replicas_list}
        if stats.get(sick) == {"healthy": False}:
            break
        time.sleep(0.1)
    # More callers than the healthy replicas' 2 × 4 slots: the sick one is no overflow either.
    run = drive(handle, tenant_requests(60, seed=1), threads=12)
    assert len(run.answers) == 60
    assert sick not in {a["replica"] for a in run.answers}
    assert not router.router.is_healthy(sick)


def test_readme_example_serves(apps):
    handle = readme_example()["ResubmittingHandle"](apps["readme"])
    body = {"messages": [{"role": "user", "content": "hello"}]}
    answers = [handle.remote(body).result(timeout_s=60) for _ in range(3)]
    assert all(a["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} for a in answers)
    with pytest.raises(KeyError, match="ep-nope"):  # an unknown endpoint fails, never waits
        handle.remote({**body, "kvroute_endpoint": "ep-nope"}).result(timeout_s=60)
    router = kv_router(handle.handle)
    wait_idle(router)
    assert len(router.router.workers) == 2


def test_an_ingress_fan_out_routes_each_call_to_its_prompt(cluster):
    """Two parallel calls from one ingress request share its internal_request_id. Seen before
    the fix: the second call served on the first one's replica, or never routed (hung)."""
    from support.ray_replicas import CacheReplica, FanOut

    config = RequestRouterConfig(
        request_router_class=KV, request_router_kwargs={"capacity_blocks": CAPACITY}
    )
    engine = CacheReplica.options(
        name="fanout-engine", num_replicas=REPLICAS, request_router_config=config
    ).bind(CAPACITY, PREFILL_S)
    handle = serve.run(FanOut.bind(engine), name="fanout", route_prefix=None)

    def body(tenant: int, question: str) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "system", "content": PROMPTS[tenant]},
                {"role": "user", "content": question},
            ]
        }

    # Each tenant's prompt placed by one call alone: where the replica holds it. A new prefix
    # goes where rendezvous hashing of its first block says (the replica ids are random), so
    # tenants are placed until two replicas are homes (~6 tenants; all 6 on one replica is a
    # 1-in-243 draw, seen in CI) — well before any replica's cache is full.
    home: dict[int, str] = {}
    pairs: list[tuple[int, int]] = []
    for t in range(len(PROMPTS)):
        home[t] = handle.remote([body(t, "first")]).result(timeout_s=120)[0]["replica"]
        pairs = [(a, b) for a in home for b in home if a < b and home[a] != home[b]][:4]
        if len(pairs) == 4 or (len(pairs) >= 2 and len(home) >= 6):
            break
    assert len(pairs) >= 2, home
    for a, b in pairs:
        answers = handle.remote([body(a, f"then {b}"), body(b, f"then {a}")]).result(timeout_s=30)
        assert [x["replica"] for x in answers] == [home[a], home[b]], (a, b)
        # The replica's own cache says so: each call found its tenant's system prompt there.
        assert all(x["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for x in answers)
    serve.delete("fanout")


def test_only_a_dead_replica_is_a_reason_to_resubmit():
    assert replica_died(ActorDiedError())
    assert replica_died(ActorUnavailableError("unreachable", b"\0" * 16))
    # An upstream actor's death, reported by the replica that depended on it: the replica's error.
    assert not replica_died(RayTaskError("f", "tb", ActorDiedError()).as_instanceof_cause())
    assert not replica_died(ValueError("bad request"))


def test_replica_killed_mid_run_loses_no_request(apps, tmp_path):
    """Ray resends a request only until a replica accepts it; requests executing on a replica
    that dies fail in the caller (ActorDiedError) unless resubmitted — ResubmittingHandle's job.
    Two held requests make sure some are executing on the victim when it is killed."""
    from support.ray_replicas import FAIL, HOLD

    raw = apps["kvroute"]
    router = kv_router(raw)
    handle = ResubmittingHandle(raw)
    # What the replica raised is the answer: not resubmitted.
    failing = handle.remote(Chat([{"role": "user", "content": FAIL}]))
    with pytest.raises(ValueError, match="was asked to fail"):
        failing.result(timeout_s=60)
    assert failing.submitted == 1
    with pytest.raises(ValueError, match="streaming"):
        ResubmittingHandle(raw.options(stream=True))
    held: list[dict[str, Any]] = []
    victim: dict[str, Any] = {}

    def hold(awaited: bool) -> None:
        body = Chat([{"role": "user", "content": HOLD + str(tmp_path)}])
        if awaited:  # the asyncio path: ``await`` the response

            async def call() -> dict[str, Any]:
                return await asyncio.wait_for(handle.remote(body), 120)

            held.append(asyncio.run(call()))
        else:
            held.append(handle.remote(body).result(timeout_s=120))

    def kill_one(n: int) -> None:
        if n != 50:
            return
        holders = [threading.Thread(target=hold, args=(a,)) for a in (False, True)]
        for t in holders:
            t.start()
        deadline = time.monotonic() + 60
        while not list(tmp_path.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.01)
        name = sorted(tmp_path.iterdir())[0].name.rpartition(".")[0]  # a replica holding one
        actors = ray.util.list_named_actors(all_namespaces=True)
        actor = next(a for a in actors if a["name"].endswith(f"#{name}"))
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        while name in router.router.workers and time.monotonic() < deadline:
            time.sleep(0.01)
        victim.update(name=name, gone=time.perf_counter())
        (tmp_path / "release").touch()
        for t in holders:
            t.join()

    run = drive(handle, tenant_requests(200, seed=2), on_done=kill_one)
    assert len(run.answers) == 200
    name = victim["name"]
    assert name not in router.router.workers
    # The held requests were executing on the victim when it died, and were answered elsewhere.
    assert any(f.name.startswith(f"{name}.") for f in tmp_path.iterdir())
    assert len(held) == 2 and name not in {a["replica"] for a in held}
    # No request sent after the victim was removed went to it: those of the run that were (if
    # it had not finished by then), and a batch sent after it.
    after = drive(handle, tenant_requests(20, seed=3))
    late = [a for sent, a in zip(run.sent, run.answers, strict=True) if sent > victim["gone"]]
    assert name not in {a["replica"] for a in late + after.answers}
    wait_idle(router)
