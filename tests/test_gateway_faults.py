"""Broken upstreams and tenants that hurt each other (issue 14, items 2, 4, 5 and 6).

Faults a real engine cannot be made to show on demand come from ``gateway_faults.FaultServer``
(a raw HTTP/1.1 server that writes scripted bytes); everything else from the OpenAI-compatible
test upstreams. Callers are the official OpenAI client and raw httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import httpx
import kvroute
import numpy as np
import openai
import pytest
from kvroute.gateway.config import ServerConfig
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.upstream import Upstreams
from kvroute.server.config import WorkerConfig
from support.gateway_faults import (
    SSE_HEAD,
    FaultServer,
    chunk,
    delta,
    reply,
)
from support.gateway_fleet import (
    ADMIN_KEY,
    Fleet,
    GatewayServer,
    chat,
    config_dict,
    messages,
    metric_samples,
)


def fleet_config(urls: list[str], **gateway) -> dict:
    """A gateway over the given upstream URLs (workers w-0, w-1, …), one open model "m"."""
    return {
        "gateway": {
            "models": ["m"],
            "connect_timeout": 1.0,
            "read_timeout": 5.0,
            "health_interval": 0.05,
            "eject_seconds": 30.0,
            "admin_api_keys": [ADMIN_KEY],
            **gateway,
        },
        "router": {"policy": "round_robin"},
        "workers": [{"name": f"w-{i}", "url": url, "kind": "openai"} for i, url in enumerate(urls)],
    }


@pytest.fixture
def faults():
    servers: list[FaultServer] = []

    def make(script) -> FaultServer:
        s = FaultServer(script)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def good():
    f = Fleet(1)
    yield f
    f.close()


def stream_text(client, **kw) -> str:
    stream = client.chat.completions.create(
        model="m", messages=messages("q", system="s"), stream=True, **kw
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def post_chat(gw) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "m", "messages": messages("q")},
        trust_env=False,
        timeout=10,
    )


def counted(gw, name: str, **labels) -> float:
    key = (f"kvroute_gateway_{name}", tuple(sorted(labels.items())))
    return metric_samples(gw.metrics()).get(key, 0.0)


# ---- item 4: nothing is committed before the upstream's first event -------------------------

CLOSED_BEFORE_FIRST_EVENT = {
    "closed": lambda body: [SSE_HEAD],
    "bad chunked encoding": lambda body: [SSE_HEAD, b"zz\r\nnot a chunk\r\n"],
    "clean end, no event": lambda body: [SSE_HEAD, b"0\r\n\r\n"],
}


@pytest.mark.parametrize(
    "script", CLOSED_BEFORE_FIRST_EVENT.values(), ids=list(CLOSED_BEFORE_FIRST_EVENT)
)
def test_stream_failing_before_its_first_event_is_retried(faults, good, script):
    bad = faults(script)
    cfg = fleet_config([bad.url, f"http://127.0.0.1:{good.ports[0]}"], max_attempts=2)
    with GatewayServer(cfg) as gw:
        client = gw.client(None)
        for _ in range(4):  # round robin: half of them try the broken worker first
            assert stream_text(client).startswith("up-0 ")
        assert bad.requests  # it was tried
        assert (
            counted(gw, "requests_total", route="/v1/chat/completions", model="m", status="200")
            == 4
        )


@pytest.mark.parametrize(
    "script", CLOSED_BEFORE_FIRST_EVENT.values(), ids=list(CLOSED_BEFORE_FIRST_EVENT)
)
def test_stream_failing_everywhere_before_its_first_event_is_502(faults, script):
    bad = faults(script)
    with GatewayServer(fleet_config([bad.url], max_attempts=1)) as gw:
        with pytest.raises(openai.APIStatusError) as e:
            stream_text(gw.client(None))
        assert e.value.status_code == 502
        assert (
            counted(gw, "requests_total", route="/v1/chat/completions", model="m", status="502")
            == 1
        )


BROKEN_AFTER_FIRST_EVENT = {
    "connection lost": lambda body: [SSE_HEAD, chunk(delta("one ") + delta("two ")), 0.05],
    "no [DONE] at the end": lambda body: [SSE_HEAD, chunk(delta("one ")), b"0\r\n\r\n"],
    "cut inside an event": lambda body: [SSE_HEAD, chunk(delta("one ") + b"data: {"), b"0\r\n\r\n"],
}


@pytest.mark.parametrize(
    "script", BROKEN_AFTER_FIRST_EVENT.values(), ids=list(BROKEN_AFTER_FIRST_EVENT)
)
def test_stream_broken_after_its_first_event_ends_with_an_error_event(faults, script):
    bad = faults(script)
    with GatewayServer(fleet_config([bad.url], max_attempts=1)) as gw:
        pieces = []
        with pytest.raises(openai.APIError) as e:
            stream = gw.client(None).chat.completions.create(
                model="m", messages=messages("q", system="s"), stream=True
            )
            for c in stream:
                pieces.append(c.choices[0].delta.content)
        assert pieces[0] == "one "
        assert "failed mid-stream" in str(e.value)
        assert (
            counted(gw, "requests_total", route="/v1/chat/completions", model="m", status="502")
            == 1
        )
        assert (
            counted(gw, "requests_total", route="/v1/chat/completions", model="m", status="200")
            == 0
        )
        assert counted(gw, "upstream_errors_total", worker="w-0", kind="broken_stream") == 1
        assert counted(gw, "in_flight", worker="w-0") == 0


def test_non_streamed_reply_cut_mid_body_is_retried(faults, good):
    cut = lambda body: [reply(200, b'{"choices": []}' + b" " * 1000)[:-900], 0.05]  # noqa: E731
    bad = faults(cut)
    cfg = fleet_config([bad.url, f"http://127.0.0.1:{good.ports[0]}"], max_attempts=2)
    with GatewayServer(cfg) as gw:
        for i in range(4):
            done, _ = chat(gw.client(None), "m", f"q{i}", system="s")
            assert done.choices[0].message.content.startswith("up-0 ")
        assert bad.requests


# ---- item 5: an upstream status of 600 or more ------------------------------------------------


def test_upstream_status_600_is_answered_502(faults, caplog):
    bad = faults(lambda body: [reply(600, b"{}")])
    with GatewayServer(fleet_config([bad.url], max_attempts=1)) as gw:
        with caplog.at_level(logging.WARNING):
            r = post_chat(gw)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_bad_status"
        assert r.json()["error"]["message"] == "upstream w-0 answered an invalid HTTP status"
        # The failure is logged with its worker, kind and detail.
        assert "upstream w-0: bad_status: status 600" in [
            r.getMessage() for r in caplog.records if r.name == "kvroute.gateway"
        ]
        assert counted(gw, "upstream_errors_total", worker="w-0", kind="bad_status") == 1
        statuses = {
            dict(labels)["status"]
            for (name, labels) in metric_samples(gw.metrics())
            if name == "kvroute_gateway_requests_total"
        }
        assert statuses == {"502"}
        # The one worker tried is charged with the failure, saying why.
        assert "upstream w-0 failed (failed a request only it was tried for, 1 in a row)" in [
            r.getMessage() for r in caplog.records if r.name == "kvroute.server.health"
        ]


def test_an_upstream_5xx_answer_is_passed_on_bounded(faults):
    """When no attempt succeeds, the caller gets the last upstream's own 5xx answer: its status
    and body, JSON unless the upstream said otherwise, and no body past ``max_response_bytes``."""
    head = "HTTP/1.1 {} X\r\n{}content-length: {}\r\nconnection: close\r\n\r\n"

    def answer(body: bytes) -> list[bytes]:
        if b"whole" in body:  # a 200 over the limit, arriving with its head in one write
            return [reply(200, b'{"choices": [], "x": "' + b"y" * 5000 + b'"}')]
        if b"big" in body:
            return [reply(500, b"x" * 5000)]
        if b"text" in body:
            data = b"engine down"
            return [head.format(503, "content-type: text/plain\r\n", len(data)).encode() + data]
        return [head.format(503, "", 4).encode() + b"oops"]

    bad = faults(answer)
    cfg = fleet_config([bad.url], max_attempts=1, max_response_bytes=4096)
    with GatewayServer(cfg) as gw:

        def ask(question: str) -> httpx.Response:
            body = {"model": "m", "messages": messages(question)}
            return httpx.post(gw.url + "/v1/chat/completions", json=body, trust_env=False)

        r = ask("plain")
        assert (r.status_code, r.content, r.headers["content-type"]) == (
            503,
            b"oops",
            "application/json",
        )
        r = ask("text")
        assert (r.status_code, r.content, r.headers["content-type"]) == (
            503,
            b"engine down",
            "text/plain",  # the upstream's own, as it named it (as a 200's or 4xx's is)
        )
        r = ask("big")
        assert (r.status_code, r.content) == (500, b"")
        r = ask("whole")
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_reply_too_large"


# ---- item 6: upstream output is bounded ------------------------------------------------------


def test_sse_without_event_boundaries_is_cut_off(faults):
    flood = [chunk(b"x" * 8192) for _ in range(64)]  # 512 KiB, no blank line
    bad = faults(lambda body: [SSE_HEAD, chunk(delta("one ")), *flood, b"0\r\n\r\n"])
    cfg = fleet_config([bad.url], max_attempts=1, max_event_bytes=65536)
    with GatewayServer(cfg) as gw:
        with pytest.raises(openai.APIError) as e:
            for _ in gw.client(None).chat.completions.create(
                model="m", messages=messages("q"), stream=True
            ):
                pass
        assert "exceeds 65536 bytes" in str(e.value)
        assert counted(gw, "upstream_errors_total", worker="w-0", kind="broken_stream") == 1


def test_non_streamed_reply_is_bounded(faults):
    big = b'{"choices": [], "x": "' + b"y" * (3 << 20) + b'"}'
    bad = faults(lambda body: [reply(200, big)])
    cfg = fleet_config([bad.url], max_attempts=2, max_response_bytes=1 << 20)
    with GatewayServer(cfg) as gw:
        r = post_chat(gw)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_reply_too_large"
        assert len(bad.requests) == 1  # not retried: another worker would answer as largely


# ---- item 2: one tenant's requests must not eject the fleet ----------------------------------


def test_poison_requests_eject_no_worker():
    """An endpoint over a pool of two workers; its requests containing POISON make both engines
    answer 500. They fail (the caller gets the engine's 500), but no worker is ejected, and the
    other tenant on the same workers is served throughout."""
    fleet = Fleet(2)
    try:
        for u in fleet.upstreams:
            u.poison = "POISON"
        cfg = config_dict(fleet, gateway={"eject_seconds": 30.0})  # max_attempts 3
        cfg["endpoints"] = [
            {"id": "ep-bad", "model": "m", "pool_size": 2, "api_keys": ["sk-bad"]},
            {"id": "ep-victim", "model": "m", "pool_size": 2, "api_keys": ["sk-victim"]},
        ]
        with GatewayServer(cfg) as gw:
            for i in range(8):
                with pytest.raises(openai.InternalServerError):
                    chat(gw.client("sk-bad"), "ep-bad", f"POISON {i}")
                done, _ = chat(gw.client("sk-victim"), "ep-victim", f"fine {i}")
                assert done.choices
            time.sleep(0.3)  # the suspicion probes have answered
            assert all(gw.get("/health").json()["workers"].values())
    finally:
        fleet.close()


# ---- health probes: what readmits an ejected worker -----------------------------------------


def test_health_probe_is_200_within_the_connect_timeout(faults):
    """``Upstreams.probe`` (the health check that readmits a worker) against real listeners: 200
    is healthy; another status, a refused connection, a worker that never answers (given up
    after ``connect_timeout``, not the 30 s read timeout) and a worker without a pool are not."""
    sick = faults(lambda body: [reply(503, b"{}")])  # GET /health: 200, anything else: 503
    never = faults(lambda body: [60.0])  # accepts, reads the request, never answers
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"
    urls = {"sick": sick.url, "never": never.url, "refused": refused}
    workers = tuple(WorkerConfig(name=n, url=u) for n, u in urls.items())
    server = ServerConfig(connect_timeout=0.2, read_timeout=30.0)
    upstreams = Upstreams(workers, server, kvroute.Router(list(urls)), GatewayMetrics(dict, dict))

    async def probes() -> list[bool]:
        upstreams.start()
        try:
            return [
                await upstreams.probe("sick", "/health"),
                await upstreams.probe("sick", "/ready"),
                await upstreams.probe("never", "/ready"),
                await upstreams.probe("refused", "/health"),
                await upstreams.probe("no-such-worker", "/health"),
            ]
        finally:
            await upstreams.stop()

    async def bounded() -> list[bool]:
        # A probe that waited for the read timeout would hang here, not fail an assertion.
        return await asyncio.wait_for(probes(), 10.0)

    assert asyncio.run(bounded()) == [True, False, False, False, False]
    assert (len(sick.requests), len(never.requests)) == (1, 1)  # the /ready probes got there


def test_failed_send_is_classified_and_closes_its_flight(faults):
    """``Flight.send`` against real listeners, each failure within its ``[gateway]`` timeout: a
    refused connection is the ``connect`` failure, and so is a connection the listener's full
    backlog never completes (``connect_timeout``); a listener that never reads a large body
    (``write_timeout``) and a response head that never comes (``read_timeout``) are ``timeout``;
    a second request to a worker whose only connection is busy is ``pool_timeout``. Each comes
    with the client's exception, and the attempt is finished in the router either way."""
    never = faults(lambda body: [60.0])
    with contextlib.ExitStack() as stack:
        free, full, deaf = (stack.enter_context(socket.socket()) for _ in range(3))
        for s in (free, full, deaf):
            s.bind(("127.0.0.1", 0))
        full.listen(0)  # one connection queued, never accepted: the next SYN is dropped
        stack.enter_context(socket.create_connection(full.getsockname()))
        deaf.listen(8)  # connections complete in the kernel; nothing ever reads them
        urls = {
            "refused": f"http://127.0.0.1:{free.getsockname()[1]}",
            "full": f"http://127.0.0.1:{full.getsockname()[1]}",
            "deaf": f"http://127.0.0.1:{deaf.getsockname()[1]}",
            "never": never.url,
        }
        workers = tuple(WorkerConfig(name=n, url=u, max_connections=1) for n, u in urls.items())
        router = kvroute.Router(list(urls), block_size=16)
        server = ServerConfig(
            connect_timeout=0.5, read_timeout=2.0, write_timeout=0.5, pool_timeout=0.3
        )
        upstreams = Upstreams(workers, server, router, GatewayMetrics(dict, dict))

        async def send(worker: str, body: bytes = b"{}"):
            tokens = np.arange(32, dtype=np.uint32)
            d = router.route(tokens=tokens, exclude=[w for w in urls if w != worker])
            flight = upstreams.begin(d, len(tokens))
            got = await flight.send("/v1/completions", "", body)
            assert flight.closed
            return got[0].kind, type(got[1]).__name__, got[2]

        async def run():
            upstreams.start()
            try:
                one = [
                    await send("refused"),
                    await send("full"),
                    await send("deaf", b"x" * (32 << 20)),  # more than the socket buffers hold
                ]
                two = await asyncio.gather(send("never"), send("never"))
                return one, sorted(two)
            finally:
                await upstreams.stop()

        # A send that waited for no timeout would hang here, not fail an assertion.
        one, two = asyncio.run(asyncio.wait_for(run(), 20.0))
    assert one == [
        ("connect", "ConnectFailed", None),
        ("connect", "ConnectTimeout", None),
        ("timeout", "WriteTimeout", None),
    ]
    assert two == [("pool_timeout", "PoolTimeout", None), ("timeout", "ReadTimeout", None)]
    assert all(router.load(w)["active"] == 0 for w in urls)
    assert all(n == 0 for n in upstreams.in_flight.values())
