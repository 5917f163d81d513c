"""Calls made while one request is handled: an ingress replica fanning out to an engine
deployment. Ray Serve 2.60 gives every such call the handled request's ``internal_request_id``
(``ray/serve/_private/default_impl.py`` ``get_request_metadata``, from the request context the
replica sets), so the id names the parent request, not the call. No Ray cluster: KvRequestRouter's
hooks are called as Ray's router calls them, and Ray's own routing loop
(``_choose_replica_for_request``) is run against replicas answering its queue-length probes.

The reference: each call is routed where its own prompt was placed (each tenant's prompt was
first served with that replica as the only candidate) and is counted on the replica that accepted
it while it runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvroute.integrations import ray_serve
from kvroute.integrations.ray_serve import KvRequestRouter
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

DEPLOYMENT = DeploymentID(name="engine", app_name="app")
NAMES = ("r0", "r1", "r2")
HOMES = {"acme": "r0", "globex": "r1"}  # where each tenant's prompt is placed first


@dataclass
class Replica:
    """What Ray's router and KvRequestRouter read of a ``RunningReplica``."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 5

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0  # never full: Ray takes the first rank


class Result:
    """An accepted attempt's ``ReplicaResult``: done-callbacks run when it completes."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def complete(self) -> None:
        for callback in self.callbacks:
            callback(self)

    async def to_object_ref_async(self) -> Any:
        raise RuntimeError("no usage in this test")


def body(tenant: str) -> dict[str, Any]:
    system = f"You answer for {tenant}. " + " ".join(f"rule {i} of {tenant}" for i in range(40))
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}


def call(tenant: str, internal_request_id: str) -> PendingRequest:
    meta = RequestMetadata(request_id="parent", internal_request_id=internal_request_id)
    return PendingRequest([body(tenant)], {}, meta)


async def placed() -> tuple[KvRequestRouter, dict[str, Replica]]:
    """A router whose model holds each tenant's prompt on its home replica: served there alone."""
    router = KvRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(capacity_blocks=256, block_size=4)
    replicas = {n: Replica(ReplicaID(unique_id=n, deployment_id=DEPLOYMENT)) for n in NAMES}
    router.update_replicas(list(replicas.values()))
    for tenant, home in HOMES.items():
        pr = call(tenant, f"warm-{tenant}")
        await router.choose_replicas([replicas[home]], pr)
        result = Result()
        router.on_request_routed(pr, replicas[home].replica_id, result)
        result.complete()
        await asyncio.sleep(0)  # the done-callback hops onto the loop
    assert all(router.router.load(n)["active"] == 0 for n in NAMES)
    return router, replicas


def active(router: KvRequestRouter) -> dict[str, int]:
    return {n: router.router.load(n)["active"] for n in NAMES}


async def two_calls_one_id() -> None:
    router, replicas = await placed()
    candidates = list(replicas.values())
    calls = {tenant: call(tenant, "ingress-1") for tenant in HOMES}
    results = {}
    for tenant, pr in calls.items():  # the second is routed while the first runs
        ranks = await router.choose_replicas(candidates, pr)
        first = ranks[0][0].replica_id
        assert first.unique_id == HOMES[tenant], tenant
        results[tenant] = Result()
        router.on_request_routed(pr, first, results[tenant])
    await asyncio.sleep(0)
    assert active(router) == {"r0": 1, "r1": 1, "r2": 0}
    # Ray reports each attempt completed under the shared id; each call is finished by its own.
    results["acme"].complete()
    router.on_request_completed(replicas["r0"].replica_id, "ingress-1")
    await asyncio.sleep(0)
    assert active(router) == {"r0": 0, "r1": 1, "r2": 0}
    results["globex"].complete()
    router.on_request_completed(replicas["r1"].replica_id, "ingress-1")
    await asyncio.sleep(0)
    assert active(router) == dict.fromkeys(NAMES, 0)
    assert not router._requests
    assert not router._by_rid


def test_calls_sharing_a_request_id_are_routed_and_counted_each():
    asyncio.run(two_calls_one_id())


async def fan_out_through_rays_loop() -> None:
    router, _ = await placed()
    calls = {tenant: call(tenant, "ingress-2") for tenant in HOMES}
    # Both queued at once, as two handle calls an ingress makes in asyncio.gather.
    chosen = await asyncio.wait_for(
        asyncio.gather(*(router._choose_replica_for_request(pr) for pr in calls.values())),
        timeout=60,  # a liveness bound: before the fix the second call never got a replica
    )
    assert {t: r.replica_id.unique_id for t, r in zip(calls, chosen, strict=True)} == HOMES


def test_a_fan_out_through_rays_routing_loop_routes_every_call_to_its_prompt():
    """Ray 2.60 indexes pending calls by internal_request_id and only the first of several
    sharing one: without KvRequestRouter's own lookup, the sibling's routing task fulfils the
    first call (or nothing) and the sibling never gets a replica (seen with a real Serve app:
    9 of 10 fan-out pairs timed out, 'Failed to get queue length' logged while it looped)."""
    asyncio.run(fan_out_through_rays_loop())


async def one_of_two_settled() -> None:
    router, replicas = await placed()
    calls = {tenant: call(tenant, "ingress-3") for tenant in HOMES}
    for pr in calls.values():
        await router.choose_replicas(list(replicas.values()), pr)
    # Ray reports an attempt under the shared id completed on acme's replica, unaccepted.
    router.on_request_completed(replicas[HOMES["acme"]].replica_id, "ingress-3")
    routed = {t: router._requests[id(pr)] for t, pr in calls.items()}
    assert routed["acme"].settled_at is not None
    assert routed["globex"].settled_at is None  # still queued: withdrawn if never dispatched
    router._forget_stale(routed["acme"].settled_at + ray_serve.SETTLED_TTL + 1)
    assert list(router._requests.values()) == [routed["globex"]]
    assert router._by_rid == {"ingress-3": {id(calls["globex"])}}


def test_a_completion_reported_under_a_shared_id_settles_the_call_it_was_for():
    asyncio.run(one_of_two_settled())
