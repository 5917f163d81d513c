"""The gateway's failover, path by path (``Gateway._choose`` / ``_failed`` / ``_settle`` /
``_forward`` / ``_give_up`` / ``_attempt``): for every kind of upstream failure in
``kvroute.gateway.errors``, what the caller gets (status, body, content type, request id), what is
logged (each record's exact text: worker, kind, detail, the health model's reason) and what is
counted (``upstream_errors_total``, ``requests_total``, ``retries_total``, the routing decisions,
the request's duration) — when no attempt succeeds, and when another worker then serves.

The expected answers are the failure table's rows as the module docs of ``errors`` state them,
written out here (not read from the table). Faults no real engine can be made to show come from
``gateway_faults.FaultServer``; the health model's probes and reasons from the OpenAI-compatible
test upstreams.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from kvroute.gateway.errors import EMPTY_STREAM, STREAM_ERROR
from kvroute.gateway.stream import first_failure
from support.gateway_faults import SSE_HEAD, FaultServer, chunk, delta, reply
from support.gateway_fleet import (
    Fleet,
    GatewayServer,
    closed_port,
    config_dict,
    lines,
    messages,
    samples,
    wait_for,
)
from test_gateway_faults import fleet_config

ROUTE = "/v1/chat/completions"


# name -> (script, streamed, (status, error code, message, type) of the give-up answer or
# (status, body, content type) of the upstream's own, the failure's kind, its logged detail,
# retried, health)
# health: "count" (charged when the request is over), "down" (ejected at once), "none".
FAILURES: dict[str, tuple[Any, bool, tuple, str, str, bool, str]] = {
    "5xx": (
        lambda body: [reply(503, b'{"error": "busy"}')],
        False,
        (503, b'{"error": "busy"}', "application/json"),
        "status_5xx",
        "status 503",
        True,
        "count",
    ),
    # A 5xx answer whose body breaks is still a 5xx answer, passed on as far as it was read
    # (here: nothing); a 4xx answer is passed on only whole, so a broken one failed mid-response.
    "5xx cut mid-body": (
        lambda body: [reply(503, b'{"error": "busy"}' + b" " * 1000)[:-900], 0.05],
        False,
        (503, b"", "application/json"),
        "status_5xx",
        "status 503",
        True,
        "count",
    ),
    "4xx cut mid-body": (
        lambda body: [reply(400, b'{"error": "no"}' + b" " * 1000)[:-900], 0.05],
        False,
        (502, "upstream_broken", "upstream w-0 failed mid-response", "upstream_error"),
        "protocol",
        "the upstream closed the connection",
        True,
        "count",
    ),
    "status 600": (
        lambda body: [reply(600, b"{}")],
        False,
        (
            502,
            "upstream_bad_status",
            "upstream w-0 answered an invalid HTTP status",
            "upstream_error",
        ),
        "bad_status",
        "status 600",
        True,
        "count",
    ),
    "closed before the head": (
        lambda body: [],
        False,
        (502, "upstream_reset", "upstream w-0 closed the connection", "upstream_error"),
        "reset",
        "the upstream closed the connection",
        True,
        "count",
    ),
    "cut mid-body": (
        lambda body: [reply(200, b'{"choices": []}' + b" " * 1000)[:-900], 0.05],
        False,
        (502, "upstream_broken", "upstream w-0 failed mid-response", "upstream_error"),
        "protocol",
        "the upstream closed the connection",
        True,
        "count",
    ),
    "stream without an event": (
        lambda body: [SSE_HEAD, b"0\r\n\r\n"],
        True,
        (
            502,
            "upstream_broken",
            "upstream w-0 ended its stream before any event",
            "upstream_error",
        ),
        "broken_stream",
        "no event before the end",
        True,
        "count",
    ),
    "reply too large": (
        lambda body: [reply(200, b'{"choices": [], "x": "' + b"y" * 5000 + b'"}')],
        False,
        (
            502,
            "upstream_reply_too_large",
            "the reply of upstream w-0 exceeds the gateway's size limit",
            "upstream_error",
        ),
        "too_large",
        "the reply exceeds 4096 bytes",
        False,
        "none",
    ),
    "event too large": (
        lambda body: [SSE_HEAD, chunk(b"data: " + b"y" * 5000), b"0\r\n\r\n"],
        True,
        (
            502,
            "upstream_reply_too_large",
            "the reply of upstream w-0 exceeds the gateway's size limit",
            "upstream_error",
        ),
        "too_large",
        "an SSE event exceeds 4096 bytes",
        False,
        "none",
    ),
    "read timeout": (
        lambda body: [5.0],
        False,
        (504, "upstream_timeout", "upstream w-0 timed out", "upstream_error"),
        "timeout",
        "no byte from the upstream for 2 s",
        False,
        "none",
    ),
    "refused": (
        None,  # no server: a closed port
        False,
        (502, "upstream_unreachable", "upstream w-0 unreachable", "upstream_error"),
        "connect",
        "",
        True,
        "down",
    ),
}


def post(gw: GatewayServer, rid: str, stream: bool) -> httpx.Response:
    body = {"model": "m", "messages": messages("q"), "stream": stream}
    return httpx.post(
        gw.url + ROUTE, json=body, headers={"x-request-id": rid}, trust_env=False, timeout=20
    )


@pytest.fixture
def servers():
    made: list[FaultServer] = []

    def make(script) -> str:
        if script is None:
            return f"http://127.0.0.1:{closed_port()}"
        s = FaultServer(script)
        made.append(s)
        return s.url

    yield make
    for s in made:
        s.stop()


GIVE_UP = {
    "max_attempts": 3,  # a retry finds no worker left: the failure is the answer, not a 503
    "max_response_bytes": 4096,
    "max_event_bytes": 4096,
    # Long enough that a loaded machine still delivers every scripted answer's first byte (0.5 s
    # was seen to lapse beside two running engines), short of the stalled script's 5 s.
    "read_timeout": 2.0,
    "eject_after": 1000,
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_each_failure_on_the_only_worker_is_answered_logged_and_counted(servers, name, caplog):
    """... and spends the caller's rate limit (key_requests_per_minute 1) unless it reached no
    worker (the README: a request that connected to no worker — `upstream_unreachable`, `busy` —
    takes nothing from its buckets): the next request is refused for the rate only then."""
    script, stream, error, kind, detail, _retried, health = FAILURES[name]
    url = servers(script)
    with GatewayServer(fleet_config([url], **GIVE_UP, key_requests_per_minute=1)) as gw:
        with caplog.at_level(logging.INFO):
            r = post(gw, "rq-1", stream)
        assert r.headers["x-request-id"] == "rq-1"
        assert "x-kvroute-worker" not in r.headers
        if isinstance(error[1], bytes):  # the upstream's own answer
            assert (r.status_code, r.content, r.headers["content-type"]) == error
        else:
            status, code, message, kind_name = error
            assert (r.status_code, r.headers["content-type"]) == (status, "application/json")
            assert r.json() == {
                "error": {"message": message, "type": kind_name, "param": None, "code": code}
            }
        # The failure's log line: its worker, kind and detail (or, for a worker that cannot be
        # reached, its ejection with the kind and the error).
        logged = lines(caplog, "kvroute.gateway")
        ejected = [m for m in lines(caplog, "kvroute.server.health") if m.startswith("ejecting")]
        if health == "down":
            assert logged == []
            (line,) = ejected
            address = url.removeprefix("http://")
            assert line.startswith(
                f"ejecting upstream w-0: connect: ConnectFailed('cannot connect to {address}: "
            )
        else:
            assert logged == [f"upstream w-0: {kind}: {detail}"]
            assert ejected == []
        failed = [m for m in lines(caplog, "kvroute.server.health") if "failed (" in m]
        if health == "count":  # the one worker tried is charged, saying why
            assert failed == [
                "upstream w-0 failed (failed a request only it was tried for, 1 in a row)"
            ]
        else:
            assert failed == []
        # Counted once each: the failure under its worker and kind, the answer under its
        # status, one routing decision, no retry (none was left), one duration.
        assert samples(gw, "upstream_errors_total") == {(("kind", kind), ("worker", "w-0")): 1}
        answered = (("model", "m"), ("route", ROUTE), ("status", str(r.status_code)))
        assert samples(gw, "requests_total") == {answered: 1}
        assert samples(gw, "retries_total") == {}
        (decision,) = samples(gw, "routing_decisions_total").items()
        assert dict(decision[0])["worker"] == "w-0" and decision[1] == 1
        assert samples(gw, "request_duration_seconds_count") == {(("route", ROUTE),): 1}
        assert samples(gw, "time_to_first_byte_seconds_count") == {}
        wait_for(lambda: samples(gw, "in_flight") == {}, "the attempt to finish")
        again = post(gw, "rq-1b", stream)
        limited = (again.status_code, again.json()["error"]["code"]) == (429, "rate_limited")
        assert limited == (kind != "connect"), (again.status_code, again.content)


@pytest.mark.parametrize("name", list(FAILURES))
def test_each_failure_is_retried_on_another_worker_or_answered(servers, name, caplog):
    """w-0 fails, w-1 (a test upstream) serves: a retried failure ends in w-1's answer on the
    second attempt, and w-0 is charged with failing a request another worker then served; a
    failure that is not retried is the answer at once. (Round robin: w-0 first.)"""
    script, stream, error, kind, _detail, retried, health = FAILURES[name]
    good = Fleet(1)
    try:
        urls = [servers(script), f"http://127.0.0.1:{good.ports[0]}"]
        with GatewayServer(fleet_config(urls, **{**GIVE_UP, "max_attempts": 2})) as gw:
            with caplog.at_level(logging.INFO):
                r = post(gw, "rq-2", stream)
            assert r.headers["x-request-id"] == "rq-2"
            decisions = {
                dict(labels)["worker"]: v
                for labels, v in samples(gw, "routing_decisions_total").items()
            }
            charged = [m for m in lines(caplog, "kvroute.server.health") if "failed (" in m]
            if retried:
                assert r.status_code == 200
                assert (r.headers["x-kvroute-worker"], r.headers["x-kvroute-attempts"]) == (
                    "w-1",
                    "2",
                )
                assert good.upstreams[0].ids == ["rq-2"]
                assert samples(gw, "retries_total") == {(): 1}
                assert decisions == {"w-0": 1, "w-1": 1}
                if health == "count":
                    assert charged == [
                        "upstream w-0 failed (failed a request another worker then served, "
                        "1 in a row)"
                    ]
                else:
                    assert charged == []
                assert samples(gw, "time_to_first_byte_seconds_count") == {(("route", ROUTE),): 1}
            else:
                assert (r.status_code, r.json()["error"]["code"]) == error[:2]
                assert good.upstreams[0].records == []
                assert samples(gw, "retries_total") == {}
                assert decisions == {"w-0": 1}
                assert charged == []
            assert samples(gw, "upstream_errors_total") == {(("kind", kind), ("worker", "w-0")): 1}
            answered = (("model", "m"), ("route", ROUTE), ("status", str(r.status_code)))
            assert samples(gw, "requests_total") == {answered: 1}
            assert samples(gw, "request_duration_seconds_count") == {(("route", ROUTE),): 1}
    finally:
        good.close()


@pytest.mark.parametrize("attempts", [1, 2])
def test_failures_are_charged_and_probed_by_how_many_workers_failed(attempts, caplog):
    """Workers that answer the request 500 and fail their health probes. Tried on one worker
    only, the request is charged to it and it is probed; tried on two, it is charged to neither
    (its content, most likely) and both are probed. A failed probe ejects, saying why; the
    caller gets the last worker's own answer."""
    fleet = Fleet(2)
    try:
        for u in fleet.upstreams:
            u.fail(500)
        cfg = config_dict(fleet, gateway={"max_attempts": attempts, "eject_after": 1000})
        with GatewayServer(cfg) as gw:
            with caplog.at_level(logging.INFO):
                for u in fleet.upstreams:
                    u.health_status = 500
                r = httpx.post(
                    gw.url + ROUTE,
                    json={"model": "ep-acme", "messages": messages("q")},
                    headers={"authorization": "Bearer sk-acme", "x-request-id": "rq-3"},
                    trust_env=False,
                    timeout=20,
                )

                def ejections() -> list[str]:
                    health = lines(caplog, "kvroute.server.health")
                    return sorted(m for m in health if m.startswith("ejecting"))

                wait_for(lambda: len(ejections()) == 1, "the probes to fail")
            tried = [u.name for u in fleet.upstreams if u.records]
            assert len(tried) == attempts
            assert (r.status_code, r.headers["x-request-id"]) == (500, "rq-3")
            last = r.json()["error"]["message"].split()[0]
            assert r.json() == {"error": {"message": f"{last} failing", "type": "server_error"}}
            logged = lines(caplog, "kvroute.gateway")
            assert sorted(logged[:attempts]) == [
                f"upstream {w}: status_5xx: status 500" for w in tried
            ]
            charged = [m for m in lines(caplog, "kvroute.server.health") if "failed (" in m]
            if attempts == 1:
                (worker,) = tried
                assert logged[1:] == []
                assert charged == [
                    f"upstream {worker} failed (failed a request only it was tried for, 1 in a row)"
                ]
                assert ejections() == [
                    f"ejecting upstream {worker}: request rq-3 failed there, and its health probe "
                    "failed"
                ]
            else:
                assert logged[2:] == [
                    "request rq-3 failed on 2 workers: charged to none (its content, most "
                    "likely); probing them"
                ]
                assert charged == []
                # Both probes fail; max_ejected_fraction (0.5) keeps one of the two in.
                why = "request rq-3 failed there and elsewhere, and its health probe failed"
                (ejected,) = (w for w in ("up-0", "up-1") if f"upstream {w}:" in ejections()[0])
                kept = "up-1" if ejected == "up-0" else "up-0"
                wait_for(lambda: len(lines(caplog, "kvroute.server.health")) == 2, "2 probes")
                assert lines(caplog, "kvroute.server.health") == [
                    f"ejecting upstream {ejected}: {why}",
                    f"not ejecting {kept} ({why}): 1 of 2 workers are out already "
                    "(max_ejected_fraction 0.50)",
                ]
    finally:
        fleet.close()


def test_a_request_that_crashes_every_engine_ejects_none():
    """A request that makes vLLM's handler raise on both workers: each answers a complete 500
    and then closes the connection (``gateway_upstream.Crash``, as uvicorn does). The request
    failed on two workers, so both are probed at once — on the connections those 500s came on.
    Their health endpoints answer 200: no worker is ejected, and the next requests are served."""
    fleet = Fleet(2)
    try:
        for u in fleet.upstreams:
            u.crash = "crash-here"
        cfg = config_dict(fleet, gateway={"models": ["m"], "connect_timeout": 5.0})
        with GatewayServer(cfg) as gw:
            health = gw.gateway.health
            r = httpx.post(
                gw.url + ROUTE,
                json={"model": "m", "messages": messages("crash-here")},
                trust_env=False,
                timeout=20,
            )
            assert (r.status_code, r.text) == (500, "Internal Server Error")
            assert [len(u.records) for u in fleet.upstreams] == [1, 1]
            wait_for(lambda: not health._probes, "the suspicion probes to end")
            assert [u.health_checks for u in fleet.upstreams] == [1, 1]
            assert health.ejected == {}
            assert gw.get("/health").json()["workers"] == {"up-0": True, "up-1": True}
            for i in range(4):
                assert post(gw, f"rq-{i}", stream=False).status_code == 200
    finally:
        fleet.close()


ENGINE_ERROR = {
    "message": "EngineCore encountered an issue. See stack trace for the root cause.",
    "type": "InternalServerError",
    "param": None,
    "code": 500,
}


def test_a_stream_whose_first_event_is_the_engines_error_is_retried(caplog):
    """vLLM answers a stream whose generation fails before any output with a 200, one error
    event and ``data: [DONE]``. That is the worker's failure, as a 5xx would be: the request is
    retried on the other worker, which serves it; the failure is counted and charged."""
    fleet = Fleet(2)
    try:
        cfg = config_dict(fleet, gateway={"models": ["m"], "eject_after": 1000})
        with GatewayServer(cfg) as gw:
            # A non-streamed request first: the prompt's prefix is then cached on one worker,
            # which the router chooses first for the same prompt.
            first = post(gw, "rq-0", stream=False).headers["x-kvroute-worker"]
            other = "up-1" if first == "up-0" else "up-0"
            fleet[first].stream_error = "q"
            with caplog.at_level(logging.INFO):
                r = post(gw, "rq-1", stream=True)
            assert (r.status_code, r.headers["x-kvroute-worker"]) == (200, other)
            assert r.headers["x-kvroute-attempts"] == "2"
            assert f"{other} rq-1" in r.text and r.text.endswith("data: [DONE]\n\n")
            assert "error" not in r.text
            assert [x["id"] for x in fleet[first].records] == ["rq-0", "rq-1"]
            assert samples(gw, "upstream_errors_total") == {
                (("kind", "stream_error"), ("worker", first)): 1
            }
            assert samples(gw, "retries_total") == {(): 1}
            assert lines(caplog, "kvroute.gateway") == [
                f"upstream {first}: stream_error: error event, code 500"
            ]
            assert lines(caplog, "kvroute.server.health") == [
                f"upstream {first} failed (failed a request another worker then served, 1 in a row)"
            ]
    finally:
        fleet.close()


@pytest.mark.parametrize("code", [500, 503, 400])
def test_a_stream_error_on_every_worker_is_answered_as_the_engines_error(code):
    """Both workers' streams fail before any output. A 5xx error event is answered as the
    gateway answers an upstream's 5xx when no attempt succeeds: the error object (the event's
    data) with its code as the status, as JSON — the OpenAI SDK raises it before any chunk. An
    error event with a 4xx code is the request's error: passed through, not retried."""
    fleet = Fleet(2)
    try:
        for u in fleet.upstreams:
            u.stream_error, u.stream_error_code = "q", code
        cfg = config_dict(fleet, gateway={"models": ["m"], "eject_after": 1000})
        with GatewayServer(cfg) as gw:
            r = post(gw, "rq-1", stream=True)
            error = {**ENGINE_ERROR, "code": code}
            tried = [u.name for u in fleet.upstreams if u.records]
            if code == 400:
                error["type"] = "BadRequestError"
                assert (r.status_code, r.headers["content-type"]) == (
                    200,
                    "text/event-stream; charset=utf-8",
                )
                assert r.text == f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n"
                assert len(tried) == 1
                assert samples(gw, "upstream_errors_total") == {}
                return
            assert (r.status_code, r.headers["content-type"]) == (code, "application/json")
            assert (r.json(), r.headers["x-request-id"]) == ({"error": error}, "rq-1")
            assert tried == ["up-0", "up-1"]
            assert samples(gw, "upstream_errors_total") == {
                (("kind", "stream_error"), ("worker", w)): 1 for w in tried
            }
            assert [dict(k)["status"] for k in samples(gw, "requests_total")] == [str(code)]
            with pytest.raises(openai.InternalServerError) as e:
                client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
                for _ in client.chat.completions.create(
                    model="m", messages=messages("q"), stream=True
                ):
                    pass
            assert e.value.status_code == code and e.value.body == error
    finally:
        fleet.close()


@pytest.mark.parametrize(
    "data, status",
    [
        # vLLM >= 0.10 and SGLang: ErrorResponse(error=ErrorInfo(...)) / {"error": ...}
        ({"error": {"message": "m", "type": "t", "param": None, "code": 503}}, 503),
        # older vLLM: {"error": ErrorResponse(object="error", ...)}
        ({"error": {"object": "error", "message": "m", "type": "t", "code": 500}}, 500),
        # a bare ErrorResponse (older vLLM's non-streamed shape)
        ({"object": "error", "message": "m", "type": "t", "param": None, "code": 500}, 500),
        ({"error": {"message": "m", "code": "overloaded"}}, 502),  # no status: 502
        ({"error": {"message": "m", "code": 404}}, None),  # the request's: passed through
        ({"object": "error", "message": "m", "code": 422}, None),
        ({"error": "a string", "object": "chat.completion.chunk"}, None),  # not an error object
        ({"id": "c", "choices": [{"delta": {"content": '"error"'}}]}, None),
    ],
)
def test_which_first_events_are_engine_errors(data, status):
    """``first_failure`` on each error shape engines send as a stream's first event."""
    payload = json.dumps(data).encode()
    failed = first_failure([b": comment\n\n", b"data: " + payload + b"\n\n"])
    if status is None:
        assert failed is None
    else:
        assert failed == (
            STREAM_ERROR,
            f"error event, code {data.get('code', data.get('error', {}).get('code'))!r}",
            (status, payload, {"content-type": "application/json"}),
        )
    assert first_failure([]) == (EMPTY_STREAM, "no event before the end", None)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answers_headers_are_forwarded_by_name(servers, stream):
    """Of an upstream's answer head, only ``content-type``, ``content-encoding``,
    ``cache-control``, ``retry-after``, ``retry-after-ms`` and ``x-ratelimit-*`` reach the
    caller (streamed or whole), with the request's own ``x-request-id``; the upstream's other
    headers (its own request id among them) do not."""
    extra = (
        "content-type: {}\r\ncontent-encoding: identity\r\ncache-control: no-store\r\n"
        "x-upstream-secret: 1\r\nx-request-id: upstream-id\r\nconnection: close\r\n"
        "x-ratelimit-remaining-tokens: 9000\r\nx-ratelimit-reset-tokens: 6ms\r\n"
        "retry-after: 1\r\nretry-after-ms: 1000\r\nx-rate: 1\r\n"
    )
    if stream:
        head = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n" + extra + "\r\n"
        done = chunk(b"data: [DONE]\n\n")
        script = lambda body: [  # noqa: E731
            head.format("text/event-stream").encode(),
            chunk(delta("one ")),
            done,
            b"0\r\n\r\n",
        ]
    else:
        data = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "one"}}]}'
        head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(data)}\r\n" + extra + "\r\n"
        script = lambda body: [head.format("application/json").encode() + data]  # noqa: E731
    with GatewayServer(fleet_config([servers(script)])) as gw:
        r = post(gw, "rq-4", stream)
        assert r.status_code == 200
        names = ("content-encoding", "cache-control", "retry-after", "retry-after-ms")
        names += ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens", "x-rate")
        assert {k: r.headers.get(k) for k in names} == {
            "content-encoding": "identity",
            "cache-control": "no-store",
            "retry-after": "1",
            "retry-after-ms": "1000",
            "x-ratelimit-remaining-tokens": "9000",
            "x-ratelimit-reset-tokens": "6ms",
            "x-rate": None,
        }
        ctype = "text/event-stream" if stream else "application/json"
        assert r.headers["content-type"].split(";")[0] == ctype
        assert r.headers["x-request-id"] == "rq-4"
        assert "x-upstream-secret" not in r.headers
        assert b"one" in r.content


RATE_LIMITED = {
    "retry-after": "7",
    "retry-after-ms": "7000",
    "x-ratelimit-limit-requests": "100",
    "x-ratelimit-remaining-requests": "0",
    "x-ratelimit-reset-requests": "7s",
}


@pytest.mark.parametrize("stream", [False, True])
def test_an_engines_429_reaches_the_caller_with_when_to_try_again(stream):
    """An engine's 429 passes through (a 4xx: not retried) with its ``retry-after``,
    ``retry-after-ms`` and ``x-ratelimit-*``, which the OpenAI SDK reads; its other headers do
    not."""
    fleet = Fleet(2)
    try:
        for u in fleet.upstreams:
            u.fail(429)
            u.fail_headers = {**RATE_LIMITED, "x-engine-secret": "1"}
        with GatewayServer(config_dict(fleet, gateway={"models": ["m"]})) as gw:
            r = post(gw, "rq-1", stream)
            assert (r.status_code, r.headers["x-request-id"]) == (429, "rq-1")
            assert {k: r.headers.get(k) for k in RATE_LIMITED} == RATE_LIMITED
            assert "x-engine-secret" not in r.headers
            assert sum(len(u.records) for u in fleet.upstreams) == 1
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError) as e:
                client.chat.completions.create(model="m", messages=messages("q"), stream=stream)
            assert e.value.response.headers["retry-after"] == "7"
    finally:
        fleet.close()


def test_the_last_engines_503_is_answered_with_its_retry_after():
    """Both workers answer 503, each with its own ``retry-after``: the request is retried,
    then answered with the last worker's own answer — its body and its ``retry-after``."""
    fleet = Fleet(2)
    try:
        for i, u in enumerate(fleet.upstreams):
            u.fail(503)
            u.fail_headers = {"retry-after": str(3 + i), "x-ratelimit-reset-requests": f"{i}s"}
        with GatewayServer(config_dict(fleet, gateway={"models": ["m"]})) as gw:
            r = post(gw, "rq-1", stream=False)
            assert r.status_code == 503
            last = fleet[r.json()["error"]["message"].split()[0]]
            assert [len(u.records) for u in fleet.upstreams] == [1, 1]
            i = fleet.upstreams.index(last)
            assert r.headers["retry-after"] == str(3 + i)
            assert r.headers["x-ratelimit-reset-requests"] == f"{i}s"
            assert (r.headers["x-request-id"], r.headers["content-type"]) == (
                "rq-1",
                "application/json",
            )
    finally:
        fleet.close()


def test_a_request_shed_on_its_ttft_slo_is_withdrawn():
    """A request that cannot meet ``x-slo-ttft-ms`` (~2,000 uncached tokens at 1,000 tokens/s)
    is shed before it is sent: 429 ``slo`` with ``retry-after``, no routing decision counted,
    and its prompt out of the router's model of the worker it was routed to."""
    fleet = Fleet(1)
    try:
        cfg = config_dict(fleet, gateway={"prefill_tokens_per_second": 1000.0})
        cfg["endpoints"] = cfg["endpoints"][:1]  # ep-acme, a pool of the one worker
        with GatewayServer(cfg) as gw:
            r = httpx.post(
                gw.url + ROUTE,
                json={"model": "ep-acme", "messages": messages("Hurry?")},
                headers={"authorization": "Bearer sk-acme", "x-slo-ttft-ms": "100"},
                trust_env=False,
                timeout=20,
            )
            assert (r.status_code, r.headers["retry-after"]) == (429, "1")
            assert r.json()["error"]["code"] == "slo"
            assert fleet.upstreams[0].records == []
            assert gw.gateway.router.index.num_blocks("up-0") == 0
            assert gw.gateway.router.load("up-0")["prefill_blocks"] == 0
            assert samples(gw, "routing_decisions_total") == {}
            assert samples(gw, "shed_total") == {(("reason", "slo"),): 1}
    finally:
        fleet.close()


def test_a_served_request_starts_the_workers_failures_in_a_row_again(caplog):
    """A worker's charged failures count in a row: one it then serves starts them again at 0
    (``eject_after`` 2: fail, serve, fail ejects nothing)."""
    fleet = Fleet(1)
    try:
        cfg = fleet_config([f"http://127.0.0.1:{fleet.ports[0]}"], max_attempts=1, eject_after=2)
        with GatewayServer(cfg) as gw:
            with caplog.at_level(logging.INFO):
                for rid in ("rq-5", "rq-6", "rq-7"):
                    fleet.upstreams[0].fail(500, times=1 if rid != "rq-6" else 0)
                    r = post(gw, rid, False)
                    assert r.status_code == (200 if rid == "rq-6" else 500)
            health = lines(caplog, "kvroute.server.health")
            assert (
                health
                == ["upstream w-0 failed (failed a request only it was tried for, 1 in a row)"] * 2
            )
            assert gw.get("/health").json()["workers"] == {"w-0": True}
    finally:
        fleet.close()


def test_status_599_is_an_upstream_5xx_answer(servers):
    """599 is the last status HTTP defines a class for (5xx): passed on as the upstream's own
    answer, not taken for an invalid status (600 is one)."""
    url = servers(lambda body: [reply(599, b'{"error": "edge"}')])
    with GatewayServer(fleet_config([url], max_attempts=1)) as gw:
        r = post(gw, "rq-8", False)
        assert (r.status_code, r.content) == (599, b'{"error": "edge"}')
        assert samples(gw, "upstream_errors_total") == {
            (("kind", "status_5xx"), ("worker", "w-0")): 1
        }


OK = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "one"}}]}'


@pytest.mark.parametrize(
    "body",
    [b"[1, 2]", b'"text"', b"7", b"null", b'{"usage": 5}', b"{}", b"not json", b"[" * 3000],
)
def test_a_whole_200_reply_of_any_shape_is_passed_on_as_it_came(servers, body):
    """A whole 200 reply is parsed only for its usage (and the cache fields added to it): a body
    that is JSON but not an object, an object whose usage is not one, or no JSON at all (nested
    past the parser's depth, too) reaches the caller byte for byte, and its flight is closed."""
    url = servers(lambda _: [reply(200, body)])
    with GatewayServer(fleet_config([url], max_attempts=1)) as gw:
        r = post(gw, "rq-9", False)
        assert (r.status_code, r.content) == (200, body)
        assert gw.active() == {"w-0": 0}
        assert samples(gw, "cached_tokens_reported_total") == {}


def test_a_retry_that_finds_every_other_worker_full_sheds_nothing():
    """A request that failed on one worker and finds the other full answers with its failure
    (the upstream's own 500), not a 429: it was not shed, and no shed is counted."""
    script = lambda body: [1.0, reply(200, OK)] if b"hold" in body else [reply(500, b"{}")]  # noqa: E731
    made = [FaultServer(script) for _ in range(2)]
    try:
        cfg = fleet_config([s.url for s in made], max_attempts=3, max_in_flight_per_worker=1)
        with GatewayServer(cfg) as gw:
            body = {"model": "m", "messages": messages("hold")}
            held = threading.Thread(
                target=httpx.post,
                args=(gw.url + ROUTE,),
                kwargs={"json": body, "timeout": 20, "trust_env": False},
            )
            held.start()
            wait_for(lambda: sum(len(s.requests) for s in made) == 1, "the held request")
            r = post(gw, "rq-10", False)
            assert (r.status_code, r.content) == (500, b"{}")
            held.join(20)
            assert samples(gw, "shed_total") == {}
            assert sorted(len(s.requests) for s in made) == [1, 1]
    finally:
        for s in made:
            s.stop()


def test_attempts_to_spare_after_every_worker_failed_answer_the_last_failure(caplog):
    """Both workers of the endpoint answer 500 and a third attempt is allowed: the router has no
    worker left, in the pool or past it (``NoWorkerError`` on the spill-over route), so the
    caller gets the last worker's own answer — not an error of the gateway's."""
    fleet = Fleet(2)
    try:
        for u in fleet.upstreams:
            u.fail(500)
        cfg = config_dict(fleet, gateway={"max_attempts": 3, "eject_after": 1000})
        with GatewayServer(cfg) as gw:
            with caplog.at_level(logging.INFO):
                r = httpx.post(
                    gw.url + ROUTE,
                    json={"model": "ep-acme", "messages": messages("q")},
                    headers={"authorization": "Bearer sk-acme", "x-request-id": "rq-5"},
                    trust_env=False,
                    timeout=20,
                )
            assert all(len(u.records) == 1 for u in fleet.upstreams)
            last = r.json()["error"]["message"].split()[0]
            assert (r.status_code, r.headers["x-request-id"]) == (500, "rq-5")
            assert r.json() == {"error": {"message": f"{last} failing", "type": "server_error"}}
            assert sorted(lines(caplog, "kvroute.gateway")) == [
                "request rq-5 failed on 2 workers: charged to none (its content, most likely); "
                "probing them",
                *(f"upstream {u.name}: status_5xx: status 500" for u in fleet.upstreams),
            ]
            assert samples(gw, "retries_total") == {(): 1}
            assert samples(gw, "shed_total") == {}
    finally:
        fleet.close()


@pytest.mark.parametrize("stream", [False, True])
def test_durations_are_the_seconds_since_the_request_arrived(stream):
    """``time_to_first_byte_seconds`` and ``request_duration_seconds`` observe the time since
    the request arrived: within the wall time the caller measured around it, first byte first."""
    fleet = Fleet(2)
    try:
        with GatewayServer(config_dict(fleet)) as gw:
            began = time.perf_counter()
            r = httpx.post(
                gw.url + ROUTE,
                json={"model": "ep-acme", "messages": messages("q"), "stream": stream},
                headers={"authorization": "Bearer sk-acme"},
                trust_env=False,
                timeout=20,
            )
            assert r.status_code == 200 and r.content
            wait_for(lambda: samples(gw, "in_flight") == {}, "the request to finish")
            elapsed = time.perf_counter() - began
            route = (("route", ROUTE),)
            assert samples(gw, "time_to_first_byte_seconds_count") == {route: 1}
            assert samples(gw, "request_duration_seconds_count") == {route: 1}
            first = samples(gw, "time_to_first_byte_seconds_sum")[route]
            whole = samples(gw, "request_duration_seconds_sum")[route]
            assert 0 < first <= whole <= elapsed
    finally:
        fleet.close()
