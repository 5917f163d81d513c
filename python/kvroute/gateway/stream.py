"""An upstream SSE stream passed through to the caller event by event.

Each complete event (up to a blank line) is forwarded as soon as it arrives; only the usage chunk
the gateway itself asked for (``stream_options.include_usage``, added when the caller did not ask)
is removed, after its ``usage`` was recorded for the router. A client that disconnects cancels the
upstream request (its connection is closed). The flight ends exactly once, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .metrics import GatewayMetrics
from .upstream import Flight, release

__all__ = ["ProxyStream", "wait_disconnect"]

log = logging.getLogger("kvroute.gateway")

_EVENT_END = re.compile(rb"\r?\n\r?\n")


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ProxyStream(Response):
    """An upstream SSE stream passed through event by event; ends the flight exactly once."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        route: str,
        model: str,
        upstream: httpx.Response,
        flight: Flight,
        strip_usage: bool,
        headers: dict[str, str],
        started: float,
    ) -> None:
        # No body and no Content-Length: the stream is sent chunked as it arrives.
        self.status_code = upstream.status_code
        self.background = None
        self.init_headers(headers)
        self.metrics = metrics
        self.route = route
        self.model = model
        self.upstream = upstream
        self.flight = flight
        self.strip_usage = strip_usage
        self.started = started
        self.usage: Any = None

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
                    self.metrics.errors.inc(self.flight.worker, "broken_stream")
                    log.warning("stream from %s broke: %r", self.flight.worker, broken)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                status = 499
        except OSError:  # the client's socket is gone
            status = 499
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
                self.metrics.done(self.route, self.model, status, self.started)

    async def _pump(self, send: Send) -> BaseException | None:
        """Forwards complete SSE events; returns the error that broke the stream, if any."""
        buf = b""
        first = True
        try:
            async for chunk in self.upstream.aiter_raw():
                if first:
                    self.flight.prefilled()
                buf += chunk
                out = []
                start = 0
                while True:
                    m = _EVENT_END.search(buf, start)
                    if m is None:
                        break
                    event = buf[start : m.end()]
                    start = m.end()
                    if b'"prompt_tokens"' in event and self._is_usage(event):
                        continue
                    out.append(event)
                buf = buf[start:]
                if out:
                    if first:
                        first = False
                        self.metrics.first_byte.observe(
                            time.perf_counter() - self.started, self.route
                        )
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
        except httpx.HTTPError as e:
            return e
        if buf:
            await send({"type": "http.response.body", "body": buf, "more_body": True})
        return None

    def _is_usage(self, event: bytes) -> bool:
        """Records a usage chunk; True when it is to be dropped (the gateway asked for it)."""
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                chunk = json.loads(line[5:])
            except ValueError:
                return False
            if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
                self.usage = chunk["usage"]
                return self.strip_usage and not chunk.get("choices")
        return False
