"""The wire facts of the endpoint-picker protocol: names, and Envoy ``ext_proc`` message builders.

GIE's endpoint-picker protocol (v1.0.0) over Envoy's ``envoy.service.ext_proc.v3``:

- The data plane may restrict the pick to a subset: filter metadata namespace
  ``envoy.lb.subset_hint``, key ``x-gateway-destination-endpoint-subset``, a list of ``ip:port``
  (or bare ``ip``: every port of it) — as a list value or one comma-separated string.
- The picker answers the request headers with the header ``x-gateway-destination-endpoint:
  ip:port`` and the same value as dynamic metadata ``envoy.lb`` → ``x-gateway-destination-endpoint``
  (never two different values), with ``clear_route_cache`` so the proxy routes on it.
- No eligible endpoint: ``ImmediateResponse`` 503; a shed request: 429.
- On the response path the data plane reports the endpoint that served the request as metadata
  ``envoy.lb`` → ``x-gateway-destination-endpoint-served``.

Envoy sends header values in ``raw_value`` (``value`` on old versions); both are read. Streamed
body chunks sent back are at most ``BODY_CHUNK`` bytes (Envoy recommends ≤ 64 KiB).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

__all__ = [
    "BODY_CHUNK",
    "DESTINATION_HEADER",
    "DESTINATION_NAMESPACE",
    "ENDPOINT_HEADER",
    "FAIRNESS_HEADER",
    "OBJECTIVE_HEADER",
    "SERVED_KEY",
    "SLO_TPOT_HEADER",
    "SLO_TTFT_HEADER",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "BodyMode",
    "body_response",
    "error_body",
    "headers_of",
    "headers_response",
    "immediate",
    "metadata_value",
    "served_of",
    "streamed_body",
    "subset_of",
    "trailers_response",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
#: llm-d's latency objectives, in milliseconds.
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
#: kvroute's own: names a dedicated endpoint (else the body's ``model`` may name one).
ENDPOINT_HEADER = "x-kvroute-endpoint"

BODY_CHUNK = 62_000

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode


def headers_of(message: Any) -> dict[str, str]:
    """An ``HttpHeaders`` message's headers (lower-case names; repeated ones joined by ``,``)."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def _python(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [_python(v) for v in value.list_value.values]
    if kind == "struct_value":
        return {k: _python(v) for k, v in value.struct_value.fields.items()}
    if kind == "number_value":
        return value.number_value
    if kind == "bool_value":
        return value.bool_value
    return None


def metadata_value(request: Any, namespace: str, key: str) -> Any:
    """``metadata_context.filter_metadata[namespace][key]`` as a Python value (None if absent)."""
    ns = request.metadata_context.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return _python(ns.fields[key])


def subset_of(request: Any) -> list[str] | None:
    """The subset hint's endpoints (None: no hint; an empty list: a hint that allows nothing)."""
    value = metadata_value(request, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        ns = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        return [] if ns is not None and SUBSET_KEY in ns.fields else None
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if isinstance(item, str):
            out.extend(p.strip() for p in item.split(",") if p.strip())
    return out


def served_of(request: Any) -> str | None:
    """The endpoint the data plane reports as having served the request (first of a list)."""
    value = metadata_value(request, DESTINATION_NAMESPACE, SERVED_KEY)
    if isinstance(value, list):
        value = value[0] if value else None
    if not isinstance(value, str):
        return None
    first = value.split(",", 1)[0].strip()
    return first or None


def _set_headers(headers: Mapping[str, str]) -> list[Any]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for k, v in headers.items()
    ]


def _common(
    set_headers: Mapping[str, str] | None,
    remove: Iterable[str],
    clear_route_cache: bool,
    body: bytes | None = None,
) -> Any:
    common = pb.CommonResponse(clear_route_cache=clear_route_cache)
    if set_headers or remove:
        common.header_mutation.CopyFrom(
            pb.HeaderMutation(set_headers=_set_headers(set_headers or {}), remove_headers=remove)
        )
    if body is not None:
        common.body_mutation.body = body
    return common


def _metadata(destination: str | None) -> struct_pb2.Struct | None:
    if destination is None:
        return None
    md = struct_pb2.Struct()
    md.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: destination}})
    return md


def headers_response(
    *,
    request: bool = True,
    set_headers: Mapping[str, str] | None = None,
    remove: Iterable[str] = (),
    destination: str | None = None,
) -> Any:
    """A ``HeadersResponse``; with ``destination``, the pick (header + ``envoy.lb`` metadata)."""
    headers = dict(set_headers or {})
    if destination is not None:
        headers[DESTINATION_HEADER] = destination
    common = _common(headers, remove, clear_route_cache=destination is not None and request)
    reply = pb.HeadersResponse(response=common)
    md = _metadata(destination)
    if request:
        return pb.ProcessingResponse(request_headers=reply, dynamic_metadata=md)
    return pb.ProcessingResponse(response_headers=reply, dynamic_metadata=md)


def body_response(
    *,
    request: bool = True,
    set_headers: Mapping[str, str] | None = None,
    remove: Iterable[str] = (),
    destination: str | None = None,
    body: bytes | None = None,
) -> Any:
    """A ``BodyResponse`` (buffered modes): may carry the pick and replace the whole body."""
    headers = dict(set_headers or {})
    if destination is not None:
        headers[DESTINATION_HEADER] = destination
    common = _common(headers, remove, clear_route_cache=destination is not None, body=body)
    reply = pb.BodyResponse(response=common)
    if request:
        return pb.ProcessingResponse(request_body=reply, dynamic_metadata=_metadata(destination))
    return pb.ProcessingResponse(response_body=reply)


def streamed_body(data: bytes, end_of_stream: bool, *, request: bool) -> Iterator[Any]:
    """``FULL_DUPLEX_STREAMED`` body responses carrying ``data`` in chunks of ≤ ``BODY_CHUNK``."""
    view = memoryview(data)
    start = 0
    while True:
        chunk = bytes(view[start : start + BODY_CHUNK])
        start += len(chunk)
        last = start >= len(data)
        streamed = pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream and last)
        reply = pb.BodyResponse(
            response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        )
        if request:
            yield pb.ProcessingResponse(request_body=reply)
        else:
            yield pb.ProcessingResponse(response_body=reply)
        if last:
            return


def trailers_response(*, request: bool) -> Any:
    if request:
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def error_body(message: str, kind: str, code: str | None) -> bytes:
    """An OpenAI-style error object, as the gateway answers."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json.dumps(body, ensure_ascii=False).encode()


def immediate(
    status: int, body: bytes, *, headers: Mapping[str, str] | None = None, details: str = ""
) -> Any:
    """An ``ImmediateResponse``: the data plane answers the client itself (JSON body)."""
    reply = pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(
            set_headers=_set_headers({"content-type": "application/json", **(headers or {})})
        ),
        body=body,
        details=details,
    )
    return pb.ProcessingResponse(immediate_response=reply)
