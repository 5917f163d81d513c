"""Hostile clients (issue 14, items 3 and 5, and "Also"): slow headers, idle connections past the
cap, bodies sent to the wrong key, slow bodies, bodies that break parsers, disconnects during the
body, and what /metrics, /health, redirects and request ids give away. Raw sockets where the
fault is in the bytes on the wire; httpx and the OpenAI client otherwise."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from kvroute.gateway.listener import uvicorn_config
from support.gateway_fleet import (
    Fleet,
    GatewayServer,
    chat,
    config_dict,
    metric_samples,
    wait_for,
)
from support.gateway_upstream import ServerThread


@pytest.fixture(scope="module")
def fleet():
    f = Fleet(2)
    yield f
    f.close()


def connect(gw: GatewayServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", gw.server.port), timeout=5)
    return s


def read_all(s: socket.socket, timeout: float) -> bytes:
    """Reads until the server closes the connection (or ``timeout``: then what came)."""
    s.settimeout(timeout)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            data = s.recv(65536)
            if not data:
                break
            out += data
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def closed_by_server(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def head(path: str = "/v1/chat/completions", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# ---- item 3: deadlines, the connection cap, the key before the body --------------------------


def test_slow_headers_are_cut_off(fleet):
    with GatewayServer(config_dict(fleet, gateway={"header_timeout": 0.5})) as gw:
        s = connect(gw)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        closed = False
        for i in range(20):  # one header line every 0.2 s, never the blank line
            try:
                s.sendall(f"x-slow-{i}: y\r\n".encode())
            except OSError:
                closed = True
                break
            if closed_by_server(s, 0.2):
                closed = True
                break
        assert closed, "the connection was still open after 4 s of slow headers"
        assert gw.gateway.guard.timed_out >= 1
        s.close()
        done, _ = chat(gw.client("sk-acme"), "ep-acme", "still serving")
        assert done.choices


def test_header_deadline_ends_when_the_request_starts(fleet):
    """A request that takes longer than header_timeout upstream is not cut off, whatever the
    caller says in X-Forwarded-For (the guard finds its connection by the socket's address)."""
    with GatewayServer(config_dict(fleet, gateway={"header_timeout": 0.3})) as gw:
        for u in fleet.upstreams:
            u.stall = 1.0
        try:
            done, _ = chat(
                gw.client("sk-acme"),
                "ep-acme",
                "slow upstream",
                extra_headers={"x-forwarded-for": "203.0.113.9", "x-forwarded-proto": "https"},
            )
            assert done.choices
        finally:
            for u in fleet.upstreams:
                u.stall = 0.0


def test_a_connection_that_sends_nothing_is_closed(fleet):
    with GatewayServer(config_dict(fleet, gateway={"header_timeout": 0.3})) as gw:
        s = connect(gw)
        assert closed_by_server(s, 3.0)
        s.close()


def test_connection_cap_evicts_the_longest_idle(fleet):
    cfg = config_dict(fleet, gateway={"max_connections": 8, "header_timeout": 60.0})
    with GatewayServer(cfg) as gw:
        idle = [connect(gw) for _ in range(8)]
        wait_for(lambda: len(gw.gateway.guard.open) == 8, "8 connections open")
        # A legitimate caller still gets through: the longest-waiting idle connection makes room.
        done, _ = chat(gw.client("sk-acme"), "ep-acme", "past the cap")
        assert done.choices
        assert closed_by_server(idle[0], 2.0)
        assert gw.gateway.guard.evicted >= 1
        assert len(gw.gateway.guard.open) <= 8
        for s in idle:
            s.close()


def test_key_is_checked_before_the_body_is_read(fleet):
    cfg = config_dict(fleet, gateway={"models": []})  # nothing is open without a key
    with GatewayServer(cfg) as gw:
        s = connect(gw)
        s.sendall(head(authorization="Bearer sk-wrong", content_length="1000000"))
        answer = read_all(s, 3.0)  # no body sent: a gateway waiting for it would say nothing
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert b"invalid_api_key" in answer
        s.close()


def test_slow_body_gets_408(fleet):
    with GatewayServer(config_dict(fleet, gateway={"body_timeout": 0.5})) as gw:
        s = connect(gw)
        s.sendall(head(authorization="Bearer sk-acme", content_length="1000") + b'{"model":')
        answer = read_all(s, 5.0)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        s.close()
        m = metric_samples(gw.metrics())
        assert m[("kvroute_gateway_rejected_total", (("reason", "request_timeout"),))] == 1


# ---- item 5: hostile bodies are 4xx with a clear message, counted ----------------------------

HOSTILE = {
    "lone surrogate in content": (
        b'{"model":"ep-acme","messages":[{"role":"user","content":"a\\ud800b"}]}',
        "lone UTF-16 surrogate",
    ),
    "lone surrogate in tools": (
        b'{"model":"ep-acme","messages":[{"role":"user","content":"hi"}],'
        b'"tools":[{"type":"function","function":{"name":"\\udfff"}}]}',
        "lone UTF-16 surrogate",
    ),
    "surrogate encoded in the raw bytes": (
        b'{"model":"ep-acme","messages":[{"role":"user","content":"a\xed\xa0\x80b"}]}',
        "",
    ),
    "nested 990 deep": (
        b'{"model":"ep-acme","messages":[{"role":"user","content":'
        + b"[" * 990
        + b"]" * 990
        + b"}]}",
        "nested too deeply",
    ),
    "nested 1000 deep": (b'{"model":"ep-acme","x":' + b"[" * 1000 + b"]" * 1000 + b"}", "nested"),
    "nested 100000 deep": (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    "stream as a string": (
        b'{"model":"ep-acme","stream":"true","messages":[{"role":"user","content":"hi"}]}',
        "'stream' must be true or false",
    ),
}


@pytest.mark.parametrize("body,message", HOSTILE.values(), ids=list(HOSTILE))
def test_hostile_bodies_are_4xx(fleet, body, message):
    with GatewayServer(config_dict(fleet)) as gw:
        before = len(fleet.records())
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            content=body,
            headers={"authorization": "Bearer sk-acme", "content-type": "application/json"},
            trust_env=False,
            timeout=10,
        )
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
        m = metric_samples(gw.metrics())
        statuses = {
            dict(labels)["status"]: v
            for (name, labels), v in m.items()
            if name == "kvroute_gateway_requests_total"
        }
        assert statuses == {"400": 1}
        assert len(fleet.records()) == before
        done, _ = chat(gw.client("sk-acme"), "ep-acme", "and the next one is fine")
        assert done.choices


def test_client_disconnect_during_the_body_is_counted(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        s = connect(gw)
        s.sendall(head(authorization="Bearer sk-acme", content_length="1000") + b"{" * 100)
        time.sleep(0.1)
        s.close()
        key = ("kvroute_gateway_rejected_total", (("reason", "client_gone"),))
        wait_for(lambda: metric_samples(gw.metrics()).get(key) == 1, "the disconnect counted")
        m = metric_samples(gw.metrics())
        statuses = {
            dict(labels)["status"]
            for (name, labels) in m
            if name == "kvroute_gateway_requests_total"
        }
        assert statuses == {"499"}


def test_a_streaming_client_that_stops_reading_is_disconnected(fleet):
    """A streaming caller that keeps its connection open but reads nothing more is cut off after
    client_write_timeout: counted 499, and its flight, worker and fleet slots, router load and
    upstream stream released (before: held for as long as the caller held the socket)."""
    cfg = config_dict(fleet, gateway={"client_write_timeout": 1.0, "max_in_flight": 8})

    def streams_over() -> int:  # upstream streams no longer held (uvicorn's send after the
        # gateway hangs up returns at once: the rest of the answer runs to its end)
        return sum(len(u.streams_ended_early) + len(u.streams_completed) for u in fleet.upstreams)

    over = streams_over()
    with GatewayServer(cfg) as gw:
        g = gw.gateway
        for u in fleet.upstreams:
            u.chunks = 300_000  # ~45 MB of SSE: far past every socket and transport buffer
        try:
            body = json.dumps(
                {"model": "ep-acme", "messages": [{"role": "user", "content": "q"}], "stream": True}
            ).encode()
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", gw.server.port))
            s.sendall(head(authorization="Bearer sk-acme", content_length=str(len(body))) + body)
            assert s.recv(60).startswith(b"HTTP/1.1 200")  # then never read again
            wait_for(lambda: g.guard.write_timed_out == 1, "the stalled client cut off", 30)
            wait_for(lambda: sum(g.upstreams.in_flight.values()) == 0, "the flight released")
            assert g.admission.total == 0
            assert sum(gw.active().values()) == 0
            assert not g.upstreams.full
            wait_for(lambda: streams_over() == over + 1, "the upstream stream let go", 30)
            s.close()
        finally:
            for u in fleet.upstreams:
                u.chunks = 3
        m = metric_samples(gw.metrics())
        statuses = {
            dict(labels)["status"]: v
            for (name, labels), v in m.items()
            if name == "kvroute_gateway_requests_total"
        }
        assert statuses == {"499": 1}
        done, _ = chat(gw.client("sk-acme"), "ep-acme", "and the next one is fine")
        assert done.choices


# ---- "Also": what the gateway gives away ------------------------------------------------------


def test_metrics_and_worker_health_need_the_admin_key(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        anyone = {"authorization": "Bearer sk-acme"}
        assert gw.get("/metrics", headers=anyone).status_code == 404
        public = gw.get("/health", headers={})
        assert public.status_code == 200 and public.json() == {"status": "ok"}
        assert "up-0" not in public.text
        assert "kvroute_gateway_requests_total" in gw.get("/metrics").text  # the admin key
        assert gw.get("/health").json()["workers"] == {"up-0": True, "up-1": True}


def test_admin_listener(fleet):
    cfg = config_dict(fleet)
    del cfg["gateway"]["admin_api_keys"]
    with GatewayServer(cfg) as gw:
        app = gw.gateway.admin_app
        admin = ServerThread(
            app, config=uvicorn_config(app, None, log_level="warning", lifespan="off")
        )
        try:
            r = httpx.get(admin.url + "/metrics", trust_env=False)
            assert r.status_code == 200 and "kvroute_gateway_in_flight" in r.text
            h = httpx.get(admin.url + "/health", trust_env=False).json()
            assert h["workers"] == {"up-0": True, "up-1": True}
            assert httpx.get(admin.url + "/v1/models", trust_env=False).status_code == 404
        finally:
            admin.stop()
        assert gw.get("/metrics", headers={}).status_code == 404  # not on the public listener


def test_trailing_slash_is_not_redirected_to_the_host_header(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        r = httpx.post(
            gw.url + "/v1/chat/completions/",
            headers={"host": "evil.example", "authorization": "Bearer sk-acme"},
            json={"model": "ep-acme", "messages": []},
            trust_env=False,
            follow_redirects=False,
        )
        assert r.status_code == 404
        assert "location" not in r.headers
        assert r.json()["error"]["code"] == "not_found"


def test_request_id_is_not_sent_upstream_verbatim(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        for _ in range(2):
            _, h = chat(gw.client(None), "base-model", "hi", extra_headers={"x-request-id": "same"})
            assert h["x-request-id"] == "same"
        ups = [r["upstream_id"] for r in fleet.records() if r["id"] == "same"]
        assert len(ups) == 2 and len(set(ups)) == 2 and "same" not in ups
        assert json.dumps(ups).count("same") == 2  # still traceable to the caller's id
