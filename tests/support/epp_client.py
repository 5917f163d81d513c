"""An ext_proc client that drives a picker exactly as Envoy does in GIE's setup; a picker runner.

``EnvoyClient.exchange`` plays one HTTP request through the picker and a real upstream, message
by message as Envoy 1.40 sends them with ``processing_mode`` headers ``SEND``, bodies
``FULL_DUPLEX_STREAMED``, trailers ``SEND`` (recorded from a real Envoy in front of kvroute's
picker; ``tests/test_epp_envoy.py`` runs that Envoy):

1. ``request_headers`` (pseudo-headers first, then the caller's headers, ``content-length``,
   ``x-forwarded-proto``, ``x-request-id``; ``end_of_stream`` only without a body), with
   ``metadata_context`` (the subset hint, if any) and ``protocol_config`` on this first message;
2. the body in chunks without ``end_of_stream``, then an empty chunk with ``end_of_stream``;
3. it reads the headers response and the streamed body until ``end_of_stream`` (or an
   ``ImmediateResponse``), checks that the header and ``envoy.lb`` metadata name the same
   endpoint, and connects to that ``ip:port`` with the mutated headers and body (what an
   ``ORIGINAL_DST`` cluster does);
4. ``response_headers`` (``:status`` first) and the upstream's body chunks as they arrive, then an
   empty chunk with ``end_of_stream``, each with ``metadata_context`` ``envoy.lb`` holding the
   picked endpoint and ``x-gateway-destination-endpoint-served``; it collects the streamed body
   the client would see.

``mode="buffered"`` plays Envoy's ``BUFFERED`` body mode instead (one reply per message; the
whole body in one message). ``EppThread`` runs an ``EppServer`` on its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from kvroute.epp import EppServer
from kvroute.epp.config import parse_config

from support.gateway_fleet import Fleet, config_dict

Mode = processing_mode_pb2.ProcessingMode


@dataclass
class Result:
    """What one exchange produced, as the data plane and its client saw it."""

    picked: str | None = None  # the endpoint named by the picker
    status: int | None = None  # the client's status (upstream's, or the immediate response's)
    body: bytes = b""  # what the client received
    immediate: Any = None  # the ImmediateResponse, if any
    request_mutation: Any = None  # the picker's request header mutation
    response_mutation: Any = None  # the picker's response header mutation
    upstream_body: bytes = b""  # the body the upstream received
    upstream_headers: dict[str, str] = field(default_factory=dict)

    @property
    def json(self) -> Any:
        return json.loads(self.body)


def header(key: str, value: str) -> Any:
    return base_pb2.HeaderValue(key=key, raw_value=value.encode())


def metadata(**namespaces: dict[str, Any]) -> Any:
    md = base_pb2.Metadata()
    for ns, fields in namespaces.items():
        s = struct_pb2.Struct()
        s.update(fields)
        md.filter_metadata[ns.replace("__", ".")].CopyFrom(s)
    return md


def mutated(headers: dict[str, str], mutation: Any) -> dict[str, str]:
    out = dict(headers)
    for name in mutation.remove_headers:
        out.pop(name, None)
    for option in mutation.set_headers:
        out[option.header.key] = option.header.raw_value.decode()
    return out


class EnvoyClient:
    """ext_proc streams to a picker at ``127.0.0.1:port``, as Envoy's FULL_DUPLEX_STREAMED."""

    def __init__(self, port: int, *, chunk: int = 16384) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.chunk = chunk
        # httpx's pool costs O(waiting × connections) per request: never let requests wait in it
        self.slots = asyncio.Semaphore(32)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(30, pool=None),
            limits=httpx.Limits(max_connections=32),
            trust_env=False,
        )

    async def close(self) -> None:
        await self.http.aclose()
        await self.channel.close()

    def request_headers(
        self, path: str, body: bytes | None, headers: dict[str, str] | None, subset: Any, mode: Any
    ) -> tuple[dict[str, str], Any]:
        hs = [
            header(":authority", "gateway.local:8081"),
            header(":path", path),
            header(":method", "POST" if body else "GET"),
            header(":scheme", "http"),
            header("accept", "application/json"),
            header("content-type", "application/json"),
            *(header(k, v) for k, v in (headers or {}).items()),
        ]
        if body:
            hs.append(header("content-length", str(len(body))))
        hs += [header("x-forwarded-proto", "http"), header("x-request-id", str(uuid.uuid4()))]
        md = base_pb2.Metadata()
        if subset is not None:
            md = metadata(envoy__lb__subset_hint={"x-gateway-destination-endpoint-subset": subset})
        plain = {h.key: h.raw_value.decode() for h in hs if not h.key.startswith(":")}
        return plain, pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(headers=hs), end_of_stream=not body
            ),
            metadata_context=md,
            protocol_config=pb.ProtocolConfiguration(
                request_body_mode=mode, response_body_mode=mode
            ),
        )

    async def exchange(
        self,
        payload: Any = None,
        *,
        path: str = "/v1/chat/completions",
        headers: dict[str, str] | None = None,
        subset: Any = None,
        raw: bytes | None = None,
        served: str | None = None,
        mode: str = "full_duplex",
        pause: asyncio.Event | None = None,
        picked: asyncio.Event | None = None,
    ) -> Result:
        """One request (see the module docs). ``served`` reports another served endpoint;
        ``picked`` is set after the pick and the exchange then waits for ``pause``."""
        body = raw if raw is not None else (json.dumps(payload).encode() if payload else b"")
        body_mode = Mode.BUFFERED if mode == "buffered" else Mode.FULL_DUPLEX_STREAMED
        call = self.stub.Process()
        result = Result()
        caller, first_message = self.request_headers(path, body, headers, subset, body_mode)
        replies: asyncio.Queue[Any] = asyncio.Queue()

        async def reader() -> None:  # Envoy takes the picker's answers as they arrive
            while True:
                try:
                    reply = await call.read()
                except grpc.aio.AioRpcError as e:
                    reply = e
                await replies.put(reply)
                if not isinstance(reply, pb.ProcessingResponse):
                    return

        async def answer() -> Any:
            reply = await replies.get()
            if isinstance(reply, Exception):
                raise reply
            if reply == grpc.aio.EOF:
                raise AssertionError("the picker closed the stream without answering")
            return reply

        reading = asyncio.ensure_future(reader())
        try:
            await call.write(first_message)
            if body_mode == Mode.BUFFERED:
                first = await answer()
                if first.HasField("immediate_response"):
                    return self._immediate(result, first)
                assert first.HasField("request_headers"), first
                await self._send(
                    call,
                    pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
                )
                reply = await answer()
                if reply.HasField("immediate_response"):
                    return self._immediate(result, reply)
                common = reply.request_body.response
                sent = common.body_mutation.body if common.body_mutation.HasField("body") else body
                dyn = reply.dynamic_metadata
            else:
                if body:
                    chunks = [body[i : i + self.chunk] for i in range(0, len(body), self.chunk)]
                    for i, chunk in enumerate([*chunks, b""]):
                        message = pb.ProcessingRequest(
                            request_body=pb.HttpBody(body=chunk, end_of_stream=i == len(chunks)),
                            metadata_context=base_pb2.Metadata(),
                        )
                        if not await self._send(call, message):
                            break  # the picker answered early (an immediate response) and ended
                reply = await answer()
                if reply.HasField("immediate_response"):
                    return self._immediate(result, reply)
                assert reply.HasField("request_headers"), reply
                common = reply.request_headers.response
                assert common.clear_route_cache
                dyn = reply.dynamic_metadata
                sent = b""
                if body:
                    while True:
                        part = await answer()
                        streamed = part.request_body.response.body_mutation.streamed_response
                        sent += streamed.body
                        if streamed.end_of_stream:
                            break
            result.request_mutation = common.header_mutation
            upstream_headers = mutated(caller, common.header_mutation)
            result.picked = upstream_headers.get("x-gateway-destination-endpoint")
            lb = dyn.fields["envoy.lb"].struct_value.fields
            assert lb["x-gateway-destination-endpoint"].string_value == result.picked
            result.upstream_body = sent
            result.upstream_headers = upstream_headers
            if picked is not None:
                picked.set()
            if pause is not None:
                await pause.wait()
            served = served or (result.picked or "").split(",")[0]  # the list's first
            lb_md = metadata(
                envoy__lb={
                    "x-gateway-destination-endpoint": result.picked,
                    "x-gateway-destination-endpoint-served": served,
                }
            )
            url = f"http://{served}{path}"
            send_headers = {
                k: v for k, v in upstream_headers.items() if k.lower() != "content-length"
            }
            async with (
                self.slots,
                self.http.stream(
                    "POST" if body else "GET", url, headers=send_headers, content=sent or None
                ) as resp,
            ):
                result.status = resp.status_code
                rh = [header(":status", str(resp.status_code))]
                rh += [header(k, v) for k, v in resp.headers.items()]
                await call.write(
                    pb.ProcessingRequest(
                        response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=rh)),
                        metadata_context=lb_md,
                    )
                )
                reply = await answer()
                assert reply.HasField("response_headers"), reply
                result.response_mutation = reply.response_headers.response.header_mutation
                async for chunk in resp.aiter_raw():
                    await call.write(
                        pb.ProcessingRequest(
                            response_body=pb.HttpBody(body=chunk), metadata_context=lb_md
                        )
                    )
            await call.write(
                pb.ProcessingRequest(
                    response_body=pb.HttpBody(end_of_stream=True), metadata_context=lb_md
                )
            )
            while True:
                reply = await answer()
                assert reply.HasField("response_body"), reply
                if body_mode == Mode.BUFFERED:
                    break
                streamed = reply.response_body.response.body_mutation.streamed_response
                result.body += streamed.body
                if streamed.end_of_stream:
                    break
            await call.done_writing()
            return result
        finally:
            reading.cancel()
            call.cancel()

    @staticmethod
    async def _send(call: Any, message: Any) -> bool:
        """Writes a message like Envoy, which keeps streaming until it reads the picker's answer:
        False when the stream no longer takes messages — the picker answered early and ended it;
        what it sent is read next (and a stream that really failed fails that read)."""
        try:
            await call.write(message)
            return True
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return False

    @staticmethod
    def _immediate(result: Result, reply: Any) -> Result:
        result.immediate = reply.immediate_response
        result.status = reply.immediate_response.status.code
        result.body = reply.immediate_response.body
        return result


def epp_config(fleet: Fleet, *, epp: dict[str, Any] | None = None, **sections: Any) -> dict:
    """The gateway tests' config over ``fleet`` (``gateway_fleet.config_dict``) as ``kvroute epp``
    reads it: the direct models in ``[epp]``, ephemeral ports, fast health probing."""
    data = config_dict(fleet, **sections)
    gateway = data.pop("gateway")
    data["epp"] = {
        "models": gateway["models"],
        "health_interval": 0.05,
        "eject_seconds": 0.2,
        **(epp or {}),
    }
    return data


class EppThread:
    """An ``EppServer`` (from a config dict) on its own event loop in a daemon thread."""

    def __init__(self, config: dict[str, Any], **kw: Any) -> None:
        config = {**config, "epp": {"metrics_port": 0, "port": 0, **config.get("epp", {})}}
        self.server = EppServer(parse_config(config), **kw)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.server.start(), timeout=120)  # loads the kubernetes client for [epp.pool]
        self.port = self.server.port
        self.router = self.server.router

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.server.metrics_port}/metrics").text

    def address(self, worker: str) -> str:
        return self.server.picker.members[worker].address

    def stop(self) -> None:
        try:
            self.call(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def __enter__(self) -> EppThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
