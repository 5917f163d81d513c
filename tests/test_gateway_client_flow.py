"""The upstream client's pool (``kvroute.gateway.client``) on the wire and over a connection's
life, in the test's own event loop: the bytes a request goes out as at every body size, the
answers read however their bytes arrive (1xx interim answers, a 101 switch), a read timer that
outlives its answer, a pooled connection the upstream drops, and a connection handed to a waiter.
``test_gateway_client_pool.py`` holds the failures' types and messages and the pool's accounting.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
from kvroute.gateway import client
from kvroute.gateway.client import ProtocolError, Response, _Connection
from support.client_stubs import (
    OK,
    FlowTransport,
    StubTransport,
    catch_callback_errors,
    pool,
    raw_server,
)


@pytest.mark.parametrize("size", [0, 1, 65535, 65536, 65537, 3 * 65536])
def test_a_body_of_any_size_goes_out_once_after_its_head(size):
    """A request's bytes on the wire are its head then its body, each once, whatever the body's
    size — below 64 KiB the two go in one write, from 64 KiB on in two: on both sides of that
    boundary and at it — and the connection then carries the next request (nothing left over
    to be read as one)."""

    async def main():
        heads: list[bytes] = []

        async def ok(n, writer):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

        server, port = await raw_server(ok, heads=heads)
        p = pool(f"http://127.0.0.1:{port}", max_connections=1, read_timeout=10.0)
        body = bytes(i % 251 for i in range(size))
        conns = []
        for path in ("/a", "/b"):
            r = await p.request("POST", path, "", body)
            assert (r.status_code, await r.read()) == (200, b"ok")
            conns.append(r.conn)
            await r.aclose()
        assert conns[0] is conns[1]  # one connection carried both
        head = "POST {} HTTP/1.1\r\nhost: 127.0.0.1:{}\r\ncontent-length: {}\r\n\r\n"
        assert heads == [head.format(path, port, size).encode() + body for path in ("/a", "/b")]
        assert p.total == 1 and list(p.idle) == [conns[0]]
        await p.aclose()
        server.close()

    asyncio.run(main())


FINAL = b"HTTP/1.1 %d Final\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"
INTERIMS = {
    "none": b"",
    "100": b"HTTP/1.1 100 Continue\r\n\r\n",
    "103": b"HTTP/1.1 103 Early Hints\r\nlink: </s.css>; rel=preload\r\n\r\n",
    "100 and 103": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: <s>\r\n\r\n",
}


@pytest.mark.parametrize("status", [200, 201, 503])
@pytest.mark.parametrize("interim", list(INTERIMS))
def test_interim_answers_are_dropped_whole_however_the_bytes_arrive(interim, status):
    """RFC 9110 15.2: 1xx answers before the final one are read and dropped, headers and all.
    Fed one byte at a time, a response's head is known exactly when the final answer's head is
    whole, and the response is complete exactly at its last byte, with the final answer's status
    and headers only (a final 200 is no interim answer); the connection then reads the next
    answer on it the same way (nothing of an interim answer's state left behind)."""

    async def main():
        p = pool("http://127.0.0.1:1")
        p.total = 1
        conn = _Connection(p)
        conn.connection_made(StubTransport(0))
        stream = INTERIMS[interim] + FINAL % status
        head_end = len(stream) - len(b"hello")
        for _ in range(2):  # two answers on one connection
            r = conn.response = Response(conn)
            for i in range(len(stream)):
                conn.data_received(stream[i : i + 1])
                assert (r.head.done(), r.complete) == (i + 1 >= head_end, i + 1 == len(stream))
            assert r.error is None and not conn.closed
            assert (r.status_code, r.headers, r.keep_alive) == (
                status,
                {"content-type": "text/plain", "content-length": "5"},
                True,
            )
            assert r.read_complete() == b"hello"
            r.close()
            assert list(p.idle) == [conn] and p.total == 1
            p.idle.clear()
        conn.close()
        await p.aclose()

    asyncio.run(main())


def test_a_switch_of_protocols_is_a_protocol_error_however_the_bytes_arrive():
    """A ``101`` is not an interim answer to skip: fed one byte at a time, nothing happens until
    its head is whole, then the request fails with ``ProtocolError`` and the connection closes."""

    async def main():
        p = pool("http://127.0.0.1:1")
        p.total = 1
        conn = _Connection(p)
        transport = StubTransport(0)
        conn.connection_made(transport)
        r = conn.response = Response(conn)
        stream = b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
        for i in range(len(stream)):
            assert not r.head.done() and not conn.closed
            conn.data_received(stream[i : i + 1])
        assert conn.closed and transport.aborted and not r.complete
        with pytest.raises(ProtocolError) as e:
            await r.head
        assert str(e.value) == "the upstream switched protocols" and r.error is e.value
        await p.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("held", [True, False])
def test_a_read_timer_that_fires_after_the_whole_answer_fails_and_closes_nothing(held):
    """A body past ``HIGH_WATER`` that arrived whole pauses reading; reading the body resumes it
    and arms the read timer, the answer already complete. When that timer fires — the answer
    still held by its caller, or its connection back in the pool — nothing fails or closes and
    no callback raises: ``read_timeout`` bounds the wait for a byte still to come."""

    async def main():
        raised: list = []
        catch_callback_errors(raised)
        p = pool("http://127.0.0.1:1", read_timeout=0.05)
        p.total = 1
        conn = _Connection(p)
        transport = FlowTransport()
        conn.connection_made(transport)
        r = conn.response = Response(conn)
        body = b"x" * (client.HIGH_WATER + 1)
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        assert r.complete and not transport.reading  # its reader is behind: paused
        assert await r.read() == body and transport.reading  # resumed, the timer armed
        if not held:
            r.close()
            assert list(p.idle) == [conn]
        await asyncio.sleep(0.2)  # the timer (0.05 s) fires first in this loop
        assert raised == [] and r.error is None
        assert not conn.closed and not transport.aborted
        if held:
            r.close()
        assert list(p.idle) == [conn] and p.total == 1 and conn.usable()
        conn.close()
        await p.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["closes", "resets", "sends bytes unasked"])
def test_an_idle_connection_the_upstream_drops_leaves_the_pool_at_once(how):
    """A pooled connection the upstream closes, resets or sends bytes on that no request asked
    for is closed and leaves the pool as soon as the client sees it — its place freed, no
    callback raising — and the next request goes out on a new connection."""

    async def main():
        raised: list = []
        catch_callback_errors(raised)
        go = asyncio.Event()
        accepted = 0

        async def serve(reader, writer):
            nonlocal accepted
            accepted += 1
            first = accepted == 1
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")  # GET: no body
                    writer.write(OK)
                    if first:
                        await go.wait()
                        if how == "resets":
                            sock = writer.get_extra_info("socket")
                            sock.setsockopt(
                                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                            )
                        if how == "sends bytes unasked":
                            writer.write(OK)
                        else:
                            writer.close()
                            return
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        p = pool(f"http://127.0.0.1:{port}")
        r = await p.request("GET", "/")
        assert await r.read() == b"ok"
        conn = r.conn
        lost = asyncio.Event()
        seen = conn.connection_lost

        def connection_lost(exc):
            seen(exc)
            lost.set()

        conn.connection_lost = connection_lost
        await r.aclose()
        assert list(p.idle) == [conn] and p.total == 1
        go.set()
        await asyncio.wait_for(lost.wait(), 10)
        assert conn.closed and not p.idle and p.total == 0
        assert raised == []
        r = await p.request("GET", "/")
        assert await r.read() == b"ok" and r.conn is not conn
        await r.aclose()
        assert list(p.idle) == [r.conn] and p.total == 1 and accepted == 2
        await p.aclose()
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("handed", ["usable", "closing", "a place"])
def test_a_waiter_takes_a_connection_handed_over_only_if_usable_and_not_asked_fresh(fresh, handed):
    """``_acquire`` in a full pool waits for a connection another request hands over, or the
    place of one closed (None); it takes a connection when it is usable — unless ``fresh`` (a
    resend after a reused connection was lost: never on a connection that was used) — and else
    closes it and opens a new connection in its place, as it does in a place handed over;
    ``total`` unchanged."""

    async def main():
        async def ok(n, writer):
            writer.write(OK)

        server, port = await raw_server(ok)
        p = pool(f"http://127.0.0.1:{port}", max_connections=1)
        p.total = 1
        conn = None
        if handed != "a place":
            conn = _Connection(p)
            transport = StubTransport(0)
            transport.aborted = handed == "closing"
            conn.connection_made(transport)
            conn.requests = 1
        waiting = asyncio.ensure_future(p._acquire(fresh=fresh))
        while not p.waiters:
            await asyncio.sleep(0)
        p._release(conn)
        got = await waiting
        if handed == "usable" and not fresh:
            assert got is conn and not conn.closed and not transport.aborted
        else:
            assert got is not conn and got.requests == 0 and got.usable()
            if conn is not None:
                assert conn.closed and transport.aborted
            r = await p._send(got, b"GET / HTTP/1.1\r\ncontent-length: 0\r\n\r\n", b"", False)
            assert (r.status_code, await r.read()) == (200, b"ok")
            await r.aclose()
            assert list(p.idle) == [got]
        assert p.total == 1
        got.close()
        await p.aclose()
        server.close()

    asyncio.run(main())


def test_a_resend_waiting_for_a_place_goes_out_on_a_new_connection():
    """A request lost unanswered on a reused connection is sent again on a new connection, also
    when the pool is full and the place it waits for comes with a used connection (handed over by
    a request that finished): that one is closed, a new one opened in its place."""

    async def main():
        hold = asyncio.Event()
        seen: list[tuple[bytes, int, int]] = []  # (path, connection, its request number)
        accepted = 0

        async def serve(reader, writer):
            nonlocal accepted
            accepted += 1
            me, n = accepted, 0
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    n += 1
                    path = head.split(b" ")[1]
                    seen.append((path, me, n))
                    if path == b"/x" and sum(s[0] == b"/x" for s in seen) == 1:
                        writer.close()  # X's first send, on a used connection: lost unanswered
                        return
                    if path == b"/y":
                        await hold.wait()
                    writer.write(OK)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        p = pool(f"http://127.0.0.1:{port}", max_connections=2)

        async def get(path: str) -> bytes:
            r = await p.request("GET", path)
            try:
                return await r.read()
            finally:
                await r.aclose()

        assert await asyncio.gather(get("/a"), get("/b")) == [b"ok", b"ok"]
        assert p.total == 2 and len(p.idle) == 2  # both used once
        y = asyncio.ensure_future(get("/y"))  # holds one connection
        x = asyncio.ensure_future(get("/x"))  # on the other: lost, sent again
        z = asyncio.ensure_future(get("/z"))  # waits: the pool is full
        assert await z == b"ok"  # in the place X's lost connection freed; then handed to X
        assert await x == b"ok"
        hold.set()
        assert await y == b"ok"
        sends = [(c, n) for path, c, n in seen if path == b"/x"]
        assert len(sends) == 2 and sends[0][1] == 2  # first on a used connection
        assert sends[1][1] == 1  # the resend: a connection's first request
        assert p.total <= 2
        await p.aclose()
        server.close()

    asyncio.run(main())


def test_a_request_waiting_in_a_full_pool_reuses_the_connection_handed_over():
    """In a full pool a request waits for a place; the connection a finished request hands over
    — read to its end, kept alive — carries it: no new connection (``max_connections`` bounds
    connections, not requests)."""

    async def main():
        hold = asyncio.Event()
        seen: list[tuple[bytes, int, int]] = []  # (path, connection, its request number)
        accepted = 0

        async def serve(reader, writer):
            nonlocal accepted
            accepted += 1
            me, n = accepted, 0
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    n += 1
                    seen.append((head.split(b" ")[1], me, n))
                    if n == 1:
                        await hold.wait()
                    writer.write(OK)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        p = pool(f"http://127.0.0.1:{port}", max_connections=1)
        sent = asyncio.ensure_future(p.request("GET", "/a"))  # its answer waits for `hold`
        while not seen:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(p.request("GET", "/b"))
        while not p.waiters:
            await asyncio.sleep(0)
        hold.set()
        first = await sent
        assert await first.read() == b"ok"
        await first.aclose()  # handed to the waiting request
        second = await waiting
        assert await second.read() == b"ok" and second.conn is first.conn
        await second.aclose()
        assert seen == [(b"/a", 1, 1), (b"/b", 1, 2)] and accepted == 1
        assert p.total == 1 and list(p.idle) == [first.conn]
        await p.aclose()
        server.close()

    asyncio.run(main())


def test_a_request_cancelled_while_waiting_for_a_place_raises_its_own_cancellation():
    """A request waiting in a full pool and cancelled — with a message, as ``Task.cancel(msg)``
    lets a caller say why — raises that cancellation, message and all, and leaves the pool as it
    was: the place still the busy connection's, and a connection freed later not handed to the
    cancelled request (it goes to the idle pool)."""

    async def main():
        p = pool("http://127.0.0.1:1", max_connections=1, pool_timeout=30.0)
        p.total = 1
        waiting = asyncio.ensure_future(p.request("GET", "/"))
        while not p.waiters:
            await asyncio.sleep(0)
        waiting.cancel("the client went away")
        with pytest.raises(asyncio.CancelledError) as e:
            await waiting
        assert e.value.args == ("the client went away",)
        assert p.total == 1 and not p.idle
        conn = _Connection(p)
        conn.connection_made(StubTransport(0))
        p._release(conn)
        assert list(p.idle) == [conn] and p.total == 1
        conn.close()
        await p.aclose()

    asyncio.run(main())
