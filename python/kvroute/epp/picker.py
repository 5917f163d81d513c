"""Picking: an OpenAI request's headers and body → a worker of ``kvroute.Router``, and its lifetime.

Nothing here knows gRPC; ``kvroute.epp.service`` drives it from the ``ext_proc`` stream.

**What a request names.** The header ``x-kvroute-endpoint`` names a dedicated endpoint; otherwise
the body's ``model`` names an endpoint (``[[endpoints]] id``) or a directly served model
(``epp.models``), exactly as in ``kvroute serve``; anything else is 404. A request without a
body (or without ``model``) goes to any worker by load alone, behind ``epp.api_keys`` (the direct
models' keys). API keys are checked as the gateway checks them (``kvroute.gateway.auth``: 401
without a valid key, 404 for a model the key does not open). The caller's ``authorization``
never reaches the worker: it is replaced by the worker's own ``api_key`` or removed.

**The body sent upstream** is the caller's, byte for byte, unless something must change: ``model``
becomes the endpoint's real model; a caller's ``cache_salt`` is dropped and the endpoint's salt is
set for ``vllm``/``sglang`` workers (as the gateway does); for a stream whose caller did not ask
for usage, ``stream_options.include_usage`` is set when the response body passes through the
picker, and that usage chunk is removed again on the way back (``ResponseScanner``).

**Routing.** The prompt is rendered and tokenized as the gateway does (``kvroute.gateway.prompt``:
the model's chat template and tokenizer with ``[tokenizer] model_dir``);
``router.route(tokens=..., endpoint=..., key=fairness id, exclude=...)`` picks among the workers
the subset hint allows (``exclude`` = every other worker). No candidate → 503. With
``epp.fallbacks`` the pick is followed by the decision's next best candidates that take the same
upstream request (``Pick.destination``). A request is
**sheddable** when its objective (``x-gateway-inference-objective``, priorities in
``[epp] objectives``) has a priority below zero; a sheddable request gets 429 when every worker it
could go to is saturated (``saturation_active`` requests in flight, or ``saturation_prefill_tokens``
queued for prefill), or when it carries ``x-slo-ttft-ms`` and the picked worker's estimated time
to first token (queued prefill tokens plus this prompt's uncached tokens, over
``prefill_tokens_per_second``) exceeds it. Requests with priority ≥ 0 are never shed.

**Lifetime** (``Lease``): ``begin`` when the pick is sent; if the data plane reports that another
known endpoint served the request, the request is moved there (withdrawn from the picked worker —
its load and the prompt its route put in the router's model — and begun on the served one); a
request shed on ``x-slo-ttft-ms`` after the pick is withdrawn too; ``prefilled`` at the first
response byte; ``observe`` with the response's ``usage.prompt_tokens_details.cached_tokens``
(converted to routing tokens), then ``finish`` — exactly once, whether the response ended, failed,
or the stream was closed early.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvroute import Decision, Router

from ..gateway.auth import Auth, Target
from ..gateway.errors import HTTPError
from ..gateway.prompt import (
    OFFLOAD_CHARS,
    RequestError,
    Tokenizer,
    load_tokenizer,
)
from ..gateway.stream import SseScanner
from ..gateway.usage import routed_cached_tokens, usage_event
from ..server.config import WorkerConfig, duplicates
from ..server.routing import NoWorkerError, build_router
from .config import EppConfig
from .protocol import ENDPOINT_HEADER, FAIRNESS_HEADER, OBJECTIVE_HEADER, SLO_TTFT_HEADER

__all__ = ["Lease", "Member", "Pick", "Picker", "Request", "ResponseScanner", "address_of"]

log = logging.getLogger("kvroute.epp")

_EMPTY = np.zeros(0, dtype=np.uint32)


def endpoint_key(address: str) -> tuple[str, int | None] | None:
    """An endpoint as a data plane may spell it — ``ip:port``, ``[ipv6]:port``, or a bare ``ip``,
    ``ipv6`` or ``[ipv6]`` (every port of it) — as (the IP in its canonical text, the port or
    None); None when it names no IP address. ``[fd00:0:0::1]:8000`` and ``[fd00::1]:8000`` are
    one endpoint."""
    text, port = address.strip(), None
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return None
        port = int(rest[1:]) if rest else None
    elif text.count(":") == 1:
        host, _, digits = text.partition(":")
        if not digits.isdigit():
            return None
        port = int(digits)
    else:
        host = text
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return None


def address_of(worker: WorkerConfig) -> str:
    """A configured worker's ``ip:port`` (what the data plane's original-destination routing
    dials), from its ``url``; the host must be an IP address."""
    parts = urlsplit(worker.url)
    host = parts.hostname or ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"worker {worker.name!r}: url {worker.url!r} must have an IP address as host for "
            "kvroute epp (the proxy connects to the picked ip:port)"
        ) from None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


@dataclass(frozen=True)
class Member:
    """A worker the picker may pick: its router name, ``ip:port`` and configuration."""

    name: str
    address: str
    config: WorkerConfig


@dataclass
class Request:
    """A parsed request: what it names and how it may be treated."""

    headers: Mapping[str, str]
    payload: dict[str, Any] | None
    target: Target | None
    fairness: str | None
    priority: int
    ttft_slo: float | None  # seconds

    @property
    def model(self) -> str:
        return self.target.name if self.target is not None else "-"

    @property
    def stream(self) -> bool:
        return self.payload is not None and self.payload.get("stream") is True


@dataclass
class Pick:
    """A decision and what the data plane must do for it."""

    decision: Decision
    member: Member
    request: Request
    routing_tokens: int
    body: bytes | None  # the body to send upstream; None: the caller's, unchanged
    set_headers: dict[str, str]
    remove_headers: list[str]
    strip_usage: bool
    fallbacks: tuple[Member, ...] = ()

    @property
    def destination(self) -> str:
        """``x-gateway-destination-endpoint``: the pick, then its fallbacks (``ip:port,...``)."""
        return ",".join(m.address for m in (self.member, *self.fallbacks))


class Picker:
    """Parses, authorizes, routes and accounts requests over a set of members (see module docs)."""

    def __init__(
        self,
        config: EppConfig,
        *,
        router: Router | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        self.epp = config.server
        self.router = (
            router
            if router is not None
            else build_router(
                config.workers, config.router, config.events, updates=config.cluster is not None
            )
        )
        self.tokenizer = tokenizer or load_tokenizer(
            config.tokenizer.path,
            config.tokenizer.bytes_per_token,
            config.tokenizer.model_dir,
            config.tokenizer.exclude_tools_when_tool_choice_none,
        )
        self.auth = Auth(config)  # type: ignore[arg-type]  # endpoints, server.models/key_digests
        self.members: dict[str, Member] = {}
        #: Members by (IP, port) and by IP (see `endpoint_key`).
        self.by_key: dict[tuple[str, int | None], Member] = {}
        self.by_ip: dict[str, list[Member]] = {}
        self.in_flight: dict[str, int] = {}
        self.salts: dict[str, str | None] = {}
        self.observer: Any = None  # called as observer(worker, predicted, reported, prompt)
        policy = self.router.config.get("policy")
        if self.epp.fallbacks and policy not in RANKED_POLICIES:
            raise ValueError(
                f"epp.fallbacks = {self.epp.fallbacks} needs router.policy 'kv_aware' or "
                f"'least_loaded' (their scores rank every candidate), got {policy!r}"
            )
        self.set_members(
            {w.name: Member(w.name, address_of(w), w) for w in config.workers}, initial=True
        )

    # ---- membership ------------------------------------------------------------------------

    @staticmethod
    def check_members(members: Mapping[str, Member]) -> None:
        """``ValueError`` when two members share an address (``set_members`` refuses them)."""
        dup = duplicates([m.address for m in members.values()])
        if dup:
            raise ValueError(f"several workers have the address(es) {dup}")

    def set_members(self, members: Mapping[str, Member], *, initial: bool = False) -> None:
        """Makes ``members`` the workers (adds and removes them in the router); endpoints whose
        pool now fits are added. Two members may not share an address. A known name at a new
        address is a new engine (a pod replaced under its name): the router's worker is removed
        and added again, so its load and cached blocks are the old engine's no more."""
        self.check_members(members)
        for name in list(self.members):
            if name not in members or members[name].address != self.members[name].address:
                self.router.remove_worker(name)
                del self.members[name]
                if not self.in_flight.get(name):
                    self.in_flight.pop(name, None)
        for name, m in members.items():
            if name not in self.members and not (initial and name in self.router.workers):
                self.router.add_worker(name, m.config.weight)
            self.members[name] = m
            self.in_flight.setdefault(name, 0)
        self.by_key, self.by_ip = {}, {}
        for m in self.members.values():
            key = endpoint_key(m.address)
            if key is not None:
                self.by_key[key] = m
                self.by_ip.setdefault(key[0], []).append(m)
        healthy = sum(self.router.is_healthy(n) for n in self.members)
        present = set(self.router.endpoints)
        for ep in self.config.endpoints:
            if ep.id not in present and ep.pool_size <= healthy:
                self.router.add_endpoint(
                    ep.id, pool_size=ep.pool_size, reserved_blocks=ep.reserved_blocks, salt=ep.salt
                )
            if ep.cache_salt and ep.id in self.router.endpoints:
                self.salts[ep.id] = self.router.endpoint_salt(ep.id)

    # ---- parsing ---------------------------------------------------------------------------

    def parse(self, headers: Mapping[str, str], body: bytes | None) -> Request:
        """Validates what the request names (raises ``HTTPError`` 400/401/403/404)."""
        payload = None
        if body:
            try:
                payload = json.loads(body)
            except ValueError as e:
                raise HTTPError(
                    400, f"request body is not valid JSON: {e}", "invalid_request_error"
                ) from None
            if not isinstance(payload, dict):
                raise HTTPError(400, "request body must be a JSON object", "invalid_request_error")
        access = self.auth.access(headers.get("authorization"))  # 401: no valid key, none open
        named = headers.get(ENDPOINT_HEADER)
        target = None
        if named is not None:
            target = access.target(named)
            if target.endpoint is None:
                raise HTTPError(
                    404,
                    f"{ENDPOINT_HEADER} names no endpoint: {named!r}",
                    "invalid_request_error",
                    "endpoint_not_found",
                )
        elif payload is not None and "model" in payload:
            target = access.target(payload.get("model"))
        elif self.epp.key_digests and access.digest not in self.epp.key_digests:
            # naming no model is direct access: the direct models' keys apply
            raise HTTPError(
                401,
                "missing or invalid API key (Authorization: Bearer ...)",
                "invalid_request_error",
                "invalid_api_key",
            )
        objective = headers.get(OBJECTIVE_HEADER)
        default = self.epp.default_priority
        return Request(
            headers=headers,
            payload=payload,
            target=target,
            fairness=headers.get(FAIRNESS_HEADER) or None,
            priority=self.epp.objectives.get(objective, default) if objective else default,
            ttft_slo=_milliseconds(headers.get(SLO_TTFT_HEADER)),
        )

    async def tokens(self, request: Request, size: int) -> np.ndarray:
        """The request's routing tokens (empty without a prompt), as the gateway computes them
        (a chat body through the model's template when ``[tokenizer] model_dir`` is set); a body
        of ``size`` bytes over ``OFFLOAD_CHARS`` is tokenized off the event loop by a slow
        tokenizer. Raises ``HTTPError`` 400."""
        payload = request.payload
        tok = self.tokenizer
        if payload is None:
            return _EMPTY
        if "messages" in payload:
            encode = tok.chat_tokens
        elif "prompt" in payload:
            encode = tok.completion_tokens
        else:
            return _EMPTY
        try:
            if tok.slow and size > OFFLOAD_CHARS:
                return await asyncio.to_thread(encode, payload)
            return encode(payload)
        except RequestError as e:
            raise HTTPError(400, str(e), "invalid_request_error") from None

    # ---- routing ---------------------------------------------------------------------------

    def pick(
        self,
        request: Request,
        tokens: np.ndarray,
        subset: list[str] | None,
        *,
        strip_usage_possible: bool,
    ) -> Pick:
        """Routes the request among the members the subset allows (raises ``HTTPError`` 503/429)."""
        endpoint = request.target.endpoint if request.target is not None else None
        if endpoint is not None and endpoint not in self.router.endpoints:
            raise HTTPError(
                503,
                f"endpoint {endpoint!r} has fewer workers than its pool_size so far",
                "service_unavailable",
                "no_endpoint",
            )
        allowed = self._allowed(subset)
        if not allowed:
            raise HTTPError(
                503,
                "no endpoint of the subset hint is known to the picker"
                if subset is not None
                else "no endpoint is known to the picker",
                "service_unavailable",
                "no_endpoint",
            )
        if request.priority < 0 and self._saturated(allowed, endpoint):
            raise HTTPError(
                429, "every endpoint is saturated; sheddable request dropped", "rate_limit", "shed"
            )
        exclude = [n for n in self.members if n not in allowed] or None
        try:
            d = self.router.route(
                tokens=tokens, endpoint=endpoint, key=request.fairness, exclude=exclude
            )
        except NoWorkerError as e:
            raise HTTPError(
                503, f"no eligible endpoint: {e}", "service_unavailable", "no_endpoint"
            ) from None
        member = self.members[d.worker]
        if request.priority < 0 and request.ttft_slo is not None:
            ttft = self._ttft(d, len(tokens))
            if ttft is not None and ttft > request.ttft_slo:
                self.router.withdraw(d)  # never sent: its prompt leaves the router's model
                raise HTTPError(
                    429,
                    f"estimated time to first token {ttft * 1000:.0f} ms exceeds "
                    f"{SLO_TTFT_HEADER} {request.ttft_slo * 1000:.0f} ms; sheddable request "
                    "dropped",
                    "rate_limit",
                    "slo",
                )
        body, strip = self._upstream_body(request, member, strip_usage_possible)
        set_headers: dict[str, str] = {}
        remove: list[str] = []
        if member.config.api_key:
            set_headers["authorization"] = f"Bearer {member.config.api_key}"
        elif "authorization" in request.headers:
            remove.append("authorization")
        fallbacks = self._fallbacks(d, member)
        return Pick(d, member, request, len(tokens), body, set_headers, remove, strip, fallbacks)

    def _fallbacks(self, d: Decision, member: Member) -> tuple[Member, ...]:
        """Up to ``epp.fallbacks`` other candidates of the decision, best score first (name on
        ties), each one that takes the very request prepared for ``member``: the same API key and
        the same cache-salt field."""
        same = (member.config.api_key, member.config.sends_cache_salt)
        out: list[Member] = []
        for _, name in sorted((score, name) for name, score in d.scores.items()):
            if len(out) == self.epp.fallbacks:
                break
            m = self.members.get(name)
            if m is not None and m is not member:
                if (m.config.api_key, m.config.sends_cache_salt) == same:
                    out.append(m)
        return tuple(out)

    def _allowed(self, subset: list[str] | None) -> set[str]:
        if subset is None:
            return set(self.members)
        allowed = set()
        for entry in subset:
            key = endpoint_key(entry)
            if key is None:
                continue
            if key[1] is not None:
                m = self.by_key.get(key)
                if m is not None:
                    allowed.add(m.name)
            else:  # a bare IP allows each of its ports
                allowed.update(m.name for m in self.by_ip.get(key[0], ()))
        return allowed

    def _saturated(self, allowed: set[str], endpoint: str | None) -> bool:
        active, queued = self.epp.saturation_active, self.epp.saturation_prefill_tokens
        if active is None and queued is None:
            return False
        names = allowed
        if endpoint is not None and endpoint in self.router.endpoints:
            names = allowed & set(self.router.endpoint_pool(endpoint))
        block = self.router.block_size
        for name in names:
            if not self.router.is_healthy(name):
                continue
            load = self.router.load(name)
            full = (active is not None and load["active"] >= active) or (
                queued is not None and load["prefill_blocks"] * block >= queued
            )
            if not full:
                return False
        return True

    def _ttft(self, decision: Any, prompt: int) -> float | None:
        rate = self.epp.prefill_tokens_per_second
        if rate is None:
            return None
        queued = self.router.load(decision.worker)["prefill_blocks"] * self.router.block_size
        return (queued + max(prompt - decision.cached_tokens, 0)) / rate

    def _upstream_body(
        self, request: Request, member: Member, strip_possible: bool
    ) -> tuple[bytes | None, bool]:
        payload = request.payload
        if payload is None:
            return None, False
        body = dict(payload)
        target = request.target
        if target is not None:
            body["model"] = target.upstream_model
        body.pop("cache_salt", None)
        salt = None
        if target is not None and target.salted and target.endpoint is not None:
            salt = self.salts.get(target.endpoint)
        if salt is not None and member.config.sends_cache_salt:
            body["cache_salt"] = salt
        strip = False
        if request.stream and strip_possible:
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage")):
                extra = options if isinstance(options, dict) else {}
                body["stream_options"] = {**extra, "include_usage": True}
                strip = True
        if body == payload:
            return None, False
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(), strip


#: The policies whose decision scores rank every candidate (lower is better): the ones
#: ``epp.fallbacks`` can list fallback endpoints for.
RANKED_POLICIES = ("kv_aware", "least_loaded")


def _milliseconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    return ms / 1000 if ms > 0 and ms != float("inf") else None


class Lease:
    """One picked request's load accounting (see the module docs): ``finish`` exactly once."""

    __slots__ = ("closed", "decision", "picker", "prefill_done", "request", "tokens", "worker")

    def __init__(self, picker: Picker, pick: Pick, tokens: np.ndarray) -> None:
        self.picker = picker
        self.decision = pick.decision
        self.request = pick.request
        self.tokens = tokens
        self.worker = pick.member.name
        self.closed = False
        self.prefill_done = False
        picker.router.begin(self.decision)
        picker.in_flight[self.worker] = picker.in_flight.get(self.worker, 0) + 1

    def served(self, address: str | None) -> None:
        """The data plane says ``address`` served the request: move it there if it differs."""
        p = self.picker
        key = endpoint_key(address) if address else None
        member = p.by_key.get(key) if key is not None else None
        if self.closed or member is None or member.name == self.worker:
            return
        target = self.request.target
        endpoint = target.endpoint if target is not None else None
        others = [n for n in p.members if n != member.name]
        try:
            moved = p.router.route(tokens=self.tokens, endpoint=endpoint, exclude=others or None)
        except NoWorkerError:
            try:
                moved = p.router.route(tokens=self.tokens, exclude=others or None)
            except NoWorkerError:
                return
        log.info("request picked for %s was served by %s", self.worker, member.name)
        self._release(withdraw=not self.prefill_done)
        self.decision = moved
        self.worker = member.name
        p.router.begin(moved)
        p.in_flight[self.worker] = p.in_flight.get(self.worker, 0) + 1

    def prefilled(self) -> None:
        if not self.prefill_done and not self.closed:
            self.prefill_done = True
            self.picker.router.prefilled(self.decision)

    def close(self, usage: Any = None) -> None:
        """Reports the response's cached tokens (if any) and finishes; idempotent."""
        if self.closed:
            return
        self.closed = True
        p = self.picker
        try:
            routed = routed_cached_tokens(usage, len(self.tokens))
            if routed is not None:
                p.router.observe(self.decision, routed)
                if p.observer is not None:
                    p.observer(self.worker, self.decision.cached_tokens, routed, len(self.tokens))
        except Exception:  # a bad report must never skip finish()
            log.exception("observe failed for worker %s", self.worker)
        finally:
            self._release()

    def _release(self, *, withdraw: bool = False) -> None:
        """Takes the request off its worker: finished, or withdrawn when it never ran there."""
        p = self.picker
        p.in_flight[self.worker] = p.in_flight.get(self.worker, 1) - 1
        if self.worker not in p.members and p.in_flight[self.worker] <= 0:
            p.in_flight.pop(self.worker, None)
        if withdraw:
            p.router.withdraw(self.decision)
        else:
            p.router.finish(self.decision)


class ResponseScanner:
    """Watches a response body for ``usage``: a JSON body (read up to ``limit`` bytes), or an SSE
    stream (cut into events by the gateway's ``SseScanner``) whose complete events are passed on
    as they arrive — minus the usage-only chunk when the picker asked for it (``strip``)."""

    def __init__(self, *, strip: bool, limit: int, sse: bool) -> None:
        self.limit = limit
        self.strip = strip
        self.events = SseScanner(1 << 62) if sse else None
        self.usage: Any = None
        self._size = 0
        self._whole: list[bytes] | None = []

    def feed(self, chunk: bytes, end: bool) -> bytes:
        """Takes a chunk; returns the bytes to pass on now."""
        if self.events is not None:
            out = [e for e in self.events.feed(chunk) if not self._drop(e)]
            if end:
                out.append(self.events.pending)  # an event without its blank line, if any
            return b"".join(out)
        if self._whole is not None:
            self._size += len(chunk)
            if self._size > self.limit:
                self._whole = None
            else:
                self._whole.append(chunk)
        if end and self._whole is not None:
            try:
                parsed = json.loads(b"".join(self._whole))
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
                self.usage = parsed["usage"]
        return chunk

    def _drop(self, event: bytes) -> bool:
        """Records a usage chunk; True when it is to be dropped (the picker asked for it)."""
        found = usage_event(event)
        if found is None:
            return False
        self.usage = found.usage
        return self.strip and found.usage_only
