"""kvroute as a Ray Serve request router: ``KvRequestRouter``.

Tested with ``ray[serve]==2.60.0`` (``pip install 'kvroute[ray]'``). Configure a deployment with::

    RequestRouterConfig(
        request_router_class="kvroute.integrations.ray_serve:KvRequestRouter",
        request_router_kwargs={"policy": "kv_aware", "capacity_blocks": 4096},
    )

``request_router_kwargs`` (JSON values, as Ray requires) go to ``initialize_state``: ``tokenizer``
(a ``tokenizer.json`` path; default ``kvroute serve``'s byte-level tokens), ``prompt_of`` (a
``"module:function"`` hook, below), ``endpoints`` (``{id: Router.add_endpoint keywords}``),
``endpoint_key``, ``saturated_waiting``, ``saturated_kv_usage``; everything else goes to
``kvroute.Router`` (``policy``, ``block_size``, ``capacity_blocks``, ``queue_weight`` …).

**Prompt.** By default the request is the first positional or keyword argument that is an
OpenAI-style chat/completions body: a mapping, or an object (a pydantic model, a dataclass) with a
``messages`` or ``prompt`` attribute. It is rendered and tokenized as ``kvroute serve`` does
(``kvroute.integrations.common``). For other shapes, ``prompt_of="pkg.mod:fn"`` names a function
``fn(pending_request) -> Mapping | None`` returning such a body. A request without one (or with an
unrenderable one) is routed on load alone, still accounted.

**Ranking.** ``choose_replicas`` routes the request once (a retry round after every replica was
full reuses that decision) and returns, each as its own rank, the replicas the router could have
chosen (healthy; in the endpoint's pool for an endpoint's request), best first: the decision's
replica, then the others in the policy's order. Ray tries the ranks in order and takes the first
replica whose queue is not full, so the router's choice stands unless that replica is at
``max_ongoing_requests``; when all are, the request waits for one of them. Only when every replica
reports itself unhealthy is Ray's own order used. A request that cannot be routed fails in the
caller with the reason (an unknown endpoint: ``KeyError``; a ``prompt_of`` hook's error) rather
than waiting in Ray's queue. Ray's locality and model-multiplexing preferences are not applied.

**Calls, not request ids.** The router keeps its state per call (Ray's ``PendingRequest``), not
per ``internal_request_id``: Ray gives every call a replica makes while handling a request that
request's id (an ingress fanning out to an engine deployment), so calls in parallel share it. Each
is routed on its own prompt, counted and finished on its own. Ray 2.60's routing loop hands the
replica it found to the pending call indexed under that id, which is only the first of them:
``KvRequestRouter`` hands it to the routing task's own call instead (without that, the first
call's replica went to the first call and a sibling, never indexed, was never routed: it hung,
Ray logging "Failed to get queue length" while it looped. Ray's own routers take the next queued
call instead).

**Endpoints.** ``endpoints`` are added once a replica is healthy, with a pool of ``pool_size``
replicas or, while fewer are healthy, all of them; the pool is re-formed at the larger size as
more replicas become healthy (autoscaling up), as the router forms it with them all from the
start. It never shrinks here: the router serves a pool with the healthy members left. A pool whose
``reserved_blocks`` do not fit keeps its previous size or, none fitting, is left out (logged; its
requests fail as naming an unknown endpoint); nothing is raised into Ray's replica updates.

**Load accounting in step with Ray's.** A request is begun (``Router.begin``) when Ray reports the
replica accepted it (``on_request_routed``) — on the replica Ray actually chose; if that is not the
decision's, the decision is withdrawn (``Router.withdraw``: the prompt its route put in the router's
model on the first-ranked replica leaves it) and the request is routed again restricted to the
chosen replica (one the router cannot route to runs unaccounted) — and finished exactly once,
when that accepted attempt's result is done, whatever its outcome (a done-callback on it, not
Ray's ``on_request_completed``: Ray schedules that and ``on_request_routed`` independently, so the
completion of a fast request can arrive before its acceptance). Ray reports acceptance only under
its strict ``max_ongoing_requests`` protocol (the default); through Ray Client, to a Java replica or
through ``choose_replica``/``dispatch``, requests are routed but not accounted, and a request Ray
reported completed without accepting it (there, or a rejected attempt never retried) is forgotten
``SETTLED_TTL``s later. A replica that dies
is removed (``on_replica_actor_died``, ``update_replicas``). For a unary response, the returned
body's ``usage.prompt_tokens_details.cached_tokens`` (a mapping or an object) is passed to
``Router.observe`` when the result is ready; streamed responses are not observed.

**A replica that dies.** Ray Serve 2.60 resends a request by itself only while no replica has
accepted it (a replica that rejects it, or is found dead or unreachable before accepting). Once a
replica has accepted a request, its death reaches the caller as ``ActorDiedError`` (or
``ActorUnavailableError`` on the gRPC transport): Serve's replicas are never restarted in place and
their calls carry no task retries. ``ResubmittingHandle(handle)`` closes that gap for unary calls:
its ``remote(...).result()`` / ``await`` resubmits the call when the replica executing it died, up
to ``attempts`` times in all (a request that kills every replica it reaches is not resubmitted
forever), and the resubmitted call is routed anew among the live replicas. Errors the replica
raised, including those of an upstream call it depended on, are not resubmitted. The call may
have partly run on the dead replica; the caller gets one answer. Streams are refused (their
chunks cannot be taken back), and requests through Serve's HTTP proxy are retried by the HTTP
client.

**Replica-published stats** (a deployment's ``record_routing_stats()``, read from
``replica.routing_stats``): ``healthy: False`` excludes the replica; ``waiting`` (requests queued in
the engine, at least ``saturated_waiting``, default 1) or ``kv_usage`` (fraction of KV cache in
use, at least ``saturated_kv_usage``, default 0.98) marks it saturated: it ranks after every
unsaturated replica.

**State across handles.** Each ``DeploymentHandle`` (each process that calls the deployment: the
HTTP proxy, every ingress replica) holds its own ``KvRequestRouter`` and therefore its own
approximate model of the replicas' caches, learnt from the requests it routed and corrected by the
usage it observed. With one calling process that is the whole traffic; with several, each knows
its own share (shared state across router replicas is the ``kvroute.cluster`` work).
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve._private.common import RequestMetadata
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvroute import Decision, NoWorkerError, Router

from .common import (
    RequestError,
    grow_endpoints,
    make_tokenizer,
    observed_tokens,
    ranked,
    routing_tokens_async,
)

__all__ = [
    "KvRequestRouter",
    "ResubmittingHandle",
    "ResubmittingResponse",
    "openai_body",
    "replica_died",
]

log = logging.getLogger("kvroute.integrations.ray_serve")

_NO_TOKENS = np.empty(0, dtype=np.uint32)
#: Seconds a routed request that Ray never dispatched is remembered.
UNDISPATCHED_TTL = 300.0
#: Seconds a request Ray reported completed on a replica without having reported it accepted is
#: remembered: a rejected attempt whose retry may still be accepted (otherwise the request ended
#: on a path without acceptance reports: Ray Client, a Java replica, choose_replica/dispatch).
SETTLED_TTL = 30.0
#: Seconds between two sweeps for such requests.
SWEEP_PERIOD_S = 1.0


def _as_body(value: Any) -> Mapping[str, Any] | None:
    if isinstance(value, Mapping):
        return value if ("messages" in value or "prompt" in value) else None
    if hasattr(value, "messages") or hasattr(value, "prompt"):
        dump = getattr(value, "model_dump", None)
        if callable(dump):
            body = dump()
            if isinstance(body, Mapping):
                return body
        return {k: getattr(value, k) for k in ("messages", "prompt", "tools") if hasattr(value, k)}
    return None


def openai_body(pending_request: PendingRequest) -> Mapping[str, Any] | None:
    """The default ``prompt_of``: the first argument that is an OpenAI-style body."""
    for value in (*pending_request.args, *pending_request.kwargs.values()):
        body = _as_body(value)
        if body is not None:
            return body
    return None


def _load_hook(path: str) -> Callable[[PendingRequest], Mapping[str, Any] | None]:
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"prompt_of must be 'module:function', got {path!r}")
    hook = getattr(importlib.import_module(module), name)
    if not callable(hook):
        raise TypeError(f"prompt_of {path!r} is not callable")
    return hook


@dataclass
class _Routed:
    decision: Decision
    ranking: list[str]
    tokens: np.ndarray
    endpoint: str | None
    pending: PendingRequest | None = None  # the call (held: its id() keys the entry)
    begun: bool = False
    routed_at: float = field(default_factory=time.monotonic)
    settled_at: float | None = None  # an attempt completed before any was reported accepted


class KvRequestRouter(RequestRouter):
    """A Ray Serve ``RequestRouter`` backed by a ``kvroute.Router`` (see the module docs)."""

    def initialize_state(
        self,
        *,
        tokenizer: str | None = None,
        prompt_of: str | None = None,
        endpoints: Mapping[str, Mapping[str, Any]] | None = None,
        endpoint_key: str = "kvroute_endpoint",
        saturated_waiting: int = 1,
        saturated_kv_usage: float = 0.98,
        **router_options: Any,
    ) -> None:
        self.router = Router([], **router_options)
        self.tokenizer = make_tokenizer(tokenizer)
        self.prompt_of = _load_hook(prompt_of) if prompt_of else openai_body
        self.endpoint_options = {e: dict(o) for e, o in (endpoints or {}).items()}
        self.endpoint_key = endpoint_key
        self._endpoint_sizes: dict[str, int] = {}  # endpoint -> the pool size it was added with
        self.saturated_waiting = saturated_waiting
        self.saturated_kv_usage = saturated_kv_usage
        # Per call, keyed by id(PendingRequest) (the entry holds the object, so the id is not
        # reused while it is there). Not by internal_request_id: every call a replica makes while
        # handling one request carries that request's id (Ray's get_request_metadata).
        self._requests: dict[int, _Routed] = {}
        self._by_rid: dict[str, set[int]] = {}  # internal_request_id -> its calls' keys
        self._swept_at = time.monotonic()

    # ---- replicas ----------------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        names = {r.replica_id.unique_id for r in replicas}
        for name in self.router.workers:
            if name not in names:
                self.router.remove_worker(name)
        for name in sorted(names - set(self.router.workers)):
            self.router.add_worker(name)
        self._size_endpoints()

    def _size_endpoints(self) -> None:
        """Endpoint pools as replicas come and go (``common.grow_endpoints``): autoscaling up
        from fewer replicas than ``pool_size`` enlarges them; nothing is raised into Ray."""
        grow_endpoints(self.router, self.endpoint_options, self._endpoint_sizes, log)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if replica_id.unique_id in self.router.workers:
            self.router.remove_worker(replica_id.unique_id)

    def _saturated(self, replica: RunningReplica) -> bool:
        stats = replica.routing_stats or {}
        waiting, usage = stats.get("waiting"), stats.get("kv_usage")
        return (isinstance(waiting, (int, float)) and waiting >= self.saturated_waiting) or (
            isinstance(usage, (int, float)) and usage >= self.saturated_kv_usage
        )

    # ---- routing -----------------------------------------------------------------------------

    async def _route(
        self, pending_request: PendingRequest, candidates: dict[str, RunningReplica]
    ) -> _Routed:
        try:
            body = self.prompt_of(pending_request)
            tokens = (
                _NO_TOKENS if body is None else await routing_tokens_async(body, self.tokenizer)
            )
        except RequestError as e:
            log.debug("routing %s on load alone: %s", pending_request.metadata.request_id, e)
            body, tokens = None, _NO_TOKENS
        endpoint = body.get(self.endpoint_key) if body is not None else None
        endpoint = endpoint if isinstance(endpoint, str) else None
        changed = False
        for name, replica in candidates.items():
            ok = (replica.routing_stats or {}).get("healthy") is not False
            if name in self.router.workers and self.router.is_healthy(name) != ok:
                self.router.set_healthy(name, ok)
                changed = True
        if changed:
            self._size_endpoints()
        exclude = [w for w in self.router.workers if w not in candidates]
        decision = self.router.route(tokens=tokens, endpoint=endpoint, exclude=exclude)
        # The fallbacks are the replicas the router could have chosen: healthy, in the pool.
        pool = set(self.router.endpoint_pool(endpoint)) if endpoint is not None else None
        eligible = [
            w
            for w in candidates
            if (pool is None or w in pool)
            and (w not in self.router.workers or self.router.is_healthy(w))
        ]
        return _Routed(decision, ranked(decision, eligible), tokens, endpoint)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        candidates = {r.replica_id.unique_id: r for r in candidate_replicas}
        rid = pending_request.metadata.internal_request_id
        key = id(pending_request)
        routed = self._requests.get(key)
        if routed is None or routed.decision.worker not in candidates:
            if routed is not None and not routed.begun:  # its replica left: routed anew below
                self._drop(key)
                self.router.withdraw(routed.decision)
            now = time.monotonic()
            if now - self._swept_at >= SWEEP_PERIOD_S:
                self._swept_at = now
                self._forget_stale(now)
            try:
                routed = await self._route(pending_request, candidates)
            except NoWorkerError as e:  # every candidate reports itself unhealthy
                log.warning("kvroute found no healthy replica (%s); Ray's order is used", e)
                return [candidate_replicas]
            except Exception as e:  # e.g. an unknown endpoint (KeyError): fail it, never hang
                log.warning("kvroute cannot route %s: %r", rid, e)
                if not pending_request.future.done():
                    pending_request.future.set_exception(e)
                return [candidate_replicas]  # Ray sees the request done and stops routing it
            routed.pending = pending_request
            self._requests[key] = routed
            self._by_rid.setdefault(rid, set()).add(key)
        order = [candidates[w] for w in routed.ranking if w in candidates]
        order.sort(key=self._saturated)  # stable: saturated replicas after the others
        return [[r] for r in order]

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: RequestMetadata | None = None
    ) -> None:
        # Ray 2.60 hands the replica a routing task found to the pending request indexed under
        # the task's internal_request_id, and indexes only the first of several calls sharing one
        # (the calls a replica makes while handling one request: an ingress fanning out). A
        # sibling's task then fulfils the first call, or nothing once that call is fulfilled and
        # unindexed, and loops (probing queue lengths) forever: the sibling hangs. (Ray's own
        # routers mix in FIFOMixin, which hands it to the next queued call instead.) The task's
        # own call (the same metadata object) is fulfilled instead.
        indexed = None
        if request_metadata is not None:
            indexed = self._pending_requests_by_id.get(request_metadata.internal_request_id)
        if request_metadata is not None and (
            indexed is None or indexed.metadata is not request_metadata
        ):
            own = next(
                (
                    pr
                    for pr in self._pending_requests_to_fulfill
                    if pr.metadata is request_metadata and not pr.future.done()
                ),
                None,
            )
            if own is not None:
                self._record_queue_wait_time(own)
                own.future.set_result(replica)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    # ---- lifecycle ---------------------------------------------------------------------------

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        rid = pending_request.metadata.internal_request_id
        key = id(pending_request)
        routed = self._requests.get(key)
        if routed is None or routed.begun:
            return
        name = replica_id.unique_id
        # A replica the router cannot route to (unhealthy: Ray's own order was used; or removed,
        # even between the route and this report: its actor died) runs the request unaccounted.
        # Nothing raised here may reach Ray: it would fail the request in its caller.
        try:
            if routed.decision.worker != name:
                # Ray chose another replica: the request is routed again, restricted to it.
                others = [w for w in self.router.workers if w != name]
                self.router.withdraw(routed.decision)
                routed.decision = self.router.route(
                    tokens=routed.tokens, endpoint=routed.endpoint, exclude=others
                )
            self.router.begin(routed.decision)
        except (NoWorkerError, KeyError) as e:
            log.debug("%s runs on %s unaccounted: %s", rid, name, e)
            self._drop(key)
            return
        routed.begun = True
        # Finished when this accepted attempt's result is done. Ray's on_request_completed is not
        # used for it: Ray schedules that callback and on_request_routed independently, so it can
        # arrive first (and, for a replica other than the decision's, be taken for a rejection).
        loop = self._event_loop
        result.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done, key, routed))
        if not pending_request.metadata.is_streaming:
            self._event_loop.create_task(
                self._observe_when_done(routed.decision, len(routed.tokens), result)
            )

    async def _observe_when_done(self, decision: Decision, prompt: int, result: Any) -> None:
        try:
            value = await (await result.to_object_ref_async())
            cached = observed_tokens(_usage_of(value), prompt)
            if cached is not None:
                self.router.observe(decision, cached)
        except Exception as e:  # failed or cancelled requests report nothing
            log.debug("no usage observed for %s: %r", decision.worker, e)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Ray calls this for every attempt sent, rejected ones included, scheduled independently
        # of on_request_routed. A begun request is finished by its own done-callback (_done); an
        # unbegun one may be a rejected attempt whose retry is still to come, so it is only marked.
        # Calls sharing the id (made while one request was handled) are told apart by the replica
        # routed to (the first rank, where Ray sends an attempt unless that replica is full).
        name = replica_id.unique_id
        for key in self._by_rid.get(internal_request_id, ()):
            routed = self._requests[key]
            if not routed.begun and routed.settled_at is None and routed.decision.worker == name:
                routed.settled_at = time.monotonic()

    def _done(self, key: int, routed: _Routed) -> None:
        # Registered once per call, when it is begun (on_request_routed returns for a begun one).
        if self._requests.get(key) is routed:
            self._drop(key)
        self.router.finish(routed.decision)

    def _drop(self, key: int) -> None:
        routed = self._requests.pop(key)
        rid = routed.pending.metadata.internal_request_id if routed.pending is not None else None
        keys = self._by_rid.get(rid)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_rid[rid]

    def _forget_stale(self, now: float) -> None:
        """Drops requests routed but never reported accepted: completed ones (kept their prompt on
        the replica they were routed to: see SETTLED_TTL) after SETTLED_TTL, others (cancelled
        while queued) withdrawn after UNDISPATCHED_TTL."""
        for key, r in list(self._requests.items()):
            if r.begun:
                continue
            if r.settled_at is not None and now - r.settled_at > SETTLED_TTL:
                self._drop(key)
            elif r.settled_at is None and now - r.routed_at > UNDISPATCHED_TTL:
                self._drop(key)
                self.router.withdraw(r.decision)


def _usage_of(value: Any) -> Any:
    if isinstance(value, Mapping):
        return value.get("usage")
    return getattr(value, "usage", None)


# ---- resubmitting calls whose replica died ---------------------------------------------------


def replica_died(error: BaseException) -> bool:
    """True when ``error`` says the replica executing the call died or became unreachable (not
    that the replica, or a call it depended on, raised)."""
    if isinstance(error, RayTaskError):
        return False
    return isinstance(error, (ActorDiedError, ActorUnavailableError))


class ResubmittingHandle:
    """A ``DeploymentHandle`` whose unary calls are resubmitted when their replica dies (see the
    module docs). ``attempts`` counts every submission of a call, the first included."""

    def __init__(self, handle: DeploymentHandle, *, attempts: int = 3) -> None:
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
        if handle.handle_options.stream:
            raise ValueError("a streaming handle cannot be resubmitted: its chunks were delivered")
        self.handle = handle
        self.attempts = attempts

    def options(self, **options: Any) -> ResubmittingHandle:
        """``handle.options(**options)``, resubmitting."""
        return ResubmittingHandle(self.handle.options(**options), attempts=self.attempts)

    def remote(self, *args: Any, **kwargs: Any) -> ResubmittingResponse:
        """Submits the call (``handle.remote(*args, **kwargs)``)."""
        return ResubmittingResponse(self.handle, args, kwargs, self.attempts)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.handle, name)  # ``handle.method`` is a handle for that method
        return (
            ResubmittingHandle(value, attempts=self.attempts)
            if isinstance(value, DeploymentHandle)
            else value
        )


class ResubmittingResponse:
    """One call through a ``ResubmittingHandle``: ``result()`` or ``await`` it."""

    def __init__(
        self, handle: DeploymentHandle, args: tuple[Any, ...], kwargs: dict[str, Any], attempts: int
    ) -> None:
        self._handle, self._args, self._kwargs = handle, args, kwargs
        self.attempts = attempts
        self.submitted = 1
        self.response = handle.remote(*args, **kwargs)

    def _resubmit(self, error: BaseException) -> None:
        if not replica_died(error) or self.submitted >= self.attempts:
            raise error
        log.warning(
            "resubmitting %s (submission %d of %d): its replica died: %s",
            self.response.request_id,
            self.submitted + 1,
            self.attempts,
            type(error).__name__,
        )
        self.submitted += 1
        self.response = self._handle.remote(*self._args, **self._kwargs)

    def result(self, *, timeout_s: float | None = None) -> Any:
        """The call's result, blocking; ``timeout_s`` bounds the whole call, resubmissions
        included (``TimeoutError``; calling again waits on)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return self.response.result(timeout_s=left)
            except (ActorDiedError, ActorUnavailableError) as e:
                self._resubmit(e)

    async def _result_async(self) -> Any:
        while True:
            try:
                return await self.response
            except (ActorDiedError, ActorUnavailableError) as e:
                self._resubmit(e)

    def __await__(self):
        return self._result_async().__await__()

    def cancel(self) -> None:
        """Cancels the call's current submission."""
        self.response.cancel()
