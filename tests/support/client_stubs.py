"""Stubs for the upstream client's tests (``test_gateway_client_pool.py``,
``test_gateway_client_flow.py``): a pool with test timeouts, raw servers in the test's own event
loop, transports whose write buffer and reading the test sets."""

from __future__ import annotations

import asyncio
import socket

from kvroute.gateway.client import Pool

JSON = "content-type: application/json\r\n"
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def pool(url: str, **kw) -> Pool:
    options = dict(
        max_connections=4,
        connect_timeout=2.0,
        read_timeout=30.0,
        write_timeout=30.0,
        pool_timeout=2.0,
        keepalive=30.0,
    )
    options.update(kw)
    return Pool(url, **options)


class StubTransport(asyncio.Transport):
    """A transport whose write buffer holds ``pending`` bytes."""

    def __init__(self, pending: int) -> None:
        super().__init__()
        self.pending = pending
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.pending

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


async def raw_server(answers, ssl=None, heads=None):
    """A server in this loop answering the n-th request it reads with ``answers(n, writer)``
    (a coroutine; returning False closes the connection); each request's head and body are
    appended to ``heads`` if given."""
    count = 0

    async def serve(reader, writer):
        nonlocal count
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = int(head.lower().split(b"content-length: ")[1].split(b"\r")[0])
                body = await reader.readexactly(size)
                if heads is not None:
                    heads.append(head + body)
                count += 1
                if await answers(count, writer) is False:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ssl)
    return server, server.sockets[0].getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FlowTransport(StubTransport):
    """A stub transport that records whether reading is paused."""

    def __init__(self) -> None:
        super().__init__(0)
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def catch_callback_errors(raised: list) -> None:
    """What the loop's callbacks (a protocol's, a timer's) raise goes to ``raised``."""

    def handler(_, context) -> None:
        raised.append(context.get("exception") or context["message"])

    asyncio.get_running_loop().set_exception_handler(handler)
