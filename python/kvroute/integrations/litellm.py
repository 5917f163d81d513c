"""kvroute as LiteLLM's routing strategy: ``KvRouteStrategy(router, ...).install()``.

Tested with ``litellm==1.110.2`` (``pip install 'kvroute[litellm]'``). ``install()`` registers the
strategy with ``Router.register_plugin`` (what ``set_custom_routing_strategy`` became in LiteLLM
1.110) and a callback object on ``litellm.callbacks``; ``close()`` removes the callback.

**What it decides.** For every pick LiteLLM asks ``async_get_available_deployment`` for, the model
group's own ``kvroute.Router`` (workers: the group's deployments by ``model_info.id``, weighted by
``litellm_params.weight``; re-read whenever LiteLLM's registry changes) routes the request's prompt.
The group is the one LiteLLM resolves the requested name to, so a ``model_group_alias`` shares its
target's router (its load and cache knowledge). Weights are read as LiteLLM's simple-shuffle reads
them: once a deployment of the group has a positive weight, those with weight 0 or none are standby,
not kvroute workers; they serve (picked at random, unaccounted, as LiteLLM does) only when no
weighted deployment is a candidate. The prompt is rendered and tokenized as ``kvroute serve`` does
(``kvroute.integrations.common``); a body it cannot render (a Responses ``input`` of message items,
say) is routed on load alone, never refused.

**What LiteLLM keeps.** The candidates are what LiteLLM's own filter chain leaves
(``Router.select(kind="healthy")``: cooldowns, pre-call checks such as context windows and rpm/tpm
limits with ``enable_pre_call_checks``, tag filtering): a deployment in cooldown is marked unhealthy
in the kvroute router (so a dedicated endpoint's pool re-forms without it), one filtered out for
this request only is excluded from this pick. A retry also avoids the deployments this request's
earlier attempts failed on (the strategy's own record, keyed by the attempt tokens LiteLLM carries
in ``metadata``) while another candidate remains, as LiteLLM's own pick moves on even when a failure
cools nothing down (its defaults: ``allowed_fails=3``); when every candidate has failed, one may be
tried again (the sync path, which has no per-attempt hooks, reads LiteLLM's own retry record,
``metadata["previous_models"]``, for the deployments this call was routed to). When LiteLLM has no
candidate its own error propagates unchanged, so retries, model-group fallbacks (each group routed
by its own kvroute router), timeouts and cooldown accounting all behave as without the strategy.
What the strategy replaces is the pick itself: ``routing_strategy`` (simple-shuffle, least-busy,
usage- and latency-based) no longer chooses among the candidates, for every model group of this
router.

**Feedback, exactly once per attempt.** An attempt is begun (``Router.begin``) when LiteLLM starts
it (``async_pre_call_deployment_hook``) and finished when it ends: on the deployment success or
failure hook, at the end of a stream (the success event), or — for a call cancelled or a stream
abandoned, where LiteLLM calls no hook — when LiteLLM drops the request's logging object. Before
finishing, the engine's ``usage.prompt_tokens_details.cached_tokens`` is passed to
``Router.observe``. For streams the strategy asks the engine for usage
(``extra_body.stream_options.include_usage``); LiteLLM does not forward that chunk to a client that
did not ask for it (``request_usage=False`` turns this off for engines that reject the field).
A hook finds its attempt by the call's ``litellm_trace_id`` among the tokens in ``metadata``, so a
``metadata`` dict the caller passes to many calls (LiteLLM writes into it) mixes no two calls up.

**Dedicated endpoints.** ``endpoints={"ep-acme": {"pool_size": 2, "reserved_blocks": 4096}}`` adds
each endpoint (``Router.add_endpoint`` keywords) to every model group's router, with a pool of
``pool_size`` deployments or, while fewer are healthy, all of them, re-formed at the larger size as
the group grows (never shrunk here: the router serves a pool from its healthy members); a request
names its endpoint through ``endpoint_of(request_kwargs)``, by default
``metadata={"kvroute_endpoint": ...}`` (an unknown name raises ``KeyError``; to map OpenAI's
``user`` instead, pass ``endpoint_of=lambda kw: kw.get("user")``). Isolated endpoints send their
``cache_salt`` to the engine in ``extra_body`` (vLLM's per-request cache salt; ``cache_salt=False``
turns this off).

**Limits.** LiteLLM's sync API (``Router.completion``) is routed the same way, among the
deployments not in cooldown (LiteLLM has no synchronous filter chain; with every one cooling down it
raises LiteLLM's own ``RouterRateLimitError``, as the async path does), an isolated endpoint's
``cache_salt`` sent as on the async path, but without load accounting or feedback: its sync path has
no per-attempt hooks. ``specific_deployment=True`` calls go to the
named deployment, unaccounted. LiteLLM's proxy cannot load a deployment picker from its config
(``router_settings.plugins`` are ``RoutingPlugin`` objects that narrow model names, not
deployments), so embed the strategy where a ``litellm.Router`` is built in Python.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import litellm
from litellm.integrations.custom_logger import CustomLogger
from litellm.types.router import CustomRoutingStrategyBase, RouterRateLimitError

from kvroute import Decision, NoWorkerError, Router

from .common import (
    RequestError,
    TokenizerSpec,
    grow_endpoints,
    make_tokenizer,
    observed_tokens,
    routing_tokens_async,
)
from .common import routing_tokens as _routing_tokens

__all__ = ["KvRouteStrategy", "metadata_endpoint"]

log = logging.getLogger("kvroute.integrations.litellm")

#: The request ``metadata`` key naming the attempts this strategy routed (a list of tokens).
ATTEMPTS_KEY = "kvroute_attempts"
#: Seconds a routed attempt LiteLLM never started is remembered (it holds no load meanwhile).
ROUTED_TTL = 120.0
_INSTANCES = itertools.count()


def metadata_endpoint(request_kwargs: Mapping[str, Any]) -> str | None:
    """The default ``endpoint_of``: ``metadata["kvroute_endpoint"]`` of the request, if any."""
    metadata = request_kwargs.get("metadata")
    value = metadata.get("kvroute_endpoint") if isinstance(metadata, Mapping) else None
    return value if isinstance(value, str) else None


@dataclass
class _Attempt:
    router: Router
    decision: Decision
    routing_prompt: int
    routed_at: float
    call: Any = None  # the request's litellm_trace_id (one per call, the same on its retries)
    begun: bool = False
    done: bool = False


def _metadata(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    for holder in (kwargs, kwargs.get("litellm_params")):
        if isinstance(holder, Mapping):
            md = holder.get("metadata")
            if isinstance(md, Mapping):
                return md
    return {}


def _call_of(kwargs: Mapping[str, Any]) -> Any:
    """The call's ``litellm_trace_id``: one per call, the same on its retries and in its hooks."""
    call = kwargs.get("litellm_trace_id")
    if call is None:
        call = getattr(kwargs.get("litellm_logging_obj"), "litellm_trace_id", None)
    return call


def _deployment_id(kwargs: Mapping[str, Any]) -> str | None:
    for holder in (kwargs, kwargs.get("litellm_params")):
        if isinstance(holder, Mapping):
            info = holder.get("model_info")
            if isinstance(info, Mapping) and isinstance(info.get("id"), str):
                return info["id"]
    return None


def _payload(request: Mapping[str, Any], messages: Any, input: Any) -> dict[str, Any]:
    """The LiteLLM call as the body the prompt is rendered from (a model directory's template also
    reads ``chat_template_kwargs``, ``add_generation_prompt`` …)."""
    return {
        **request,
        "messages": messages if messages is not None else request.get("messages"),
        "input": input if input is not None else request.get("input"),
    }


def _weights(deployments: Any) -> tuple[dict[str, float], set[str]]:
    """The kvroute workers of a group's deployments by weight, and the standby deployments: as
    LiteLLM's simple-shuffle reads ``litellm_params.weight``, once any deployment has a positive
    weight the others (weight 0 or none) get no traffic while a weighted one is a candidate. With
    no positive weight every deployment weighs 1."""
    given = {d["model_info"]["id"]: d["litellm_params"].get("weight") for d in deployments or ()}
    positive = {i: float(w) for i, w in given.items() if isinstance(w, (int, float)) and w > 0}
    if not positive:
        return dict.fromkeys(given, 1.0), set()
    return positive, set(given) - set(positive)


def _deployment_ids(deployments: Any) -> list[str]:
    return [d["model_info"]["id"] for d in deployments or ()]


class KvRouteStrategy(CustomRoutingStrategyBase):
    """A LiteLLM custom routing strategy backed by one ``kvroute.Router`` per model group.

    ``router_options`` go to every ``kvroute.Router`` (``policy``, ``block_size``,
    ``capacity_blocks``, ``queue_weight`` …). ``tokenizer`` renders every group's prompts
    (a ``kvroute.gateway.prompt.Tokenizer``, a ``tokenizer.json`` path, or None for
    ``kvroute serve``'s byte-level default); ``tokenizers`` overrides it per model group.
    """

    def __init__(
        self,
        router: Any,
        *,
        tokenizer: TokenizerSpec = None,
        tokenizers: Mapping[str, TokenizerSpec] | None = None,
        endpoints: Mapping[str, Mapping[str, Any]] | None = None,
        endpoint_of: Callable[[Mapping[str, Any]], str | None] = metadata_endpoint,
        request_usage: bool = True,
        cache_salt: bool = True,
        **router_options: Any,
    ) -> None:
        self.litellm_router = router
        self.tokenizer = make_tokenizer(tokenizer)
        self.tokenizers = {g: make_tokenizer(t) for g, t in (tokenizers or {}).items()}
        self.endpoints = {e: dict(opts) for e, opts in (endpoints or {}).items()}
        self.endpoint_of = endpoint_of
        self.request_usage = request_usage
        self.cache_salt = cache_salt
        self.router_options = router_options
        Router([], **router_options)  # bad options fail here, not on the first request
        self.routers: dict[str, Router] = {}
        self._versions: dict[str, int] = {}
        self._standby: dict[str, set[str]] = {}  # group -> deployments its weights send nothing
        self._pool_sizes: dict[str, dict[str, int]] = {}  # group -> endpoint -> its pool size
        self._lock = threading.Lock()
        self._prefix = f"{next(_INSTANCES)}:"
        self._tokens = itertools.count()
        self._routed: OrderedDict[str, _Attempt] = OrderedDict()
        self._active: dict[str, _Attempt] = {}
        # token -> (worker, failed at, the call's litellm_trace_id)
        self._failed: OrderedDict[str, tuple[str, float, Any]] = OrderedDict()
        # sync path: litellm_trace_id -> (the workers its picks chose, last pick at)
        self._sync_calls: OrderedDict[Any, tuple[list[str], float]] = OrderedDict()
        self.feedback = _Feedback(self, f"kvroute-{self._prefix}")

    # ---- installation ------------------------------------------------------------------------

    def install(self) -> KvRouteStrategy:
        """Makes this the router's strategy and registers the feedback callbacks."""
        self.litellm_router.register_plugin(self)
        litellm.logging_callback_manager.add_litellm_callback(self.feedback)
        return self

    def close(self) -> None:
        """Removes the feedback callbacks (the router keeps the strategy until its
        ``routing_strategy`` is set again)."""
        litellm.logging_callback_manager.remove_callback_from_all_lists(self.feedback)

    # ---- per model group ---------------------------------------------------------------------

    def group_of(self, model: str) -> str:
        """The model group LiteLLM resolves ``model`` to (an alias names its target's group)."""
        return self.litellm_router.registry().resolve(model)

    def router_for(self, model_group: str) -> Router:
        """The group's kvroute router, its workers in step with LiteLLM's registry: every
        deployment, except the standby ones LiteLLM's weights send no traffic (``_weights``)."""
        registry = self.litellm_router.registry()
        version = registry.version
        with self._lock:
            router = self.routers.get(model_group)
            if router is not None and self._versions.get(model_group) == version:
                return router
            weights, standby = _weights(registry.deployments(model_group) or [])
            if router is None:
                router = Router(weights, **self.router_options)
                self.routers[model_group] = router
            else:
                for name in router.workers:
                    if name not in weights:
                        router.remove_worker(name)
                for name, weight in weights.items():
                    if name not in router.workers:
                        router.add_worker(name, weight)
            self._standby[model_group] = standby
            self._versions[model_group] = version
            return router

    def _size_endpoints(self, model_group: str, router: Router) -> None:
        """Endpoint pools as the group's deployments come (``common.grow_endpoints``): a group
        that grows enlarges them; nothing is raised into LiteLLM's call."""
        with self._lock:
            sizes = self._pool_sizes.setdefault(model_group, {})
            grow_endpoints(router, self.endpoints, sizes, log)

    def _sync_health(self, router: Router, group_ids: list[str]) -> None:
        cooled = self._cooled(group_ids)
        for name in router.workers:
            ok = name not in cooled
            if router.is_healthy(name) != ok:
                router.set_healthy(name, ok)

    # ---- picks -------------------------------------------------------------------------------

    async def async_get_available_deployment(
        self,
        model: str,
        messages: list[dict[str, Any]] | None = None,
        input: Any = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        request = request_kwargs if request_kwargs is not None else {}
        if specific_deployment:
            return self._specific(model)
        healthy = await self.litellm_router.select(
            model, dict(request), kind="healthy", messages=messages
        )
        try:
            tokens = await routing_tokens_async(
                _payload(request, messages, input), self._tokenizer(model)
            )
        except RequestError as e:
            log.debug("routing a %s request on load alone: %s", model, e)
            tokens = None
        return self._route(model, request, tokens, _deployment_ids(healthy), healthy)

    def get_available_deployment(
        self,
        model: str,
        messages: list[dict[str, Any]] | None = None,
        input: Any = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        request = request_kwargs if request_kwargs is not None else {}
        if specific_deployment:
            return self._specific(model)
        try:
            tokens = _routing_tokens(_payload(request, messages, input), self._tokenizer(model))
        except RequestError as e:
            log.debug("routing a %s request on load alone: %s", model, e)
            tokens = None
        deployments = self.litellm_router.registry().deployments(model) or []
        ids = _deployment_ids(deployments)
        cooled = self._cooled(ids)
        allowed = [i for i in ids if i not in cooled]
        if ids and not allowed:
            raise self._all_cooling(model, ids, cooled)
        return self._route(model, request, tokens, allowed, deployments, account=False)

    def _cooled(self, ids: list[str]) -> set[str]:
        """The deployments among ``ids`` in LiteLLM's cooldown."""
        cooldowns = self.litellm_router.health().cooldowns
        return {cid for cid, _ in cooldowns.get_active_cooldowns(ids, None)}

    def _all_cooling(self, model: str, ids: list[str], cooled: set[str]) -> Exception:
        """LiteLLM's own error for a group whose every deployment is cooling down (what its async
        filter chain raises)."""
        cooldowns = self.litellm_router.health().cooldowns
        return RouterRateLimitError(
            model=model,
            cooldown_time=cooldowns.get_min_cooldown(ids, None),
            enable_pre_call_checks=bool(self.litellm_router.settings().enable_pre_call_checks),
            cooldown_list=sorted(cooled),
            model_ids=ids,
        )

    def _tokenizer(self, model: str) -> Any:
        found = self.tokenizers.get(model)
        return (
            found
            if found is not None
            else self.tokenizers.get(self.group_of(model), self.tokenizer)
        )

    def _specific(self, deployment_id: str) -> dict[str, Any]:
        found = self.litellm_router.registry().deployment_dict(deployment_id)
        if found is None:
            raise ValueError(f"no deployment with id {deployment_id!r}")
        return found

    def _route(
        self,
        model: str,
        request: dict[str, Any],
        tokens: Any,
        allowed: list[str] | None,
        deployments: Any,
        *,
        account: bool = True,
    ) -> dict[str, Any]:
        group = self.group_of(model)
        router = self.router_for(group)
        group_ids = list(router.workers)
        self._sync_health(router, group_ids)
        self._size_endpoints(group, router)
        exclude = [] if allowed is None else [w for w in group_ids if w not in set(allowed)]
        if all(w in exclude or not router.is_healthy(w) for w in group_ids):
            standby = [
                d
                for d in deployments
                if d["model_info"]["id"] in self._standby.get(group, ())
                and (allowed is None or d["model_info"]["id"] in allowed)
            ]
            if standby:  # LiteLLM's weights then choose among the rest at random: unaccounted
                return random.choice(standby)
        endpoint = self.endpoint_of(request)
        failed = self._failed_workers(request) if account else self._sync_failed(request)
        decision = self._pick(router, tokens, endpoint, exclude, failed)
        if not account:
            self._sync_routed(request, decision.worker)
        chosen = next(d for d in deployments if d["model_info"]["id"] == decision.worker)
        extra = dict(request.get("extra_body") or {})
        salt = router.endpoint_salt(endpoint) if endpoint is not None else None
        if self.cache_salt and salt is not None:
            extra["cache_salt"] = salt  # on the sync path too: the tenant's cache isolation
        if account:
            self._account(router, request, decision, 0 if tokens is None else len(tokens))
            options = request.get("stream_options")
            wants_usage = isinstance(options, Mapping) and options.get("include_usage")
            if self.request_usage and request.get("stream") and not wants_usage:
                usage = {**(extra.get("stream_options") or {}), "include_usage": True}
                extra["stream_options"] = usage
        if extra:
            request["extra_body"] = extra
        return chosen

    def _account(
        self, router: Router, request: dict[str, Any], decision: Decision, routing_prompt: int
    ) -> None:
        """Remembers the routed attempt (begun when LiteLLM starts it) under a new token in the
        request's ``metadata[ATTEMPTS_KEY]``."""
        now = time.monotonic()
        token = f"{self._prefix}{next(self._tokens)}"
        with self._lock:
            while self._routed:
                oldest = next(iter(self._routed.values()))
                if now - oldest.routed_at < ROUTED_TTL:
                    break
                self._routed.popitem(last=False)
            call = _call_of(request)
            self._routed[token] = _Attempt(router, decision, routing_prompt, now, call)
            while self._failed and now - next(iter(self._failed.values()))[1] >= ROUTED_TTL:
                self._failed.popitem(last=False)
        metadata = request.get("metadata")
        if not isinstance(metadata, dict):
            metadata = request["metadata"] = {}
        metadata.setdefault(ATTEMPTS_KEY, []).append(token)

    def _failed_workers(self, request: Mapping[str, Any]) -> set[str]:
        """The workers of this call's earlier attempts that failed (its own record: the attempt
        tokens in ``metadata[ATTEMPTS_KEY]``, which LiteLLM carries from try to try, of this
        ``litellm_trace_id``: a metadata dict the caller reuses across calls collects every
        call's tokens)."""
        tokens = _metadata(request).get(ATTEMPTS_KEY)
        if not isinstance(tokens, list):
            return set()
        call = _call_of(request)
        with self._lock:
            found = (self._failed.get(t) for t in tokens if isinstance(t, str))
            return {f[0] for f in found if f is not None and f[2] == call}

    def _sync_failed(self, request: Mapping[str, Any]) -> set[str]:
        """The sync path's (no hooks) failed workers of this call: the deployments LiteLLM's own
        retry record (``metadata["previous_models"]``) names that this call was routed to."""
        previous = _metadata(request).get("previous_models")
        if not isinstance(previous, (list, tuple)):
            return set()
        named = {p.get("deployment_id") for p in previous if isinstance(p, Mapping)}
        with self._lock:
            routed = self._sync_calls.get(_call_of(request))
            return {w for w in routed[0] if w in named} if routed is not None else set()

    def _sync_routed(self, request: Mapping[str, Any], worker: str) -> None:
        call = _call_of(request)
        if call is None:
            return
        now = time.monotonic()
        with self._lock:
            while self._sync_calls and now - next(iter(self._sync_calls.values()))[1] >= ROUTED_TTL:
                self._sync_calls.popitem(last=False)
            workers = self._sync_calls.pop(call, ([], now))[0]
            self._sync_calls[call] = ([*workers, worker], now)

    def _pick(
        self, router: Router, tokens: Any, endpoint: Any, exclude: list[str], failed: set[str]
    ) -> Decision:
        """``router.route``, avoiding the workers this request already failed on while another
        candidate remains (a retry LiteLLM's cooldowns did not redirect goes elsewhere); with none
        left, a failed one may be tried again, as LiteLLM would."""
        failed = failed - set(exclude)
        if failed:
            others = [
                w
                for w in router.workers
                if w not in failed and w not in exclude and router.is_healthy(w)
            ]
            if others:
                try:
                    return router.route(
                        tokens=tokens, endpoint=endpoint, exclude=[*exclude, *failed]
                    )
                except NoWorkerError:  # the endpoint's pool holds only failed workers
                    pass
        return router.route(tokens=tokens, endpoint=endpoint, exclude=exclude)

    # ---- attempt lifecycle (called by the feedback callbacks) ---------------------------------

    def _current(self, kwargs: Mapping[str, Any]) -> str | None:
        """The attempt this hook is about: the last one this strategy routed for the call. A
        metadata dict the caller reuses collects other calls' tokens too (LiteLLM writes into the
        caller's dict), so the token is the last of this call's (``litellm_trace_id``)."""
        attempts = _metadata(kwargs).get(ATTEMPTS_KEY)
        if not isinstance(attempts, list) or not attempts:
            return None
        call = _call_of(kwargs)
        if call is None:
            last = attempts[-1]
            return last if isinstance(last, str) and last.startswith(self._prefix) else None
        with self._lock:
            for token in reversed(attempts):
                if isinstance(token, str) and token.startswith(self._prefix):
                    attempt = self._routed.get(token) or self._active.get(token)
                    if attempt is not None and attempt.call == call:
                        return token
        return None

    def _begin(self, kwargs: Mapping[str, Any]) -> None:
        token = self._current(kwargs)
        if token is None:
            return
        with self._lock:
            attempt = self._routed.pop(token, None)
            if attempt is None or _deployment_id(kwargs) not in (None, attempt.decision.worker):
                return
            attempt.router.begin(attempt.decision)
            attempt.begun = True
            self._active[token] = attempt
        logging_obj = kwargs.get("litellm_logging_obj")
        if logging_obj is not None:
            weakref.finalize(logging_obj, self._end, token, None)

    def _end(self, token: str | None, usage: Any, *, failed: bool = False) -> None:
        """Finishes the attempt (after observing ``usage``'s cached tokens); once. A ``failed``
        attempt's worker is remembered for the request's retries (``_pick``)."""
        if token is None:
            return
        with self._lock:
            attempt = self._active.pop(token, None)
            if attempt is None or attempt.done:
                return
            attempt.done = True
            if failed:
                failure = (attempt.decision.worker, time.monotonic(), attempt.call)
                self._failed[token] = failure
        try:
            cached = observed_tokens(usage, attempt.routing_prompt)
            if cached is not None:
                attempt.router.observe(attempt.decision, cached)
        except Exception:  # a bad report must never skip finish()
            log.exception("observe failed for deployment %s", attempt.decision.worker)
        finally:
            attempt.router.finish(attempt.decision)

    def in_flight(self) -> int:
        """Attempts begun and not yet finished."""
        with self._lock:
            return len(self._active)


class _Feedback(CustomLogger):
    """LiteLLM callbacks that begin, observe and finish the strategy's attempts."""

    def __init__(self, strategy: KvRouteStrategy, name: str) -> None:
        super().__init__()
        self.strategy = strategy
        # LiteLLM keeps one callback per class and public scalar attributes: this makes it ours.
        self.name = name

    async def async_pre_call_deployment_hook(self, kwargs: dict[str, Any], call_type: Any) -> None:
        self.strategy._begin(kwargs)
        return None

    async def async_post_call_success_deployment_hook(
        self, request_data: dict[str, Any], response: Any, call_type: Any
    ) -> None:
        if not request_data.get("stream"):
            self.strategy._end(
                self.strategy._current(request_data), getattr(response, "usage", None)
            )
        return None

    async def async_post_call_failure_deployment_hook(
        self, request_data: Mapping[str, Any], exception: Exception, call_type: Any, *args: Any
    ) -> None:
        self.strategy._end(self.strategy._current(request_data), None, failed=True)

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        # Streams end here (their deployment success hook does not run).
        self.strategy._end(self.strategy._current(kwargs), getattr(response_obj, "usage", None))
