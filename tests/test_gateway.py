"""The gateway end to end: test upstreams (each a prefix cache modelled with kvroute.BlockCache)
and the gateway under uvicorn on 127.0.0.1, called with the official OpenAI client.

Expected cached-token counts come from the upstreams' own model (``gateway_upstream``), which
re-implements the documented byte-level rendering independently of the gateway's code.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import time

import httpx
import openai
import pytest
from support.gateway_fleet import (
    LONG_SYSTEM,
    Fleet,
    GatewayServer,
    chat,
    config_dict,
    messages,
    metric_samples,
    wait_for,
)
from support.gateway_upstream import expected_cached, reference_render


@pytest.fixture
def fleet():
    f = Fleet(4)
    yield f
    f.close()


@pytest.fixture
def gw(fleet):
    with GatewayServer(config_dict(fleet)) as g:
        yield g


def shared_prefix_cached(a: list[dict], b: list[dict]) -> int:
    """Tokens the second of two chats finds cached: full blocks of their common rendered prefix."""
    x, y = reference_render(a).encode(), reference_render(b).encode()
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return expected_cached(x[:n].decode("utf-8", errors="ignore"))


def fleet_owner(fleet, record) -> str:
    return next(u.name for u in fleet.upstreams if any(r is record for r in u.records))


# ---- the classic experiment ----------------------------------------------------------------


def test_two_calls_same_system_prompt(fleet, gw):
    client = gw.client("sk-acme")
    first, h1 = chat(client, "ep-acme", "Which fuel for R3?")
    second, h2 = chat(client, "ep-acme", "And for model R17, please?")

    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    expected = shared_prefix_cached(
        messages("Which fuel for R3?"), messages("And for model R17, please?")
    )
    system_only = expected_cached(reference_render([{"role": "system", "content": LONG_SYSTEM}]))
    assert cached == expected >= system_only > 1500  # the whole system prompt, block-aligned
    # Both calls went to the endpoint's one pool worker, which is what the router predicted.
    assert h1["x-kvroute-worker"] == h2["x-kvroute-worker"]
    assert int(h1["x-kvroute-cached-tokens"]) == 0
    assert int(h2["x-kvroute-cached-tokens"]) == cached
    worker = h2["x-kvroute-worker"]
    assert second.choices[0].message.content == f"{worker} {h2['x-request-id']}"
    # Upstream saw the real model name, the endpoint's salt, and not the caller's key.
    recs = fleet[worker].records
    assert [r["model"] for r in recs] == ["acme-model", "acme-model"]
    salt = gw.gateway.router.endpoint_salt("ep-acme")
    assert [r["cache_salt"] for r in recs] == [salt, salt]
    assert all(r["authorization"] is None for r in recs)


def test_two_calls_streamed_with_and_without_usage(fleet, gw):
    client = gw.client("sk-globex")
    msgs = messages("Streaming please.")
    stream = client.chat.completions.create(model="ep-globex", messages=msgs, stream=True)
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)  # the usage chunk the gateway asked for is gone
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    worker = text.split()[0]
    stream = client.chat.completions.create(
        model="ep-globex",
        messages=messages("Streaming again."),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    expected = shared_prefix_cached(msgs, messages("Streaming again."))
    assert usage[0].prompt_tokens_details.cached_tokens == expected > 1500
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split()[0] == worker
    # Upstream was asked for usage both times; the gateway observed both reports.
    recs = fleet[worker].records
    assert [r["stream_options"] for r in recs] == [{"include_usage": True}] * 2
    m = metric_samples(gw.metrics())
    assert m[("kvroute_gateway_cached_tokens_reported_total", (("worker", worker),))] == expected
    assert m[("kvroute_gateway_cached_tokens_predicted_total", (("worker", worker),))] == expected


def test_completions_text_and_token_ids(fleet, gw):
    client = gw.client("sk-acme")
    prompt = LONG_SYSTEM + " Question one."
    a = client.completions.with_raw_response.create(model="ep-acme", prompt=prompt)
    b = client.completions.with_raw_response.create(model="ep-acme", prompt=LONG_SYSTEM + " Two?")
    assert a.parse().usage.prompt_tokens_details.cached_tokens == 0
    assert a.headers["x-kvroute-worker"] == b.headers["x-kvroute-worker"]
    expected = expected_cached(LONG_SYSTEM + " ")
    assert b.parse().usage.prompt_tokens_details.cached_tokens == expected
    # Token ids route as they are; a repeated id prefix is found cached.
    ids = list(range(1000, 1400))
    c = client.completions.create(model="ep-acme", prompt=[*ids, 1, 2, 3])
    d = client.completions.with_raw_response.create(model="ep-acme", prompt=[*ids, 4, 5])
    assert c.usage.prompt_tokens_details.cached_tokens == 0
    assert d.parse().usage.prompt_tokens_details.cached_tokens == 400 // 16 * 16
    assert int(d.headers["x-kvroute-cached-tokens"]) == 400


def test_direct_model_is_open_and_unsalted(fleet, gw):
    client = gw.client(None)
    _, headers = chat(client, "base-model", "hello", extra_body={"cache_salt": "mine"})
    rec = fleet[headers["x-kvroute-worker"]].records[-1]
    assert rec["model"] == "base-model"
    assert rec["cache_salt"] is None  # a caller's salt is never forwarded
    models = {m.id for m in client.models.list()}
    assert models == {"base-model"}
    models = {m.id for m in gw.client("sk-acme").models.list()}
    assert models == {"base-model", "ep-acme"}


def test_a_caller_cannot_name_an_endpoints_engine_cache_partition(fleet, gw):
    """An endpoint's salt partitions the engines' prefix caches; SGLang keys its partitions by
    ``cache_salt`` and ``extra_key`` joined, so a caller's ``extra_key`` naming the salt (or its
    tail, after another endpoint's salt) would land in that partition and read its hits back in
    ``cached_tokens``: neither field of a caller is forwarded."""
    acme = gw.client("sk-acme")
    question = LONG_SYSTEM + " The same question, twice."
    chat(acme, "ep-acme", question)
    salt = gw.gateway.router.endpoint_salt("ep-acme")
    for client, model, extra_key in [
        (gw.client(None), "base-model", salt),
        (gw.client("sk-globex"), "ep-globex", salt),
    ]:
        resp = client.chat.completions.create(
            model=model,
            messages=messages(question),
            extra_body={"extra_key": extra_key, "cache_salt": salt},
        )
        assert resp.usage.prompt_tokens_details.cached_tokens == 0, model
    assert all(r["extra_key"] is None for r in fleet.records())


def test_endpoints_are_isolated(fleet, gw):
    """Two tenants with the same prompt never share cached blocks (router or engine)."""
    acme, globex = gw.client("sk-acme"), gw.client("sk-globex")
    chat(acme, "ep-acme", "same question")
    _, h = chat(globex, "ep-globex", "same question")
    assert int(h["x-kvroute-cached-tokens"]) == 0
    chat(globex, "ep-globex", "same question")
    recs = [r for r in fleet.records() if r["model"] in ("acme-model", "globex-model")]
    assert recs[1]["cached_tokens"] == 0  # even if it landed on acme's worker
    assert recs[2]["cached_tokens"] > 1500


# ---- stickiness and failover -----------------------------------------------------------------


def test_endpoint_sticks_across_restarts_of_other_upstreams(fleet, gw):
    client = gw.client("sk-acme")
    _, h = chat(client, "ep-acme", "q0")
    home = h["x-kvroute-worker"]
    full = None
    for i, other in enumerate(u.name for u in fleet.upstreams if u.name != home):
        fleet.stop(other)
        # Traffic of the open model finds the dead upstream and fails over.
        for j in range(6):
            done, hh = chat(gw.client(None), "base-model", f"noise {i} {j}", system=f"s{j}")
            assert hh["x-kvroute-worker"] != other
        done, h = chat(client, "ep-acme", f"q{i + 1}")
        assert h["x-kvroute-worker"] == home
        cached = done.usage.prompt_tokens_details.cached_tokens
        full = cached if full is None else full
        assert cached == full > 1500
        fleet.start(other)
        gw.wait_healthy(other)
        done, h = chat(client, "ep-acme", f"q{i + 1} again")
        assert h["x-kvroute-worker"] == home
        assert done.usage.prompt_tokens_details.cached_tokens == full
    # A new gateway over the same fleet puts the endpoint on the same worker: its cache is warm.
    gw.stop()
    with GatewayServer(config_dict(fleet)) as again:
        done, h = chat(again.client("sk-acme"), "ep-acme", "after the gateway restarted")
        assert h["x-kvroute-worker"] == home
        assert done.usage.prompt_tokens_details.cached_tokens == full


def test_failover_when_upstream_is_down(fleet, gw):
    client = gw.client("sk-acme")
    _, h = chat(client, "ep-acme", "warm up")
    home = h["x-kvroute-worker"]
    fleet.stop(home)
    done, h = chat(client, "ep-acme", "is anyone there?")
    assert h["x-kvroute-worker"] != home and h["x-kvroute-attempts"] == "2"
    assert done.choices[0].message.content.startswith(h["x-kvroute-worker"])
    assert gw.get("/health").json()["workers"][home] is False
    m = metric_samples(gw.metrics())
    assert (
        m[("kvroute_gateway_upstream_errors_total", (("kind", "connect"), ("worker", home)))] == 1
    )
    assert m[("kvroute_gateway_worker_healthy", (("worker", home),))] == 0
    assert m[("kvroute_gateway_retries_total", ())] == 1
    # It comes back (empty cache): readmitted after its health check, and the endpoint returns.
    fleet.start(home)
    gw.wait_healthy(home)
    _, h = chat(client, "ep-acme", "back home")
    assert h["x-kvroute-worker"] == home
    assert set(gw.active().values()) == {0}  # failed attempts were finished too


def test_failover_on_5xx_before_first_byte(fleet, gw):
    client = gw.client("sk-acme")
    _, h = chat(client, "ep-acme", "warm up")
    home = h["x-kvroute-worker"]
    fleet[home].fail(503, times=1)
    done, h = chat(client, "ep-acme", "retry me", extra_headers={"x-request-id": "rid-5xx"})
    assert done.choices[0].message.content == f"{h['x-kvroute-worker']} rid-5xx"
    assert h["x-kvroute-worker"] != home
    owners = [fleet_owner(fleet, r) for r in fleet.records() if r["id"] == "rid-5xx"]
    # The caller's id reaches the upstreams prefixed, never verbatim, and differently each time.
    upstream_ids = [r["upstream_id"] for r in fleet.records() if r["id"] == "rid-5xx"]
    assert all(u != "rid-5xx" and u.endswith("-rid-5xx") for u in upstream_ids)
    assert owners == [home, h["x-kvroute-worker"]]  # tried once on each, in that order
    # Streaming requests fail over the same way (the 5xx came before any byte).
    gw.wait_healthy(home)
    fleet[home].fail(500, times=1)
    stream = client.chat.completions.create(
        model="ep-acme", messages=messages("stream retry"), stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert not text.startswith(home)


def test_a_request_spilling_out_of_its_pool_is_routed_by_its_prompt(fleet, gw):
    """ep-acme's pool is one worker: when it fails, the retry spills over to the router's choice
    in the rest of the fleet, made by the request's prompt like any other (the second such request
    goes where the first left its prefix, and the router predicts the hit)."""
    client = gw.client("sk-acme")
    _, h = chat(client, "ep-acme", "warm up")
    home = h["x-kvroute-worker"]
    fleet[home].fail(500)
    _, h1 = chat(client, "ep-acme", "Which fuel for R3?")
    second, h2 = chat(client, "ep-acme", "And for model R17, please?")
    assert h1["x-kvroute-worker"] == h2["x-kvroute-worker"] != home
    assert h1["x-kvroute-attempts"] == h2["x-kvroute-attempts"] == "2"
    cached = second.usage.prompt_tokens_details.cached_tokens
    expected = shared_prefix_cached(
        messages("Which fuel for R3?"), messages("And for model R17, please?")
    )
    assert int(h2["x-kvroute-cached-tokens"]) == cached == expected > 1500


def test_a_spilling_request_never_goes_back_to_a_worker_it_failed_on(fleet, gw):
    """The spill-over choice excludes the workers already tried, even the one holding the
    prompt's prefix: a system prompt sent to ``home`` outside any endpoint (unsalted, as the
    spill-over routes) would draw the retry back to it otherwise."""
    _, h = chat(gw.client("sk-acme"), "ep-acme", "warm up")
    home = h["x-kvroute-worker"]
    for k in range(40):  # a prefix the router has seen on home, unsalted
        system = f"Tenant {k}. {LONG_SYSTEM}"
        _, seeded = chat(gw.client(None), "base-model", "seed", system=system)
        if seeded["x-kvroute-worker"] == home:
            break
    else:
        pytest.fail(f"no unsalted prompt was routed to {home}")
    fleet[home].fail(500)
    _, h = chat(gw.client("sk-acme"), "ep-acme", "spill", system=system)
    assert h["x-kvroute-worker"] != home and h["x-kvroute-attempts"] == "2"


def test_a_retry_stays_in_its_endpoints_pool_while_a_member_is_untried(fleet, gw):
    """A request spills past its endpoint's pool only when no untried member is left: ep-globex's
    pool is two workers, both failing once, so its request tries one, then the other, and only
    its third attempt goes outside the pool — though the pool's members report a long queue and
    the two workers outside are idle (a retry routed past the pool would go to one of them)."""
    pool = set(gw.gateway.router.endpoint_pool("ep-globex"))
    assert len(pool) == 2
    for worker in pool:
        fleet[worker].fail(500, times=1)
        gw.gateway.router.set_load(worker, queued=50, prefill_blocks=5000)
    rid = {"x-request-id": "rid-pool"}
    _, h = chat(gw.client("sk-globex"), "ep-globex", "Which fuel?", extra_headers=rid)
    tried = [fleet_owner(fleet, r) for r in fleet.records() if r["id"] == "rid-pool"]
    assert len(tried) == 3 and set(tried[:2]) == pool and tried[2] not in pool
    assert (h["x-kvroute-worker"], h["x-kvroute-attempts"]) == (tried[2], "3")
    assert set(gw.active().values()) == {0}


def test_a_first_attempt_stays_in_its_endpoints_pool_when_its_member_is_full(fleet):
    """Only a retry spills past an endpoint's pool: a first attempt whose one pool worker is at
    ``max_in_flight_per_worker`` is shed (429 ``worker_queue``), though three workers outside the
    pool are idle."""
    cfg = config_dict(fleet, gateway={"max_in_flight_per_worker": 1})
    with GatewayServer(cfg) as gw:
        (home,) = gw.gateway.router.endpoint_pool("ep-acme")
        fleet[home].stall = 2.0  # its first request holds the pool's worker
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(chat, gw.client("sk-acme"), "ep-acme", "Hold on?")
            wait_for(lambda: len(fleet[home].records) == 1, "the first request upstream")
            with pytest.raises(openai.RateLimitError) as e:
                chat(gw.client("sk-acme"), "ep-acme", "Meanwhile?")
            assert e.value.code == "worker_queue"
            held.result()
        assert [fleet_owner(fleet, r) for r in fleet.records()] == [home]
        assert set(gw.active().values()) == {0}


def test_all_upstreams_failing_gives_the_last_error(fleet):
    with GatewayServer(config_dict(fleet, gateway={"max_attempts": 3})) as gw:
        for u in fleet.upstreams:
            u.fail(502)
        with pytest.raises(openai.APIStatusError) as e:
            chat(gw.client(None), "base-model", "x", extra_headers={"x-request-id": "rid-all"})
        assert e.value.status_code == 502
        tried = [fleet_owner(fleet, r) for r in fleet.records() if r["id"] == "rid-all"]
        assert len(tried) == len(set(tried)) == 3  # bounded attempts, each on another worker
        # Failing on every worker it tried, the request is the likely cause: their health
        # endpoints answer, so nobody is ejected, however often it happens.
        for i in range(4):
            with pytest.raises(openai.APIStatusError):
                chat(gw.client(None), "base-model", f"again {i}")
        time.sleep(0.3)  # the suspicion probes have answered
        assert all(gw.get("/health").json()["workers"].values())
        # Sick workers (their health endpoint fails too) are ejected once suspected, within
        # max_ejected_fraction (0.5: 2 of the 4) …
        for u in fleet.upstreams:
            u.health_status = 503
        with pytest.raises(openai.APIStatusError):
            chat(gw.client(None), "base-model", "sick")
        wait_for(
            lambda: sum(not ok for ok in gw.get("/health").json()["workers"].values()) == 2,
            "the sick workers' ejection",
        )
        # … and readmitted by their health check once they recover.
        for u in fleet.upstreams:
            u.fail(502, times=0)
            u.health_status = 200
        for u in fleet.upstreams:
            gw.wait_healthy(u.name)


def test_a_worker_failing_alone_is_ejected_after_eject_after(fleet, caplog):
    """Failures that other workers then serve are the failing worker's: after ``eject_after``
    of them in a row it is taken out, and no caller saw an error."""
    cfg = config_dict(fleet, gateway={"eject_seconds": 30.0}, router={"policy": "round_robin"})
    with GatewayServer(cfg) as gw, caplog.at_level(logging.WARNING, "kvroute.server.health"):
        fleet["up-0"].fail(500)
        i = 0
        while gw.get("/health").json()["workers"]["up-0"]:
            _, h = chat(gw.client(None), "base-model", f"question {i}", system=f"tenant {i}")
            assert h["x-kvroute-worker"] != "up-0"
            i += 1
            assert i < 50
        assert len(fleet["up-0"].records) == 3  # eject_after
    # Each failure is charged to up-0, saying why, and the third ejects it.
    logged = [r.getMessage() for r in caplog.records if r.name == "kvroute.server.health"]
    assert logged == [
        *(
            f"upstream up-0 failed (failed a request another worker then served, {n} in a row)"
            for n in (1, 2, 3)
        ),
        "ejecting upstream up-0: 3 failures in a row",
    ]


def test_client_errors_are_not_retried(fleet, gw):
    client = gw.client(None)
    for u in fleet.upstreams:
        u.fail(400)
    with pytest.raises(openai.BadRequestError):
        chat(client, "base-model", "bad", extra_headers={"x-request-id": "rid-400"})
    assert sum(r["id"] == "rid-400" for r in fleet.records()) == 1
    assert all(gw.get("/health").json()["workers"].values())


def test_all_ejected_answers_503(fleet):
    with GatewayServer(
        config_dict(fleet, gateway={"eject_seconds": 30.0, "max_attempts": 4})
    ) as gw:
        for u in fleet.upstreams:
            fleet.stop(u.name)
        with pytest.raises(openai.APIStatusError) as e:
            chat(gw.client(None), "base-model", "anyone?")
        assert e.value.status_code == 502  # four connect failures
        with pytest.raises(openai.APIStatusError) as e:
            chat(gw.client(None), "base-model", "anyone?")
        assert e.value.status_code == 503  # nobody left to route to
        assert gw.get("/health").status_code == 503


def test_read_timeout_is_not_retried(fleet):
    with GatewayServer(config_dict(fleet, gateway={"read_timeout": 0.3})) as gw:
        try:
            for u in fleet.upstreams:
                u.stall = 3.0
            with pytest.raises(openai.APIStatusError) as e:
                chat(gw.client(None), "base-model", "slow", extra_headers={"x-request-id": "rid-t"})
            assert e.value.status_code == 504
            assert sum(r["id"] == "rid-t" for r in fleet.records()) == 1
        finally:
            for u in fleet.upstreams:
                u.stall = 0.0


# ---- auth and limits -------------------------------------------------------------------------


def test_auth(fleet, gw):
    with pytest.raises(openai.AuthenticationError) as e:
        chat(gw.client(None), "ep-acme", "no key", extra_headers={"Authorization": openai.omit})
    assert e.value.status_code == 401
    for unknown in ("sk-wrong", "sk-acmE", "sk-acme-longer"):
        with pytest.raises(openai.AuthenticationError):
            chat(gw.client(unknown), "ep-acme", "wrong key")
    with pytest.raises(openai.NotFoundError):
        chat(gw.client("sk-acme"), "ep-nope", "unknown")
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "ep-acme", "messages": []},
        headers={"authorization": "Basic sk-acme"},
        trust_env=False,
    )
    assert r.status_code == 401
    assert not fleet.records()  # nothing reached an upstream
    done, _ = chat(gw.client("sk-acme"), "ep-acme", "right key")
    assert done.choices


def _answer(gw, key: str | None, model: str) -> tuple[int, dict]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers=headers,
        trust_env=False,
    )
    error = r.json()["error"]
    return r.status_code, {**error, "message": error["message"].replace(repr(model), "M")}


def test_unknown_and_forbidden_endpoints_are_answered_alike(fleet, gw):
    """401 vs 404 (or 403) must not tell a caller which endpoint ids exist (issue 14, "Also")."""
    for key in (None, "sk-wrong", "sk-globex"):
        assert _answer(gw, key, "ep-acme") == _answer(gw, key, "ep-does-not-exist")
    assert _answer(gw, "sk-globex", "ep-acme")[0] == 404
    assert _answer(gw, None, "ep-acme")[0] == 401
    assert not fleet.records()


def test_hashed_keys_in_config(fleet):
    import hashlib

    cfg = config_dict(fleet)
    cfg["endpoints"][0] = {
        "id": "ep-acme",
        "model": "acme-model",
        "api_key_sha256": [hashlib.sha256(b"sk-hashed").hexdigest()],
    }
    with GatewayServer(cfg) as gw:
        chat(gw.client("sk-hashed"), "ep-acme", "hi")
        with pytest.raises(openai.AuthenticationError):
            chat(gw.client("sk-acme"), "ep-acme", "hi")


def test_body_limit(fleet):
    with GatewayServer(config_dict(fleet, gateway={"max_body_bytes": 4096})) as gw:
        with pytest.raises(openai.APIStatusError) as e:
            chat(gw.client(None), "base-model", "x" * 5000)
        assert e.value.status_code == 413
        body = json.dumps({"model": "base-model", "prompt": "y" * 5000}).encode()

        def chunked():  # no Content-Length: the limit is enforced while reading
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        r = httpx.post(gw.url + "/v1/completions", content=chunked(), trust_env=False)
        assert r.status_code == 413 and "content-length" not in r.request.headers
        assert r.json()["error"]["code"] == "request_too_large"
        assert not fleet.records()
        done, _ = chat(gw.client(None), "base-model", "x" * 100, system="short")
        assert done.choices


def test_body_limit_on_a_body_here_whole(fleet):
    """A chunked body (no Content-Length) over ``max_body_bytes`` that has arrived whole before
    the gateway reads it (one write) is refused like one read in pieces."""
    with GatewayServer(config_dict(fleet, gateway={"max_body_bytes": 4096})) as gw:
        for size, status in ((5000, b"413"), (1000, b"200")):
            body = json.dumps({"model": "base-model", "prompt": "y" * size}).encode()
            wire = (
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                b"\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
                b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            )
            port = int(gw.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(wire)
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
            assert answer.split(b" ", 2)[1] == status, answer[:200]
            if status == b"413":
                assert b"request_too_large" in answer
                assert not fleet.records()


def test_bad_requests(fleet, gw):
    post = lambda body: httpx.post(  # noqa: E731
        gw.url + "/v1/chat/completions",
        content=body,
        trust_env=False,
        headers={"content-type": "application/json"},
    )
    assert post(b"{not json").status_code == 400
    assert post(b"[1, 2]").status_code == 400
    assert post(json.dumps({"model": "base-model", "messages": "hi"}).encode()).status_code == 400
    r = httpx.post(
        gw.url + "/v1/completions", json={"model": "base-model", "prompt": 5}, trust_env=False
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert not fleet.records()


# ---- streaming -------------------------------------------------------------------------------


def test_stream_passes_events_through_as_they_come(fleet, gw):
    """The upstream holds its stream after the first content chunk until the client has seen
    that chunk: a buffering gateway would never deliver it (and the test would time out)."""
    for u in fleet.upstreams:
        u.chunks = 4
        u.gate_after_first = True
    client = gw.client("sk-acme")
    stream = client.chat.completions.create(
        model="ep-acme",
        messages=messages("gated"),
        stream=True,
        extra_headers={"x-request-id": "rid-gated"},
    )
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if len(pieces) == 1:
                worker = pieces[0].split()[0]
                assert not fleet[worker].gate.is_set()  # upstream is still holding the rest
                assert "rid-gated" not in fleet[worker].streams_completed
                fleet[worker].gate.set()
    assert pieces == [f"{worker} rid-gated", ".", ".", "."]
    wait_for(lambda: "rid-gated" in fleet[worker].streams_completed, "stream completion")


def test_client_disconnect_cancels_streaming_upstream(fleet, gw):
    for u in fleet.upstreams:
        u.chunks = 500
        u.chunk_delay = 0.02
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        trust_env=False,
        timeout=10,
        headers={"authorization": "Bearer sk-acme", "x-request-id": "rid-gone"},
        json={"model": "ep-acme", "messages": messages("long"), "stream": True},
    ) as r:
        worker = r.headers["x-kvroute-worker"]
        next(r.iter_raw())
    wait_for(lambda: "rid-gone" in fleet[worker].streams_ended_early, "upstream cancellation")
    released = f'kvroute_gateway_in_flight{{worker="{worker}"}} 0'
    wait_for(lambda: released in gw.metrics(), "load released")
    assert 'status="499"' in gw.metrics()
    assert set(gw.active().values()) == {0}  # the router's load accounting agrees


def test_client_disconnect_cancels_waiting_upstream(fleet, gw):
    for u in fleet.upstreams:
        u.stall = 30.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gw.url + "/v1/chat/completions",
            trust_env=False,
            timeout=httpx.Timeout(10, read=0.5),
            headers={"authorization": "Bearer sk-acme", "x-request-id": "rid-wait"},
            json={"model": "ep-acme", "messages": messages("slow")},
        )
    wait_for(
        lambda: any("rid-wait" in u.abandoned for u in fleet.upstreams),
        "upstream saw the disconnect",
    )
    wait_for(lambda: 'status="499"' in gw.metrics(), "499 counted")
    m = metric_samples(gw.metrics())
    assert all(v == 0 for (n, _), v in m.items() if n == "kvroute_gateway_in_flight")
    assert set(gw.active().values()) == {0}


def test_client_disconnect_cancels_waiting_upstream_with_a_request_pipelined(fleet, gw):
    """As above, the client having pipelined a second request behind the waiting one before it
    left: the listener still sees it go (a pipelined request does not stop reading)."""
    for u in fleet.upstreams:
        u.stall = 30.0
    body = json.dumps({"model": "ep-acme", "messages": messages("slow pipelined")}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-acme\r\n"
        "content-type: application/json\r\nx-request-id: rid-pipe\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()

    def gone_answers() -> float:  # requests ended because the client went (status 499)
        m = metric_samples(gw.metrics())
        return sum(v for (n, labels), v in m.items() if ("status", "499") in labels)

    before = gone_answers()
    host, port = gw.url.rsplit("/", 1)[-1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(head + body)
        wait_for(lambda: set(gw.active().values()) != {0}, "the request routed")
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-acme\r\n\r\n")
        time.sleep(0.3)
    # Ended as the client's going (499), not by the upstream read deadline (10 s) long after.
    wait_for(lambda: gone_answers() > before, "499 counted")
    assert any("rid-pipe" in u.abandoned for u in fleet.upstreams)
    wait_for(lambda: set(gw.active().values()) == {0}, "load released")
    m = metric_samples(gw.metrics())
    assert all(v == 0 for (n, _), v in m.items() if n == "kvroute_gateway_in_flight")


# ---- metrics -----------------------------------------------------------------------------------


def test_metrics(fleet, gw):
    client = gw.client("sk-acme")
    for q in ("a", "b", "c"):
        chat(client, "ep-acme", q)
    list(client.chat.completions.create(model="ep-acme", messages=messages("d"), stream=True))
    with pytest.raises(openai.AuthenticationError):
        chat(gw.client("nope"), "ep-acme", "x")
    text = gw.metrics()
    m = metric_samples(text)  # prometheus_client's parser accepts the exposition
    chat_route = ("route", "/v1/chat/completions")
    assert (
        m[("kvroute_gateway_requests_total", (("model", "ep-acme"), chat_route, ("status", "200")))]
        == 4
    )
    assert (
        m[("kvroute_gateway_requests_total", (("model", "-"), chat_route, ("status", "401")))] == 1
    )
    assert m[("kvroute_gateway_request_duration_seconds_count", (chat_route,))] == 5
    assert m[("kvroute_gateway_request_duration_seconds_bucket", (("le", "+Inf"), chat_route))] == 5
    decisions = {k: v for k, v in m.items() if k[0] == "kvroute_gateway_routing_decisions_total"}
    assert sum(decisions.values()) == 4
    labels = dict(next(iter(decisions))[1])
    assert labels["policy"] == "kv_aware" and labels["worker"].startswith("up-")
    recs = [r for r in fleet.records() if r["model"] == "acme-model"]
    reported = sum(r["cached_tokens"] for r in recs)
    assert reported > 0
    got = sum(v for (n, _), v in m.items() if n == "kvroute_gateway_cached_tokens_reported_total")
    assert got == reported
    predicted = sum(
        v for (n, _), v in m.items() if n == "kvroute_gateway_cached_tokens_predicted_total"
    )
    assert predicted == reported
    assert all(v == 0 for (n, _), v in m.items() if n == "kvroute_gateway_in_flight")
    assert "# TYPE kvroute_gateway_request_duration_seconds histogram" in text


def test_health_and_models_endpoints(fleet, gw):
    h = gw.get("/health")
    assert h.status_code == 200
    assert h.json() == {
        "status": "ok",
        "workers": {u.name: True for u in fleet.upstreams},
        # The test upstreams publish no /metrics: no engine block size is known.
        "engine_block_sizes": {u.name: None for u in fleet.upstreams},
        # The byte-level fallback routes: not the engine's tokens, and it says so.
        "tokenizer": {"name": "bytes", "exact": False, "bytes_per_token": 4},
    }
    models = gw.get("/v1/models", headers={"authorization": "Bearer sk-globex"}).json()
    assert {m["id"] for m in models["data"]} == {"base-model", "ep-globex"}


def test_worker_api_key_sent_upstream(fleet):
    cfg = config_dict(fleet)
    for w in cfg["workers"]:
        w["api_key"] = "upstream-secret"
    with GatewayServer(cfg) as gw:
        _, h = chat(gw.client("sk-acme"), "ep-acme", "hi")
        assert fleet[h["x-kvroute-worker"]].records[-1]["authorization"] == "Bearer upstream-secret"


def test_openai_kind_gets_no_cache_salt(fleet):
    cfg = config_dict(fleet)
    for w in cfg["workers"]:
        w["kind"] = "openai"
    with GatewayServer(cfg) as gw:
        _, h = chat(gw.client("sk-acme"), "ep-acme", "hi")
        assert fleet[h["x-kvroute-worker"]].records[-1]["cache_salt"] is None


def test_endpoint_priority_goes_upstream_in_each_engines_direction(fleet):
    cfg = config_dict(fleet)
    kinds = ["vllm", "sglang", "openai", "vllm"]
    for w, kind in zip(cfg["workers"], kinds, strict=True):
        w["kind"] = kind
    cfg["endpoints"][1]["pool_size"] = 4
    cfg["endpoints"][1]["priority"] = 3
    with GatewayServer(cfg) as gw:
        assert gw.gateway.router.endpoint_priority("ep-globex") == 3
        seen = {}
        client = gw.client("sk-globex")
        for _ in kinds:  # each worker of the pool in turn: the one just used is set aside
            _, h = chat(client, "ep-globex", "Which fuel?", extra_body={"priority": -9})
            worker = h["x-kvroute-worker"]
            seen[worker] = fleet[worker].records[-1]["priority"]
            gw.gateway.router.set_healthy(worker, False)
        for w in seen:
            gw.gateway.router.set_healthy(w, True)
        # vLLM serves lower values first (-3), SGLang higher (3); an openai upstream gets none.
        want = {"vllm": -3, "sglang": 3, "openai": None}
        kind_of = {u.name: k for u, k in zip(fleet.upstreams, kinds, strict=True)}
        assert seen == {w: want[kind_of[w]] for w in seen}
        assert {kind_of[w] for w in seen} == {"vllm", "sglang", "openai"}
        # Priority 0 (ep-acme, the public model) is never sent, nor is the caller's own.
        for model, key in (("ep-acme", "sk-acme"), ("base-model", None)):
            _, h = chat(gw.client(key), model, "hi", extra_body={"priority": 5})
            assert fleet[h["x-kvroute-worker"]].records[-1]["priority"] is None


@pytest.mark.skipif(os.name != "posix", reason="subprocess signals")
def test_cli_serve(fleet, tmp_path):
    """`kvroute serve --config FILE` in a subprocess answers the OpenAI client."""
    from support.gateway_fleet import cli_serve

    with cli_serve(config_dict(fleet), tmp_path) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-acme", max_retries=0, timeout=10)
        first, _ = chat(client, "ep-acme", "one")
        second, _ = chat(client, "ep-acme", "two")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens > 1500


def test_hf_tokenizer_routing(fleet, tmp_path):
    """With [tokenizer] path, routing tokens come from a local HF tokenizer file; the engine's
    reported cached tokens are converted to routing tokens by the prompts' length ratio."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = sorted(set(LONG_SYSTEM.replace(".", " ").split()))
    tok = tokenizers.Tokenizer(
        models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, "[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with GatewayServer(config_dict(fleet, tokenizer={"path": str(path)})) as gw:
        client = gw.client("sk-globex")
        q1, q2 = "Rule of rockets", "Policy handbook"  # words the tokenizer knows
        _, h1 = chat(client, "ep-globex", q1)
        done, h2 = chat(client, "ep-globex", q2)
        assert h1["x-kvroute-worker"] == h2["x-kvroute-worker"]
        ids1, ids2 = (tok.encode(reference_render(messages(q))).ids for q in (q1, q2))
        common = next(i for i, (a, b) in enumerate(zip(ids1, ids2, strict=False)) if a != b)
        routing_prompt = len(ids2)
        assert int(h2["x-kvroute-cached-tokens"]) == common // 16 * 16 > 0
        reported = done.usage.prompt_tokens_details.cached_tokens
        m = metric_samples(gw.metrics())
        worker = (("worker", h2["x-kvroute-worker"]),)
        converted = m[("kvroute_gateway_cached_tokens_reported_total", worker)]
        assert converted == round(reported * routing_prompt / done.usage.prompt_tokens)
