"""``kvroute relay``'s HTTP endpoint (``--port``): ``GET /metrics`` (Prometheus text) and
``GET /health`` (JSON; 200 while the relay is connected to NATS, 503 while it is not).

A minimal HTTP/1.1 server on asyncio (the relay needs no web framework): one request per
connection, anything but those two paths answered 404, a request not read within 5 s dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["serve_status"]

log = logging.getLogger("kvroute.cluster")

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS[503] = "Service Unavailable"


async def serve_status(
    host: str,
    port: int,
    metrics: Callable[[], str],
    health: Callable[[], tuple[bool, dict[str, Any]]],
    content_type: str = "text/plain; version=0.0.4; charset=utf-8",
) -> asyncio.Server:
    """Starts serving; ``metrics()`` renders ``/metrics``, ``health()`` gives ``/health``'s
    (healthy, body). Close the returned server to stop."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = ""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            method, path, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            path = path.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, ctype, body = 200, content_type, metrics().encode()
            elif path == "/health":
                ok, doc = health()
                status, ctype = (200 if ok else 503), "application/json"
                body = json.dumps(doc, default=str).encode()
            else:
                status, ctype, body = 404, "text/plain", b"/metrics or /health\n"
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        except ValueError:
            status, ctype, body = 400, "text/plain", b"bad request\n"
        head_out = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(ConnectionError):
            writer.write(head_out + (b"" if method == "HEAD" else body))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, host, port)
    log.info("relay: /metrics and /health on http://%s:%d", host, port)
    return server
