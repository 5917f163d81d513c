"""What the gateway answers when something fails, in one place.

``HTTPError`` is an error answered to the caller as an OpenAI-style error object
(``{"error": {"message", "type", "param", "code"}}``). ``UpstreamFailure`` says, for one kind of
upstream failure, how it is answered (status, code), whether the request moves on to the router's
next choice (``retry``) and what it tells the health model (``health``: ``"down"`` ejects the
worker at once, ``"count"`` counts one failure toward ``eject_after``, ``"none"`` nothing).
``classify`` maps an exception raised by the upstream client to its row of ``SEND_FAILURES``
(while sending the request and waiting for the response head) or ``BODY_FAILURES`` (while reading
the body); an exception in neither table is a bug and propagates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from starlette.responses import JSONResponse, Response

from .client import (
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    PoolTimeout,
    ProtocolError,
    ReadTimeout,
    UpstreamError,
    WriteTimeout,
)

__all__ = [
    "BAD_STATUS",
    "BODY_FAILURES",
    "EMPTY_STREAM",
    "SEND_FAILURES",
    "STATUS_5XX",
    "STREAM_ERROR",
    "TOO_LARGE",
    "Answer",
    "Failed",
    "HTTPError",
    "Outcome",
    "UpstreamFailure",
    "classify",
]


class HTTPError(Exception):
    """An error answered to the client as an OpenAI-style error object."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, object]:
        return {
            "error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}
        }

    def response(self, headers: dict[str, str] | None = None) -> Response:
        if self.headers:
            headers = {**self.headers, **(headers or {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass(frozen=True)
class UpstreamFailure:
    """One kind of upstream failure: how it is counted, answered, retried and judged."""

    kind: str  # the ``upstream_errors_total{kind}`` label
    status: int  # answered when no attempt succeeds
    code: str
    message: str  # formatted with ``worker``
    retry: bool  # move on to the router's next choice
    health: Literal["down", "count", "none"]

    def error(self, worker: str) -> HTTPError:
        kind = "service_unavailable" if self.status == 503 else "upstream_error"
        return HTTPError(self.status, self.message.format(worker=worker), kind, self.code)


Answer: TypeAlias = "tuple[int, bytes, dict[str, str]]"
#: A failed attempt: (failure, detail, the upstream's own 5xx answer if it gave one: status,
#: body and the headers to pass on, ``content-type`` among them).
Failed: TypeAlias = "tuple[UpstreamFailure, object, Answer | None]"
#: An attempt's outcome: the response for the client, or how it failed.
Outcome: TypeAlias = "Response | Failed"


CONNECT = UpstreamFailure(
    "connect", 502, "upstream_unreachable", "upstream {worker} unreachable", True, "down"
)
POOL_TIMEOUT = UpstreamFailure(
    "pool_timeout", 503, "busy", "upstream {worker} has no free connection", True, "none"
)
TIMEOUT = UpstreamFailure(
    "timeout", 504, "upstream_timeout", "upstream {worker} timed out", False, "none"
)
RESET = UpstreamFailure(
    "reset", 502, "upstream_reset", "upstream {worker} closed the connection", True, "count"
)
#: The body broke before anything was sent to the caller: retried (nothing was committed).
BROKEN = UpstreamFailure(
    "protocol", 502, "upstream_broken", "upstream {worker} failed mid-response", True, "count"
)
#: A stream that ended or broke before its first event: retried.
EMPTY_STREAM = UpstreamFailure(
    "broken_stream",
    502,
    "upstream_broken",
    "upstream {worker} ended its stream before any event",
    True,
    "count",
)
#: A stream whose first event is the engine's error (vLLM and SGLang answer 200 and send
#: ``data: {"error": {...}}`` when generation fails before any output): retried like a 5xx; the
#: error is passed on as a JSON answer (status its ``code`` when a 5xx, else 502) if no attempt
#: succeeds.
STREAM_ERROR = UpstreamFailure(
    "stream_error",
    502,
    "upstream_error",
    "upstream {worker} failed its stream before any output",
    True,
    "count",
)
#: A status outside 100..599 (HTTP allows three digits; nothing above 599 is defined).
BAD_STATUS = UpstreamFailure(
    "bad_status",
    502,
    "upstream_bad_status",
    "upstream {worker} answered an invalid HTTP status",
    True,
    "count",
)
#: A reply past ``max_response_bytes`` (or an SSE event past ``max_event_bytes``): not retried,
#: as another worker would most likely answer the same request as largely.
TOO_LARGE = UpstreamFailure(
    "too_large",
    502,
    "upstream_reply_too_large",
    "the reply of upstream {worker} exceeds the gateway's size limit",
    False,
    "none",
)
#: A 5xx answer: retried; the upstream's own answer is passed on if no attempt succeeds.
STATUS_5XX = UpstreamFailure(
    "status_5xx", 502, "upstream_error", "upstream {worker} failed", True, "count"
)

Row = tuple[tuple[type[BaseException], ...], UpstreamFailure]

#: Sending the request and reading the response head (``kvroute.gateway.client``'s errors). A
#: reset before any response byte is retried although the upstream may have read the request
#: (the client already sent it again once when a reused keep-alive connection was lost so):
#: completions have no side effects, so at worst it computed twice. Read timeouts are not
#: retried: the upstream may still be computing.
SEND_FAILURES: tuple[Row, ...] = (
    ((ConnectFailed, ConnectTimeout), CONNECT),
    ((PoolTimeout,), POOL_TIMEOUT),
    ((ReadTimeout, WriteTimeout), TIMEOUT),
    ((ConnectionLost, ProtocolError), RESET),
)
#: Reading a response body (or a stream's first event) before anything was sent to the caller.
BODY_FAILURES: tuple[Row, ...] = (
    ((ReadTimeout,), TIMEOUT),
    ((UpstreamError,), BROKEN),
)


def classify(error: BaseException, table: tuple[Row, ...]) -> UpstreamFailure | None:
    """The failure row an upstream client exception belongs to, or None (not an upstream
    failure: let it propagate)."""
    for types, failure in table:
        if isinstance(error, types):
            return failure
    return None


def body_failed(error: UpstreamError) -> Failed:
    """How an attempt failed while reading its response body (``BODY_FAILURES``); an error in no
    row of it is a bug and is raised again."""
    failure = classify(error, BODY_FAILURES)
    if failure is None:
        raise error
    return failure, error, None
