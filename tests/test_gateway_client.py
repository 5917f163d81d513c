"""The gateway's upstream client (``kvroute.gateway.client``) on its own: keep-alive reuse, a
connection the server closed, the pool bound, the timeouts and the error types the gateway's
failure table is keyed by. Upstreams: the OpenAI-compatible test upstream (uvicorn) and the raw
``FaultServer``."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from kvroute.gateway.client import (
    BodyTooLarge,
    ConnectFailed,
    ConnectionLost,
    Pool,
    PoolTimeout,
    ProtocolError,
    ReadTimeout,
)
from support.gateway_faults import FaultServer, chunk, reply
from support.gateway_upstream import ServerThread, Upstream


def pool(url: str, **kw) -> Pool:
    options = dict(
        max_connections=4,
        connect_timeout=2.0,
        read_timeout=5.0,
        write_timeout=5.0,
        pool_timeout=2.0,
        keepalive=30.0,
    )
    options.update(kw)
    return Pool(url, **options)


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
JSON = "content-type: application/json\r\n"


@pytest.fixture(scope="module")
def upstream():
    u = Upstream("up-0")
    server = ServerThread(u.app)
    yield u, server.url
    server.stop()


def test_keep_alive_reuses_one_connection(upstream):
    _, url = upstream

    async def main():
        p = pool(url)
        for i in range(5):
            r = await p.request(
                "POST", "/v1/chat/completions", f"x-request-id: r{i}\r\n{JSON}", CHAT
            )
            body = json.loads(await r.read())
            await r.aclose()
            assert r.status_code == 200 and body["choices"][0]["message"]["content"] == f"up-0 r{i}"
        assert p.total == 1 and len(p.idle) == 1
        await p.aclose()

    asyncio.run(main())


def test_a_connection_the_server_closed_is_not_reused():
    # Every answer closes its connection (FaultServer): each request needs a new one.
    server = FaultServer(lambda body: [reply(200, b'{"ok": true}')])
    try:

        async def main():
            p = pool(server.url)
            for _ in range(3):
                r = await p.request("POST", "/x", JSON, b"{}")
                assert await r.read() == b'{"ok": true}'
                await r.aclose()
            assert p.total <= 1
            await p.aclose()

        asyncio.run(main())
        assert len(server.requests) == 3
    finally:
        server.stop()


def test_a_reused_connection_lost_before_any_answer_byte_is_sent_again():
    """vLLM's API server meets an exception in its handler: a complete 500 without
    ``connection: close``, then uvicorn closes the socket (``gateway_upstream.Crash``). The next
    request reused that connection and was lost unanswered: it is sent again, once, on a new
    connection — and the 500's connection, closed by the server, is not kept."""
    u = Upstream("up-c")
    u.crash = "boom"
    server = ServerThread(u.app)
    crash = json.dumps({"model": "m", "messages": [{"role": "user", "content": "boom"}]})

    async def main():
        p = pool(server.url)
        r = await p.request("POST", "/v1/chat/completions", JSON, crash.encode())
        assert (r.status_code, await r.read()) == (500, b"Internal Server Error")
        assert r.keep_alive  # the server did not say it would close
        await r.aclose()
        assert (p.total, len(p.idle)) == (1, 1)
        assert await p.get("/health") == 200  # sent on the 500's connection, then again
        assert u.health_checks == 1  # the first never reached the handler
        assert p.total == 1
        await p.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_reused_connection_lost_after_an_answer_byte_is_not_sent_again():
    """A server that answers a request on a reused connection in part and then closes it did
    answer: the request is not sent again (ConnectionLost), so it reaches the server twice in
    all, not three times. A raw server: no real one answers half a head."""
    requests: list[bytes] = []

    async def main():
        async def serve(reader, writer):
            while data := await reader.readuntil(b"\r\n\r\n"):
                await reader.readexactly(int(data.split(b"content-length: ")[1].split(b"\r")[0]))
                requests.append(data)
                if len(requests) == 1:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-")
                    await writer.drain()
                    writer.close()
                    return

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        p = pool(f"http://127.0.0.1:{port}")
        r = await p.request("POST", "/x", JSON, b"{}")
        assert await r.read() == b"ok"
        await r.aclose()
        with pytest.raises(ConnectionLost):
            await p.request("POST", "/x", JSON, b"{}")
        assert len(requests) == 2 and p.total == 0
        await p.aclose()
        server.close()

    asyncio.run(main())


def test_chunked_body_is_decoded_and_bounded():
    body = chunk(b'{"a": ') + chunk(b"1}") + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    server = FaultServer(lambda _: [head, body])
    try:

        async def main():
            p = pool(server.url)
            r = await p.request("POST", "/x", JSON, b"{}")
            assert await r.read() == b'{"a": 1}'
            await r.aclose()
            r = await p.request("POST", "/x", JSON, b"{}")
            with pytest.raises(BodyTooLarge):
                await r.read(limit=4)
            await r.aclose()
            await p.aclose()

        asyncio.run(main())
    finally:
        server.stop()


def test_a_body_here_whole_is_read_without_waiting_and_bounded():
    """``read_complete``: None while the body is still on its way, then all of it (every chunk,
    as ``read`` gives it), ``BodyTooLarge`` past the limit."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    pieces = [head, chunk(b'{"a": '), 0.05, chunk(b"1}"), 0.2, b"0\r\n\r\n"]
    server = FaultServer(lambda _: pieces)
    try:

        async def whole(r) -> None:
            while not r.complete:
                await asyncio.sleep(0.01)

        async def main():
            p = pool(server.url)
            r = await p.request("POST", "/x", JSON, b"{}")
            assert r.read_complete() is None  # the chunks are still coming
            await asyncio.wait_for(whole(r), 5)
            assert r.read_complete() == b'{"a": 1}'
            r.close()
            r = await p.request("POST", "/x", JSON, b"{}")
            await asyncio.wait_for(whole(r), 5)
            with pytest.raises(BodyTooLarge):
                r.read_complete(limit=7)
            r.close()
            await p.aclose()

        asyncio.run(main())
    finally:
        server.stop()


def test_pool_bound_and_read_timeout():
    server = FaultServer(lambda _: [1.0, reply(200, b"{}")])  # answers after 1 s
    try:

        async def main():
            p = pool(server.url, max_connections=1, pool_timeout=0.2, read_timeout=0.5)
            first = asyncio.ensure_future(p.request("POST", "/x", JSON, b"{}"))
            await asyncio.sleep(0.05)
            with pytest.raises(PoolTimeout):
                await p.request("POST", "/x", JSON, b"{}")
            with pytest.raises(ReadTimeout):
                await first
            assert p.total == 0  # the timed-out connection was closed, not pooled
            await p.aclose()

        asyncio.run(main())
    finally:
        server.stop()


def test_errors_are_typed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    lost = FaultServer(lambda _: [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"])
    garbage = FaultServer(lambda _: [b"SMTP ready\r\n\r\n"])
    try:

        async def main():
            pools = [pool(f"http://127.0.0.1:{closed_port}"), pool(lost.url), pool(garbage.url)]
            with pytest.raises(ConnectFailed):
                await pools[0].request("GET", "/")
            r = await pools[1].request("POST", "/x", JSON, b"{}")
            with pytest.raises(ConnectionLost):
                await r.read()
            await r.aclose()
            with pytest.raises(ProtocolError):
                await pools[2].request("POST", "/x", JSON, b"{}")
            for p in pools:
                assert p.total == 0  # failed connections are not kept
                await p.aclose()

        asyncio.run(main())
    finally:
        lost.stop()
        garbage.stop()


def test_interim_1xx_answers_are_skipped():
    # RFC 9110 15.2: a client must parse and ignore 1xx answers before the final one (100
    # Continue, 103 Early Hints, with or without headers); their headers are not the reply's.
    interim = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
    )
    server = FaultServer(lambda _: [interim, reply(201, b'{"ok": true}')])
    try:

        async def main():
            p = pool(server.url)
            r = await p.request("POST", "/x", JSON, b"{}")
            assert r.status_code == 201 and "link" not in r.headers
            assert await r.read() == b'{"ok": true}'
            await r.aclose()
            await p.aclose()

        asyncio.run(main())
    finally:
        server.stop()
