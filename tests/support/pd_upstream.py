"""Test upstreams that implement the engines' prefill/decode hand-over protocols.

Both keep ``support.gateway_upstream.Upstream``'s behaviour (a modelled prefix cache, records,
fault injection) and add the hand-over, with the fields written from the engines' public sources
(vLLM's NIXL connector and its proxy examples; SGLang's ``mini_lb`` and bootstrap server), and an
``Exchange`` standing for the KV transport between them, which checks that a decode worker gets
exactly the KV its prefill computed, once.

- ``VllmPd``: a request with ``kv_transfer_params.do_remote_decode`` is a prefill: it must be
  non-streamed, ``max_tokens = 1`` (and ``max_completion_tokens = 1`` if given), without
  ``stream_options``, ``min_tokens``, ``min_completion_tokens``; its reply carries
  ``kv_transfer_params`` (``do_remote_prefill = true``, ``do_remote_decode = false``,
  ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
  ``remote_port``, ``tp_size``, ``dcp_size``, ``pp_size``, ``remote_num_tokens``,
  ``remote_blocks_expiry_time``, ``transfer_mode``: what vLLM 0.32's NIXL pull scheduler
  returns) and the KV is offered on the exchange. A request with ``do_remote_prefill`` is a
  decode: it pulls that KV (which must exist, be for the same prompt and salt, come with the
  prefill's parameters unchanged, and not have been pulled before) and stores it in its own
  cache. Anything else is an ordinary request (a decode worker prefilling locally).
  ``VllmPd(shared_storage=True)`` is vLLM with its shared-storage ``ExampleConnector``: the
  prefill reply carries no ``kv_transfer_params`` and leaves the KV in storage under its prompt;
  a request without them loads its prompt's KV from there when present (any number of times).
- ``SglangPd(mode="prefill" | "decode")``: every request needs ``bootstrap_host``,
  ``bootstrap_port`` and ``bootstrap_room`` (an int in ``[0, 2^63)``), else 400 (a PD-mode
  SGLang server serves nothing else). The prefill server checks that host and port are its own and
  publishes the room's KV; the decode server waits for the room (as SGLang's decode waits for its
  bootstrap), checks the prompt and the prefill's address, and answers; a decode whose client
  went away while waiting is recorded as aborted.

Protocol violations are answered 500 and listed in ``Exchange.errors`` (tests assert it empty).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from support.gateway_upstream import Upstream, reference_tokens

ROOM_LIMIT = 1 << 63


class Exchange:
    """The KV transport between prefill and decode test upstreams."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.offers: dict[tuple[str, str], dict[str, Any]] = {}  # (engine, request id) → KV
        self.rooms: dict[int, dict[str, Any]] = {}
        self.pulled: list[tuple[str, str]] = []
        self.consumed_rooms: list[int] = []
        self.aborted_rooms: list[int] = []
        self.errors: list[str] = []

    def error(self, message: str) -> Response:
        with self.lock:
            self.errors.append(message)
        return JSONResponse({"error": {"message": message, "type": "server_error"}}, 500)


def fingerprint(body: dict[str, Any], text: str | None, tokens: list[int] | None) -> str:
    """The prompt and salt a KV belongs to."""
    toks = tokens if tokens is not None else reference_tokens(text or "")
    return json.dumps([toks, body.get("cache_salt")])


class PdUpstream(Upstream):
    """An upstream that records every request body it receives (``bodies``)."""

    def __init__(self, name: str, exchange: Exchange, **kw: Any) -> None:
        self.exchange = exchange
        super().__init__(name, **kw)

    def reset(self) -> None:
        super().reset()
        self.bodies: list[dict[str, Any]] = []

    def _store(self, fp: str) -> None:
        """Stores a received prompt's KV in this engine's cache (as the engine does)."""
        from kvroute import BlockHasher

        toks, salt = json.loads(fp)
        with self.lock:
            self.cache.insert(BlockHasher(16, salt=salt).hash(toks))

    async def _answer(
        self,
        request: Request,
        body: dict[str, Any],
        text: str | None,
        *,
        chat: bool,
        tokens: list[int] | None = None,
    ) -> Response:
        with self.lock:
            self.bodies.append(body)
        return await self._pd(request, body, text, chat, tokens)

    async def _pd(self, request, body, text, chat, tokens) -> Response:
        return await super()._answer(request, body, text, chat=chat, tokens=tokens)


class VllmPd(PdUpstream):
    """vLLM with a KV connector (see the module docs)."""

    def __init__(
        self, name: str, exchange: Exchange, *, shared_storage: bool = False, **kw: Any
    ) -> None:
        self.shared_storage = shared_storage
        super().__init__(name, exchange, **kw)

    async def _pd(self, request, body, text, chat, tokens) -> Response:
        params = body.get("kv_transfer_params")
        fp = fingerprint(body, text, tokens)
        ex = self.exchange
        if self.shared_storage:
            return await self._shared_storage(request, body, text, chat, tokens, params, fp)
        if isinstance(params, dict) and params.get("do_remote_decode"):
            bad = [
                k
                for k, ok in (
                    ("stream", body.get("stream") is False),
                    ("max_tokens", body.get("max_tokens") == 1),
                    (
                        "max_completion_tokens",
                        body.get("max_completion_tokens", 1) == 1,
                    ),
                    ("stream_options", "stream_options" not in body),
                    ("min_tokens", "min_tokens" not in body),
                    ("min_completion_tokens", "min_completion_tokens" not in body),
                    ("do_remote_prefill", params.get("do_remote_prefill") is False),
                )
                if not ok
            ]
            if bad:
                return ex.error(f"{self.name}: bad prefill request fields {bad}: {body}")
            resp = await super()._pd(request, body, text, chat, tokens)
            if resp.status_code != 200:
                return resp
            reply = json.loads(resp.body)
            rid = request.headers.get("x-request-id", "")
            blocks = len(json.loads(fp)[0]) // 16
            reply["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": list(range(100, 100 + blocks)),
                "remote_engine_id": f"engine-{self.name}",
                "remote_request_id": rid,
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": len(json.loads(fp)[0]),
                "remote_blocks_expiry_time": time.time() + 480.0,
                "transfer_mode": "pull",
            }
            with ex.lock:
                ex.offers[(f"engine-{self.name}", rid)] = {
                    "fp": fp,
                    "params": reply["kv_transfer_params"],
                }
            return JSONResponse(reply)
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            key = (params.get("remote_engine_id"), params.get("remote_request_id"))
            with ex.lock:
                offer = ex.offers.pop(key, None)
                if offer is not None:
                    ex.pulled.append(key)
            if offer is None:
                return ex.error(f"{self.name}: no KV offered for {key} (or pulled twice)")
            if offer["fp"] != fp or params != offer["params"]:
                return ex.error(f"{self.name}: the KV of {key} is for another prompt")
            self._store(fp)
        elif params is not None:
            return ex.error(f"{self.name}: unexpected kv_transfer_params {params}")
        return await super()._pd(request, body, text, chat, tokens)

    async def _shared_storage(self, request, body, text, chat, tokens, params, fp) -> Response:
        ex = self.exchange
        key = ("storage", fp)
        if isinstance(params, dict) and params.get("do_remote_decode"):
            resp = await super()._pd(request, body, text, chat, tokens)
            if resp.status_code == 200:
                with ex.lock:
                    ex.offers[key] = {"fp": fp, "params": None}
            return resp
        if params is not None:
            return ex.error(f"{self.name}: unexpected kv_transfer_params {params}")
        with ex.lock:
            found = key in ex.offers
            if found:
                ex.pulled.append(key)
        if found:
            self._store(fp)
        return await super()._pd(request, body, text, chat, tokens)


class SglangPd(PdUpstream):
    """An SGLang server in PD mode (see the module docs)."""

    def __init__(
        self,
        name: str,
        exchange: Exchange,
        *,
        mode: str,
        bootstrap_port: int = 8998,
        wait: float = 5.0,
        **kw: Any,
    ) -> None:
        self.mode = mode
        self.bootstrap_port = bootstrap_port
        self.wait = wait
        super().__init__(name, exchange, **kw)

    async def _pd(self, request, body, text, chat, tokens) -> Response:
        ex = self.exchange
        host, port, room = (
            body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
        )
        if not (
            isinstance(host, str)
            and isinstance(port, int)
            and isinstance(room, int)
            and not isinstance(room, bool)
            and 0 <= room < ROOM_LIMIT
        ):
            return JSONResponse(
                {"error": {"message": f"{self.mode} server needs bootstrap fields"}}, 400
            )
        fp = fingerprint(body, text, tokens)
        if self.mode == "prefill":
            if (host, port) != ("127.0.0.1", self.bootstrap_port):
                return ex.error(f"{self.name}: bootstrap {host}:{port} is not this server's")
            resp = await super()._pd(request, body, text, chat, tokens)
            if resp.status_code == 200:
                with ex.lock:
                    if room in ex.rooms or room in ex.consumed_rooms:
                        ex.errors.append(f"{self.name}: room {room} reused")
                    ex.rooms[room] = {"fp": fp, "bootstrap": (host, port)}
            return resp
        deadline = time.monotonic() + self.wait
        while True:
            with ex.lock:
                got = ex.rooms.pop(room, None)
                if got is not None:
                    ex.consumed_rooms.append(room)
            if got is not None:
                break
            if await request.is_disconnected():
                with ex.lock:
                    ex.aborted_rooms.append(room)
                return Response(status_code=499)
            if time.monotonic() > deadline:
                return JSONResponse({"error": {"message": f"room {room}: KV never came"}}, 500)
            await asyncio.sleep(0.005)
        if got["fp"] != fp or got["bootstrap"] != (host, port):
            return ex.error(f"{self.name}: room {room} holds another prompt or prefill")
        self._store(fp)
        return await super()._pd(request, body, text, chat, tokens)
