"""Prefill/decode pairs' failover, path by path (``PdForwarder``'s ``_read_prefill`` (vLLM),
``_drain_prefill`` (SGLang), ``_refused``, ``_send``): for each way a prefill half can fail, and
for a failed decode half, what the caller gets (status, body, content type, request id), what is
logged (each record's exact text: the worker charged, the failure's kind and detail, the health
model's reason) and what is counted (``upstream_errors_total``, ``requests_total``,
``retries_total``, one routing decision per half sent, ``pd_pairs_total``) — and that the pair's
load returns to zero.

The expected answers are the failure table's rows (``kvroute.gateway.errors``) as its module
docs state them, written out here. Faults no real engine can be made to show come from
``gateway_faults.FaultServer`` in the prefill worker's place; the decode worker is the test
upstream of its protocol (``support.pd_upstream``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from typing import Any

import httpx
import pytest
from kvroute.gateway import pd
from support.gateway_faults import FaultServer, reply
from support.gateway_fleet import (
    GatewayServer,
    closed_port,
    lines,
    messages,
    samples,
    wait_for,
)
from test_gateway_pd import PdFleet, ask, idle

ROUTE = "/v1/chat/completions"


def post(gw: GatewayServer, rid: str) -> httpx.Response:
    """A chat call to the endpoint whose prompt fills blocks, as raw HTTP."""
    return httpx.post(
        gw.url + ROUTE,
        json={"model": "ep-acme", "messages": messages("Which fuel?")},
        headers={"authorization": "Bearer sk-acme", "x-request-id": rid},
        trust_env=False,
        timeout=20,
    )


def by_worker(gw: GatewayServer) -> dict[str, float]:
    return {
        dict(labels)["worker"]: v for labels, v in samples(gw, "routing_decisions_total").items()
    }


REFUSAL = b'{"error": {"message": "no"}}'
TEXT_HEAD = (
    "HTTP/1.1 {} X\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\n"
    "connection: close\r\n\r\n"
)
RATE_HEAD = (
    "HTTP/1.1 {} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n"
    "retry-after: 9\r\nx-ratelimit-remaining-requests: 0\r\nx-engine: 1\r\n"
    "connection: close\r\n\r\n"
)
# name -> (protocols, script (None: nobody listens), the answer: (status, body, content type) of
# the prefill's own, or (status, code, message) of the gateway's error, kind, logged detail,
# health: "count" charged, "down" ejected, "none")
PREFILL_FAULTS: dict[str, tuple[tuple[str, ...], Any, tuple, str | None, str, str]] = {
    "5xx": (
        ("vllm", "sglang"),
        lambda body: [reply(503, b'{"error": "busy"}')],
        (503, b'{"error": "busy"}', "application/json"),
        "status_5xx",
        "prefill status 503",
        "count",
    ),
    "4xx": (
        ("vllm", "sglang"),
        lambda body: [reply(400, REFUSAL)],
        (400, REFUSAL, "application/json"),
        None,
        "",
        "none",
    ),
    # The prefill's own content type passed on (JSON only when it names none).
    "5xx as text": (
        ("vllm", "sglang"),
        lambda body: [TEXT_HEAD.format(503, len(b"engine down")).encode() + b"engine down"],
        (503, b"engine down", "text/plain; charset=utf-8"),
        "status_5xx",
        "prefill status 503",
        "count",
    ),
    "4xx as text": (
        ("vllm", "sglang"),
        lambda body: [TEXT_HEAD.format(422, len(b"too long")).encode() + b"too long"],
        (422, b"too long", "text/plain; charset=utf-8"),
        None,
        "",
        "none",
    ),
    # An engine's 429 (a 4xx: passed on) and 503, each with when to try again: passed on too.
    "429 with retry-after": (
        ("vllm", "sglang"),
        lambda body: [RATE_HEAD.format(429, len(REFUSAL)).encode() + REFUSAL],
        (429, REFUSAL, "application/json"),
        None,
        "",
        "none",
    ),
    "503 with retry-after": (
        ("vllm", "sglang"),
        lambda body: [RATE_HEAD.format(503, len(REFUSAL)).encode() + REFUSAL],
        (503, REFUSAL, "application/json"),
        "status_5xx",
        "prefill status 503",
        "count",
    ),
    "closed before the head": (
        ("vllm", "sglang"),
        lambda body: [],
        (502, "upstream_reset", "upstream up-0 closed the connection"),
        "reset",
        "the upstream closed the connection",
        "count",
    ),
    "cut mid-body": (
        ("vllm", "sglang"),
        lambda body: [reply(200, b'{"choices": []}' + b" " * 1000)[:-900], 0.05],
        (502, "upstream_broken", "upstream up-0 failed mid-response"),
        "protocol",
        "the upstream closed the connection",
        "count",
    ),
    # A 5xx or 4xx answer whose body breaks before its end: vLLM's prefill reply is read whole
    # before its status is looked at, so it failed mid-response; SGLang's answer is passed on or
    # charged as far as it was read (here: nothing).
    "5xx cut mid-body": (
        ("vllm",),
        lambda body: [reply(503, b'{"error": "busy"}' + b" " * 1000)[:-900], 0.05],
        (502, "upstream_broken", "upstream up-0 failed mid-response"),
        "protocol",
        "the upstream closed the connection",
        "count",
    ),
    "4xx cut mid-body": (
        ("vllm",),
        lambda body: [reply(400, REFUSAL + b" " * 1000)[:-900], 0.05],
        (502, "upstream_broken", "upstream up-0 failed mid-response"),
        "protocol",
        "the upstream closed the connection",
        "count",
    ),
    "5xx cut mid-body, drained": (
        ("sglang",),
        lambda body: [reply(503, b'{"error": "busy"}' + b" " * 1000)[:-900], 0.05],
        (503, b"", "application/json"),
        "status_5xx",
        "prefill status 503",
        "count",
    ),
    "4xx cut mid-body, drained": (
        ("sglang",),
        lambda body: [reply(400, REFUSAL + b" " * 1000)[:-900], 0.05],
        (400, b"", "application/json"),
        None,
        "",
        "none",
    ),
    # SGLang's prefill reply is drained, never parsed nor bounded: these are no failures there.
    "reply too large": (
        ("vllm",),
        lambda body: [reply(200, b'{"x": "' + b"y" * 5000 + b'"}')],
        (
            502,
            "upstream_reply_too_large",
            "the reply of upstream up-0 exceeds the gateway's size limit",
        ),
        "too_large",
        "the reply exceeds 4096 bytes",
        "none",
    ),
    "not a JSON object": (
        ("vllm",),
        lambda body: [reply(200, b"[1, 2]")],
        (502, "upstream_error", "upstream up-0 failed"),
        "status_5xx",
        "the prefill's reply is not a JSON object",
        "count",
    ),
    "read timeout": (  # vLLM only: SGLang's decode, sent at once, would time out alike
        ("vllm",),
        lambda body: [5.0],
        (504, "upstream_timeout", "upstream up-0 timed out"),
        "timeout",
        "no byte from the upstream for 0.5 s",
        "none",
    ),
    "refused": (
        ("vllm", "sglang"),
        None,
        (502, "upstream_unreachable", "upstream up-0 unreachable"),
        "connect",
        "",
        "down",
    ),
}
CASES = [(p, name) for name, row in PREFILL_FAULTS.items() for p in row[0]]


@pytest.mark.parametrize(("protocol", "name"), CASES, ids=[f"{p}-{n}" for p, n in CASES])
def test_each_prefill_failure_is_answered_logged_and_counted(protocol, name, caplog):
    _protocols, script, answer, kind, detail, health = PREFILL_FAULTS[name]
    prefill = FaultServer(script) if script is not None else None
    fleet = PdFleet(protocol, 1, 1)
    config = fleet.config(
        gateway={
            "max_attempts": 1,
            "max_response_bytes": 4096,
            "read_timeout": 0.5 if name == "read timeout" else 10.0,
            "eject_after": 1000,
        }
    )
    url = prefill.url if prefill is not None else f"http://127.0.0.1:{closed_port()}"
    config["workers"][0]["url"] = url
    try:
        with GatewayServer(config) as gw:
            with caplog.at_level(logging.INFO):
                r = post(gw, "pq-1")
            assert r.headers["x-request-id"] == "pq-1"
            if isinstance(answer[1], bytes):  # the prefill worker's own answer, whole
                assert (r.status_code, r.content, r.headers["content-type"]) == answer
                rate = ("retry-after", "x-ratelimit-remaining-requests", "x-engine")
                passed = {k: r.headers[k] for k in rate if k in r.headers}
                assert passed == ({} if "retry" not in name else {rate[0]: "9", rate[1]: "0"})
            else:
                status, code, message = answer
                assert (r.status_code, r.headers["content-type"]) == (status, "application/json")
                kind_name = "service_unavailable" if status == 503 else "upstream_error"
                assert r.json() == {
                    "error": {"message": message, "type": kind_name, "param": None, "code": code}
                }
            logged = lines(caplog, "kvroute.gateway")
            health_lines = lines(caplog, "kvroute.server.health")
            ejected = [m for m in health_lines if m.startswith("ejecting")]
            charged = [m for m in health_lines if "failed (" in m]
            if kind is None or health == "down":
                assert logged == []
            else:
                assert logged == [f"upstream up-0: {kind}: {detail}"]
            if health == "down":
                (line,) = ejected
                address = url.removeprefix("http://")
                assert line.startswith(
                    f"ejecting upstream up-0: connect: ConnectFailed('cannot connect to {address}: "
                )
            else:
                assert ejected == []
            if health == "count":
                assert charged == [
                    "upstream up-0 failed (failed a request only it was tried for, 1 in a row)"
                ]
            else:
                assert charged == []
            # Counted once each: the pair, a decision per half, the failure under the prefill
            # worker, the answer under its status; no retry.
            assert samples(gw, "pd_pairs_total") == {(("reason", "remote"),): 1}
            assert by_worker(gw) == {"up-0": 1, "up-1": 1}
            errors = {(("kind", kind), ("worker", "up-0")): 1} if kind else {}
            assert samples(gw, "upstream_errors_total") == errors
            answered = (("model", "ep-acme"), ("route", ROUTE), ("status", str(r.status_code)))
            assert samples(gw, "requests_total") == {answered: 1}
            assert samples(gw, "request_duration_seconds_count") == {(("route", ROUTE),): 1}
            assert samples(gw, "retries_total") == {}
            if protocol == "vllm":
                assert fleet["up-1"].bodies == []  # the decode half was never sent …
                # … so it was withdrawn: the prompt left the router's model of that worker
                assert gw.gateway.router.index.num_blocks("up-1") == 0
            else:  # sent at once, waiting for the KV: aborted
                wait_for(lambda: len(fleet.exchange.aborted_rooms) == 1, "the decode's abort")
                assert fleet.exchange.consumed_rooms == []
            idle(gw)
    finally:
        if prefill is not None:
            prefill.stop()
        fleet.close()
    assert fleet.exchange.errors == []


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_failed_decode_half_is_answered_logged_and_counted(protocol, caplog):
    """The decode worker answers 503: the caller gets that answer, the decode worker is charged
    and logged with the status, and both halves' load returns to zero."""
    fleet = PdFleet(protocol, 1, 1)
    fleet["up-1"].fail(503)
    try:
        with GatewayServer(fleet.config(gateway={"max_attempts": 1})) as gw:
            with caplog.at_level(logging.INFO):
                r = post(gw, "pq-2")
            assert (r.status_code, r.headers["x-request-id"]) == (503, "pq-2")
            assert r.headers["content-type"] == "application/json"
            assert r.json() == {"error": {"message": "up-1 failing", "type": "server_error"}}
            assert lines(caplog, "kvroute.gateway") == ["upstream up-1: status_5xx: status 503"]
            assert [m for m in lines(caplog, "kvroute.server.health") if "failed (" in m] == [
                "upstream up-1 failed (failed a request only it was tried for, 1 in a row)"
            ]
            assert samples(gw, "upstream_errors_total") == {
                (("kind", "status_5xx"), ("worker", "up-1")): 1
            }
            assert by_worker(gw) == {"up-0": 1, "up-1": 1}
            assert len(fleet["up-0"].bodies) == 1  # the prefill was served
            answered = (("model", "ep-acme"), ("route", ROUTE), ("status", "503"))
            assert samples(gw, "requests_total") == {answered: 1}
            idle(gw)
    finally:
        fleet.close()


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_retried_prefill_is_charged_to_the_worker_that_failed(protocol, caplog):
    """The endpoint's prefill worker answers 500: the pair is routed again past the pool
    (another prefill worker, the same decode worker), the failure is logged and counted under the
    worker that failed, which is charged with a request another worker then served."""
    fleet = PdFleet(protocol, 2, 1)
    try:
        with GatewayServer(fleet.config()) as gw:
            (first,) = gw.gateway.router.endpoint_pool("ep-acme", phase="prefill")
            (other,) = set(fleet.names("prefill")) - {first}
            fleet[first].fail(500)  # for good: a retry that tried it again would fail too
            with caplog.at_level(logging.INFO):
                _text, headers = ask(gw, "Retry me?", rid="pq-3")
            assert (headers["x-kvroute-prefill-worker"], headers["x-kvroute-worker"]) == (
                other,
                "up-2",
            )
            assert headers["x-kvroute-attempts"] == "2"
            assert lines(caplog, "kvroute.gateway") == [
                f"upstream {first}: status_5xx: prefill status 500"
            ]
            assert [m for m in lines(caplog, "kvroute.server.health") if "failed (" in m] == [
                f"upstream {first} failed (failed a request another worker then served, 1 in a row)"
            ]
            assert samples(gw, "retries_total") == {(): 1}
            assert samples(gw, "pd_pairs_total") == {(("reason", "remote"),): 1}  # a request
            assert by_worker(gw) == {first: 1, other: 1, "up-2": 2}
            assert samples(gw, "upstream_errors_total") == {
                (("kind", "status_5xx"), ("worker", first)): 1
            }
            answered = (("model", "ep-acme"), ("route", ROUTE), ("status", "200"))
            assert samples(gw, "requests_total") == {answered: 1}
            idle(gw)
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_retried_pair_stays_in_the_endpoints_pool_while_a_member_is_untried(protocol):
    """A pair spills past its endpoint's pool only when no untried member (of a phase) is left,
    as single requests do: the pool holds two of the three prefill workers, both failing once,
    so the request's prefill tries one, then the other, and only its third attempt goes outside
    the pool — though the pool's members report a long queue and the worker outside is idle
    (a retry routed past the pool would go there). The router holds no pair of it after."""
    fleet = PdFleet(protocol, 3, 2)
    config = fleet.config()
    config["endpoints"][0]["pool_size"] = 2
    try:
        with GatewayServer(config) as gw:
            pool = set(gw.gateway.router.endpoint_pool("ep-acme", phase="prefill"))
            assert len(pool) == 2
            for worker in pool:
                fleet[worker].fail(500, times=1)
                gw.gateway.router.set_load(worker, queued=50, prefill_blocks=5000)
            _text, headers = ask(gw, "Retry me?", rid="pq-pool")
            owner = {id(r): n for n in fleet.names("prefill") for r in fleet[n].records}
            tried = [owner[id(r)] for r in fleet.records() if id(r) in owner]  # in order
            assert len(tried) == 3 and set(tried[:2]) == pool and tried[2] not in pool
            assert headers["x-kvroute-prefill-worker"] == tried[2]
            assert headers["x-kvroute-attempts"] == "3"
            idle(gw)
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


def test_a_retried_pair_that_finds_every_other_worker_full_sheds_nothing():
    """As for single requests: a pair whose prefill failed, retried when every other prefill
    worker is full, answers with its failure (the prefill's own 500), not a 429 — it was not
    shed, and no shed is counted. SGLang: the held request's decode half fills a decode worker
    too (it waits for the KV)."""
    fleet = PdFleet("sglang", 2, 2)
    try:
        with GatewayServer(fleet.config(gateway={"max_in_flight_per_worker": 1})) as gw:
            prefills = fleet.names("prefill")
            for name in prefills:
                fleet[name].stall, fleet[name].poison = 2.5, "POISON"  # under the 5 s room wait

            def send(question: str) -> httpx.Response:
                body = {"model": "base-model", "messages": messages(question)}
                return httpx.post(gw.url + ROUTE, json=body, trust_env=False, timeout=20)

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                held = pool.submit(send, "Hold on?")
                wait_for(lambda: sum(len(fleet[n].bodies) for n in prefills) == 1, "the hold")
                for name in prefills:
                    fleet[name].stall = 0.0  # the other prefill worker fails at once
                r = send("POISON?")
                assert r.status_code == 500
                assert held.result().status_code == 200
            assert samples(gw, "shed_total") == {}
            assert sorted(len(fleet[n].bodies) for n in prefills) == [1, 1]
            idle(gw)
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


def post_slo(gw: GatewayServer, question: str, slo_ms: str) -> httpx.Response:
    return httpx.post(
        gw.url + ROUTE,
        json={"model": "ep-acme", "messages": messages(question)},
        headers={"authorization": "Bearer sk-acme", "x-slo-ttft-ms": slo_ms},
        trust_env=False,
        timeout=20,
    )


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_pair_shed_on_its_ttft_slo_is_withdrawn_whole(protocol):
    """A pair whose prefill cannot meet ``x-slo-ttft-ms`` (~2,000 uncached tokens at 1,000
    tokens/s) is shed before either half is sent: 429 ``slo``, no routing decision or pair
    counted, and both halves withdrawn — the prompt leaves the router's model of both workers.
    A relaxed SLO is served."""
    fleet = PdFleet(protocol, 1, 1)
    config = fleet.config(gateway={"prefill_tokens_per_second": 1000.0})
    try:
        with GatewayServer(config) as gw:
            r = post_slo(gw, "Hurry?", "100")
            assert (r.status_code, r.headers["retry-after"]) == (429, "1")
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "slo")
            assert error["message"].startswith("predicted time to first token ")
            assert error["message"].endswith(" ms on the best worker exceeds x-slo-ttft-ms 100")
            assert [fleet[n].bodies for n in ("up-0", "up-1")] == [[], []]
            router = gw.gateway.router
            assert [router.index.num_blocks(n) for n in ("up-0", "up-1")] == [0, 0]
            assert samples(gw, "shed_total") == {(("reason", "slo"),): 1}
            assert samples(gw, "routing_decisions_total") == {}
            assert samples(gw, "pd_pairs_total") == {}
            idle(gw)
            r = post_slo(gw, "Relaxed?", "60000")
            assert (r.status_code, r.headers["x-kvroute-prefill-worker"]) == (200, "up-0")
            idle(gw)
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


@pytest.mark.parametrize(
    ("tail", "usage"),
    [
        (b'{"id": "x", "usage": {"prompt_tokens": 3}}', {"prompt_tokens": 3}),  # a JSON body
        (b'{"id": "x"}', None),
        (b'data: {"usage": {"a": 1}}\n\ndata: {"usage": {"a": 2}}\n\ndata: [DONE]\n\n', {"a": 2}),
        (b'data: {"usage": {"a": 1}}\n\ndata: {"usage": null}\n\ndata: [DONE]\n\n', {"a": 1}),
        (b'data:{"usage": {"a": 5}}\n\n', {"a": 5}),  # no space after the colon
        # only data fields are read: not another field's line, JSON after its 5th byte or not
        (b'data: {"usage": {"a": 1}}\n\nevent{"usage": {"a": 7}}\n\n', {"a": 1}),
        (b'age": {"a": 9}}\n\ndata: {"choices": []}\n\n', None),  # the tail's cut first line
        (b'data: {"choices": [], "x": "usage"}\n\n', None),
        (b"data: [DONE]\n\n", None),
        (b"", None),
    ],
)
def test_the_usage_of_a_prefill_replys_end(tail, usage):
    """What an SGLang prefill's drained reply reported: a JSON body's ``usage``, or the last
    stream chunk whose ``usage`` is an object (OpenAI's streams send ``"usage": null`` in the
    others)."""
    assert pd._last_usage(tail) == usage


def test_a_prefill_reply_is_a_json_object_or_none():
    assert pd._json_object(b'{"a": [1]}') == {"a": [1]}
    for data in (b"[1, 2]", b'"text"', b"3", b"null", b"not json", b"{", b"[" * 100_000):
        assert pd._json_object(data) is None


def test_an_sglang_decode_failing_first_aborts_its_prefill(caplog):
    """SGLang sends both halves at once. The decode worker fails before the prefill has answered
    (here at once, a fault no engine shows on demand): the caller gets the decode's answer, it is
    charged to the decode worker, and the prefill request is aborted upstream, not left to
    compute KV nobody will take."""
    decode = FaultServer(lambda body: [reply(503, b'{"error": "decode down"}')])
    fleet = PdFleet("sglang", 1, 1)
    fleet["up-0"].stall = 5.0  # the prefill
    config = fleet.config(gateway={"max_attempts": 1})
    config["workers"][1]["url"] = decode.url
    try:
        with GatewayServer(config) as gw:
            with caplog.at_level(logging.INFO):
                r = post(gw, "pq-5")
            assert (r.status_code, r.content) == (503, b'{"error": "decode down"}')
            assert lines(caplog, "kvroute.gateway") == ["upstream up-1: status_5xx: status 503"]
            wait_for(lambda: fleet["up-0"].abandoned == ["pq-5"], "the prefill to be aborted")
            assert samples(gw, "upstream_errors_total") == {
                (("kind", "status_5xx"), ("worker", "up-1")): 1
            }
            idle(gw)
    finally:
        decode.stop()
        fleet.close()


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_retry_never_goes_back_to_the_prefill_worker_that_failed(protocol):
    """The only prefill worker answers every request 500 (and is not ejected): the retry
    excludes it inside the endpoint's pool and past it. vLLM's decode worker then serves the
    request alone; SGLang's cannot, and the prefill's own answer is the caller's. Either way the
    failed worker got the request once, though ``max_attempts`` allows three."""
    fleet = PdFleet(protocol, 1, 1)
    fleet["up-0"].fail(500)
    config = fleet.config(gateway={"max_attempts": 3, "eject_after": 1000})
    try:
        with GatewayServer(config) as gw:
            r = post(gw, "pq-6")
            if protocol == "vllm":
                assert r.status_code == 200
                workers = (r.headers["x-kvroute-prefill-worker"], r.headers["x-kvroute-worker"])
                assert workers == ("up-1", "up-1")
                assert r.headers["x-kvroute-attempts"] == "2"
            else:
                assert r.status_code == 500
                assert r.json() == {"error": {"message": "up-0 failing", "type": "server_error"}}
            assert len(fleet["up-0"].bodies) == 1
            idle(gw)
    finally:
        fleet.close()


@pytest.mark.parametrize("params", [None, {}, [], "engine-0", [1, 2]], ids=repr)
def test_a_vllm_prefill_without_usable_transfer_params_hands_over_out_of_band(params, caplog):
    """A vLLM prefill reply whose ``kv_transfer_params`` is missing, empty or not an object
    hands nothing over: the decode request goes without the field (its engine finds the KV in
    its connector, or computes the prompt), logged at debug level — not the reply's value."""
    reply_body = {"id": "p", "choices": [{"index": 0, "text": "x"}]}
    if params is not None:
        reply_body["kv_transfer_params"] = params
    prefill = FaultServer(lambda body: [reply(200, json.dumps(reply_body).encode())])
    fleet = PdFleet("vllm", 1, 1)
    config = fleet.config()
    config["workers"][0]["url"] = prefill.url
    try:
        with GatewayServer(config) as gw:
            with caplog.at_level(logging.DEBUG, "kvroute.gateway"):
                r = post(gw, "pq-7")
            assert (r.status_code, r.headers["x-kvroute-worker"]) == (200, "up-1")
            (d_body,) = fleet["up-1"].bodies
            assert "kv_transfer_params" not in d_body
            assert lines(caplog, "kvroute.gateway") == [
                "prefill on up-0 returned no kv_transfer_params"
            ]
            idle(gw)
    finally:
        prefill.stop()
        fleet.close()
    assert fleet.exchange.errors == []


def test_an_sglang_prefill_reply_still_streaming_is_drained_in_the_background():
    """The SGLang decode answers while the prefill's own (streamed) reply is held after its first
    chunk: the client has its answer, and the gateway keeps the prefill's drain — in
    ``PdForwarder.background``, which ``stop`` cancels — until the reply ends, then finishes the
    prefill's flight."""
    fleet = PdFleet("sglang", 1, 1)
    prefill = fleet["up-0"]
    prefill.gate_after_first = True  # its stream holds after the first content chunk
    try:
        with GatewayServer(fleet.config()) as gw:
            pd_ = gw.gateway.pd
            assert pd_ is not None
            text, headers = ask(gw, "Hold the prefill?", stream=True, rid="pq-9")
            assert text.startswith("up-1 pq-9")
            assert (headers["x-kvroute-prefill-worker"], headers["x-kvroute-worker"]) == (
                "up-0",
                "up-1",
            )
            # The decode's flight closes just after its last byte went out; the prefill is
            # still being read.
            wait_for(lambda: gw.active()["up-1"] == 0, "the decode's flight to close")
            assert gw.active() == {"up-0": 1, "up-1": 0}
            (task,) = pd_.background
            assert not task.done()
            prefill.gate.set()
            wait_for(lambda: not pd_.background, "the prefill's drain to end")
            idle(gw)
            assert len(prefill.streams_completed) == 1 and prefill.streams_ended_early == []
    finally:
        fleet.close()
    assert fleet.exchange.errors == []
