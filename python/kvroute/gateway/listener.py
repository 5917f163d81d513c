"""The gateway's front door: client connections under deadlines and a cap, and the admin listener.

uvicorn parses HTTP (httptools when installed, else h11) and has no deadline for a request's
headers: a client that opens a connection and sends a header line every few seconds holds a
socket for ever, and enough of them exhaust the process's file descriptors. ``ConnectionGuard``
wraps uvicorn's protocol (through uvicorn's documented ``http=`` protocol-class setting, without
changing it) and guarantees, per client connection:

- the request line and headers arrive within ``header_timeout`` seconds of the connection's
  first byte (of a new connection, or of the next request on a kept-alive one), else the
  connection is answered 408 and closed;
- a connection idle between requests is closed after ``keep_alive_timeout``;
- at most ``max_connections`` client connections are open: a new one past the cap evicts the
  connection that has waited longest without a request in progress (idle, or still sending
  headers), and is refused (closed) only when every open connection has a request in progress.

The request body has its own deadline (``body_timeout``, enforced by the app while it reads the
body: 408). The app marks a connection's request as started when it is called (its headers are
complete) and as ended when it returns; it finds its connection by the client address uvicorn
puts in the ASGI scope.

``serve`` runs the gateway's app and, with ``admin_port``, the admin app (``/metrics``,
``/health``) on its own listener, in one process and one event loop; before starting it raises the
process's open-file limit to its hard limit, and lowers ``max_connections`` if that limit cannot
hold them beside the upstream connections.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "ConnectionGuard",
    "guarded_protocol",
    "raise_open_file_limit",
    "run_servers",
    "uvicorn_config",
]

log = logging.getLogger("kvroute.gateway")

_IDLE, _HEADERS, _ACTIVE = 0, 1, 2
#: A request's line and headers larger than this are answered 431 (h11 has its own limit;
#: httptools has none).
MAX_HEADER_BYTES = 64 * 1024
_TOO_LARGE_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
    b"content-length: 26\r\nconnection: close\r\n\r\nrequest headers too large\n"
)
_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 40\r\n"
    b"connection: close\r\n\r\nrequest headers not received in time\r\n\r\n"
)


class _Connection:
    """The guard's view of one client connection."""

    __slots__ = ("header_bytes", "key", "owner", "since", "state", "tail", "timer", "transport")

    def __init__(self, owner: int, transport: Any) -> None:
        self.owner = owner
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.key = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.state = _IDLE
        self.since = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None
        self.header_bytes = 0  # of the request being received, until its blank line
        self.tail = b""  # the last bytes seen, for a blank line split across reads

    def arm(self, seconds: float, fired: Callable[[], None]) -> None:
        self.disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds, fired)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class ConnectionGuard:
    """Deadlines and a cap on client connections (see the module docs)."""

    def __init__(
        self, *, header_timeout: float, keep_alive_timeout: float, max_connections: int
    ) -> None:
        self.header_timeout = header_timeout
        self.keep_alive_timeout = keep_alive_timeout
        self.max_connections = max_connections
        self.open: dict[int, _Connection] = {}  # id(protocol) -> connection, in opening order
        self.by_peer: dict[tuple[Any, ...], _Connection] = {}
        self.timed_out = 0
        self.evicted = 0
        self.refused = 0

    # ---- called by the protocol wrapper ------------------------------------------------------

    def opened(self, owner: int, transport: Any) -> bool:
        """A new connection; False when it is refused (closed at once)."""
        if len(self.open) >= self.max_connections and not self._evict_one():
            self.refused += 1
            transport.abort()
            return False
        conn = _Connection(owner, transport)
        self.open[owner] = conn
        if conn.key is not None:
            self.by_peer[conn.key] = conn
        conn.arm(self.header_timeout, lambda: self._expired(owner))
        conn.state = _HEADERS
        return True

    def received(self, owner: int, data: bytes) -> bool:
        """Bytes arrived; False when the connection was closed for oversized headers."""
        conn = self.open.get(owner)
        if conn is None:
            return True
        if conn.state == _IDLE:
            conn.state = _HEADERS
            conn.since = time.monotonic()
            conn.header_bytes = 0
            conn.tail = b""
            conn.arm(self.header_timeout, lambda: self._expired(owner))
        if conn.state != _HEADERS or conn.header_bytes < 0:
            return True
        if data.find(b"\r\n\r\n") >= 0 or (
            conn.tail and (conn.tail + data[:3]).find(b"\r\n\r\n") >= 0
        ):
            conn.header_bytes = -1  # complete: the app is called next
            return True
        conn.header_bytes += len(data)
        conn.tail = data[-3:]
        if conn.header_bytes <= MAX_HEADER_BYTES:
            return True
        log.info("closing a client connection: request headers over %d bytes", MAX_HEADER_BYTES)
        conn.transport.write(_TOO_LARGE_431)
        conn.transport.close()
        self.closed(owner)
        return False

    def closed(self, owner: int) -> None:
        conn = self.open.pop(owner, None)
        if conn is not None:
            conn.disarm()
            if conn.key is not None and self.by_peer.get(conn.key) is conn:
                del self.by_peer[conn.key]

    # ---- called by the app -------------------------------------------------------------------

    def request_started(self, client: Any) -> None:
        conn = self._by_client(client)
        if conn is not None:
            conn.state = _ACTIVE
            conn.disarm()

    def request_ended(self, client: Any) -> None:
        """The response was sent: the connection is idle (uvicorn's own keep-alive timer, set to
        ``keep_alive_timeout``, closes it if no request follows)."""
        conn = self._by_client(client)
        if conn is not None and conn.state == _ACTIVE:
            conn.state = _IDLE
            conn.since = time.monotonic()

    # ---- internals ---------------------------------------------------------------------------

    def _by_client(self, client: Any) -> _Connection | None:
        if not client:
            return None
        return self.by_peer.get(tuple(client[:2]))

    def _expired(self, owner: int) -> None:
        conn = self.open.get(owner)
        if conn is None or conn.state == _ACTIVE:
            return
        if conn.state == _HEADERS:
            self.timed_out += 1
            log.info("closing a client connection: no complete request headers in time")
            if not conn.transport.is_closing():
                conn.transport.write(_TIMEOUT_408)
        conn.transport.close()
        self.closed(owner)

    def _evict_one(self) -> bool:
        """Closes the connection waiting longest without a request in progress."""
        waiting = [(c.since, o) for o, c in self.open.items() if c.state != _ACTIVE]
        if not waiting:
            return False
        _, owner = min(waiting)
        conn = self.open[owner]
        self.evicted += 1
        conn.transport.abort()
        self.closed(owner)
        return True


class _Coalescing:
    """The transport as uvicorn's protocol sees it: the writes of one turn of the event loop (a
    response's head and body, an SSE batch) leave in one ``write`` — one system call and one
    TCP segment instead of two."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._pending: list[bytes] | None = None
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        pending = sum(map(len, self._pending)) if self._pending else 0
        return self._transport.get_write_buffer_size() + pending

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(base: type, guard: ConnectionGuard) -> type:
    """A uvicorn HTTP protocol class: ``base`` (uvicorn's own) under ``guard``."""

    class Guarded(asyncio.Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = base(*args, **kwargs)
            self.live = False

        def connection_made(self, transport: Any) -> None:
            self.live = guard.opened(id(self), transport)
            if self.live:
                self.inner.connection_made(_Coalescing(transport))

        def data_received(self, data: bytes) -> None:
            if self.live and guard.received(id(self), data):
                self.inner.data_received(data)

        def eof_received(self) -> bool | None:
            return self.inner.eof_received() if self.live else None

        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(id(self))
            if self.live:
                self.live = False
                self.inner.connection_lost(exc)

        def pause_writing(self) -> None:
            if self.live:
                self.inner.pause_writing()

        def resume_writing(self) -> None:
            if self.live:
                self.inner.resume_writing()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def raise_open_file_limit() -> int:
    """Raises the soft open-file limit to the hard limit; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def uvicorn_config(app: Any, guard: ConnectionGuard | None, **options: Any) -> Any:
    """A ``uvicorn.Config`` for one of the gateway's ASGI apps (``guard``: its connections'
    deadlines and cap); ``options`` are more ``uvicorn.Config`` arguments."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools if installed, else h11

    if guard is not None:
        options["http"] = guarded_protocol(AutoHTTPProtocol, guard)
        options.setdefault("timeout_keep_alive", guard.keep_alive_timeout)
    options.setdefault("interface", "asgi3")
    # The scope's client address must stay the connection's own: the guard finds connections by
    # it (and a caller's X-Forwarded-For would otherwise rewrite it).
    options["proxy_headers"] = False
    options.setdefault("server_header", False)
    return uvicorn.Config(app, **options)


async def run_servers(configs: list[Any]) -> None:
    """Serves every config in this event loop until the first one exits (a signal), then stops
    the others."""
    import uvicorn

    servers = [uvicorn.Server(c) for c in configs]
    others = [asyncio.ensure_future(s.serve()) for s in servers[1:]]
    try:
        await servers[0].serve()
    finally:
        for s in servers[1:]:
            s.should_exit = True
        await asyncio.gather(*others, return_exceptions=True)
