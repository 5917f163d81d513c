"""A raw HTTP/1.1 upstream that misbehaves on purpose, for faults no real engine can be made to
show on demand: a status of 600, a stream that closes before its first event or in the middle,
bad chunked encoding, an SSE stream without event boundaries, a reply of many megabytes.

``FaultServer(script)`` listens on 127.0.0.1 (ephemeral port) in a thread with its own event
loop. ``GET /health`` is answered 200, and the gateway's reads of an engine's block size 404
(``GET /metrics``, an SGLang worker's ``GET /server_info`` and ``/get_server_info``). Every
other request is read whole (headers, then ``Content-Length`` bytes), recorded, and answered by
``script(request)``: a list whose ``bytes`` items are written as they are and whose ``float``
items are pauses (seconds); then the connection is closed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

Step = bytes | float

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def delta(text: str) -> bytes:
    return event(
        {
            "id": "x",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }
    )


def reply(status: int, body: bytes, reason: str = "X") -> bytes:
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class FaultServer:
    """See the module docs."""

    def __init__(self, script: Callable[[bytes], list[Step]]) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            if head.startswith(b"GET /health"):
                writer.write(reply(200, b"{}", "OK"))
            elif head.startswith((b"GET /metrics", b"GET /server_info", b"GET /get_server_info")):
                writer.write(reply(404, b"{}", "Not Found"))
            else:
                self.requests.append(body)
                for step in self.script(body):
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                    else:
                        writer.write(step)
                        await writer.drain()
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def stop(self) -> None:
        """Closes the listener and every connection, then ends the thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        self.thread.join(10)
        self.loop.close()
