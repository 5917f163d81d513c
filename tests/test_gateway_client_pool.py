"""The upstream client's pool (``kvroute.gateway.client.Pool``) against raw servers in the test's
own event loop, where the order of every timer is the loop's, not the machine's load: the write
timeout, and each failure's type and whole message (they reach the gateway's log lines).

``test_gateway_client.py`` drives the pool against real servers (uvicorn, ``FaultServer``)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import struct

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from kvroute.gateway import client
from kvroute.gateway.client import (
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    PoolTimeout,
    ProtocolError,
    ReadTimeout,
    Response,
    WriteTimeout,
    _Connection,
)
from support.client_stubs import JSON, StubTransport, free_port, pool, raw_server

BIG = b"x" * (32 << 20)  # past any loopback socket's buffers: the rest waits in the transport


class HeldServer:
    """Reads each request only when the test lets it (``go``), then answers ``ok``."""

    def __init__(self) -> None:
        self.gates: list[asyncio.Event] = []
        self.bodies: list[int] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def go(self, i: int) -> None:
        while len(self.gates) <= i:
            self.gates.append(asyncio.Event())
        self.gates[i].set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                i = len(self.bodies)
                while len(self.gates) <= i:
                    self.gates.append(asyncio.Event())
                await self.gates[i].wait()
                head = await reader.readuntil(b"\r\n\r\n")
                size = int(head.lower().split(b"content-length: ")[1].split(b"\r")[0])
                await reader.readexactly(size)
                self.bodies.append(size)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


def test_a_request_the_upstream_does_not_take_is_a_write_timeout():
    """No byte of a request's body taken within ``write_timeout``: ``WriteTimeout``, named with
    the timeout; the connection is closed, not kept."""

    async def main():
        server = HeldServer()  # never reads
        p = pool(await server.start(), write_timeout=0.3)
        with pytest.raises(WriteTimeout) as e:
            await p.request("POST", "/x", JSON, BIG)
        assert str(e.value) == "the upstream took no request for 0.3 s"
        assert p.total == 0 and not p.idle
        await p.aclose()
        await server.close()

    asyncio.run(main())


@pytest.mark.parametrize("pending", [0, 1, 2, 65536])
@pytest.mark.parametrize("current", [True, False])
def test_a_write_check_fails_only_its_own_request_with_bytes_not_taken(pending, current):
    """``write_timeout`` after a request was slow to leave, its check fails it — closing the
    connection — if any byte of it (one is enough) is still not taken, and only while it is the
    connection's request: a request answered before its check has left the connection, which
    another request may be using by then (its own check decides for it)."""

    async def main():
        p = pool("http://127.0.0.1:1", write_timeout=0.25)
        conn = _Connection(p)
        transport = StubTransport(pending)
        conn.connection_made(transport)
        mine = Response(conn)
        conn.response = mine if current else Response(conn)
        conn._write_check(mine)
        fails = current and pending > 0
        assert transport.aborted is fails and conn.closed is fails
        assert (conn.response.error is not None) is fails
        if fails:
            assert isinstance(conn.response.error, WriteTimeout)
            assert str(conn.response.error) == "the upstream took no request for 0.25 s"
            with pytest.raises(WriteTimeout):
                await conn.response.head
        else:
            assert not conn.response.head.done()
        await p.aclose()

    asyncio.run(main())


def test_each_failure_has_its_type_and_whole_message():
    """Every way a request fails, with the message the gateway logs and answers with: refused,
    no connection in time, no free connection in time, no byte in time, closed unanswered,
    reset, switched protocols, not HTTP — and a reused connection lost unanswered whose new
    connection is refused (the request did leave: ``ConnectionLost``, naming both)."""

    async def ok(n, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    raised: list[BaseException] = []  # what the protocol's callbacks raised: nothing may

    def handler(_, context) -> None:
        error = context.get("exception")
        if isinstance(error, Exception):  # not the test servers' tasks cancelled at the end
            raised.append(error)

    async def main():
        asyncio.get_running_loop().set_exception_handler(handler)
        port = free_port()
        with pytest.raises(ConnectFailed) as e:
            await pool(f"http://127.0.0.1:{port}").request("GET", "/")
        assert str(e.value).startswith(f"cannot connect to 127.0.0.1:{port}: [Errno 111] ")

        # A listener that accepts nothing, its queue full: a SYN goes unanswered.
        with socket.socket() as full:
            full.bind(("127.0.0.1", 0))
            full.listen(0)
            port = full.getsockname()[1]
            queued = [socket.socket() for _ in range(2)]
            for s in queued:
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
            p = pool(f"http://127.0.0.1:{port}", connect_timeout=0.2)
            with pytest.raises(ConnectTimeout) as e:
                await p.request("GET", "/")
            assert str(e.value) == f"no connection to 127.0.0.1:{port} within 0.2 s"
            assert p.total == 0
            for s in queued:
                s.close()

        async def silent(n, writer):
            await asyncio.sleep(5)

        server, port = await raw_server(silent)
        # The read timeout well after the pool's: a stalled loop cannot free the slot first.
        p = pool(f"http://127.0.0.1:{port}", max_connections=1, pool_timeout=0.2, read_timeout=1.5)
        first = asyncio.ensure_future(p.request("POST", "/x", JSON, b"{}"))
        await asyncio.sleep(0.05)
        with pytest.raises(PoolTimeout) as e:
            await p.request("POST", "/x", JSON, b"{}")
        assert str(e.value) == f"no free connection to 127.0.0.1:{port} within 0.2 s"
        with pytest.raises(ReadTimeout) as e:
            await first
        assert str(e.value) == "no byte from the upstream for 1.5 s"
        assert p.total == 0
        server.close()

        async def hang_up(n, writer):
            return False

        server, port = await raw_server(hang_up)
        with pytest.raises(ConnectionLost) as e:
            await pool(f"http://127.0.0.1:{port}").request("POST", "/x", JSON, b"{}")
        assert str(e.value) == "the upstream closed the connection"
        server.close()

        async def reset(n, writer):
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False

        server, port = await raw_server(reset)
        with pytest.raises(ConnectionLost) as e:
            await pool(f"http://127.0.0.1:{port}").request("POST", "/x", JSON, b"{}")
        assert str(e.value) == (
            "the upstream closed the connection: [Errno 104] Connection reset by peer"
        )
        server.close()

        async def switch(n, writer):
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
            )
            await asyncio.sleep(5)

        server, port = await raw_server(switch)
        with pytest.raises(ProtocolError) as e:
            await pool(f"http://127.0.0.1:{port}").request("POST", "/x", JSON, b"{}")
        assert str(e.value) == "the upstream switched protocols"
        server.close()

        async def smtp(n, writer):
            writer.write(b"SMTP ready\r\n\r\n")
            await asyncio.sleep(5)

        server, port = await raw_server(smtp)
        with pytest.raises(ProtocolError) as e:
            await pool(f"http://127.0.0.1:{port}").request("POST", "/x", JSON, b"{}")
        assert str(e.value).startswith("invalid HTTP from the upstream: ")
        server.close()

        # Answered once, keep-alive; the second request, on that connection, is read and the
        # connection closed unanswered, the server no longer listening: the new one is refused.
        async def once(n, writer):
            if n == 1:
                return await ok(n, writer)
            server.close()
            return False

        server, port = await raw_server(once)
        p = pool(f"http://127.0.0.1:{port}")
        r = await p.request("POST", "/x", JSON, b"{}")
        assert await r.read() == b"ok"
        await r.aclose()
        assert (p.total, len(p.idle)) == (1, 1)
        with pytest.raises(ConnectionLost) as e:
            await p.request("POST", "/x", JSON, b"{}")
        assert str(e.value).startswith(
            "the upstream closed the connection, and a new one failed: cannot connect to "
            f"127.0.0.1:{port}: [Errno 111] "
        )
        assert p.total == 0 and not p.idle
        await asyncio.sleep(0.05)  # the last connection_lost callbacks

    asyncio.run(main())
    assert raised == []


@pytest.mark.parametrize("complete", [True, False])
@pytest.mark.parametrize("error", [None, "lost"])
@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("closing", [False, True])
def test_a_connection_is_pooled_only_after_a_whole_clean_keep_alive_answer(
    complete, error, keep_alive, closing
):
    """``Response.close`` puts its connection back only when the answer was read to its end,
    without error, the server did not ask to close, and the connection is not closing; else it
    is closed and its place freed — every combination, one condition failing at a time or many."""

    async def main():
        p = pool("http://127.0.0.1:1")
        p.total = 1
        conn = _Connection(p)
        transport = StubTransport(0)
        transport.aborted = closing
        conn.connection_made(transport)
        r = conn.response = Response(conn)
        r.complete, r.keep_alive = complete, keep_alive
        r.error = None if error is None else ConnectionLost(error)
        r.close()
        pooled = complete and error is None and keep_alive and not closing
        assert list(p.idle) == ([conn] if pooled else [])
        assert p.total == (1 if pooled else 0)
        assert conn.closed is not pooled and transport.aborted is (closing or not pooled)
        assert conn.response is None and r.released
        r.close()  # a second close changes nothing
        assert list(p.idle) == ([conn] if pooled else []) and p.total == (1 if pooled else 0)
        await p.aclose()

    asyncio.run(main())


def test_a_request_is_never_written_on_a_closed_connection():
    """``_send`` on a connection already closed (by either side) raises ``ConnectionLost`` and
    writes nothing."""

    async def main():
        p = pool("http://127.0.0.1:1")
        p.total = 1
        conn = _Connection(p)
        transport = StubTransport(0)
        conn.connection_made(transport)
        conn.closed = True
        with pytest.raises(ConnectionLost) as e:
            await p._send(conn, b"GET / HTTP/1.1\r\n\r\n", b"", again=False)
        assert str(e.value) == "the upstream closed the connection"
        assert p.total == 0 and not p.idle
        await p.aclose()

    asyncio.run(main())


def test_a_freed_place_goes_to_the_first_live_waiter_and_total_counts_connections():
    """``_release``: a connection given back goes to the first waiter still waiting (a cancelled
    one is passed over), else to the idle pool; a closed one's place (None) goes to that waiter,
    which opens a connection in it — ``total``, the connections open or opening, unchanged — else
    ``total`` drops by one. Never more than ``max_connections`` open."""

    async def main():
        loop = asyncio.get_running_loop()
        p = pool("http://127.0.0.1:1", max_connections=2)
        conn = _Connection(p)
        conn.connection_made(StubTransport(0))
        p.total = 2
        p._release(conn)  # no waiter: idle
        assert list(p.idle) == [conn] and p.total == 2
        p.idle.clear()
        p._release(None)  # no waiter: a place freed
        assert p.total == 1
        p.total = 2
        gone, first, second = (loop.create_future() for _ in range(3))
        gone.cancel()
        p.waiters.extend([gone, first, second])
        p._release(None)  # the place passes to the first live waiter, which will open one
        assert first.result() is None and not second.done() and p.total == 2
        p._release(conn)  # handed over as it is
        assert second.result() is conn and p.total == 2 and not p.idle and not p.waiters
        await p.aclose()

    asyncio.run(main())


def self_signed(tmp_path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for 127.0.0.1 and a client context trusting only it."""

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "kvroute test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_file, key_file)
    client = ssl.create_default_context(cafile=str(cert_file))
    return server, client


def test_an_https_upstream_is_spoken_to_over_tls_checking_its_name(tmp_path):
    """An ``https`` base URL: the connection is TLS with the given context, the server's
    certificate checked against the host (SNI and name check: ``server_hostname``), kept alive
    and reused as over plain TCP; a context that does not trust the server's certificate fails
    to connect."""
    server_ctx, client_ctx = self_signed(tmp_path)

    async def main():
        async def ok(n, writer):
            assert writer.get_extra_info("ssl_object") is not None  # TLS on the server's side
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

        server, port = await raw_server(ok, ssl=server_ctx)
        p = pool(f"https://127.0.0.1:{port}", ssl=client_ctx)
        for _ in range(2):
            r = await p.request("POST", "/x", JSON, b"{}")
            assert (r.status_code, await r.read()) == (200, b"ok")
            await r.aclose()
        assert p.total == 1
        await p.aclose()
        stranger = pool(f"https://127.0.0.1:{port}", ssl=ssl.create_default_context())
        with pytest.raises(ConnectFailed) as e:
            await stranger.request("GET", "/")
        assert "CERTIFICATE_VERIFY_FAILED" in str(e.value)
        server.close()

    asyncio.run(main())


def test_an_idle_connection_is_taken_newest_first_and_every_unfit_one_met_is_dropped(
    monkeypatch,
):
    """``_idle``: the most recently used fit connection; each one met first that is closed,
    closing or idle for ``keepalive`` seconds or more is closed and its place freed."""

    async def main():
        p = pool("http://127.0.0.1:1", keepalive=30.0)
        now = 1000.0
        monkeypatch.setattr(client.time, "monotonic", lambda: now)
        conns = []
        # Idle 29.5 s: fit; exactly 30 s (keepalive): not.
        for stale, closing in [(False, False), (False, False), (True, False), (False, True)]:
            c = _Connection(p)
            c.connection_made(StubTransport(0))
            c.transport.aborted = closing
            c.idle_since = now - (30.0 if stale else 29.5)
            conns.append(c)
        p.idle.extend(conns)
        p.total = 5  # one more, busy
        assert p._idle() is conns[1]  # the two after it dropped, the one before it kept
        assert list(p.idle) == [conns[0]] and p.total == 3
        assert conns[2].closed and conns[3].closed and not conns[1].closed
        p.idle.clear()
        assert p._idle() is None and p.total == 3
        await p.aclose()

    asyncio.run(main())


def test_a_connection_handed_to_a_cancelled_request_is_not_lost():
    """A request waiting for a free connection is handed one and cancelled before it resumes:
    the connection is passed on (to the idle pool here), never lost with its place (Python
    3.12's ``wait_for`` raises the cancellation; 3.11's returns the connection instead)."""

    async def main():
        p = pool("http://127.0.0.1:1", max_connections=1)
        p.total = 1
        conn = _Connection(p)
        conn.connection_made(StubTransport(0))
        waiting = asyncio.ensure_future(p._acquire())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(p.waiters) == 1
        p._release(conn)
        waiting.cancel()
        try:
            got = await waiting
        except asyncio.CancelledError:
            got = None
        assert p.total == 1
        assert got is conn or list(p.idle) == [conn]
        await p.aclose()

    asyncio.run(main())


def test_a_request_goes_out_as_one_head_with_the_pools_and_the_callers_headers():
    """The bytes of a request: method, the base URL's path prefix and the path, ``host``, the
    pool's fixed headers, the caller's, ``content-length`` — none when not given (``get``)."""

    async def main():
        heads: list[bytes] = []

        async def ok(n, writer):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

        server, port = await raw_server(ok, heads=heads)
        p = pool(f"http://127.0.0.1:{port}/base/", headers=[("authorization", "Bearer k")])
        r = await p.request("POST", "/v1/x", "x-a: 1\r\n", b'{"a": 1}')
        assert await r.read() == b"ok"
        await r.aclose()
        assert await p.get("/health") == 200
        assert heads == [
            f"POST /base/v1/x HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer k\r\n"
            'x-a: 1\r\ncontent-length: 8\r\n\r\n{"a": 1}'.encode(),
            f"GET /base/health HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            "authorization: Bearer k\r\ncontent-length: 0\r\n\r\n".encode(),
        ]
        await p.aclose()
        server.close()

    asyncio.run(main())
