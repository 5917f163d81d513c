"""The Responses API's edges, each answer to the byte: refusals and their texts, what
``chat_view`` does with any JSON body (a view or a ``RequestError``, never another exception),
SSE events read as the SSE format says (against a reference written from it), the answers of the
by-id routes and of a follow-up that cannot be served, and the owners' wire format at its
bounds."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.responses import ResponseShare, decode_owners, encode_owners
from kvroute.gateway.prompt import RequestError
from kvroute.gateway.request import Incoming
from kvroute.gateway.responses import ResponseOwners, chat_view, event_payload
from support.gateway_fleet import Fleet, GatewayServer, config_dict, wait_for

# ---- chat_view -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input": 3}, "'input' must be a string or a list of items"),
        ({"input": ["hi"]}, "'input' items must be objects, got str"),
        ({"input": [{"type": "x"}]}, "'input' has an item of unsupported type 'x'"),
        (
            {"input": [{"type": "reasoning", "encrypted_content": "e"}]},
            "'input' has a reasoning item with encrypted_content (unsupported)",
        ),
        ({"input": "x", "tools": {}}, "'tools' must be a list"),
        ({"input": "x", "tools": [1]}, "'tools' entries must be objects, got int"),
        ({"input": "x", "chat_template_kwargs": 1}, "'chat_template_kwargs' must be an object"),
        ({"input": "x", "instructions": 1}, "'instructions' must be a string, got int"),
        ({"input": "x", "reasoning": []}, "'reasoning' must be an object, got list"),
        (
            {"input": "x", "previous_response_id": 1.5},
            "'previous_response_id' must be a string, got float",
        ),
    ],
)
def test_refusals_say_what_is_wrong(body, message):
    with pytest.raises(RequestError) as e:
        chat_view(body)
    assert str(e.value) == message


def test_what_the_view_holds():
    user = {"role": "user", "content": "q"}
    v = chat_view(
        {"input": [user], "tools": [{"type": "function", "name": "f"}], "tool_choice": "none"}
    )
    assert v["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert v["tool_choice"] == "none" and v["add_generation_prompt"] is True
    assert "tool_choice" not in chat_view({"input": "x", "tool_choice": "none"})
    for status in ("in_progress", "incomplete"):
        for kind in ("message", "reasoning"):
            last = {"type": kind, "role": "assistant", "content": "a", "status": status}
            v = chat_view({"input": [user, last]})
            assert v["continue_final_message"] is True and v["add_generation_prompt"] is False
    done = {"role": "assistant", "content": "a", "status": "completed"}
    assert chat_view({"input": [user, done]})["continue_final_message"] is False
    call = {"type": "custom_tool_call", "call_id": "c", "name": "run"}  # no input: ""
    args = chat_view({"input": [user, call]})["messages"][1]["tool_calls"][0]["function"]
    assert args == {"name": "run", "arguments": '{"input": ""}'}
    call["input"] = "ls ü"  # as vLLM encodes it: JSON, non-ASCII kept
    args = chat_view({"input": [user, call]})["messages"][1]["tool_calls"][0]["function"]
    assert args["arguments"] == '{"input": "ls ü"}'
    plain = {"type": "function_call", "call_id": "c", "name": "f", "namespace": ""}
    named = chat_view({"input": [user, plain]})["messages"][1]["tool_calls"][0]["function"]
    assert named["name"] == "f"  # an empty namespace names nothing
    # Only a message or a reasoning item is continued, whatever the others' status.
    pending = {**plain, "status": "in_progress"}
    assert chat_view({"input": [user, pending]})["continue_final_message"] is False
    # Reasoning from a content list only; an odd first part gives none, never an error.
    odd_parts = {"type": "reasoning", "content": "abc", "summary": [{"text": "s"}]}
    assert chat_view({"input": [user, odd_parts]})["messages"][1]["reasoning"] == "s"
    odd_first = {"type": "reasoning", "content": ["x"], "summary": []}
    assert chat_view({"input": [user, odd_first]})["messages"][1]["reasoning"] is None
    # A tool listing tools is flattened only when it is a namespace.
    odd = {"type": "web_search", "tools": [{"type": "function", "name": "f"}]}
    assert chat_view({"input": "x", "tools": [odd]})["tools"] == []
    # A reasoning item with neither content nor summary: empty reasoning.
    bare = chat_view({"input": [user, {"type": "reasoning", "summary": []}]})["messages"][1]
    assert bare == {"role": "assistant", "reasoning": ""}
    # An assistant message after one with content is a message of its own.
    two = chat_view(
        {
            "input": [
                user,
                {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "b"},
            ]
        }
    )
    assert [m.get("content") for m in two["messages"]] == ["q", "a", "b"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
KEYS = st.sampled_from(
    [
        "type",
        "role",
        "content",
        "summary",
        "call_id",
        "name",
        "namespace",
        "arguments",
        "input",
        "output",
        "status",
        "encrypted_content",
        "tools",
        "text",
    ]
)
TYPES = st.sampled_from(
    [
        "message",
        "reasoning",
        "function_call",
        "custom_tool_call",
        "function_call_output",
        "custom_tool_call_output",
        "namespace",
        "function",
        "custom",
        "x",
    ]
)
ITEM = st.dictionaries(KEYS, JSON | TYPES, max_size=6)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "input": JSON | st.lists(ITEM | JSON, max_size=5),
        "instructions": JSON,
        "tools": JSON | st.lists(ITEM | JSON, max_size=4),
        "tool_choice": JSON,
        "reasoning": JSON | st.dictionaries(st.just("effort"), JSON),
        "chat_template_kwargs": JSON,
        "previous_response_id": JSON,
    },
)


@settings(max_examples=400, deadline=None)
@given(BODY)
def test_any_body_gives_a_view_or_says_what_is_wrong(body):
    before = json.dumps(body, sort_keys=True)
    try:
        view = chat_view(body)
    except RequestError:
        return
    finally:
        assert json.dumps(body, sort_keys=True) == before  # the body sent upstream is untouched
    assert isinstance(view["messages"], list)


# ---- SSE events ------------------------------------------------------------------------------


def reference_event(event: bytes) -> tuple[bytes, Any]:
    """The SSE format read literally: lines split on LF (a CR before it dropped); ``event:``
    gives the type, ``data:`` lines (one leading space dropped) joined by LF are the data; without
    an ``event:`` field, the data's ``type`` is the type."""
    kind, data = b"", []
    for line in event.split(b"\n"):
        if line.endswith(b"\r"):
            line = line[:-1]
        field, colon, value = line.partition(b":")
        if not colon:
            continue
        if value.startswith(b" "):
            value = value[1:]
        if field == b"event":
            kind = value.strip()
        elif field == b"data":
            data.append(value)
    payload = None
    if data:
        try:
            payload = json.loads(b"\n".join(data))
        except ValueError:
            payload = None
    if not kind and isinstance(payload, dict) and isinstance(payload.get("type"), str):
        kind = payload["type"].encode()
    return kind, payload


LINE = st.one_of(
    st.sampled_from([b"event: response.created", b"event:response.completed", b": keep-alive"]),
    st.builds(
        lambda d, sp: b"data:" + (b" " if sp else b"") + json.dumps(d).encode(),
        st.dictionaries(st.sampled_from(["type", "x"]), st.sampled_from(["a", "error", 1])),
        st.booleans(),
    ),
    st.sampled_from([b'data: {"a":', b"data: 1}", b"data:", b"id: 7"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(LINE, min_size=1, max_size=5), st.booleans())
def test_events_are_read_as_the_sse_format_says(lines, crlf):
    end = b"\r\n" if crlf else b"\n"
    event = end.join(lines) + end + end
    assert event_payload(event) == reference_event(event)


# ---- through a gateway -----------------------------------------------------------------------


@pytest.fixture
def fleet():
    f = Fleet(2)
    yield f
    f.close()


def raw_get(url: str, target: bytes) -> tuple[int, bytes]:
    """``GET target`` as raw bytes (a query no client library would send)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def test_the_by_id_answers(fleet):
    with GatewayServer(config_dict(fleet, gateway={"max_response_bytes": 4096})) as gw:
        client = gw.client("sk-acme")
        rid = client.responses.create(model="ep-acme", input="keep me").id
        holder = next(u for u in fleet.upstreams if rid in u.stored)
        auth = {"authorization": "Bearer sk-acme"}

        def call(method: str, path: str, **kw: Any) -> httpx.Response:
            headers = {**auth, **kw.pop("headers", {})}
            return httpx.request(method, gw.url + path, headers=headers, timeout=20, **kw)

        r = call("GET", f"/v1/responses/{rid}", headers={"x-request-id": "mine-1"})
        assert r.headers["x-request-id"] == "mine-1" == holder.records[-1]["upstream_id"]
        assert holder.records[-1]["query"] == ""  # none given, none sent
        assert r.headers["content-type"] == "application/json"
        r = call("GET", f"/v1/responses/{rid}", headers={"x-request-id": "not mine!"})
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        assert holder.records[-1]["upstream_id"] == r.headers["x-request-id"]

        def error(message: str, kind: str, code: str | None) -> dict[str, Any]:
            return {"error": {"message": message, "type": kind, "param": None, "code": code}}

        r = call("GET", "/v1/responses/")
        assert r.status_code == 404 and r.json() == error(
            "not found", "invalid_request_error", "not_found"
        )
        r = call("PUT", f"/v1/responses/{rid}/cancel")
        assert r.status_code == 405
        assert r.json() == error(
            f"use POST on /v1/responses/{rid}/cancel", "invalid_request_error", "method_not_allowed"
        )
        r = call("GET", "/v1/responses/resp_none", headers={"x-request-id": "mine-2"})
        assert r.headers["x-request-id"] == "mine-2"  # on the gateway's own answers too
        assert r.status_code == 404 and r.json() == {
            "error": {
                "message": "Response with id 'resp_none' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
        # A query outside URL characters: this listener refuses the request line itself; a
        # server that passes it on gets the gateway's own 400 (called here directly).
        before = len(fleet.records())
        status, _ = raw_get(gw.url, f"/v1/responses/{rid}?a=\xfc".encode("latin-1"))
        assert status == 400 and len(fleet.records()) == before
        scope = {
            "type": "http",
            "method": "GET",
            "path": f"/v1/responses/{rid}",
            "query_string": b"a=\xfc b",
            "headers": [(b"authorization", b"Bearer sk-acme")],
        }
        answer = asyncio.run(gw.gateway.responses.by_id(Incoming(scope, None)))
        assert answer.status_code == 400 and json.loads(answer.body) == error(
            "the query string has characters not allowed in a URL", "invalid_request_error", None
        )
        holder.reply_bytes = 0
        big = {"id": rid, "object": "response", "text": "x" * 5000}
        holder.responses[rid] = big
        r = call("GET", f"/v1/responses/{rid}")
        assert r.status_code == 502
        assert r.json()["error"]["type"] == "upstream_error"
        assert r.json()["error"]["code"] == "upstream_failed"
        assert r.json()["error"]["message"].startswith(f"upstream {holder.name} failed: ")
        # A replay is streamed through, not read whole: past max_response_bytes too.
        replay = call("GET", f"/v1/responses/{rid}?stream=true")
        assert replay.status_code == 200 and replay.text.count("x" * 5000) == 1
        gw.gateway.router.set_healthy(holder.name, False)
        r = call("GET", f"/v1/responses/{rid}")
        assert r.status_code == 503 and r.json() == error(
            f"response {rid!r} is held by worker {holder.name}, which cannot serve it now",
            "service_unavailable",
            "previous_response_unavailable",
        )


def test_a_follow_up_for_another_target_reads_as_an_unknown_id(fleet):
    """Word for word what the engine answers for an id it does not hold."""
    with GatewayServer(config_dict(fleet)) as gw:
        rid = gw.client("sk-acme").responses.create(model="ep-acme", input="mine").id
        before = len(fleet.records())

        def follow(previous: str) -> httpx.Response:
            body = {"model": "base-model", "input": "x", "previous_response_id": previous}
            return httpx.post(gw.url + "/v1/responses", json=body, timeout=20)

        foreign, unknown = follow(rid), follow("resp_other")
        assert foreign.status_code == unknown.status_code == 404
        assert foreign.json() == json.loads(json.dumps(unknown.json()).replace("resp_other", rid))
        assert len(fleet.records()) == before  # (the double records only what it serves)


def test_a_follow_up_whose_worker_is_full_is_shed(fleet):
    cfg = config_dict(fleet, gateway={"max_in_flight_per_worker": 1})
    with GatewayServer(cfg) as gw:
        rid = gw.client(None).responses.create(model="base-model", input="hold").id
        holder = next(u for u in fleet.upstreams if rid in u.stored)
        holder.stall = 3.0
        body = {"model": "base-model", "input": "x" * 400, "previous_response_id": rid}
        import threading

        first = threading.Thread(
            target=lambda: httpx.post(gw.url + "/v1/responses", json=body, timeout=20)
        )
        first.start()
        wait_for(lambda: gw.active().get(holder.name) == 1, "the first follow-up in flight")
        # Routed with its tokens: the router's load holds its prefill.
        assert gw.gateway.router.load(holder.name)["prefill_blocks"] > 0
        r = httpx.post(gw.url + "/v1/responses", json=body, timeout=20)
        holder.stall = 0.0
        first.join()
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": f"worker {holder.name}, which holds {rid}, is full",
            "type": "rate_limit_error",
            "param": None,
            "code": "worker_queue",
        }
        gw.gateway.router.set_healthy(holder.name, False)
        r = httpx.post(gw.url + "/v1/responses", json=body, timeout=20)
        assert r.status_code == 503 and r.json()["error"] == {
            "message": f"previous_response_id {rid!r} is held by worker {holder.name}, which "
            "cannot serve it now",
            "type": "service_unavailable",
            "param": None,
            "code": "previous_response_unavailable",
        }


# ---- the owners' wire format -----------------------------------------------------------------


def test_names_at_the_bounds():
    for n in (1, 256):
        entry = ("resp_1", "w" * n, "t" * n)
        assert decode_owners(encode_owners("r", [entry])) == ("r", [entry])
    for worker, target in (("", "t"), ("w", ""), ("w" * 257, "t"), ("w", "t" * 257)):
        with pytest.raises(ValueError, match="a name is empty or longer than 256"):
            decode_owners(encode_owners("r", [("resp_1", worker, target)]))


def test_what_could_not_be_sent_goes_first_in_the_next_message():
    owners = ResponseOwners()
    share = ResponseShare(owners, ClusterConfig(), ["w"])
    share.connected = True
    owners.learn("resp_2", "w", "t")
    share.restore([("resp_0", "w", "t"), ("resp_1", "w", "t")])
    assert [e[0] for e in share.drain()] == ["resp_0", "resp_1", "resp_2"]


def test_an_odd_created_event_teaches_nothing():
    from kvroute.gateway.responses_api import ResponsesApi

    api = ResponsesApi(None)  # type: ignore[arg-type]
    for data in (b"[1]", b"1", b"{", b'{"response": 1}'):
        api.learn_stream(None, None, [b"event: response.created\ndata: " + data + b"\n\n"])
    assert len(api.owners) == 0
