"""Test doubles for the gateway: small OpenAI-compatible upstreams and a uvicorn thread runner.

``Upstream`` serves ``/v1/chat/completions``, ``/v1/completions`` (streamed and not),
``/v1/models`` and ``/health`` like vLLM, and models vLLM's prefix cache with a
``kvroute.BlockCache`` over 16-token blocks of the gateway's documented byte-level routing tokens
(re-implemented here from the documentation in ``kvroute.gateway.prompt``, independently of the
gateway's code): a prompt's full blocks are matched (``cached_tokens`` = matched blocks × 16,
at most the blocks before the prompt's last token, which vLLM always recomputes), then inserted.
``cache_salt`` starts a separate chain (``BlockHasher(salt=...)``), as in vLLM.

Each upstream records every request it receives (the ``x-request-id`` header as ``upstream_id``,
and as ``id`` the caller's id in it — the gateway sends ``<16 hex digits>-<caller's id>`` — path,
salt, model, whether it streamed) and which streams ended early (the client went away), and can be
told to fail with a status (always, or for prompts containing ``poison``), to crash on prompts
containing ``crash`` (an exception in the handler, answered as uvicorn does: ``Crash``), to
stall before answering, or to stream slowly. The reply's content is
``"<upstream name> <caller's request id>"`` so a caller can check it got its own answer.

Run as a script it serves N upstreams in one process and prints their ports as JSON
(``python tests/support/gateway_upstream.py 4``), with ``/_test/records`` for the load test.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import struct
import sys
import threading
import time
import uuid
from typing import Any

import uvicorn
from kvroute import BlockCache, BlockHasher
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

BLOCK = 16
_PREFIXED_ID = re.compile(r"[0-9a-f]{16}-(.+)")
_ARRIVALS = itertools.count()  # orders records across the upstreams of one process


def _j(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def reference_render(messages: list[Any], tools: Any = None) -> str:
    """The gateway's documented chat rendering, written from its documentation."""
    text = ""
    if isinstance(tools, list) and len(tools) > 0:
        text += "<|tools|>\n" + _j(tools) + "\n"
    for m in messages:
        if not isinstance(m, dict):
            text += _j(m)
            continue
        c = m.get("content")
        if c is None:
            body = ""
        elif isinstance(c, str):
            body = c
        elif isinstance(c, list):
            body = "".join(
                p["text"]
                if isinstance(p, dict)
                and p.get("type") == "text"
                and isinstance(p.get("text"), str)
                else _j(p)
                for p in c
            )
        else:
            body = _j(c)
        rest = {k: v for k, v in m.items() if k != "role" and k != "content"}
        role = m.get("role")
        text += f"<|{role if isinstance(role, str) else _j(role)}|>\n{body}"
        text += (_j(rest) if rest else "") + "\n"
    return text


def reference_tokens(text: str) -> list[int]:
    """The documented byte-level fallback: 4 UTF-8 bytes per little-endian u32, zero-padded."""
    data = text.encode("utf-8")
    data += b"\0" * (-len(data) % 4)
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def expected_cached(prefix_text: str) -> int:
    """Tokens a second request sharing ``prefix_text`` (and more) finds cached: its full blocks."""
    return len(reference_tokens(prefix_text)) // BLOCK * BLOCK


def _not_found(response_id: str) -> Response:
    """vLLM's answer (its ``ErrorResponse``) for a response it does not hold."""
    message = f"Response with id '{response_id}' not found."
    error = {"message": message, "type": "invalid_request_error", "param": "response_id"}
    return JSONResponse({"error": {**error, "code": 404}}, status_code=404)


class Upstream:
    """One OpenAI-compatible test server (see the module docs)."""

    def __init__(self, name: str, *, capacity: int = 1 << 16, delay: float = 0.0) -> None:
        self.name = name
        self.capacity = capacity
        self.delay = delay
        self.lock = threading.Lock()
        self.reset()
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/responses/{rid}", self._retrieve, methods=["GET"]),
                Route("/v1/responses/{rid}/cancel", self._cancel, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/_test/records", self._records, methods=["GET"]),
            ]
        )

    def reset(self) -> None:
        """A fresh engine: empty cache, no records, no failure modes."""
        with self.lock:
            self.cache = BlockCache(self.capacity)
            self.records: list[dict[str, Any]] = []
            self.streams_ended_early: list[str] = []
            self.streams_completed: list[str] = []
            self.abandoned: list[str] = []  # callers that went away while we stalled
            self.fail_status: int | None = None
            self.fail_times = 0  # < 0: always
            self.fail_headers: dict[str, str] = {}  # sent with a failure's answer
            self.poison: str | None = None  # prompts containing it are answered 500
            self.crash: str | None = None  # prompts containing it raise in the handler
            self.crash_hold = 0.5  # seconds between a crash's 500 and its connection's close
            # Streams of prompts containing it fail before any output, as vLLM's do: a 200
            # with one error event (``ErrorResponse``, ``code`` this) and ``data: [DONE]``.
            self.stream_error: str | None = None
            self.stream_error_code = 500
            self.health_checks = 0
            self.report_cached = True  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
            self.stall = 0.0
            self.chunks = 3
            self.reply_bytes = 0  # a JSON reply padded with trailing spaces to this size (0: none)
            self.chunk_delay = 0.0
            self.health_status = 200
            self.gate_after_first = False  # hold a stream after its first content chunk …
            self.gate = threading.Event()  # … until this is set
            # /v1/responses: the conversations stored (vLLM with its store on): id -> text,
            # and the responses themselves (GET /v1/responses/{id})
            self.stored: dict[str, str] = {}
            self.responses: dict[str, dict[str, Any]] = {}

    def fail(self, status: int, times: int = -1) -> None:
        with self.lock:
            self.fail_status, self.fail_times = status, times

    @property
    def ids(self) -> list[str]:
        with self.lock:
            return [r["id"] for r in self.records]

    def on_cache_change(
        self,
        hashes: Any,
        matched: int,
        stored: int,
        evicted: Any,
        tokens: list[int],
        salt: str | None,
    ) -> None:
        """Called (under the lock) after a prompt's blocks were matched and inserted."""

    # ---- handlers ----------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        with self.lock:
            self.health_checks += 1
        return Response(status_code=self.health_status)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _records(self, request: Request) -> Response:
        with self.lock:
            return JSONResponse({"records": self.records, "ended_early": self.streams_ended_early})

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        text = reference_render(body["messages"], body.get("tools"))
        return await self._answer(request, body, text, chat=True)

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):  # token ids
            tokens = prompt[0] if prompt and isinstance(prompt[0], list) else prompt
            return await self._answer(request, body, None, chat=False, tokens=tokens)
        return await self._answer(request, body, prompt, chat=False)

    async def _responses(self, request: Request) -> Response:
        """vLLM's Responses server, for requests whose items are chat messages: the prompt is
        the stored conversation of ``previous_response_id`` (404 when this engine has none)
        followed by ``instructions`` as a system message and ``input`` (a string as a user
        message, items with a ``role`` as themselves)."""
        body = await request.json()
        history = ""
        previous = body.get("previous_response_id")
        if previous is not None:
            with self.lock:
                stored = self.stored.get(previous)
            if stored is None:
                return _not_found(previous)
            history = stored
        messages = []
        if body.get("instructions"):
            messages.append({"role": "system", "content": body["instructions"]})
        given = body["input"]
        messages += [{"role": "user", "content": given}] if isinstance(given, str) else given
        text = history + reference_render(messages)
        return await self._answer(request, body, text, chat=True, responses=True)

    async def _retrieve(self, request: Request) -> Response:
        """A stored response; with ``?stream=true``, as vLLM replays a background one: its
        events (here the final one)."""
        rid = request.path_params["rid"]
        record = {"seq": next(_ARRIVALS), "path": request.url.path, "query": request.url.query}
        record["upstream_id"] = request.headers.get("x-request-id")
        with self.lock:
            self.records.append({**record, "id": rid})
            found = self.responses.get(rid)
        if found is None:
            return _not_found(rid)
        if request.query_params.get("stream") == "true":
            data = json.dumps({"type": "response.completed", "response": found})
            event = f"event: response.completed\ndata: {data}\n\n".encode()
            return StreamingResponse(iter([event]), media_type="text/event-stream")
        return JSONResponse(found)

    async def _cancel(self, request: Request) -> Response:
        """vLLM cancels only background responses: every other one is answered 400."""
        rid = request.path_params["rid"]
        with self.lock:
            self.records.append({"seq": next(_ARRIVALS), "path": request.url.path, "id": rid})
            found = rid in self.responses
        if not found:
            return JSONResponse({"error": {"message": "not found", "code": 404}}, status_code=404)
        error = {"message": "Cannot cancel a synchronous response.", "code": 400}
        return JSONResponse({"error": error}, status_code=400)

    def _failing(self) -> int | None:
        with self.lock:
            if self.fail_status is None or self.fail_times == 0:
                return None
            if self.fail_times > 0:
                self.fail_times -= 1
            return self.fail_status

    async def _answer(
        self,
        request: Request,
        body: dict[str, Any],
        text: str | None,
        *,
        chat: bool,
        tokens: list[int] | None = None,
        responses: bool = False,
    ) -> Response:
        upstream_id = request.headers.get("x-request-id", "")
        prefixed = _PREFIXED_ID.fullmatch(upstream_id)
        rid = prefixed.group(1) if prefixed else upstream_id
        salt = body.get("cache_salt")
        # SGLang keys its radix cache by the salt and its own `extra_key` joined
        # (`"".join([cache_salt, extra_key])`): either names a partition.
        extra_key = body.get("extra_key")
        if isinstance(extra_key, str) and extra_key:
            salt = (salt or "") + extra_key
        stream = body.get("stream") is True
        record = {
            "seq": next(_ARRIVALS),
            "id": rid,
            "upstream_id": upstream_id,
            "path": request.url.path,
            "model": body.get("model"),
            "cache_salt": body.get("cache_salt"),
            "extra_key": extra_key,
            "priority": body.get("priority"),
            "stream": stream,
            "stream_options": body.get("stream_options"),
            "request_id": body.get("request_id"),
            "authorization": request.headers.get("authorization"),
            "accept_encoding": request.headers.get("accept-encoding"),
        }
        with self.lock:
            self.records.append(record)
        if self.crash is not None and self.crash in (text or ""):
            return Crash(self.crash_hold)
        status = self._failing()
        if self.poison is not None and self.poison in (text or ""):
            status = 500
        if self.stall:
            deadline = time.monotonic() + self.stall
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    with self.lock:
                        self.abandoned.append(rid)
                    return Response(status_code=499)
                await asyncio.sleep(0.01)
        if status is not None:
            return JSONResponse(
                {"error": {"message": f"{self.name} failing", "type": "server_error"}},
                status_code=status,
                headers=self.fail_headers,
            )
        if self.delay:
            await asyncio.sleep(self.delay)
        if tokens is None:
            tokens = reference_tokens(text or "")
        hashes = BlockHasher(BLOCK, salt=salt).hash(tokens)
        with self.lock:
            matched = self.cache.match(hashes)
            stored, evicted = self.cache.insert(hashes)
            self.on_cache_change(hashes, matched, stored, evicted, tokens, salt)
        cached = min(matched, max(len(tokens) - 1, 0) // BLOCK) * BLOCK
        record["cached_tokens"] = cached
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": self.chunks,
            "total_tokens": len(tokens) + self.chunks,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if not self.report_cached:
            del usage["prompt_tokens_details"]
        content = f"{self.name} {rid}"
        if responses:
            return self._response(body, text or "", content, usage, stream)
        kind = "chat.completion" if chat else "text_completion"
        if not stream:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": content}
            else:
                choice["text"] = content
            reply = {
                "id": f"cmpl-{rid}",
                "object": kind,
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [choice],
                "usage": usage,
            }
            if self.reply_bytes:
                data = json.dumps(reply).encode()
                assert len(data) <= self.reply_bytes
                return Response(data.ljust(self.reply_bytes), media_type="application/json")
            return JSONResponse(reply)
        if self.stream_error is not None and self.stream_error in (text or ""):
            error = {
                "message": "EngineCore encountered an issue. See stack trace for the root cause.",
                "type": "InternalServerError"
                if self.stream_error_code >= 500
                else "BadRequestError",
                "param": None,
                "code": self.stream_error_code,
            }
            events = [b"data: " + json.dumps({"error": error}).encode() + b"\n\n"]
            events.append(b"data: [DONE]\n\n")
            return StreamingResponse(iter(events), media_type="text/event-stream")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            self._stream(rid, body.get("model"), content, usage, include_usage, chat),
            media_type="text/event-stream",
        )

    async def _stream(
        self,
        rid: str,
        model: Any,
        content: str,
        usage: dict[str, Any],
        include_usage: bool,
        chat: bool,
    ):
        done = False
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[Any], **more: Any) -> bytes:
            chunk = {"id": f"cmpl-{rid}", "object": kind, "created": 0, "model": model}
            chunk["choices"] = choices
            chunk.update(more)
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        def piece(text: str, finish: str | None = None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        try:
            if chat:
                yield event([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])
            for i in range(self.chunks):
                if i and self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
                yield event([piece(content if i == 0 else ".")])
                if i == 0 and self.gate_after_first:
                    deadline = time.monotonic() + 20
                    while not self.gate.is_set() and time.monotonic() < deadline:
                        await asyncio.sleep(0.005)
            yield event([piece("", "stop")])
            if include_usage:
                yield event([], usage=usage)
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            with self.lock:
                (self.streams_completed if done else self.streams_ended_early).append(rid)

    def _response(
        self, body: dict[str, Any], text: str, content: str, usage: dict[str, Any], stream: bool
    ) -> Response:
        """A Responses answer: stored (when ``store`` is not false) and, streamed, the events
        vLLM sends — ``response.created`` and ``response.in_progress`` before any output, the
        deltas, ``response.completed`` with the usage (or, for a ``stream_error`` prompt, an
        ``error`` event after the first two)."""
        response_id = f"resp_{uuid.uuid4().hex}"
        message = reference_render([{"role": "assistant", "content": content}])
        final = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": body.get("model"),
        }
        if body.get("store") is not False:
            with self.lock:
                self.stored[response_id] = text + message
                self.responses[response_id] = {**final, "status": "completed"}
        r_usage = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
        }
        if "prompt_tokens_details" in usage:
            r_usage["input_tokens_details"] = dict(usage["prompt_tokens_details"])
        output = [
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": content, "annotations": []}],
            }
        ]
        response = final
        final = {**response, "status": "completed", "output": output, "usage": r_usage}
        if not stream:
            return JSONResponse(final)
        begun = {**response, "status": "in_progress", "output": [], "usage": None}

        def event(kind: str, **data: Any) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

        events = [event("response.created", response=begun)]
        events.append(event("response.in_progress", response=begun))
        if self.stream_error is not None and self.stream_error in text:
            events.append(event("error", code=self.stream_error_code, message="engine failed"))
            return StreamingResponse(iter(events), media_type="text/event-stream")
        for i in range(self.chunks):
            events.append(event("response.output_text.delta", delta=content if i == 0 else "."))
        events.append(event("response.completed", response=final))
        return StreamingResponse(iter(events), media_type="text/event-stream")


class Crash(Response):
    """An exception in the engine's handler, as vLLM's API server (FastAPI under uvicorn) meets
    it: Starlette's ``ServerErrorMiddleware`` answers a complete 500 (``content-length``, no
    ``connection: close``) and raises again, and uvicorn then closes the connection
    (``run_asgi``: the response had started). A real server's close follows the answer at once,
    and a request the client sends on the connection just then is lost unanswered — when the
    client is quicker than the close. Here ``hold`` seconds pass between the two, with the
    answer's bytes (the whole 500: ``content-length`` and body) on the wire but its end not yet
    told to uvicorn (``more_body``), so a request sent in that time waits in uvicorn's pipeline
    queue and is lost with the connection every time."""

    def __init__(self, hold: float) -> None:
        super().__init__("Internal Server Error", status_code=500, media_type="text/plain")
        self.hold = hold

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 500, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        await asyncio.sleep(self.hold)
        raise RuntimeError("the engine's handler failed")


class ServerThread:
    """Serves an ASGI app with uvicorn on 127.0.0.1 in a daemon thread (ephemeral port unless
    given: a restart may reuse the port)."""

    def __init__(self, app: Any, port: int = 0, config: Any = None) -> None:
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        if config is None:
            config = uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="auto",
                timeout_graceful_shutdown=1,
                timeout_keep_alive=60,
            )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        self._sock = sock
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self._sock.close()


def main(argv: list[str]) -> int:
    """Serves ``argv[0]`` upstreams (named up-0, up-1, …) until stdin closes."""
    count = int(argv[0]) if argv else 2
    delay = float(argv[1]) if len(argv) > 1 else 0.0
    servers = [ServerThread(Upstream(f"up-{i}", delay=delay).app) for i in range(count)]
    print(json.dumps([s.port for s in servers]), flush=True)
    sys.stdin.read()
    for s in servers:
        s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
