"""A lean HTTP/1.1 client for the gateway's upstream calls.

Keep-alive connections are asyncio protocols whose responses httptools parses (the parser
uvicorn uses); a request is one write (head and body together), a response's body arrives as the
chunks the parser hands over (chunked encoding decoded), with no per-request task, stream object
or lock. What a general-purpose client adds per request — URL merging, cookies, redirects, auth
flows, an anyio layer — a proxy does not want.

Guarantees:

- ``Pool.request`` raises ``ConnectFailed`` (refused, unreachable), ``ConnectTimeout``,
  ``PoolTimeout`` (no connection free within ``pool_timeout``), ``WriteTimeout`` (the request
  not taken by the upstream's socket within ``write_timeout``), ``ReadTimeout`` (no byte for
  ``read_timeout`` seconds while a response is awaited or read), ``ConnectionLost`` (closed or
  reset before the response was complete) or ``ProtocolError`` (not HTTP/1.1); all are
  ``UpstreamError``; the first three (``NOT_SENT``) only before a connection was had, so no
  byte of the request left. A connection is reused only after a response was read to its end
  and the server did not ask to close it; an idle connection older than ``keepalive`` seconds,
  or one the server closed (or is closing), is never used.
- A request sent on a reused connection that is lost before any byte of the response arrived is
  sent once more, on a new connection: a server may close a keep-alive connection just as a
  request goes out on it — the keep-alive timeout's race, or uvicorn closing the socket after
  the complete 500 it answered an application's exception with (no ``connection: close``), whose
  close the pool cannot have seen yet. Such a server did not answer; it may have read the
  request (a server that crashes on reading it fails the same way): the same request sent again
  is at worst computed twice, which completions, having no side effects, allow.
- Interim answers (1xx: ``100 Continue``, ``103 Early Hints``) are read and dropped, headers
  and all: ``status_code`` is the final answer's (a ``101`` switch is a ``ProtocolError``).
- Backpressure: a response whose body is not being consumed stops reading from its socket past
  ``HIGH_WATER`` buffered bytes.
- ``Response.aclose()`` returns the connection to its pool when the body was read to the end and
  closes it otherwise (a request cancelled mid-response never leaves a half-read connection).
"""

from __future__ import annotations

import asyncio
import collections
import ssl as _ssl
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httptools

from .deadline import LazyDeadline

__all__ = [
    "NOT_SENT",
    "BodyTooLarge",
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionLost",
    "Pool",
    "PoolTimeout",
    "ProtocolError",
    "ReadTimeout",
    "Response",
    "UpstreamError",
    "WriteTimeout",
]

HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """A failure talking to an upstream."""


class ConnectFailed(UpstreamError):
    """The connection was refused or the host unreachable."""


class ConnectTimeout(UpstreamError):
    """No connection within ``connect_timeout``."""


class PoolTimeout(UpstreamError):
    """No free connection to the upstream within ``pool_timeout``."""


class WriteTimeout(UpstreamError):
    """The upstream did not take the request within ``write_timeout``."""


class ReadTimeout(UpstreamError):
    """No byte from the upstream for ``read_timeout`` seconds."""


class ConnectionLost(UpstreamError):
    """The connection closed or was reset before the response was complete."""


class ProtocolError(UpstreamError):
    """The upstream's answer is not valid HTTP/1.1."""


#: Raised only before a connection was had: not one byte of the request was sent.
NOT_SENT = (ConnectFailed, ConnectTimeout, PoolTimeout)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.requests = 0  # sent on it: a reused connection has sent one before
        self.response: Response | None = None
        self._name = b""
        # Of the next byte, when one is awaited: one lazy timer per connection, so arming it
        # for every chunk and request makes and cancels no timer.
        self._read = LazyDeadline(self.loop, _Connection._read_expired, self)
        self._paused = False
        self._interim = False  # parsing a 1xx answer, which the final one follows

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is unusable
            self._fail(ProtocolError("unsolicited bytes from the upstream"))
            return
        self.response.answered = True
        self._arm()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("the upstream switched protocols"))
        except httptools.HttpParserError as e:
            self._fail(ProtocolError(f"invalid HTTP from the upstream: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._read.cancel()
        if self.response is not None and not self.response.complete:
            reason = f": {exc}" if exc else ""
            self.response._failed(ConnectionLost(f"the upstream closed the connection{reason}"))
        self.pool._lost(self)

    def pause_writing(self) -> None:  # requests are small: nothing to hold back
        pass

    def resume_writing(self) -> None:
        pass

    # ---- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self.response
        if r is not None:
            r.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self.response
        if r is not None:
            status = self.parser.get_status_code()
            if status < 200:  # an interim answer (100, 103; 101 raises HttpParserUpgrade)
                self._interim = True
                r.headers.clear()
                return
            r.status_code = status
            r.keep_alive = self.parser.should_keep_alive()
            if not r.head.done():
                r.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        r = self.response
        if r is not None:
            r._chunk(body)

    def on_message_complete(self) -> None:
        if self._interim:  # the final answer follows on this connection
            self._interim = False
            return
        r = self.response
        if r is not None:
            self._disarm()
            r._complete()

    # ---- timers and flow ---------------------------------------------------------------------

    def _arm(self) -> None:
        self._read.set(self.pool.read_timeout)

    def _disarm(self) -> None:
        self._read.clear()

    def _write_check(self, response: Response) -> None:
        if (
            self.response is response
            and self.transport is not None
            and self.transport.get_write_buffer_size() > 0
        ):
            self._fail(
                WriteTimeout(f"the upstream took no request for {self.pool.write_timeout:g} s")
            )

    def _read_expired(self) -> None:
        if self.response is not None and not self.response.complete:
            self._fail(ReadTimeout(f"no byte from the upstream for {self.pool.read_timeout:g} s"))

    def _fail(self, error: UpstreamError) -> None:
        r = self.response
        if r is not None and not r.complete:
            r._failed(error)
        self.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self._disarm()  # no byte can come while paused: not the upstream's delay
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self._arm()
            self.transport.resume_reading()

    def usable(self) -> bool:
        """Open, and not being closed by either side."""
        t = self.transport
        return not self.closed and t is not None and not t.is_closing()

    def close(self) -> None:
        self._read.cancel()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()


class Response:
    """An upstream response: status and headers at once, the body as it arrives."""

    __slots__ = (
        "answered",
        "buffered",
        "chunks",
        "complete",
        "conn",
        "error",
        "head",
        "headers",
        "keep_alive",
        "released",
        "status_code",
        "waiter",
    )

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.head: asyncio.Future[None] = conn.loop.create_future()
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.released = False
        self.answered = False  # a byte of the answer arrived

    # ---- fed by the connection ---------------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _chunk(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER:
            self.conn.pause()
        self._wake()

    def _complete(self) -> None:
        self.complete = True
        self._wake()

    def _failed(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved: awaited by request(), or nobody (then no warning)
        self._wake()

    # ---- read by the caller ------------------------------------------------------------------

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            if self.chunks:
                data = self.chunks.popleft()
                self.buffered -= len(data)
                if self.buffered <= HIGH_WATER // 4:
                    self.conn.resume()
                yield data
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def read_complete(self, limit: int | None = None) -> bytes | None:
        """The whole body when all of it has arrived (``read`` without awaiting), else None;
        ``BodyTooLarge`` past ``limit`` bytes."""
        if not self.complete:
            return None
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        self.conn.resume()
        if limit is not None and len(data) > limit:
            raise BodyTooLarge(f"the reply exceeds {limit} bytes")
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; ``BodyTooLarge`` past ``limit`` bytes."""
        out = []
        size = 0
        async for chunk in self:
            size += len(chunk)
            if limit is not None and size > limit:
                raise BodyTooLarge(f"the reply exceeds {limit} bytes")
            out.append(chunk)
        return b"".join(out)

    async def aclose(self) -> None:
        """Returns the connection to its pool (body read to the end) or closes it."""
        self.close()

    def close(self) -> None:
        """``aclose`` without awaiting (it never waits)."""
        if self.released:
            return
        self.released = True
        conn = self.conn
        conn.response = None
        if self.complete and self.error is None and self.keep_alive and conn.usable():
            conn.pool._release(conn)
        else:
            conn.close()
            conn.pool._release(None)


class BodyTooLarge(Exception):
    """A response body past the caller's limit."""


class Pool:
    """Keep-alive connections to one upstream (``base`` URL), at most ``max_connections``."""

    def __init__(
        self,
        base: str,
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
        write_timeout: float,
        pool_timeout: float,
        keepalive: float,
        ssl: Any = None,
        headers: list[tuple[str, str]] = (),  # type: ignore[assignment]
    ) -> None:
        parts = urlsplit(base)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl = (ssl or _ssl.create_default_context()) if parts.scheme == "https" else None
        self.authority = parts.netloc
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.pool_timeout = pool_timeout
        self.keepalive = keepalive
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in headers)
        self.loop = asyncio.get_running_loop()
        self.idle: collections.deque[_Connection] = collections.deque()
        self.total = 0  # connections open or opening
        self.waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self.closed = False

    # ---- connections -------------------------------------------------------------------------

    def _release(self, conn: _Connection | None) -> None:
        """A connection is free again (or, None, one was closed)."""
        if conn is None:
            self.total -= 1
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                if conn is None:
                    self.total += 1  # the waiter opens a new one
                w.set_result(conn)
                return
        if conn is not None:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)

    def _lost(self, conn: _Connection) -> None:
        if conn.response is None and conn in self.idle:  # an idle connection the server closed
            self.idle.remove(conn)
            self._release(None)

    async def _open(self) -> _Connection:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Connection(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                ),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            self._release(None)
            raise ConnectTimeout(
                f"no connection to {self.authority} within {self.connect_timeout:g} s"
            ) from None
        except OSError as e:
            self._release(None)
            raise ConnectFailed(f"cannot connect to {self.authority}: {e}") from None
        except BaseException:
            self._release(None)
            raise
        return conn

    def _idle(self) -> _Connection | None:
        """An idle connection fit for reuse, if any (the unfit ones met are closed)."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # the most recently used: the least likely to be closed
            if conn.usable() and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
            self.total -= 1
        return None

    async def _acquire(self, fresh: bool = False) -> _Connection:
        """A new connection, or one another request hands over, when none is idle (``fresh``:
        never one that was used; one handed over is closed and its place taken by a new one)."""
        if self.total < self.max_connections:
            self.total += 1
            return await self._open()
        waiter: asyncio.Future[_Connection | None] = self.loop.create_future()
        self.waiters.append(waiter)
        try:
            conn = await asyncio.wait_for(waiter, self.pool_timeout)
        except asyncio.TimeoutError:
            raise PoolTimeout(
                f"no free connection to {self.authority} within {self.pool_timeout:g} s"
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # what was handed over: passed on
            raise
        if conn is None or fresh or not conn.usable():
            if conn is not None:
                conn.close()  # its place in the pool is this request's
            return await self._open()
        return conn

    # ---- requests ----------------------------------------------------------------------------

    async def request(
        self, method: str, path: str, headers: str = "", body: bytes = b""
    ) -> Response:
        """Sends one request; returns once the response's status and headers arrived (sent
        again on a new connection if a reused one was lost before any byte of the answer).
        ``headers`` is preformatted (``"name: value\\r\\n"`` lines)."""
        conn = self._idle() or await self._acquire()  # an idle one: no coroutine to await
        head = (
            f"{method} {self.prefix}{path} HTTP/1.1\r\nhost: {self.authority}\r\n{self.fixed}"
            f"{headers}content-length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        if conn.requests:
            response = await self._send(conn, head, body, again=True)
            if response is not None:
                return response
            try:
                conn = await self._acquire(fresh=True)
            except NOT_SENT as e:  # the request did leave, on the lost connection
                raise ConnectionLost(
                    f"the upstream closed the connection, and a new one failed: {e}"
                ) from None
        response = await self._send(conn, head, body, again=False)
        assert response is not None
        return response

    async def _send(
        self, conn: _Connection, head: bytes, body: bytes, again: bool
    ) -> Response | None:
        """One request on ``conn``: its response once the head arrived; None (``again``) when
        the connection was lost before any byte of the answer."""
        conn.requests += 1
        response = conn.response = Response(conn)
        try:
            if conn.closed or conn.transport is None:
                raise ConnectionLost("the upstream closed the connection")
            conn._arm()
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)
            if conn.transport.get_write_buffer_size():  # the upstream is slow to take it
                self.loop.call_later(self.write_timeout, conn._write_check, response)
            await response.head
        except ConnectionLost:
            await response.aclose()
            if again and not response.answered:
                return None
            raise
        except BaseException:
            await response.aclose()
            raise
        return response

    async def get(self, path: str) -> int:
        """The status of ``GET path`` (the body is read and dropped)."""
        return (await self.fetch(path))[0]

    async def fetch(self, path: str, limit: int = 1 << 20) -> tuple[int, bytes]:
        """The status and body of ``GET path`` (a body over ``limit`` bytes raises)."""
        response = await self.request("GET", path)
        try:
            body = await response.read(limit)
        finally:
            await response.aclose()
        return response.status_code, body

    async def aclose(self) -> None:
        self.closed = True
        while self.idle:
            self.idle.pop().close()
        for w in self.waiters:
            if not w.done():
                w.cancel()
