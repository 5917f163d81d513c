"""A completion request's arrival: the ASGI request as the gateway sees it, and its body read and
parsed within the gateway's limits.

Guarantees: a body is read up to ``max_bytes`` (413 past it, before reading a byte when
``Content-Length`` already says so) and within ``timeout`` seconds (408 past it) unless the
listener holds all of it already; a client that goes away meanwhile raises ``ClientGone``. The
payload is a JSON object (400 otherwise: invalid JSON, nesting too deep for the parser) whose
``stream`` is a boolean and ``stream_options`` an object when present; ``rawjson`` keeps its text
when it can, for the upstream body.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope

from .errors import HTTPError
from .listener import Cycle
from .rawjson import RawObject, parse_object

__all__ = ["REQUEST_ID", "ClientGone", "Incoming", "parse_payload", "read_body", "uncancel"]

#: A caller's ``x-request-id`` the gateway keeps (else it makes one).
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class ClientGone(Exception):
    """The client disconnected before its request was read."""


class Incoming:
    """One HTTP request as the gateway sees it: the ASGI scope and its headers, and the
    listener's ``kvroute`` ASGI extension when it is served by ``kvroute.gateway.listener``."""

    __slots__ = ("after", "headers", "listener", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.after: list[Callable[[], None]] = []  # run once the response has been sent
        extensions = scope.get("extensions")
        self.listener: Cycle | None = extensions.get("kvroute") if extensions else None


def uncancel(task: asyncio.Task[Any]) -> None:
    """Withdraws a cancellation this handler made and handled (Python >= 3.11 counts them)."""
    withdraw = getattr(task, "uncancel", None)
    if withdraw is not None:
        withdraw()


def _declared_size(req: Incoming, limit: int) -> None:
    """413 when ``Content-Length`` already says the body exceeds ``limit``."""
    declared = req.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(
            413, f"request body of {declared} bytes exceeds {limit}", code="request_too_large"
        )


async def _receive_body(req: Incoming, limit: int) -> bytes:
    _declared_size(req, limit)
    chunks = []
    size = 0
    while True:
        message = await req.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _receive_in_time(req: Incoming, limit: int, timeout: float) -> bytes:
    """The body, read within ``timeout`` seconds (408 past it)."""
    task = asyncio.current_task()
    expired = False

    def expire() -> None:  # a timer, not wait_for: no task per request
        nonlocal expired
        expired = True
        if task is not None:
            task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await _receive_body(req, limit)
    except asyncio.CancelledError:
        if not expired or task is None:
            raise
        uncancel(task)
        raise HTTPError(
            408, f"request body not received within {timeout:g} s", code="request_timeout"
        ) from None
    finally:
        timer.cancel()


async def read_body(req: Incoming, limit: int, timeout: float) -> bytes:
    """The request's body, at most ``limit`` bytes: taken whole from the listener when it holds
    all of it (no deadline then, and no await), else read within ``timeout`` seconds unless the
    whole of it has arrived."""
    cycle = req.listener
    body = cycle.take_body() if cycle is not None else None
    if body is not None:
        _declared_size(req, limit)
        if len(body) > limit:
            raise HTTPError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        return body
    if cycle is not None and not cycle.more_body:  # the whole body is here: no deadline
        return await _receive_body(req, limit)
    return await _receive_in_time(req, limit, timeout)


def parse_payload(body: bytes) -> tuple[dict[str, Any], RawObject | None]:
    """The request's JSON object and (``rawjson``) its text."""
    raw = parse_object(body)
    try:
        payload = raw.value if raw is not None else json.loads(body)
    except RecursionError:
        raise HTTPError(
            400, "request body is nested too deeply", code="nested_too_deeply"
        ) from None
    except ValueError as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_body")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise HTTPError(
            400, f"'stream' must be true or false, got {stream!r:.40}", code="invalid_stream"
        )
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise HTTPError(400, "'stream_options' must be an object", code="invalid_stream")
    return payload, raw
