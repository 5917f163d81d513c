"""An upstream's answer passed through to the caller: an SSE stream event by event
(``ProxyStream``), a whole reply in one piece (``WholeResponse``).

The gateway commits the caller's 200 only once the upstream's **first complete event** has
arrived (``first_events``): a stream that fails before it is an upstream failure like any other
(retried on another worker, or answered 502), and so is one whose first event is the engine's
error (``first_failure``: vLLM's and SGLang's ``data: {"error": {...}}``, sent with a 200 when
generation fails before any output; an error whose ``code`` is a 4xx is the request's and passes
through). From then on each complete event (up to a blank
line) is forwarded as soon as it arrives. The usage chunk gets the cache fields
(``kvroute.gateway.usage``) and, when the gateway itself asked for it
(``stream_options.include_usage`` added because the caller did not), is removed after its
``usage`` was recorded for the router.

A stream that breaks after the 200 — the connection lost, bad chunked encoding, an event larger
than ``max_event_bytes``, or an end without ``data: [DONE]`` — is ended with an error event
(``data: {"error": {...}}``, which the OpenAI SDKs raise as an error) and counted as status 502
in ``requests_total`` and as ``broken_stream`` in ``upstream_errors_total``. Scanning is linear:
each byte is searched for an event boundary at most once, and an unfinished event is bounded by
``max_event_bytes``. A client that disconnects cancels the upstream request (its connection is
closed). The flight ends exactly once, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .client import Response as UpstreamResponse
from .client import UpstreamError
from .errors import EMPTY_STREAM, STREAM_ERROR, Answer, Failed
from .metrics import GatewayMetrics
from .responses import PREAMBLE, TERMINAL, event_payload
from .upstream import Flight, release
from .usage import UsageEvent, usage_event, with_cache_fields

__all__ = [
    "FORWARDED_HEADERS",
    "EventTooLarge",
    "ProxyStream",
    "SseScanner",
    "WholeResponse",
    "event_kind",
    "failed_answer",
    "first_failure",
    "first_output",
    "forwarded_headers",
    "responses_failure",
    "wait_disconnect",
]

log = logging.getLogger("kvroute.gateway")

_EVENT_END = re.compile(rb"\r?\n\r?\n")
_DONE = re.compile(rb"^data:\s*\[DONE\]", re.MULTILINE)
_DATA = re.compile(rb"^data: ?(.*?)\r?$", re.MULTILINE)


#: Of an upstream answer's head, what reaches the caller: its body's type, encoding and caching,
#: and when to try again — ``retry-after`` and ``retry-after-ms`` (which the OpenAI SDKs and
#: LiteLLM honour) and OpenAI's ``x-ratelimit-*``. Nothing else (an upstream's own request id,
#: its server, its cookies) is passed on.
FORWARDED_HEADERS = frozenset(
    ("content-type", "content-encoding", "cache-control", "retry-after", "retry-after-ms")
)


def forwarded_headers(headers: dict[str, str]) -> dict[str, str]:
    """The headers of an upstream answer (lower-case names) that reach the caller."""
    return {
        n: v for n, v in headers.items() if n in FORWARDED_HEADERS or n.startswith("x-ratelimit-")
    }


def failed_answer(status: int, data: bytes, headers: dict[str, str]) -> Answer:
    """An upstream's own failed answer as kept to pass on (``errors.Failed``): its status, body
    and forwarded headers (``content-type`` JSON unless it named one)."""
    kept = forwarded_headers(headers)
    kept.setdefault("content-type", "application/json")
    return status, data, kept


class WholeResponse(Response):
    """``Response(body, status_code=status, headers=headers)`` for ``headers`` with lower-case
    names and no ``content-length``: the same ``raw_headers`` (``content-length`` appended
    unless the status has no body), without ``Response``'s general header processing — an
    upstream's reply on its way to the client."""

    def __init__(self, body: bytes, status: int, headers: dict[str, str]) -> None:
        self.body = body
        self.status_code = status
        self.background = None
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if not (status < 200 or status in (204, 304)):
            raw.append((b"content-length", str(len(body)).encode()))
        self.raw_headers = raw


class EventTooLarge(Exception):
    """An SSE event grew past ``max_event_bytes`` without its blank line."""


class SseScanner:
    """Splits a byte stream into complete SSE events, scanning each byte once."""

    __slots__ = ("buf", "limit", "scanned")

    def __init__(self, limit: int) -> None:
        self.buf = bytearray()
        self.limit = limit
        self.scanned = 0  # bytes of buf already searched for a boundary

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self.buf
        buf += chunk
        events = []
        start = 0
        pos = max(self.scanned - 3, 0)  # a boundary (up to 4 bytes) may straddle two chunks
        while True:
            m = _EVENT_END.search(buf, pos)
            if m is None:
                break
            events.append(bytes(buf[start : m.end()]))
            start = pos = m.end()
        if start:
            del buf[:start]
        self.scanned = len(buf)
        if len(buf) > self.limit:
            raise EventTooLarge(f"an SSE event exceeds {self.limit} bytes")
        return events

    @property
    def pending(self) -> bytes:
        return bytes(self.buf)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def first_events(
    chunks: AsyncIterator[bytes], scanner: SseScanner, on_first_byte: Callable[[], None]
) -> list[bytes]:
    """Reads until the first complete event; [] when the stream ended before one. Raises what
    reading raises (``UpstreamError``, ``EventTooLarge``)."""
    first = True
    async for chunk in chunks:
        if first:
            first = False
            on_first_byte()
        events = scanner.feed(chunk)
        if events:
            return events
    return []


async def first_output(
    chunks: AsyncIterator[bytes], scanner: SseScanner, on_output: Callable[[], None]
) -> list[bytes]:
    """A Responses stream read up to its first event with data after the preamble
    (``response.created``, ``response.in_progress``: sent before the prefill), which calls
    ``on_output``; every event read when the stream ended before one. Raises what reading
    raises."""
    events: list[bytes] = []
    async for chunk in chunks:
        for event in scanner.feed(chunk):
            events.append(event)
            if b"data:" in event and event_kind(event) not in PREAMBLE:
                on_output()
                return events
    return events


def event_kind(event: bytes) -> bytes:
    """An SSE event's ``event:`` field (vLLM names every Responses event so), else its data's
    ``type``."""
    if event.startswith(b"event:"):
        end = event.find(b"\n")
        return event[6:end].strip()
    return event_payload(event)[0]


def responses_failure(first: list[bytes]) -> Failed | None:
    """``first_failure`` for a Responses stream: it failed when it ended within the preamble
    (``EMPTY_STREAM``), or when its first event after it is an ``error`` or ``response.failed``
    event (or an error object) whose ``code`` is not a 4xx."""
    last = first[-1] if first else b""
    if b"data:" not in last or event_kind(last) in PREAMBLE:
        return EMPTY_STREAM, "no output event before the end", None
    kind, payload = event_payload(last)
    if kind not in (b"error", b"response.failed") or not isinstance(payload, dict):
        return first_failure([last])
    error = payload
    if kind == b"response.failed":
        response = payload.get("response")
        error = response.get("error") if isinstance(response, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if type(code) is int and 400 <= code <= 499:
        return None
    status = code if type(code) is int and 500 <= code <= 599 else 502
    data = b"\n".join(m.group(1) for m in _DATA.finditer(last))
    return STREAM_ERROR, f"{kind.decode()} event, code {code!r}", failed_answer(status, data, {})


def first_failure(first: list[bytes]) -> Failed | None:
    """How a stream failed before its first output: ``EMPTY_STREAM`` when it ended before any
    event; ``STREAM_ERROR`` when its first event with data is an error object — ``{"error":
    {...}}`` (vLLM, SGLang) or ``{"object": "error", ...}`` (older vLLM's ``ErrorResponse``) —
    whose ``code`` is not a 4xx, with that object as the answer to pass on (status: the ``code``
    when a 5xx, else 502); None otherwise."""
    if not first:
        return EMPTY_STREAM, "no event before the end", None
    for event in first:
        data = b"\n".join(m.group(1) for m in _DATA.finditer(event))
        if not data:
            continue  # a comment or a field other than data
        if b'"error"' not in data:
            return None
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(payload, dict):
            return None
        inner = payload.get("error")
        if isinstance(inner, dict):
            code = inner.get("code")
        elif payload.get("object") == "error":
            code = payload.get("code")
        else:
            return None
        if type(code) is int and 400 <= code <= 499:
            return None  # the request's error, as a 4xx answer would be: passed through
        status = code if type(code) is int and 500 <= code <= 599 else 502
        return STREAM_ERROR, f"error event, code {code!r}", failed_answer(status, data, {})
    return None


def error_event(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class ProxyStream(Response):
    """An upstream SSE stream (its first events already read) passed through event by event."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        route: str,
        model: str,
        upstream: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        scanner: SseScanner,
        first: list[bytes],
        flight: Flight,
        *,
        strip_usage: bool,
        cache_fields: bool,
        client_usage: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        headers: dict[str, str],
        started: float,
        responses: Callable[[Any], Any] | None = None,
    ) -> None:
        # No body and no Content-Length: the stream is sent chunked as it arrives.
        self.status_code = upstream.status_code
        self.background = None
        self.init_headers(headers)
        self.metrics = metrics
        self.route = route
        self.model = model
        self.upstream = upstream
        self.chunks = chunks
        self.scanner = scanner
        self.first = first
        self.flight = flight
        self.strip_usage = strip_usage
        self.cache_fields = cache_fields
        self.client_usage = client_usage
        self.started = started
        self.usage: Any = None
        # A Responses stream (ends with a terminal event): its final usage in chat terms.
        self.responses = responses
        self.done = False  # data: [DONE] (a Responses stream: its terminal event) seen
        self.outcome = 200  # what requests_total counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = self.status_code
        pump = watch = None
        try:
            await send(
                {"type": "http.response.start", "status": status, "headers": self.raw_headers}
            )
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(wait_disconnect(receive))
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                broken = pump.result()
                if broken is not None:
                    self.outcome = 502
                    worker = self.flight.worker
                    self.metrics.errors.inc(worker, "broken_stream")
                    log.warning("stream from %s broke after its first event: %s", worker, broken)
                    await send(
                        {
                            "type": "http.response.body",
                            "body": error_event(
                                f"upstream {worker} failed mid-stream: {broken}", "upstream_broken"
                            ),
                            "more_body": True,
                        }
                    )
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                self.outcome = 499
        except OSError:  # the client's socket is gone
            self.outcome = 499
        finally:
            for task in (pump, watch):
                if task is not None:
                    task.cancel()
            if pump is not None:
                with contextlib.suppress(BaseException):
                    await pump
            try:
                await release(self.upstream, self.flight, self.usage)
            finally:
                self.metrics.done(self.route, self.model, self.outcome, self.started)

    def _forwardable(self, events: list[bytes]) -> bytes:
        if self.responses is not None:
            for event in events:
                if event_kind(event) in TERMINAL:
                    self.done = True
                    response = event_payload(event)[1]
                    response = response.get("response") if isinstance(response, dict) else None
                    if isinstance(response, dict) and isinstance(response.get("usage"), dict):
                        self.usage = self.responses(response["usage"])
            return b"".join(events)
        out = []
        for event in events:
            found = usage_event(event)
            if found is not None:
                event = self._usage_event(event, found)
                if not event:
                    continue
            elif not self.done and _DONE.search(event):
                self.done = True
            out.append(event)
        return b"".join(out)

    async def _pump(self, send: Send) -> str | None:
        """Forwards complete SSE events; returns why the stream broke, if it did."""
        first = self._forwardable(self.first)
        self.first = []
        self.metrics.first_byte.observe(time.perf_counter() - self.started, self.route)
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        try:
            async for chunk in self.chunks:
                body = self._forwardable(self.scanner.feed(chunk))
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        except UpstreamError as e:
            return f"{type(e).__name__}: {e}"
        except EventTooLarge as e:
            return str(e)
        if self.scanner.buf:
            return f"the stream ended inside an event ({len(self.scanner.buf)} bytes)"
        if not self.done:
            end = "a final event" if self.responses is not None else "data: [DONE]"
            return f"the stream ended without {end}"
        return None

    def _usage_event(self, event: bytes, found: UsageEvent) -> bytes:
        """Records a usage chunk; returns the event to forward (b"" to drop it)."""
        self.usage = found.usage
        if self.strip_usage and found.usage_only:
            return b""
        usage = self.usage
        if self.client_usage is not None:
            usage = self.client_usage(usage)
        if self.cache_fields:
            usage = with_cache_fields(usage)
        if usage is not self.usage:
            return found.with_usage(usage)
        return event
