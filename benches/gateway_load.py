"""Lean load plumbing for the gateway benchmark: a canned OpenAI-compatible upstream and an
HTTP/1.1 load generator, both plain asyncio, so that neither costs the gateway's core anything
and the benchmark measures the gateway.

``python benches/gateway_load.py upstream N`` serves N upstreams (ephemeral ports on 127.0.0.1)
and prints their ports as JSON, until stdin closes. Each answers ``POST /v1/chat/completions``
(non-streamed: a chat completion with ``usage`` and ``prompt_tokens_details.cached_tokens``;
streamed: three SSE events and ``data: [DONE]``), ``GET /v1/models`` and ``GET /health``.

``load(url, bodies, concurrency, headers)`` sends every body over ``concurrency`` keep-alive
connections and returns (seconds, statuses).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

REPLY = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 500,
            "completion_tokens": 1,
            "total_tokens": 501,
            "prompt_tokens_details": {"cached_tokens": 480},
        },
    }
).encode()
_OK = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(REPLY)).encode()
    + b"\r\n\r\n"
    + REPLY
)
_SSE = (
    b"".join(
        b"data: " + json.dumps(e).encode() + b"\n\n"
        for e in (
            {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]},
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": 500,
                    "completion_tokens": 1,
                    "total_tokens": 501,
                    "prompt_tokens_details": {"cached_tokens": 480},
                },
            },
        )
    )
    + b"data: [DONE]\n\n"
)
_STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
    + str(len(_SSE)).encode()
    + b"\r\n\r\n"
    + _SSE
)
_SMALL = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class _Upstream(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            length = (
                int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
                if i >= 0
                else 0
            )
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            if head.startswith(b"post"):
                self.transport.write(_STREAM if b'"stream":true' in body else _OK)
            elif head.startswith(b"get /v1/models"):
                models = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(models)).encode()
                    + b"\r\n\r\n"
                    + models
                )
            else:
                self.transport.write(_SMALL)


async def _serve(n: int) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(_Upstream, "127.0.0.1", 0) for _ in range(n)]
    print(json.dumps([s.sockets[0].getsockname()[1] for s in servers]), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)


class _Client(asyncio.Protocol):
    """One keep-alive connection sending requests one after another."""

    def __init__(self) -> None:
        self.buf = b""
        self.waiter: asyncio.Future | None = None
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        self._check()

    def connection_lost(self, exc):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed"))

    def _check(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = self.buf[:end].lower()
        status = int(head[9:12])
        i = head.find(b"content-length:")
        if i >= 0:
            j = head.find(b"\r\n", i)
            length = int(head[i + 15 : j if j > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
        else:  # chunked
            k = self.buf.find(b"\r\n0\r\n\r\n", end)
            if k < 0:
                return
            self.buf = self.buf[k + 7 :]
        waiter, self.waiter = self.waiter, None
        waiter.set_result(status)

    async def send(self, request: bytes) -> int:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        self._check()
        return await self.waiter


async def load(
    host: str,
    port: int,
    path: str,
    bodies: list[bytes],
    concurrency: int,
    headers: dict[str, str] | None = None,
) -> tuple[float, Counter]:
    """Sends every body (POST ``path``) over ``concurrency`` connections; (seconds, statuses)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    requests = [
        (
            f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"{extra}content-length: {len(b)}\r\n\r\n"
        ).encode()
        + b
        for b in bodies
    ]
    loop = asyncio.get_running_loop()
    clients = [(await loop.create_connection(_Client, host, port))[1] for _ in range(concurrency)]
    statuses: Counter = Counter()
    queue = iter(requests)

    async def run(client: _Client) -> None:
        for request in queue:
            statuses[await client.send(request)] += 1

    started = time.perf_counter()
    await asyncio.gather(*(run(c) for c in clients))
    seconds = time.perf_counter() - started
    for c in clients:
        c.transport.close()
    return seconds, statuses


if __name__ == "__main__":
    if sys.argv[1:2] == ["upstream"]:
        asyncio.run(_serve(int(sys.argv[2]) if len(sys.argv) > 2 else 2))
