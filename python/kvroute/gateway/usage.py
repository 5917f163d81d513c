"""DeepSeek-style prompt-cache fields in ``usage``: ``prompt_cache_hit_tokens`` and
``prompt_cache_miss_tokens``.

Scripts written against DeepSeek's API read how much of the prompt was served from the cache from
``usage.prompt_cache_hit_tokens`` (and the rest from ``usage.prompt_cache_miss_tokens``); vLLM,
SGLang and OpenAI report ``usage.prompt_tokens_details.cached_tokens``. With
``cache_usage_fields = true`` (the default) the gateway adds the two fields, derived from the
engine's report — hit = ``cached_tokens``, miss = ``prompt_tokens − cached_tokens`` — to
non-streamed replies and to the final usage chunk of streams, and keeps the OpenAI field as it is.
When the engine reports no ``cached_tokens`` (vLLM without ``--enable-prompt-tokens-details``,
SGLang without ``--enable-cache-report``) both fields stay absent: nothing is known, and 0 would
claim a cold cache.
"""

from __future__ import annotations

import json
from typing import Any

from .prompt import to_routing_tokens
from .rawjson import dumps

__all__ = [
    "UsageEvent",
    "cached_tokens",
    "routed_cached_tokens",
    "usage_event",
    "with_cache_fields",
    "with_cache_fields_body",
    "with_cached_tokens",
]


#: The fields ``with_cache_fields`` adds.
CACHE_FIELDS = ("prompt_cache_hit_tokens", "prompt_cache_miss_tokens")


def cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when it is a count, else None."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        return cached
    return None


def routed_cached_tokens(usage: Any, routing_prompt: int) -> int | None:
    """The cached tokens ``usage`` reports, in routing tokens (scaled by the engine's
    ``prompt_tokens`` to the routed prompt's length), or None when it reports none."""
    cached = cached_tokens(usage)
    if cached is None:
        return None
    prompt = usage.get("prompt_tokens")
    return to_routing_tokens(cached, prompt if isinstance(prompt, int) else None, routing_prompt)


class UsageEvent:
    """An SSE event that carries a chunk with ``usage``: the parsed chunk and the event's lines
    (``lines[line]`` is the chunk's ``data:`` line), to rewrite it."""

    __slots__ = ("chunk", "line", "lines")

    def __init__(self, chunk: dict[str, Any], lines: list[bytes], line: int) -> None:
        self.chunk = chunk
        self.lines = lines
        self.line = line

    @property
    def usage(self) -> dict[str, Any]:
        return self.chunk["usage"]

    @property
    def usage_only(self) -> bool:
        """A chunk with no choices: the one ``stream_options.include_usage`` adds at the end."""
        return not self.chunk.get("choices")

    def with_usage(self, usage: dict[str, Any]) -> bytes:
        """The event with its chunk's ``usage`` replaced."""
        self.chunk["usage"] = usage
        lines = list(self.lines)
        lines[self.line] = b"data: " + json.dumps(self.chunk, ensure_ascii=False).encode()
        return b"\n".join(lines)


def usage_event(event: bytes) -> UsageEvent | None:
    """The usage chunk an SSE event carries (its first ``data:`` line: a JSON object whose
    ``usage`` is an object), or None. Cheap for every other event: only an event mentioning
    ``"prompt_tokens"`` is parsed."""
    if b'"prompt_tokens"' not in event:
        return None
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if not line.startswith(b"data:"):
            continue
        try:
            chunk = json.loads(line[5:])
        except (ValueError, RecursionError):
            return None
        if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
            return UsageEvent(chunk, lines, i)
        return None
    return None


def with_cache_fields(usage: Any) -> Any:
    """``usage`` with the hit/miss fields added (a new dict), or ``usage`` itself when the engine
    reported no cached tokens (or the fields are there already)."""
    cached = cached_tokens(usage)
    if cached is None or "prompt_cache_hit_tokens" in usage:
        return usage
    prompt = usage.get("prompt_tokens")
    out = dict(usage)
    out["prompt_cache_hit_tokens"] = cached
    if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= cached:
        out["prompt_cache_miss_tokens"] = prompt - cached
    return out


def with_cached_tokens(usage: dict[str, Any], cached: int | None) -> dict[str, Any]:
    """``usage`` (a new dict) with ``prompt_tokens_details.cached_tokens`` set to ``cached``, or
    without it (and without the hit/miss fields) when ``cached`` is None: a disaggregated pair's
    client is told what its prefill worker found cached, not the KV its decode worker received."""
    out = {k: v for k, v in usage.items() if k not in CACHE_FIELDS}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        details = {k: v for k, v in details.items() if k != "cached_tokens"}
    elif cached is None:
        return out  # nothing to take out
    else:
        details = {}
    if cached is not None:
        details["cached_tokens"] = cached
    out["prompt_tokens_details"] = details
    return out


def with_cache_fields_body(reply: Any, data: bytes) -> bytes:
    """A non-streamed reply's body with the fields added to its ``usage`` (``reply`` is ``data``
    parsed); ``data`` itself when there is nothing to add."""
    if not isinstance(reply, dict):
        return data
    usage = reply.get("usage")
    fields = with_cache_fields(usage)
    if fields is usage:
        return data
    reply["usage"] = fields
    return dumps(reply).encode()
