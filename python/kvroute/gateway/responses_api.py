"""The gateway's side of the Responses API (``kvroute.gateway.responses`` gives the rules):
the routing tokens of ``POST /v1/responses``, the worker a follow-up is pinned to, the owners
learnt from answers, and ``GET /v1/responses/{id}`` / ``POST /v1/responses/{id}/cancel``
forwarded to the worker holding the response.

Guarantees:

- A follow-up naming a response this process served for another target is answered 404, as
  the engine answers an unknown id (one tenant never continues another's conversation). One
  naming a response it served for the same target is sent only to the worker holding it
  (outside the endpoint's pool too), never elsewhere: when that worker is ejected, removed or
  already failed for the request, the answer is 503 ``previous_response_unavailable`` (429
  ``worker_queue`` when it is only at its in-flight bound); the first attempt's own failure
  (e.g. 502 unreachable) when it was tried.
- The owner of a response is learnt from a 200 answer: a whole reply's ``id``, a stream's
  ``response.created`` event (the stream was committed: its first output arrived).
- ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` are answered by the worker
  holding the response, for callers that may open the target it was made for (404 for anyone
  else, as for an unknown id: whether an id exists is not disclosed); the worker's answer passes
  as it is (status, body, forwarded headers). These take no in-flight slot and are not retried.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.responses import Response, StreamingResponse

from kvroute import Decision
from kvroute.server.routing import NoWorkerError

from .admin import not_found
from .admission import Shed
from .client import BodyTooLarge, UpstreamError
from .client import Response as UpstreamResponse
from .errors import HTTPError
from .request import REQUEST_ID
from .responses import RESPONSES, ResponseOwners, chat_view, event_payload
from .stream import WholeResponse, event_kind, forwarded_headers
from .upstream import request_head

if TYPE_CHECKING:
    from .app import Call, Gateway
    from .auth import Target
    from .request import Incoming
    from .upstream import Flight

__all__ = ["BY_ID", "ResponsesApi"]

#: The path prefix of a stored response's routes.
BY_ID = RESPONSES + "/"
#: A query string passed on: URL characters only (no space, no line break).
_QUERY = re.compile(rb"[\x21-\x7e]*")

log = logging.getLogger("kvroute.gateway")


class ResponsesApi:
    """The Responses routes of one gateway (see the module docs)."""

    def __init__(self, g: Gateway) -> None:
        self.g = g
        self.owners = ResponseOwners()

    def tokens(self, payload: dict[str, Any]) -> np.ndarray:
        """A Responses request's routing tokens."""
        return self.g.tokenizer.chat_tokens(chat_view(payload))

    def pinned(self, target: Target, payload: dict[str, Any]) -> tuple[str, str] | None:
        """A follow-up's previous response and the worker holding it, when this process served
        it (else None: the request is routed as any). Raises ``HTTPError`` 404 when it was made
        for another target: one tenant never continues another's conversation."""
        previous = payload.get("previous_response_id")
        owner = self.owners.owner(previous)
        if owner is None:
            return None
        if owner[1] != target.name:
            raise NotFound(previous)
        return previous, owner[0]

    def choose(
        self, call: Call, tokens: np.ndarray, tried: list[str], exclude: list[str]
    ) -> Decision | HTTPError:
        """A follow-up's one possible worker, or why it cannot take the request now."""
        assert call.pinned is not None
        g = self.g
        previous, owner = call.pinned
        if owner not in exclude:
            others = [w for w in g.router.workers if w != owner]
            with contextlib.suppress(NoWorkerError):
                return g.router.route(tokens=tokens, exclude=others)
        if owner in g.upstreams.full and not tried:
            return g._shed(Shed("worker_queue", f"worker {owner}, which holds {previous}, is full"))
        return HTTPError(
            503,
            f"previous_response_id {previous!r} is held by worker {owner}, which cannot serve "
            "it now",
            "service_unavailable",
            "previous_response_unavailable",
        )

    def learn_reply(self, call: Call, flight: Flight, reply: Any) -> None:
        """A whole 200 answer's response is held by its worker."""
        if isinstance(reply, dict) and call.target is not None:
            self.owners.learn(reply.get("id"), flight.worker, call.target.name)

    def learn_stream(self, call: Call, flight: Flight, first: list[bytes]) -> None:
        """A committed stream's response (its ``response.created`` event's) is held by its
        worker."""
        for event in first:
            if event_kind(event) == b"response.created":
                created = event_payload(event)[1]
                response = created.get("response") if isinstance(created, dict) else None
                self.learn_reply(call, flight, response)
                return

    async def by_id(self, req: Incoming) -> Response:
        """``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: the holder's answer,
        counted in ``requests_total`` (route ``/v1/responses/{id}``; model: the response's
        target when the caller may see it)."""
        started = time.perf_counter()
        model: list[str] = ["-"]
        answer = await self._by_id(req, model)
        self.g.metrics.done(BY_ID + "{id}", model[0], answer.status_code, started)
        return answer

    async def _by_id(self, req: Incoming, model: list[str]) -> Response:
        g = self.g
        scope = req.scope
        path, method = scope["path"], scope["method"]
        response_id, _, action = path[len(BY_ID) :].partition("/")
        given = req.headers.get("x-request-id")
        rid = given if given and REQUEST_ID.fullmatch(given) else os.urandom(16).hex()
        headers = {"x-request-id": rid}
        try:
            allowed = {"": "GET", "cancel": "POST"}.get(action)
            if allowed is None or not response_id:
                raise not_found()
            if method != allowed:
                raise HTTPError(405, f"use {allowed} on {path}", code="method_not_allowed")
            access = g.auth.access(req.headers.get("authorization"))
            owner = self.owners.owner(response_id)
            if owner is None:
                raise NotFound(response_id)
            worker, target = owner
            try:
                access.target(target)
            except HTTPError:  # a caller who may not open its target: as for an unknown id
                raise NotFound(response_id) from None
            model[0] = target
            query = scope.get("query_string") or b""
            if not _QUERY.fullmatch(query):
                raise HTTPError(400, "the query string has characters not allowed in a URL")
            upstream_path = path + ("?" + query.decode() if query else "")
            pool = g.upstreams.pools.get(worker)
            if pool is None or not g.router.is_healthy(worker):
                raise HTTPError(
                    503,
                    f"response {response_id!r} is held by worker {worker}, which cannot serve "
                    "it now",
                    "service_unavailable",
                    "previous_response_unavailable",
                )
            try:
                resp = await pool.request(method, upstream_path, request_head(rid))
                passed = {**forwarded_headers(resp.headers), **headers}
                if passed.get("content-type", "").startswith("text/event-stream"):
                    return StreamingResponse(_relay(resp), resp.status_code, passed)
                try:
                    data = await resp.read(g.server.max_response_bytes)
                finally:
                    resp.close()
            except (UpstreamError, BodyTooLarge) as e:
                raise HTTPError(
                    502, f"upstream {worker} failed: {e}", "upstream_error", "upstream_failed"
                ) from None
        except HTTPError as e:
            return e.response(headers)
        passed.setdefault("content-type", "application/json")
        return WholeResponse(data, resp.status_code, passed)


class NotFound(HTTPError):
    """vLLM's answer for a response it does not hold, to the byte: given alike for one this
    gateway holds for another target (whether an id exists is not disclosed)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(404, f"Response with id '{response_id}' not found.")

    def body(self) -> dict[str, object]:
        error = {"message": str(self), "type": self.kind, "param": "response_id", "code": 404}
        return {"error": error}


async def _relay(resp: UpstreamResponse) -> AsyncIterator[bytes]:
    """A stored response's event stream (``?stream=true``) as it arrives; the upstream
    connection closed when it ends or the caller goes away."""
    try:
        async for chunk in resp:
            yield chunk
    except UpstreamError as e:  # the caller sees the stream end; the cause is logged
        log.warning("stored response stream broke: %s", e)
    finally:
        resp.close()
