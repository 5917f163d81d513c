"""The gateway's front door: client connections under deadlines and a cap, HTTP/1.1 parsed and
answered by one lean asyncio protocol per connection, and the admin listener.

``GuardedHTTP`` is the public listener's protocol: httptools parses requests, the gateway's ASGI
app is called with a minimal ``receive``/``send`` pair, and ``ConnectionGuard`` holds every open
connection. uvicorn's server runs it (through uvicorn's documented ``http=`` protocol-class
setting): binding, lifespan, signals and graceful shutdown stay uvicorn's, the per-request work is
this module's. The guard guarantees, per client connection:

- the request line and headers arrive within ``header_timeout`` seconds of the connection's
  opening or of the first byte of the next request on a kept-alive one — also one pipelined
  while a request is in progress —, and are at most ``MAX_HEADER_BYTES`` (counted by the reads
  that carry them; a head that begins inside a read after a body is counted from the next read):
  else the request is answered 408 (431) and the connection closed — after the answers to the
  requests before it, with nothing more read;
- a connection idle between requests is closed after ``keep_alive_timeout``;
- a response write that waits on a client not reading (the socket's send buffer and the
  transport's above its high-water mark) is given ``write_timeout`` seconds for the client to
  take some of it: past that the connection is aborted and the request is the client's going
  away (499; a stream's upstream request cancelled, its slots released), counted in
  ``write_timed_out``;
- at most ``max_connections`` client connections are open: a new one past the cap evicts the
  connection that has waited longest without a request in progress (idle, or still sending
  headers), and is refused (closed) only when every open connection has a request in progress.

The request body has its own deadline (``body_timeout``, enforced by the app while it reads the
body: 408). HTTP as uvicorn's httptools protocol serves it: pipelined requests are answered in order
(the bytes after one that waits for its turn are held unparsed, reading going on so that the
client's going is seen — and cancels the request in progress — up to ``HIGH_WATER`` bytes held; a
head they continue has its deadline anew when they are parsed), a body is buffered up to
``HIGH_WATER`` bytes before reading pauses until the app reads it, ``Expect: 100-continue`` is
answered when the app first reads (an answer given before that closes the connection), ``receive()``
gives ``http.disconnect`` once the client has gone (its EOF counts: a client that only shuts down
its sending side is taken to have given up, as nginx's proxy takes it by default, so its upstream
request is cancelled at once) or the response is complete, invalid HTTP is answered 400 (after the
answers to the requests before it) and closed, HTTP/1.0 and ``connection: close`` close after the
response, a response without ``content-length`` is chunked, one whose body disagrees with its
``content-length`` (or whose app failed after the head) closes the connection, and an app that fails
before answering gets a 500. A response's head leaves with its first body bytes: one write. Response
headers with bytes HTTP forbids (CR, LF, controls) raise instead of being sent.

``serve`` runs the gateway's app and, with ``admin_port``, the admin app (``/metrics``,
``/health``, under uvicorn's own protocol) on its own listener, in one process and one event
loop; before starting it raises the process's open-file limit to its hard limit, and lowers
``max_connections`` if that limit cannot hold them beside the upstream connections.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
import resource
import time
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httptools

from .deadline import LazyDeadline

__all__ = [
    "ConnectionGuard",
    "Cycle",
    "GuardedHTTP",
    "guarded_protocol",
    "raise_open_file_limit",
    "run_servers",
    "uvicorn_config",
]

log = logging.getLogger("kvroute.gateway")

_IDLE, _HEADERS, _ACTIVE = 0, 1, 2  # ConnectionGuard's connection states
_BETWEEN, _HEAD, _BODY = 0, 1, 2  # where the parser is in the client's byte stream
#: A request's line and headers larger than this are answered 431 (httptools has no limit).
MAX_HEADER_BYTES = 64 * 1024
#: Request body bytes buffered before reading from the client pauses until the app reads them.
HIGH_WATER = 64 * 1024
_TOO_LARGE_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
    b"content-length: 26\r\nconnection: close\r\n\r\nrequest headers too large\n"
)
_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 40\r\n"
    b"connection: close\r\n\r\nrequest headers not received in time\r\n\r\n"
)
_INVALID_400 = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 29\r\nconnection: close\r\n\r\nInvalid HTTP request received."
)
_ERROR_500 = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
    (b"connection", b"close"),
]
_HEADER_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_HEADER_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_DISCONNECT = {"type": "http.disconnect"}


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}


class _Connection:
    """The guard's view of one client connection."""

    __slots__ = ("head", "headers", "idle", "late", "since", "state", "transport")

    def __init__(self, transport: Any, owner: int, expired: Any) -> None:
        loop = asyncio.get_running_loop()
        self.transport = transport
        self.state = _IDLE
        self.head = False  # a request's head is being read (its deadline runs)
        # Called with the 408 when the head's deadline passes while a request is in progress.
        self.late: Callable[[bytes], None] | None = None
        self.since = time.monotonic()
        self.headers = LazyDeadline(loop, expired, owner)  # of the request's line and headers
        self.idle = LazyDeadline(loop, expired, owner)  # of a kept-alive connection's next request


class ConnectionGuard:
    """Deadlines and a cap on client connections (see the module docs)."""

    def __init__(
        self,
        *,
        header_timeout: float,
        keep_alive_timeout: float,
        write_timeout: float,
        max_connections: int,
    ) -> None:
        self.header_timeout = header_timeout
        self.keep_alive_timeout = keep_alive_timeout
        self.write_timeout = write_timeout
        self.max_connections = max_connections
        self.open: dict[int, _Connection] = {}  # id(protocol) -> connection, in opening order
        self.timed_out = 0
        self.write_timed_out = 0
        self.evicted = 0
        self.refused = 0

    # ---- called by the protocol --------------------------------------------------------------

    def opened(self, owner: int, transport: Any) -> _Connection | None:
        """A new connection (its headers' deadline starts now); None when it is refused (closed
        at once)."""
        if len(self.open) >= self.max_connections and not self._evict_one():
            self.refused += 1
            transport.abort()
            return None
        conn = self.open[owner] = _Connection(transport, owner, self._expired)
        conn.state = _HEADERS
        conn.head = True
        conn.headers.set(self.header_timeout)
        return conn

    def headers_begun(self, conn: _Connection) -> None:
        """The first byte of a request's head (on an idle connection, or pipelined behind a
        request in progress): its deadline starts."""
        conn.head = True
        if conn.state == _IDLE:
            conn.state = _HEADERS
            conn.since = time.monotonic()
            conn.idle.clear()
        conn.headers.set(self.header_timeout)

    @staticmethod
    def request_started(conn: _Connection) -> None:
        """The request's headers are complete: no deadline while it is served."""
        conn.state = _ACTIVE
        conn.head = False
        conn.headers.clear()

    @staticmethod
    def head_set_aside(conn: _Connection) -> None:
        """The head being read is refused (answered once the requests before it are), or waits
        unparsed for its turn (``headers_begun`` again when it is parsed): no deadline now."""
        conn.head = False
        conn.headers.clear()

    def request_ended(self, conn: _Connection) -> None:
        """The response was sent: the connection is idle until ``keep_alive_timeout``, or
        reading a head whose deadline already runs."""
        conn.since = time.monotonic()
        if conn.head:
            conn.state = _HEADERS
            return
        conn.state = _IDLE
        conn.idle.set(self.keep_alive_timeout)

    def closed(self, owner: int) -> None:
        conn = self.open.pop(owner, None)
        if conn is not None:
            conn.headers.cancel()
            conn.idle.cancel()

    # ---- internals ---------------------------------------------------------------------------

    def _expired(self, owner: int) -> None:
        conn = self.open.get(owner)
        if conn is None:
            return
        if conn.state == _ACTIVE:  # a pipelined head late: refused after the answers before it
            if conn.head and conn.late is not None:
                self.timed_out += 1
                log.info("closing a client connection: no complete request headers in time")
                conn.late(_TIMEOUT_408)
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


class Cycle:
    """One request and its response on a connection: the ASGI ``receive`` and ``send``, and the
    listener's ASGI extension (``scope["extensions"]["kvroute"]`` is the cycle): ``respond``
    sends a whole response in one call, ``watch`` registers a callback for the client's
    disconnection — so an app needs no task waiting on ``receive`` to learn of it —,
    ``take_body`` gives a body that has arrived whole without awaiting, and ``task`` is the task
    the app runs in."""

    __slots__ = (
        "body",
        "chunked",
        "complete",
        "continue_100",
        "delivered",
        "gone",
        "head",
        "keep_alive",
        "more_body",
        "on_gone",
        "proto",
        "remaining",
        "scope",
        "started",
        "task",
        "waiter",
    )

    def __init__(self, proto: GuardedHTTP, scope: dict[str, Any], keep_alive: bool) -> None:
        self.proto = proto
        self.scope = scope
        self.keep_alive = keep_alive
        self.continue_100 = False
        self.body = bytearray()
        self.more_body = True
        self.delivered = False  # the last http.request message was received by the app
        self.gone = False  # the client disconnected before the response was complete
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.complete = False
        self.head = b""  # the response's head, written with its first body bytes
        self.chunked = False
        self.remaining = -1  # body bytes the content-length still promises (-1: none given)
        self.on_gone: Callable[[], None] | None = None
        self.task: asyncio.Task[None] | None = None  # the task running the app for this request

    # ---- the kvroute extension ---------------------------------------------------------------

    def take_body(self) -> bytes | None:
        """The request's whole body, when all of it has arrived and ``receive`` would return it
        in one message now (the client still there, no ``100 Continue`` owed): taken as
        ``receive`` takes it, without awaiting; else None (read it with ``receive``)."""
        if self.more_body or self.delivered or self.gone or self.complete or self.continue_100:
            return None
        body = bytes(self.body)
        self.body.clear()
        self.delivered = True
        self.proto.resume_reading()
        return body

    def watch(self, callback: Callable[[], None] | None) -> None:
        """``callback`` is called (once, from the event loop) if the client disconnects before
        the response is complete — at once if it has already; None unregisters it."""
        self.on_gone = callback
        if callback is not None and self.gone:
            self.proto.loop.call_soon(self.disconnected)

    def disconnected(self) -> None:
        self.gone = True
        self.wake()
        callback, self.on_gone = self.on_gone, None
        if callback is not None:
            callback()

    def respond(self, status: int, headers: Any, body: bytes) -> None:
        """The whole response (status, ASGI headers, body) at once: as ``send`` of its start
        and of its one body message (written even if the client reads slowly: it is whole)."""
        if self.gone:
            return
        if self.started:
            raise RuntimeError("respond() after the response started")
        self.head = self._head(status, headers)
        self.started = True
        self.continue_100 = False
        self._body(body, False)

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def run(self, app: Any) -> None:
        proto = self.proto
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as e:
            log.error("exception in the gateway's ASGI app", exc_info=e)
            if not self.started and not self.gone:
                await self._error_500()
            elif not self.complete:
                proto.transport.close()
            if not isinstance(e, Exception):
                raise
        else:
            if not self.started and not self.gone:
                log.error("the ASGI app returned without starting a response")
                await self._error_500()
            elif not self.complete and not self.gone:
                log.error("the ASGI app returned without completing its response")
                proto.transport.close()

    async def _error_500(self) -> None:
        await self.send({"type": "http.response.start", "status": 500, "headers": _ERROR_500})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def receive(self) -> dict[str, Any]:
        proto = self.proto
        if self.continue_100:
            self.continue_100 = False
            if not proto.transport.is_closing():
                proto.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while True:
            if self.gone or self.complete:
                return _DISCONNECT
            if self.body or (not self.more_body and not self.delivered):
                body = bytes(self.body)
                self.body.clear()
                if not self.more_body:
                    self.delivered = True
                proto.resume_reading()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            proto.resume_reading()
            waiter = self.waiter = proto.loop.create_future()
            try:
                await waiter
            finally:
                self.waiter = None

    async def send(self, message: dict[str, Any]) -> None:
        proto = self.proto
        if proto.write_paused and not self.gone:
            await proto.drain()
        if self.gone:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {kind!r}")
            self.head = self._head(message["status"], message.get("headers", ()))
            self.started = True  # only now: a head refused above still gets the 500
            self.continue_100 = False
            return
        if self.complete:
            raise RuntimeError(f"{kind!r} sent after the response was complete")
        if kind != "http.response.body":
            raise RuntimeError(f"expected http.response.body, got {kind!r}")
        self._body(message.get("body", b""), message.get("more_body", False))

    def _body(self, body: bytes, more: bool) -> None:
        proto = self.proto
        if self.scope["method"] == "HEAD":
            body = b""
            self.remaining = 0
        elif self.chunked:
            body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (
                b"" if more else b"0\r\n\r\n"
            )
        elif self.remaining >= 0:
            self.remaining -= len(body)
            if self.remaining < 0:
                raise RuntimeError("response body longer than its content-length")
        if self.head:
            body = self.head + body
            self.head = b""
        if body:
            proto.transport.write(body)
        if not more:
            if self.remaining > 0:
                raise RuntimeError("response body shorter than its content-length")
            self.complete = True
            self.wake()
            if not self.keep_alive:
                proto.transport.close()
            proto.response_complete()

    def _head(self, status: int, headers: Any) -> bytes:
        """The response's head; sets its framing (nothing when it raises)."""
        line = _STATUS_LINE.get(status) or _status_line(status)
        parts = [line]
        for name, value in self.proto.server_state.default_headers:  # uvicorn's date header
            parts += (name, b": ", value, b"\r\n")
        keep_alive, closing, chunked, remaining = self.keep_alive, False, False, -1
        if self.continue_100 and self.more_body:
            # Answered before the body a client waits to send was asked for: whether it sends the
            # body next is its choice, so no later byte can be read as the next request's.
            keep_alive = False
        for name, value in headers:
            if _HEADER_NAME.search(name) or _HEADER_VALUE.search(value):
                raise RuntimeError(f"invalid response header {name!r}")
            name = name.lower()
            if name == b"content-length":
                if remaining < 0 and not chunked:
                    remaining = int(value)
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                chunked = True
                remaining = -1
            elif name == b"connection" and b"close" in value.lower():
                keep_alive = False
                closing = True
            parts += (name, b": ", value, b"\r\n")
        if not keep_alive and not closing:
            parts.append(b"connection: close\r\n")
        if (
            remaining < 0
            and not chunked
            and self.scope["method"] != "HEAD"
            and status not in (204, 304)
        ):
            chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        self.keep_alive, self.chunked, self.remaining = keep_alive, chunked, remaining
        return b"".join(parts)


class GuardedHTTP(asyncio.Protocol):
    """One client connection of the public listener (see the module docs); ``guard`` is set on
    the subclass ``guarded_protocol`` makes."""

    guard: ConnectionGuard

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any] | None = None,
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.root_path = config.root_path
        self.loop = _loop or asyncio.get_running_loop()
        self.server_state = server_state
        self.app_state = app_state if app_state is not None else {}
        self.parser = httptools.HttpRequestParser(self)
        try:  # answer the first of pipelined requests sent with connection: close
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # pragma: no cover - httptools < 0.6.3
            pass
        self.transport: Any = None
        self.conn: _Connection | None = None  # None: refused, or closed
        self.owner = id(self)
        self.server: Any = None
        self.client: Any = None
        self.scheme = "http"
        self.cycle: Cycle | None = None  # the request being received
        self.serving: Cycle | None = None  # the request being answered
        self.pipeline: deque[Cycle] = deque()
        # Bytes after a pipelined request, held unparsed until it is served (reading goes on, so
        # that the client's going is seen, up to HIGH_WATER bytes held).
        self.held: list[bytes] = []
        self.held_bytes = 0
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0  # of the head being read (see the module docs)
        self.parsing = _BETWEEN
        self.refusal: bytes | None = None  # the answer to a refused pipelined head
        self.continue_100 = False
        self.upgraded = False
        self.read_paused = False
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self.transport = transport
        self.conn = self.guard.opened(self.owner, transport)
        if self.conn is None:
            return
        self.conn.late = self._refuse
        self.server_state.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        local = transport.get_extra_info("sockname")
        self.server = (str(local[0]), int(local[1])) if isinstance(local, tuple) else None
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is None or self.upgraded or self.refusal is not None:
            return
        if self.pipeline:  # a request waits for its turn: what follows it waits too, unparsed
            if conn.head:  # a head begun before: its deadline restarts when it is parsed
                self.guard.head_set_aside(conn)
            self.held.append(data)
            self.held_bytes += len(data)
            if self.held_bytes > HIGH_WATER:
                self.pause_reading()
            return
        if self.parsing != _BODY:  # these bytes begin or continue a request's head
            self.header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol switch here: the request is served as HTTP, then the connection
            # closes (whatever follows its head is not HTTP/1.1).
            self.upgraded = True
            if self.cycle is not None:
                self.cycle.keep_alive = False
            return
        except httptools.HttpParserError:
            log.info("closing a client connection: invalid HTTP request")
            broken = self.cycle if self.parsing == _BODY else None  # a request's body broke
            if broken is not None and broken is self.serving:  # the 400 is its answer
                if not broken.started:
                    self.transport.write(_INVALID_400)
                self.transport.close()
                self._closed()
                return
            if broken is not None and broken in self.pipeline:  # never to be served
                self.pipeline.remove(broken)
            self._refuse(_INVALID_400)  # after the answers to the requests before it
            return
        conn = self.conn
        if conn is None or self.refusal is not None or self.parsing == _BODY:
            return
        if self.header_bytes > MAX_HEADER_BYTES:
            log.info("closing a client connection: request headers over %d bytes", MAX_HEADER_BYTES)
            self._refuse(_TOO_LARGE_431)

    def eof_received(self) -> None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()
        for cycle in (self.serving, *self.pipeline, self.cycle):
            if cycle is not None and not cycle.complete and not cycle.gone:
                cycle.disconnected()
        self.pipeline.clear()
        self.held.clear()
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        if exc is None:
            self.transport.close()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    # ---- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.parsing = _HEAD
        conn = self.conn
        if conn is not None and not conn.head:  # the first byte of a request: its deadline
            self.guard.headers_begun(conn)
        self.url = b""
        self.headers = []
        self.continue_100 = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.continue_100 = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.parsing = _BODY
        conn = self.conn
        if conn is not None:
            self.guard.request_started(conn)
        self.header_bytes = 0
        parser = self.parser
        version = parser.get_http_version()
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "method": parser.get_method().decode("ascii"),
            "root_path": self.root_path,
            "path": self.root_path + path,
            "raw_path": self.root_path.encode("ascii") + raw_path,
            "query_string": url.query or b"",
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        keep_alive = version != "1.0" and parser.should_keep_alive()
        cycle = self.cycle = Cycle(self, scope, keep_alive)
        scope["extensions"] = {"kvroute": cycle}
        cycle.continue_100 = self.continue_100
        if self.serving is None:
            self._serve(cycle)
        else:  # pipelined: answered after the one in progress (what follows waits unparsed)
            self.pipeline.append(cycle)

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.complete or cycle.gone:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        self.parsing = _BETWEEN
        cycle = self.cycle
        if cycle is None or cycle.complete:
            return
        cycle.more_body = False
        cycle.wake()

    # ---- serving -----------------------------------------------------------------------------

    def _serve(self, cycle: Cycle) -> None:
        self.serving = cycle
        tasks = self.server_state.tasks
        task = cycle.task = self.loop.create_task(cycle.run(self.app))
        task.add_done_callback(tasks.discard)
        tasks.add(task)

    def response_complete(self) -> None:
        """The response in progress was sent in full: the next pipelined request, or idle."""
        self.server_state.total_requests += 1
        self.serving = None
        if self.transport.is_closing():
            return
        if self.pipeline:
            self._serve(self.pipeline.popleft())
            held, self.held, self.held_bytes = self.held, [], 0
            self.resume_reading()
            if held:
                if self.parsing == _HEAD and self.conn is not None:
                    self.guard.headers_begun(self.conn)  # the head set aside: read on, in time
                self.data_received(b"".join(held))
        elif self.refusal is not None:
            self.transport.write(self.refusal)
            self.transport.close()
            self._closed()
        else:
            self.resume_reading()
            if self.conn is not None:
                self.guard.request_ended(self.conn)

    def _refuse(self, answer: bytes) -> None:
        """The head being read broke the header deadline or size cap: ``answer`` (408, 431) and
        the close — now, or after the answers to the requests before it (nothing more read)."""
        conn = self.conn
        if conn is None or self.refusal is not None:
            return
        if self.serving is None:
            if not self.transport.is_closing():
                self.transport.write(answer)
            self.transport.close()
            self._closed()
            return
        self.refusal = answer
        self.guard.head_set_aside(conn)

    def _closed(self) -> None:
        if self.conn is not None:
            self.conn = None
            self.guard.closed(self.owner)
            self.server_state.connections.discard(self)

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close now if idle, else after the response."""
        serving = self.serving
        if serving is None or serving.complete:
            self.transport.close()
        else:
            serving.keep_alive = False

    # ---- flow control ------------------------------------------------------------------------

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    async def drain(self) -> None:
        """Until the client has taken enough of what is written (or is gone); a client that
        takes nothing for ``write_timeout`` seconds has its connection aborted."""
        if self.drained is None or self.drained.done():
            self.drained = self.loop.create_future()
        drained = self.drained
        timer = self.loop.call_later(self.guard.write_timeout, self._write_stalled, drained)
        try:
            await drained
        finally:
            timer.cancel()

    def _write_stalled(self, drained: asyncio.Future[None]) -> None:
        if drained.done() or self.transport is None or self.transport.is_closing():
            return
        self.guard.write_timed_out += 1
        log.info(
            "closing a client connection: it read nothing of the response for %g s",
            self.guard.write_timeout,
        )
        # connection_lost follows: the requests on it are the client's going (499), and
        # the drain wakes up.
        self.transport.abort()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedHTTP]:
    """The public listener's protocol class, its connections under ``guard``."""
    return type("GuardedHTTP", (GuardedHTTP,), {"guard": guard})


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

    if guard is not None:
        options["http"] = guarded_protocol(guard)
        options.setdefault("timeout_keep_alive", guard.keep_alive_timeout)
    options.setdefault("interface", "asgi3")
    # The scope's client address stays the connection's own: a caller's X-Forwarded-For must
    # not rewrite it.
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
