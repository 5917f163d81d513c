"""The ``envoy.service.ext_proc.v3.ExternalProcessor`` service: one state machine per HTTP request.

**Body modes.** The data plane's body mode is read from ``protocol_config`` (sent by Envoy on a
stream's first message); without it, ``FULL_DUPLEX_STREAMED`` — the mode GIE requires — is assumed.

- ``FULL_DUPLEX_STREAMED`` (GIE): request headers and body chunks are taken without a reply until
  the body ends (``end_of_stream``, or request trailers); then the pick goes back as the headers
  response (header, ``envoy.lb`` metadata, ``clear_route_cache``), followed by the body — the
  caller's, or the rewritten one — in ``StreamedBodyResponse`` chunks, then the trailers response.
  Response body chunks are passed back as they arrive (minus a usage chunk the picker asked for).
- ``BUFFERED`` / ``BUFFERED_PARTIAL``: the headers are answered at once (continue); the pick goes
  back with the body response (header mutation, metadata, a replaced body with its
  ``content-length``).
- ``NONE``, or ``STREAMED`` (whose header response must precede the body; header mutations in
  body responses are ignored there): the pick is made from the headers alone (by load, the
  ``x-kvroute-endpoint`` header and the fairness id; no prompt) and answered at once.
- A request whose headers end the stream (no body) is picked at once in every mode.
- ``observability_mode`` (the data plane ignores every answer) cannot carry a pick: not supported.

**Errors.** A request the picker refuses gets an ``ImmediateResponse`` (OpenAI-style JSON error:
400 malformed body, 401/403 key, 404 unknown model or endpoint, 413 body over
``epp.max_body_bytes``, 429 shed, 503 no eligible endpoint) and the stream ends. A stream
that breaks the protocol (a body before headers, headers twice) is aborted with
``INVALID_ARGUMENT`` naming the fault. A stream the data plane closes early (the client went away)
ends the request's accounting. Nothing a stream does affects another.

**Response path.** The served endpoint (``envoy.lb`` → ``x-gateway-destination-endpoint-served``)
is read from the response messages' metadata; ``usage`` from the JSON body or the SSE stream's usage
chunk; with ``epp.routing_headers`` the response carries ``x-kvroute-worker`` and
``x-kvroute-cached-tokens``. A 5xx response counts as a failure of the worker that served it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from ..gateway.errors import HTTPError
from ..server.metrics import Counter, Gauge, Histogram, Registry
from . import protocol as p
from .picker import Lease, Pick, Picker, ResponseScanner

__all__ = ["ExtProcService", "ProtocolError"]

log = logging.getLogger("kvroute.epp")

_M = p.BodyMode
_BUFFERED = (_M.BUFFERED, _M.BUFFERED_PARTIAL)


class ProtocolError(Exception):
    """The data plane broke the ext_proc protocol on one stream (the stream is aborted)."""


class ExtProcService(pb_grpc.ExternalProcessorServicer):
    """The ext_proc servicer over a ``Picker``; counts into ``registry`` (``kvroute_epp_``)."""

    def __init__(self, picker: Picker, registry: Registry | None = None) -> None:
        self.picker = picker
        self.server = picker.config.server
        self.streams = 0
        # the health model's reports: failures(worker, status) for a 5xx answer, successes(worker)
        self.failures: Any = None
        self.successes: Any = None
        reg = self.registry = registry or Registry()
        m = "kvroute_epp_"
        self.m_requests = reg.add(
            Counter(m + "requests_total", "Requests ended.", ("model", "status"))
        )
        self.m_rejected = reg.add(
            Counter(m + "rejected_total", "Requests answered by the picker.", ("status", "code"))
        )
        self.m_decisions = reg.add(
            Counter(m + "routing_decisions_total", "Picks.", ("policy", "reason", "worker"))
        )
        self.m_moved = reg.add(
            Counter(m + "served_elsewhere_total", "Requests served by another endpoint.")
        )
        self.m_pick = reg.add(
            Histogram(m + "pick_duration_seconds", "Request body complete to pick sent.")
        )
        self.m_duration = reg.add(
            Histogram(m + "request_duration_seconds", "Request headers to the stream's end.")
        )
        self.m_stream_errors = reg.add(
            Counter(m + "stream_errors_total", "Streams aborted or closed early.", ("kind",))
        )
        self.m_predicted = reg.add(
            Counter(
                m + "cached_tokens_predicted_total",
                "Cached routing tokens predicted, on requests whose response reported them.",
                ("worker",),
            )
        )
        self.m_reported = reg.add(
            Counter(
                m + "cached_tokens_reported_total",
                "Cached tokens reported by responses, in routing tokens.",
                ("worker",),
            )
        )
        self.m_prompt = reg.add(
            Counter(
                m + "prompt_tokens_total",
                "Routing tokens of prompts whose response reported cached tokens.",
                ("worker",),
            )
        )
        reg.add(Gauge(m + "streams", "ext_proc streams open.", (), lambda: [((), self.streams)]))
        reg.add(
            Gauge(
                m + "in_flight",
                "Picked requests not finished.",
                ("worker",),
                lambda: (((w,), n) for w, n in picker.in_flight.items()),
            )
        )
        picker.observer = self._observed

    def _observed(self, worker: str, predicted: int, reported: int, prompt: int) -> None:
        self.m_predicted.inc(worker, by=predicted)
        self.m_reported.inc(worker, by=reported)
        self.m_prompt.inc(worker, by=prompt)

    async def Process(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        exchange = Exchange(self)
        self.streams += 1
        try:
            async for message in request_iterator:
                for reply in await exchange.handle(message):
                    yield reply
                if exchange.done:
                    return
        except ProtocolError as e:
            self.m_stream_errors.inc("protocol")
            log.warning("ext_proc stream aborted: %s", e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.streams -= 1
            exchange.close()


class Exchange:
    """One HTTP request's ext_proc conversation (see the module docs)."""

    def __init__(self, service: ExtProcService) -> None:
        self.service = service
        self.picker = service.picker
        self.request_mode = _M.FULL_DUPLEX_STREAMED
        self.response_mode = _M.FULL_DUPLEX_STREAMED
        self.first = True
        self.headers: dict[str, str] | None = None
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.picked = False
        self.pick: Pick | None = None
        self.lease: Lease | None = None
        self.scanner: ResponseScanner | None = None
        self.status: str | None = None
        self.done = False
        self.started = time.perf_counter()

    # ---- dispatch --------------------------------------------------------------------------

    async def handle(self, message: Any) -> list[Any]:
        if self.first:
            self.first = False
            if message.HasField("protocol_config"):
                config = message.protocol_config
                self.request_mode = config.request_body_mode
                self.response_mode = config.response_body_mode
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            return self._response_trailers()
        raise ProtocolError(f"a ProcessingRequest without a request message ({kind!r})")

    # ---- request path ----------------------------------------------------------------------

    async def _request_headers(self, message: Any) -> list[Any]:
        if self.headers is not None:
            raise ProtocolError("request headers received twice on one stream")
        self.headers = p.headers_of(message.request_headers)
        self.subset = p.subset_of(message)
        mode = self.request_mode
        if message.request_headers.end_of_stream or mode == _M.NONE or mode == _M.STREAMED:
            return await self._decide(None, lambda pick: [self._pick_headers(pick)])
        if mode in _BUFFERED:
            return [p.headers_response()]
        return []  # full duplex (or streamed without waiting): wait for the body

    async def _request_body(self, body: Any) -> list[Any]:
        if self.headers is None:
            raise ProtocolError("a request body chunk arrived before the request headers")
        if self.picked:  # picked from the headers: pass the body on unchanged
            if self.request_mode == _M.FULL_DUPLEX_STREAMED:
                return list(p.streamed_body(body.body, body.end_of_stream, request=True))
            return [p.body_response()]
        self.size += len(body.body)
        limit = self.service.server.max_body_bytes
        if self.size > limit:
            return self._reject(
                HTTPError(
                    413,
                    f"request body exceeds {limit} bytes",
                    "invalid_request_error",
                    "request_too_large",
                )
            )
        self.chunks.append(body.body)
        if self.request_mode in _BUFFERED:
            return await self._decide(b"".join(self.chunks), self._pick_buffered)
        if body.end_of_stream:
            return await self._decide(b"".join(self.chunks), self._pick_full_duplex(True))
        return []

    async def _request_trailers(self) -> list[Any]:
        if self.headers is None:
            raise ProtocolError("request trailers arrived before the request headers")
        out: list[Any] = []
        if not self.picked:
            out = await self._decide(b"".join(self.chunks), self._pick_full_duplex(False))
            if self.done:
                return out
        return [*out, p.trailers_response(request=True)]

    def _pick_headers(self, pick: Pick) -> Any:
        return p.headers_response(
            set_headers=pick.set_headers,
            remove=pick.remove_headers,
            destination=pick.destination,
        )

    def _pick_full_duplex(self, end: bool) -> Any:
        def replies(pick: Pick) -> list[Any]:
            body = pick.body if pick.body is not None else b"".join(self.chunks)
            self.chunks = []
            return [self._pick_headers(pick), *p.streamed_body(body, end, request=True)]

        return replies

    def _pick_buffered(self, pick: Pick) -> list[Any]:
        headers = dict(pick.set_headers)
        if pick.body is not None:
            headers["content-length"] = str(len(pick.body))
        self.chunks = []
        return [
            p.body_response(
                set_headers=headers,
                remove=pick.remove_headers,
                destination=pick.destination,
                body=pick.body,
            )
        ]

    async def _decide(self, body: bytes | None, replies: Any) -> list[Any]:
        """Parses and routes the request; the replies for the pick, or an immediate response."""
        assert self.headers is not None
        self.picked = True
        picked_at = time.perf_counter()
        picker = self.picker
        try:
            request = picker.parse(self.headers, body)
            tokens = await picker.tokens(request, len(body or b""))
            pick = picker.pick(
                request,
                tokens,
                self.subset,
                strip_usage_possible=self.response_mode == _M.FULL_DUPLEX_STREAMED,
            )
        except HTTPError as e:
            return self._reject(e)
        self.pick = pick
        d = pick.decision
        self.service.m_decisions.inc(d.policy, d.reason, pick.member.name)
        out = replies(pick)
        self.lease = Lease(picker, pick, tokens)
        self.service.m_pick.observe(time.perf_counter() - picked_at)
        return out

    def _reject(self, e: HTTPError) -> list[Any]:
        self.done = True
        self.status = str(e.status)
        self.service.m_rejected.inc(str(e.status), e.code or e.kind)
        if e.status >= 500 or e.status == 429:
            log.info("request rejected (%d %s): %s", e.status, e.code, e)
        body = p.error_body(str(e), e.kind, e.code)
        return [p.immediate(e.status, body, details=f"kvroute_{e.code or e.kind}")]

    # ---- response path ---------------------------------------------------------------------

    def _response_headers(self, message: Any) -> list[Any]:
        headers = p.headers_of(message.response_headers)
        self.status = headers.get(":status", "")
        lease = self.lease
        set_headers: dict[str, str] = {}
        if lease is not None:
            served = p.served_of(message)
            before = lease.worker
            lease.served(served)
            if lease.worker != before:
                self.service.m_moved.inc()
            if self.status.startswith("5"):
                if self.service.failures is not None:
                    self.service.failures(lease.worker, self.status)
            elif self.service.successes is not None:
                self.service.successes(lease.worker)
            if self.service.server.routing_headers:
                set_headers["x-kvroute-worker"] = lease.worker
                set_headers["x-kvroute-cached-tokens"] = str(lease.decision.cached_tokens)
        sse = "text/event-stream" in headers.get("content-type", "")
        strip = self.pick is not None and self.pick.strip_usage
        limit = self.service.server.max_body_bytes
        self.scanner = ResponseScanner(strip=strip, limit=limit, sse=sse)
        if message.response_headers.end_of_stream:
            self._finish()
        return [p.headers_response(request=False, set_headers=set_headers)]

    def _response_body(self, body: Any) -> list[Any]:
        if self.scanner is None:
            raise ProtocolError("a response body chunk arrived before the response headers")
        if self.lease is not None and body.body:
            self.lease.prefilled()
        data = self.scanner.feed(body.body, body.end_of_stream)
        if body.end_of_stream:
            self._finish()
        if self.response_mode != _M.FULL_DUPLEX_STREAMED:
            return [p.body_response(request=False)]
        if not data and not body.end_of_stream:
            return []
        return list(p.streamed_body(data, body.end_of_stream, request=False))

    def _response_trailers(self) -> list[Any]:
        out: list[Any] = []
        if self.scanner is not None:
            rest = self.scanner.feed(b"", True)
            if rest and self.response_mode == _M.FULL_DUPLEX_STREAMED:
                out.extend(p.streamed_body(rest, False, request=False))
        self._finish()
        return [*out, p.trailers_response(request=False)]

    def _finish(self) -> None:
        if self.lease is not None:
            self.lease.close(self.scanner.usage if self.scanner is not None else None)
        self.done = True

    def close(self) -> None:
        """The stream ended (normally, aborted, or closed early): accounting ends here."""
        s = self.service
        if self.lease is not None and not self.lease.closed:
            s.m_stream_errors.inc("closed_early")
            with contextlib.suppress(Exception):
                self.lease.close()
        if self.headers is not None:
            model = self.pick.request.model if self.pick is not None else "-"
            s.m_requests.inc(model, self.status or "499")
            s.m_duration.observe(time.perf_counter() - self.started)
