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
full reuses that decision) and returns every candidate as its own rank, best first: the
decision's replica, then the others in the policy's order. Ray tries the ranks in order and takes
the first replica whose queue is not full, so the router's choice stands unless that replica is at
``max_ongoing_requests``. Ray's locality and model-multiplexing preferences are not applied.

**Load accounting in step with Ray's.** A request is begun (``Router.begin``) when Ray reports
the replica accepted it (``on_request_routed``) — on the replica Ray actually chose; if that is
not the decision's, the request is routed again restricted to it — and finished in
``on_request_completed``, which Ray calls exactly once for every dispatched request, whatever its
outcome. A replica that dies is removed (``on_replica_actor_died``, ``update_replicas``), and its
in-flight requests are retried by Ray on the others and routed anew. For a unary response, the
returned body's ``usage.prompt_tokens_details.cached_tokens`` (a mapping or an object) is passed to
``Router.observe`` when the result is ready; streamed responses are not observed.

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
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvroute import Decision, Router

from .common import (
    RequestError,
    make_tokenizer,
    observed_tokens,
    ranked,
    routing_tokens_async,
)

__all__ = ["KvRequestRouter", "openai_body"]

log = logging.getLogger("kvroute.integrations.ray_serve")

_NO_TOKENS = np.empty(0, dtype=np.uint32)
#: Seconds a routed request that Ray never dispatched is remembered.
UNDISPATCHED_TTL = 300.0
#: Routing calls between two sweeps for such requests.
SWEEP_EVERY = 1024


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
    begun: bool = False
    routed_at: float = field(default_factory=time.monotonic)


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
        self.saturated_waiting = saturated_waiting
        self.saturated_kv_usage = saturated_kv_usage
        self._requests: dict[str, _Routed] = {}
        self._calls = 0

    # ---- replicas ----------------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        names = {r.replica_id.unique_id for r in replicas}
        for name in self.router.workers:
            if name not in names:
                self.router.remove_worker(name)
        for name in sorted(names - set(self.router.workers)):
            self.router.add_worker(name)
        for endpoint, opts in self.endpoint_options.items():
            if endpoint not in self.router.endpoints and self.router.workers:
                pool = min(opts["pool_size"], len(self.router.workers))
                self.router.add_endpoint(endpoint, **{**opts, "pool_size": pool})

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
        for name, replica in candidates.items():
            ok = (replica.routing_stats or {}).get("healthy") is not False
            if name in self.router.workers and self.router.is_healthy(name) != ok:
                self.router.set_healthy(name, ok)
        exclude = [w for w in self.router.workers if w not in candidates]
        decision = self.router.route(tokens=tokens, endpoint=endpoint, exclude=exclude)
        return _Routed(decision, ranked(decision, candidates), tokens, endpoint)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        candidates = {r.replica_id.unique_id: r for r in candidate_replicas}
        rid = pending_request.metadata.internal_request_id
        routed = self._requests.get(rid)
        if routed is None or routed.decision.worker not in candidates:
            self._calls += 1
            if self._calls % SWEEP_EVERY == 0:
                self._forget_stale()
            try:
                routed = await self._route(pending_request, candidates)
            except ValueError as e:  # every candidate unhealthy or outside the endpoint's pool
                log.warning("kvroute found no replica (%s); Ray's order is used", e)
                return [candidate_replicas]
            self._requests[rid] = routed
        order = [candidates[w] for w in routed.ranking if w in candidates]
        order += [r for name, r in candidates.items() if name not in routed.ranking]
        order.sort(key=self._saturated)  # stable: saturated replicas after the others
        return [[r] for r in order]

    # ---- lifecycle ---------------------------------------------------------------------------

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        routed = self._requests.get(pending_request.metadata.internal_request_id)
        if routed is None or routed.begun:
            return
        name = replica_id.unique_id
        if routed.decision.worker != name:
            if name not in self.router.workers:
                return
            others = [w for w in self.router.workers if w != name]
            routed.decision = self.router.route(
                tokens=routed.tokens, endpoint=routed.endpoint, exclude=others
            )
        self.router.begin(routed.decision)
        routed.begun = True
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
        routed = self._requests.get(internal_request_id)
        if routed is None or routed.decision.worker != replica_id.unique_id:
            return  # not ours, or a rejected attempt on another replica than the one now serving
        del self._requests[internal_request_id]
        if routed.begun:
            self.router.finish(routed.decision)

    def _forget_stale(self) -> None:
        """Drops requests routed but never dispatched (cancelled while queued; no load held)."""
        now = time.monotonic()
        for rid in [
            rid
            for rid, r in self._requests.items()
            if not r.begun and now - r.routed_at > UNDISPATCHED_TTL
        ]:
            del self._requests[rid]


def _usage_of(value: Any) -> Any:
    if isinstance(value, Mapping):
        return value.get("usage")
    return getattr(value, "usage", None)
