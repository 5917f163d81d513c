"""What the LiteLLM and Ray Serve adapters share.

- **Routing tokens** (``routing_tokens``): a request body is rendered and tokenized exactly as
  ``kvroute serve`` does it, by the same ``kvroute.gateway.prompt.Tokenizer`` methods
  (``chat_tokens`` for a chat's ``messages`` and ``tools``, ``completion_tokens`` for a
  completions ``prompt`` or an embeddings ``input``): with a ``ModelTokenizer`` (a model
  directory) these are the engine's own tokens. A slow tokenizer encodes long prompts off the
  event loop.
- **Reported usage** (``reported_cached``): the engine's
  ``usage.prompt_tokens_details.cached_tokens`` and ``usage.prompt_tokens``, from a dict or an
  object (OpenAI SDK and LiteLLM types), converted to routing tokens (``to_routing_tokens``)
  before ``Router.observe``.
- **Fallback order** (``ranked``): the decision's worker first, then every other candidate in the
  order the router's policy would have preferred it (``Decision.scores``), unscored ones last.
- **Endpoint pools as workers come** (``grow_endpoints``): each configured endpoint is added
  once a worker is healthy, with a pool of its ``pool_size`` or, while fewer workers are healthy,
  all of them, and re-added at the larger size as more are: the pool the router forms with every
  worker present (the head of the endpoint's rendezvous order). A pool never shrinks here (the
  router serves it with the healthy members left), and nothing is raised into the host: a size
  that does not fit (its ``reserved_blocks`` beside other reservations) is tried once and
  logged, the endpoint keeping its pool or, new, left out (its requests then fail as for an
  unknown endpoint).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Union

import numpy as np

from kvroute import Decision, Router
from kvroute.gateway.prompt import (
    OFFLOAD_CHARS,
    ByteTokenizer,
    RequestError,
    Tokenizer,
    load_tokenizer,
    to_routing_tokens,
)

__all__ = [
    "RequestError",
    "TokenizerSpec",
    "grow_endpoints",
    "make_tokenizer",
    "observed_tokens",
    "ranked",
    "reported_cached",
    "routing_tokens",
    "routing_tokens_async",
]

#: A tokenizer, the path of a Hugging Face ``tokenizer.json``, or None (the byte-level fallback).
TokenizerSpec = Union[Tokenizer, str, None]  # noqa: UP007 (a runtime alias)

#: Policies whose ``Decision.scores`` prefer larger values (the rest prefer smaller ones).
_HIGHER_WINS = frozenset({"random", "round_robin"})


def make_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """``spec`` as a tokenizer (see ``TokenizerSpec``)."""
    if spec is None:
        return ByteTokenizer()
    if isinstance(spec, str):
        return load_tokenizer(spec)
    if isinstance(spec, Tokenizer):
        return spec
    raise TypeError(f"tokenizer must be a Tokenizer, a tokenizer.json path or None, got {spec!r}")


def _encoder(payload: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[Any, dict[str, Any], Any]:
    """The tokenizer method for the body, the body it reads, and the prompt text's source."""
    body = dict(payload)
    if body.get("messages") is not None:
        return tokenizer.chat_tokens, body, body["messages"]
    if body.get("prompt") is None and body.get("input") is not None:
        body["prompt"] = body["input"]  # embeddings: read as a completions prompt
    if body.get("prompt") is not None:
        return tokenizer.completion_tokens, body, body["prompt"]
    raise RequestError("the request has no 'messages', 'prompt' or 'input' to route on")


def routing_tokens(payload: Mapping[str, Any], tokenizer: Tokenizer) -> np.ndarray:
    """The request's routing tokens (uint32). Raises ``RequestError`` for a body that cannot be
    rendered."""
    encode, body, _ = _encoder(payload, tokenizer)
    return encode(body)


async def routing_tokens_async(payload: Mapping[str, Any], tokenizer: Tokenizer) -> np.ndarray:
    """``routing_tokens``, with a slow tokenizer's long prompts encoded in a worker thread."""
    encode, body, source = _encoder(payload, tokenizer)
    if tokenizer.slow and len(str(source)) > OFFLOAD_CHARS:
        return await asyncio.to_thread(encode, body)
    return encode(body)


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return int(value)


def reported_cached(usage: Any) -> tuple[int, int | None] | None:
    """``(cached_tokens, prompt_tokens)`` an engine reported in an OpenAI ``usage`` (dict or
    object), or None when it reported no cached tokens."""
    if usage is None:
        return None
    cached = _count(_field(_field(usage, "prompt_tokens_details"), "cached_tokens"))
    if cached is None:
        return None
    return cached, _count(_field(usage, "prompt_tokens"))


def observed_tokens(usage: Any, routing_prompt: int) -> int | None:
    """The engine's reported cached tokens in routing tokens, or None when it reported none."""
    report = reported_cached(usage)
    if report is None:
        return None
    return to_routing_tokens(report[0], report[1], routing_prompt)


def ranked(decision: Decision, candidates: Iterable[str]) -> list[str]:
    """``candidates`` best first: the decision's worker, then by the policy's preference."""
    scores = decision.scores
    sign = -1.0 if decision.policy in _HIGHER_WINS else 1.0
    rest = [c for c in candidates if c != decision.worker]
    rest.sort(key=lambda c: (c not in scores, sign * scores.get(c, 0.0)))
    return [decision.worker, *rest]


def grow_endpoints(
    router: Router,
    options: Mapping[str, Mapping[str, Any]],
    sizes: dict[str, int],
    log: logging.Logger,
) -> None:
    """Adds or enlarges ``router``'s endpoints (see the module notes). ``options`` maps each
    endpoint to its ``Router.add_endpoint`` keywords (``pool_size`` among them); ``sizes`` is the
    caller's record of the size each was last tried at, updated here."""
    healthy = sum(1 for w in router.workers if router.is_healthy(w))
    for endpoint, opts in options.items():
        size = min(opts["pool_size"], healthy)
        added = sizes.get(endpoint)
        if size < 1 or (added is not None and size <= added):
            continue
        if endpoint in router.endpoints:
            router.remove_endpoint(endpoint)
        sizes[endpoint] = size  # tried once per size
        error = _add_endpoint(router, endpoint, opts, size)
        if error is not None and added is not None:
            log.warning("endpoint %s keeps its pool of %d: %s", endpoint, added, error)
            error = _add_endpoint(router, endpoint, opts, added)
        if error is not None:
            log.error("endpoint %s is left out (unknown to requests): %s", endpoint, error)


def _add_endpoint(
    router: Router, endpoint: str, opts: Mapping[str, Any], size: int
) -> ValueError | None:
    try:
        router.add_endpoint(endpoint, **{**opts, "pool_size": size})
    except ValueError as e:
        return e
    return None
