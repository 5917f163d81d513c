"""``POST /v1/responses`` through the gateway (``kvroute.gateway.responses``).

- The routing tokens against vLLM's own rendering: the vectors ``make e2e`` captured from a
  vLLM 0.32 engine's ``POST /v1/responses/render`` (``tests/data/vectors``), rendered here by
  the tiny Llama's chat template and tokenizer.
- Through a real gateway and the OpenAI SDK, over test upstreams that model vLLM's Responses
  server (``support.gateway_upstream``: its store, its 404 for a response it does not hold, its
  events): answers, streams, usage learned by the router, a follow-up kept on the worker that
  holds its previous response, failures before any output retried.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from kvroute.gateway.errors import EMPTY_STREAM, STREAM_ERROR
from kvroute.gateway.prompt import ModelTokenizer, RequestError
from kvroute.gateway.responses import ResponseOwners, chat_usage, chat_view
from kvroute.gateway.stream import responses_failure
from support.gateway_fleet import Fleet, GatewayServer, config_dict, wait_for
from support.gateway_upstream import expected_cached, reference_render

DATA = Path(__file__).resolve().parent / "data"
VECTORS = json.loads((DATA / "vectors" / "vllm_0.32.0_responses_render.json").read_text("utf-8"))
ECHO = json.loads((DATA / "vectors" / "vllm_0.32.0_responses_template.json").read_text("utf-8"))
SYSTEM = "You are the support agent of a large shop. " * 12  # several 16-token blocks


@pytest.fixture(scope="module")
def tiny() -> ModelTokenizer:
    return ModelTokenizer(str(DATA / "tiny_llama"))


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: str(c["request"])[:60])
def test_routing_tokens_are_the_engines(tiny, case):
    assert tiny.chat_tokens(chat_view(case["request"])).tolist() == case["tokens"]


@pytest.fixture(scope="module")
def echo(tmp_path_factory) -> ModelTokenizer:
    """The tiny Llama's tokenizer with the template that prints what it is given."""
    root = tmp_path_factory.mktemp("echo")
    for f in (DATA / "tiny_llama").iterdir():
        shutil.copy(f, root / f.name)
    (root / "chat_template.jinja").write_text(ECHO["template"])
    return ModelTokenizer(str(root))


@pytest.mark.parametrize("case", ECHO["cases"], ids=lambda c: str(c["request"])[:60])
def test_what_the_template_is_given_is_what_vllm_gives_it(echo, case):
    """Messages, tools and template variables exactly as vLLM's own Responses renderer passes
    them (the vectors of ``tests/e2e/responses_template_vectors.py``)."""
    assert echo.chat_tokens(chat_view(case["request"])).tolist() == case["tokens"]


def test_the_vectors_cover_every_item_kind():
    kinds = set()
    for case in VECTORS["cases"]:
        given = case["request"]["input"]
        kinds |= {"string"} if isinstance(given, str) else {i.get("type", "message") for i in given}
    assert kinds >= {"string", "message", "function_call", "function_call_output", "reasoning"}


@pytest.mark.parametrize(
    "body, says",
    [
        ({"input": 3}, "'input' must be a string or a list"),
        ({"input": ["hi"]}, "items must be objects, got str"),
        ({"input": [{"type": "image_generation_call"}]}, "unsupported type 'image_generation"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
            "encrypted_content",
        ),
        ({"input": "x", "tools": {"type": "function"}}, "'tools' must be a list"),
        ({"input": "x", "chat_template_kwargs": []}, "'chat_template_kwargs' must be an object"),
        ({"input": "x", "instructions": ["be brief"]}, "'instructions' must be a string"),
        ({"input": "x", "reasoning": "low"}, "'reasoning' must be an object, got str"),
        ({"input": "x", "previous_response_id": 7}, "'previous_response_id' must be a string"),
    ],
)
def test_bodies_vllm_refuses_are_refused(body, says):
    with pytest.raises(RequestError, match=says):
        chat_view(body)


def test_usage_in_chat_terms():
    usage = {"input_tokens": 40, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 32}}
    assert chat_usage(usage) == {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert chat_usage({"input_tokens": 5, "output_tokens": 1}) == {
        "prompt_tokens": 5,
        "completion_tokens": 1,
    }
    chat = {"prompt_tokens": 1}
    assert chat_usage(chat) is chat and chat_usage(None) is None


def test_owners_keep_the_most_recent_ids():
    owners = ResponseOwners(capacity=3)
    for i in range(3):
        owners.learn(f"r{i}", f"w{i}", "m")
    owners.learn("r0", "w9", "m")  # learnt again: the most recent now
    owners.learn("r3", "w3", "m")
    assert owners.owner("r1") is None and len(owners) == 3
    assert owners.owner("r0") == ("w9", "m") and owners.owner("r3") == ("w3", "m")
    owners.learn(None, "w", "m")
    owners.learn("", "w", "m")
    assert len(owners) == 3 and owners.owner(["r0"]) is None


def _event(kind: str, **data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def test_a_stream_fails_only_before_its_first_output():
    created, progress = _event("response.created"), _event("response.in_progress")
    delta = _event("response.output_text.delta", delta="x")
    assert responses_failure([])[0] is EMPTY_STREAM
    assert responses_failure([created, progress])[0] is EMPTY_STREAM
    assert responses_failure([created, progress, delta]) is None
    failed = responses_failure([created, progress, _event("error", code=503, message="m")])
    assert failed[0] is STREAM_ERROR and failed[2][0] == 503
    assert responses_failure([created, _event("error", code="server_error")])[2][0] == 502
    assert responses_failure([created, _event("error", code=400, message="bad")]) is None
    gone = _event("response.failed", response={"error": {"code": "server_error"}})
    assert responses_failure([created, gone])[0] is STREAM_ERROR
    old = b'data: {"error": {"code": 500, "message": "m"}}\n\n'  # vLLM's chat error shape
    assert responses_failure([created, old])[0] is STREAM_ERROR
    odd = _event("response.failed", response=None)
    assert responses_failure([created, odd])[2][0] == 502
    assert responses_failure([created, b": keep-alive\n\n"])[0] is EMPTY_STREAM


# ---- through the gateway --------------------------------------------------------------------


@pytest.fixture
def fleet():
    f = Fleet(2)
    yield f
    f.close()


def _idle(gw: GatewayServer) -> None:
    wait_for(lambda: all(v == 0 for v in gw.active().values()), "every flight finished", 10)


def test_answers_and_learns_the_cache_of_the_worker(fleet):
    with GatewayServer(config_dict(fleet, gateway={"routing_headers": True})) as gw:
        client = gw.client(None)
        first = client.responses.create(model="base-model", instructions=SYSTEM, input="One?")
        again = client.responses.with_raw_response.create(
            model="base-model", instructions=SYSTEM, input="Two?"
        )
        second = again.parse()
        assert first.output_text.split()[0] == second.output_text.split()[0]  # one worker
        cached = expected_cached(reference_render([{"role": "system", "content": SYSTEM}]))
        assert second.usage.input_tokens_details.cached_tokens == cached > 0
        assert int(again.headers["x-kvroute-cached-tokens"]) == cached  # the router predicted it
        _idle(gw)
        assert 'route="/v1/responses"' in gw.metrics()


def test_a_stream_passes_every_event_and_its_usage_reaches_the_router(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        client = gw.client(None)
        client.responses.create(model="base-model", instructions=SYSTEM, input="warm")
        _idle(gw)
        worker = fleet.records()[-1]
        kinds, final = [], None
        with client.responses.create(
            model="base-model", instructions=SYSTEM, input="streamed", stream=True
        ) as events:
            for event in events:
                kinds.append(event.type)
                if event.type == "response.completed":
                    final = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
        assert final is not None and final.usage.input_tokens_details.cached_tokens > 0
        assert fleet.records()[-1]["stream_options"] is None  # nothing added to the body
        assert fleet.records()[-1]["upstream_id"] != worker["upstream_id"]
        _idle(gw)
        # The router learnt the hit from the final event's usage, in routing tokens.
        reported = re.findall(r"cached_tokens_reported_total\{[^}]*\} (\S+)", gw.metrics())
        assert sum(map(float, reported)) == final.usage.input_tokens_details.cached_tokens


def test_a_follow_up_goes_to_the_worker_holding_its_previous_response(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        client = gw.client(None)
        first = client.responses.create(model="base-model", input="Remember the number 7.")
        owner = fleet.records()[-1]
        holder = next(u for u in fleet.upstreams if first.id in u.stored)
        previous = first.id
        for i in range(12):  # inputs the router alone would spread over both workers
            reply = client.responses.create(
                model="base-model",
                input=f"question {i} " + "x" * (i * 40),
                previous_response_id=previous,
                stream=i % 2 == 1,
            )
            if i % 2 == 1:
                reply = next(e.response for e in reply if e.type == "response.completed")
            previous = reply.id
        served = {u.name for u in fleet.upstreams for r in u.records if r["seq"] > owner["seq"]}
        assert served == {holder.name}
        _idle(gw)
        # The follow-ups found their history cached, which their routing tokens do not have: no
        # report of it corrected the router (the root's, cold, reported 0).
        assert reply.usage.input_tokens_details.cached_tokens > 0
        reported = re.findall(r"cached_tokens_reported_total\{[^}]*\} (\S+)", gw.metrics())
        assert sum(map(float, reported)) == 0


def test_a_follow_up_whose_worker_is_down_is_not_sent_elsewhere(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        client = gw.client(None)
        first = client.responses.create(model="base-model", input="Remember the number 7.")
        holder = next(u for u in fleet.upstreams if first.id in u.stored)
        fleet.stop(holder.name)
        before = len(fleet.records())
        # Found unreachable (and ejected) by the first follow-up; the second is not even sent.
        with pytest.raises(openai.APIStatusError) as e:
            client.responses.create(model="base-model", input="and?", previous_response_id=first.id)
        assert e.value.status_code == 502 and f"upstream {holder.name} unreachable" in str(e.value)
        assert gw.get("/health").json()["workers"][holder.name] is False
        with pytest.raises(openai.APIStatusError) as e:
            client.responses.create(model="base-model", input="and?", previous_response_id=first.id)
        assert e.value.status_code == 503
        assert first.id in str(e.value) and holder.name in str(e.value)
        assert len(fleet.records()) == before  # the other worker never saw it
        # An id this gateway never served is routed as any request: the engine's 404 passes.
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="base-model", input="?", previous_response_id="resp_x")


def test_a_stream_failing_before_output_is_retried_on_another_worker(fleet):
    for u in fleet.upstreams:
        u.stream_error = "fragile"
    fleet.upstreams[1].stream_error = None
    with GatewayServer(config_dict(fleet)) as gw:
        client = gw.client(None)
        for i in range(6):
            events = list(
                client.responses.create(model="base-model", input=f"fragile {i}", stream=True)
            )
            assert events[-1].type == "response.completed"
            assert events[-1].response.output_text.startswith(fleet.upstreams[1].name)
        _idle(gw)
        fleet.upstreams[1].stream_error = "fragile"
        r = httpx.post(
            gw.url + "/v1/responses",
            json={"model": "base-model", "input": "fragile", "stream": True},
            timeout=20,
        )
        assert r.status_code == 500 and b"engine failed" in r.content  # both failed: no 200
        _idle(gw)


def test_a_body_vllm_refuses_is_answered_400(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        r = httpx.post(
            gw.url + "/v1/responses",
            json={"model": "base-model", "input": [{"type": "image_generation_call"}]},
            timeout=20,
        )
        assert r.status_code == 400 and "image_generation_call" in r.text
        assert fleet.records() == []


def test_a_stored_response_is_read_and_cancelled_at_its_worker_by_its_callers_only(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        first = gw.client("sk-acme").responses.create(model="ep-acme", input="keep me")
        holder = next(u for u in fleet.upstreams if first.id in u.stored)

        def call(method: str, path: str, key: str | None = "sk-acme") -> httpx.Response:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return httpx.request(method, gw.url + path, headers=headers, timeout=20)

        got = call("GET", f"/v1/responses/{first.id}?include=x")
        assert got.status_code == 200 and got.json()["id"] == first.id
        assert holder.records[-1]["path"] == f"/v1/responses/{first.id}"
        assert holder.records[-1]["query"] == "include=x"
        replay = call("GET", f"/v1/responses/{first.id}?stream=true")  # passed as a stream
        assert replay.headers["content-type"].startswith("text/event-stream")
        assert replay.text.startswith("event: response.completed")
        cancel = call("POST", f"/v1/responses/{first.id}/cancel")
        assert cancel.status_code == 400 and "synchronous" in cancel.text  # the engine's answer
        before = len(fleet.records())
        # Another tenant's key, no key, an unknown id, a wrong method or path, a follow-up for
        # another target: never sent.
        # Whether an id exists is not disclosed: the answer for another target's is vLLM's own
        # for an unknown id, word for word.
        unknown = call("GET", "/v1/responses/resp_unknown")
        for key in ("sk-globex", None):
            foreign = call("GET", f"/v1/responses/{first.id}", key)
            assert foreign.status_code == unknown.status_code == 404
            assert foreign.json() == {
                **unknown.json(),
                "error": {
                    **unknown.json()["error"],
                    "message": f"Response with id '{first.id}' not found.",
                },
            }
        assert call("GET", "/v1/responses/a%0D%0Ax-evil:%201").status_code == 404
        assert call("DELETE", f"/v1/responses/{first.id}").status_code == 405
        assert call("GET", f"/v1/responses/{first.id}/cancel").status_code == 405
        assert call("GET", f"/v1/responses/{first.id}/other").status_code == 404
        assert call("GET", "/v1/responses/").status_code == 404
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{first.id}' not"):
            gw.client(None).responses.create(
                model="base-model", input="and?", previous_response_id=first.id
            )
        assert len(fleet.records()) == before
        counted, route = gw.metrics(), 'requests_total{route="/v1/responses/{id}"'
        assert route + ',model="ep-acme",status="200"} 2' in counted  # the GET and the replay
        assert route + ',model="-",status="404"}' in counted
        fleet.stop(holder.name)
        gw.gateway.router.set_healthy(holder.name, False)
        gone = call("GET", f"/v1/responses/{first.id}")
        assert gone.status_code == 503 and holder.name in gone.text


def test_with_pd_it_is_answered_501_and_nothing_is_sent(fleet):
    workers = config_dict(fleet)["workers"]
    for w, role in zip(workers, ("prefill", "decode"), strict=True):
        w["role"] = role
    cfg = config_dict(fleet, workers=workers, pd={"protocol": "vllm"}, endpoints=[])
    with GatewayServer(cfg) as gw:
        r = httpx.post(
            gw.url + "/v1/responses", json={"model": "base-model", "input": "hi"}, timeout=20
        )
        assert r.status_code == 501 and "[pd]" in r.json()["error"]["message"]
        assert fleet.records() == []


def test_the_callers_request_id_never_names_a_response(fleet):
    """vLLM names a response by the body's ``request_id``: a tenant choosing one could overwrite
    another's stored response, or hand the gateway an id that is no URL."""
    with GatewayServer(config_dict(fleet)) as gw:
        reply = gw.client(None).responses.create(
            model="base-model", input="hi", extra_body={"request_id": "resp_chosen"}
        )
        assert fleet.records()[-1]["request_id"] is None and reply.id != "resp_chosen"


def test_the_view_leaves_the_body_as_it_was():
    body = {
        "input": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
        ],
        "tools": [{"type": "function", "name": "f"}],
        "chat_template_kwargs": {"x": 1},
        "reasoning": {"effort": "low"},
    }
    before = json.loads(json.dumps(body))
    view = chat_view(body)
    assert body == before
    assert view["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{}"}, "type": "function"}
        ],
        "reasoning": "t",
    }
    assert view["chat_template_kwargs"] == {
        "x": 1,
        "reasoning_effort": "low",
        "enable_thinking": True,
    }
