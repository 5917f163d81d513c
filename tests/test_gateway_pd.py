"""``kvroute serve`` with ``[pd]``: requests served as prefill/decode pairs over test upstreams
that implement vLLM's KV-connector flow and SGLang's bootstrap flow (``support.pd_upstream``),
whose exchange checks that every decode gets exactly the KV its prefill computed, once.

Checked: the fields each engine expects arrive (and only the gateway's); the decode side gets
the prefill's ``kv_transfer_params`` / bootstrap room; the client gets the decode's answer,
streamed or not; short prompts stay on the decode worker (conditional disaggregation); failover
on each half; load accounting returns to zero; a load run loses and duplicates nothing.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from typing import Any

import httpx
import openai
import pytest
from kvroute.gateway import parse_config
from kvroute.gateway.pd import bootstrap_host
from support.gateway_faults import FaultServer, reply
from support.gateway_fleet import (
    LONG_SYSTEM,
    Fleet,
    GatewayServer,
    config_dict,
    metric_samples,
    wait_for,
)
from support.pd_upstream import Exchange, SglangPd, VllmPd

VLLM_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PdFleet(Fleet):
    """Test upstreams with roles: up-0 … up-(p-1) prefill, then d decode workers."""

    def __init__(self, protocol: str, prefill: int, decode: int, **kw: Any) -> None:
        self.exchange = Exchange()
        self.protocol = protocol
        self.roles = ["prefill"] * prefill + ["decode"] * decode
        n = prefill + decode

        def make(name: str) -> Any:
            role = self.roles[int(name.rsplit("-", 1)[1])]
            if protocol == "vllm":
                return VllmPd(name, self.exchange, **kw)
            port = 9000 + int(name.rsplit("-", 1)[1])
            return SglangPd(name, self.exchange, mode=role, bootstrap_port=port, **kw)

        super().__init__(n, factory=lambda name: make(name))

    def config(self, threshold: int | None = 0, **sections: Any) -> dict[str, Any]:
        data = config_dict(self, **sections)
        most = max(self.roles.count("prefill"), self.roles.count("decode"))
        for ep in data["endpoints"]:
            ep["pool_size"] = min(ep["pool_size"], most)
        for w, role in zip(data["workers"], self.roles, strict=True):
            w["role"] = role
            w["kind"] = self.protocol
            if self.protocol == "sglang" and role == "prefill":
                w["bootstrap_port"] = 9000 + int(w["name"].rsplit("-", 1)[1])
        data["pd"] = {"protocol": self.protocol}
        if threshold is not None and self.protocol == "vllm":
            data["pd"]["threshold"] = threshold
        return data

    def names(self, role: str) -> list[str]:
        return [u.name for u, r in zip(self.upstreams, self.roles, strict=True) if r == role]


@pytest.fixture(params=["vllm", "sglang"])
def pd(request):
    fleet = PdFleet(request.param, 2, 2)
    gw = GatewayServer(fleet.config())
    yield fleet, gw
    gw.stop()
    fleet.close()
    assert fleet.exchange.errors == []


def ask(gw: GatewayServer, question: str, *, stream: bool = False, rid: str | None = None, **kw):
    """One chat call through the gateway; returns (text, headers)."""
    client = gw.client("sk-acme")
    headers = {"x-request-id": rid} if rid else None
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
    raw = client.chat.completions.with_raw_response.create(
        model="ep-acme", messages=messages, stream=stream, extra_headers=headers, **kw
    )
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content
    return text, raw.headers


def post_r1(gw: GatewayServer, timeout: Any = 10) -> httpx.Response:
    """A short chat call to the endpoint, as raw HTTP (the status and body as they come)."""
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "ep-acme", "messages": [{"role": "user", "content": "R1?"}]},
        headers={"authorization": "Bearer sk-acme"},
        trust_env=False,
        timeout=timeout,
    )


def idle(gw: GatewayServer) -> None:
    wait_for(lambda: all(v == 0 for v in gw.active().values()), "every flight to finish")
    loads = [gw.gateway.router.load(w) for w in gw.gateway.router.workers]
    assert all(load["prefill_blocks"] == load["decode_blocks"] == 0 for load in loads)


# ---- the two protocols ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_pair_hands_the_kv_over_as_the_engine_expects(pd, stream):
    fleet, gw = pd
    text, headers = ask(gw, "What fuels R7?", stream=stream, rid="q-1", max_tokens=20)
    decode, prefill = headers["x-kvroute-worker"], headers["x-kvroute-prefill-worker"]
    assert decode in fleet.names("decode") and prefill in fleet.names("prefill")
    assert text.startswith(f"{decode} q-1")  # the decode worker's answer, the client's own id
    # One routing decision counted per half, each under its worker.
    decisions: dict[str, float] = {}
    for (name, labels), value in metric_samples(gw.metrics()).items():
        if name == "kvroute_gateway_routing_decisions_total":
            worker = dict(labels)["worker"]
            decisions[worker] = decisions.get(worker, 0) + value
    assert decisions == {prefill: 1, decode: 1}
    (p_body,) = fleet[prefill].bodies
    (d_body,) = fleet[decode].bodies
    assert p_body["model"] == d_body["model"] == "acme-model"
    assert p_body["cache_salt"] == d_body["cache_salt"] == "ep-acme"
    assert p_body["messages"] == d_body["messages"]
    if fleet.protocol == "vllm":
        assert p_body["kv_transfer_params"] == VLLM_PREFILL_PARAMS
        assert (p_body["stream"], p_body["max_tokens"]) == (False, 1)
        assert "stream_options" not in p_body
        # max_completion_tokens is bounded only when given (toy_proxy_server.py's flow)
        assert "max_completion_tokens" not in p_body
        # The decode worker got the original request with the prefill's kv_transfer_params.
        (key,) = fleet.exchange.pulled
        assert key == (f"engine-{prefill}", fleet[prefill].records[0]["upstream_id"])
        params = d_body["kv_transfer_params"]
        assert params["remote_engine_id"] == f"engine-{prefill}" and params["do_remote_prefill"]
        assert d_body["max_tokens"] == 20 and d_body.get("stream", False) is stream
        assert fleet[prefill].records[0]["upstream_id"] == fleet[decode].records[0]["upstream_id"]
    else:
        # The same request to both, with the prefill's bootstrap address and one fresh room.
        fields = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
        assert [p_body[k] for k in fields] == [d_body[k] for k in fields]
        port = 9000 + int(prefill.rsplit("-", 1)[1])
        assert (p_body["bootstrap_host"], p_body["bootstrap_port"]) == ("127.0.0.1", port)
        assert fleet.exchange.consumed_rooms == [p_body["bootstrap_room"]]
        assert p_body == d_body
    if stream:
        # Streamed through as a stream: the usage chunk the gateway asked the decode engine
        # for (the client did not) is taken out.
        chunks = list(
            gw.client("sk-acme").chat.completions.create(
                model="ep-acme",
                messages=[{"role": "user", "content": "And R8?"}],
                stream=True,
            )
        )
        assert chunks and all(c.usage is None for c in chunks)
    idle(gw)


@pytest.mark.parametrize("stream", [False, True])
def test_a_connector_without_transfer_params_hands_over_out_of_band(stream, caplog):
    """vLLM's shared-storage ExampleConnector (what `make e2e` runs) answers the prefill without
    kv_transfer_params: the decode gets the original request without them, and its engine
    loads the prompt's KV from the connector itself (logged at debug level, no failure)."""
    fleet = PdFleet("vllm", 1, 1, shared_storage=True)
    with GatewayServer(fleet.config()) as gw, caplog.at_level(logging.DEBUG, "kvroute.gateway"):
        client = gw.client("sk-acme")
        messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "R9?"}]
        raw = client.chat.completions.with_raw_response.create(
            model="ep-acme",
            messages=messages,
            max_tokens=12,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        assert (raw.headers["x-kvroute-prefill-worker"], raw.headers["x-kvroute-worker"]) == (
            "up-0",
            "up-1",
        )
        reply = list(raw.parse()) if stream else [raw.parse()]
        text = "".join(
            (c.choices[0].delta.content or "") if stream else c.choices[0].message.content
            for c in reply
            if c.choices
        )
        assert text.startswith("up-1 ")  # the decode worker's answer
        (p_body,) = fleet["up-0"].bodies
        (d_body,) = fleet["up-1"].bodies
        assert p_body["kv_transfer_params"] == VLLM_PREFILL_PARAMS
        assert "kv_transfer_params" not in d_body
        assert d_body["max_tokens"] == 12 and d_body.get("stream", False) is stream
        assert p_body["messages"] == d_body["messages"] == messages
        # The decode engine loaded the prompt the prefill stored, and reports it cached; the
        # client is told what the prefill found cached (a cold prompt: nothing).
        assert [k for k, _ in fleet.exchange.pulled] == ["storage"]
        assert fleet["up-1"].records[-1]["cached_tokens"] > 1800
        assert reply[-1].usage.prompt_tokens_details.cached_tokens == 0
        idle(gw)
    assert [r.getMessage() for r in caplog.records if r.name == "kvroute.gateway"] == [
        "prefill on up-0 returned no kv_transfer_params"
    ]
    fleet.close()
    assert fleet.exchange.errors == []


def test_rooms_are_fresh_and_client_handover_fields_are_dropped():
    fleet = PdFleet("sglang", 1, 1)
    with GatewayServer(fleet.config()) as gw:
        for i in range(6):
            ask(
                gw,
                f"Question {i}?",
                stream=i % 2 == 1,
                extra_body={"bootstrap_room": 7, "bootstrap_host": "10.9.9.9"},
            )
        rooms = [b["bootstrap_room"] for b in fleet["up-0"].bodies]
        assert len(set(rooms)) == 6 and 7 not in rooms
        # Non-negative 63-bit integers, as SGLang's own mini_lb draws them
        # (random.randint(0, 2**63 - 1)).
        assert all(isinstance(r, int) and 0 <= r < 1 << 63 for r in rooms)
        assert {b["bootstrap_host"] for b in fleet["up-1"].bodies} == {"127.0.0.1"}
    fleet.close()
    assert fleet.exchange.errors == []
    fleet = PdFleet("vllm", 1, 1)
    with GatewayServer(fleet.config()) as gw:
        evil = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_block_ids": [1]}
        ask(gw, "Anything?", extra_body={"kv_transfer_params": evil}, max_completion_tokens=7)
        assert fleet["up-0"].bodies[0]["kv_transfer_params"] == VLLM_PREFILL_PARAMS
        assert fleet["up-1"].bodies[0]["kv_transfer_params"]["remote_host"] == "127.0.0.1"
        # The prefill computes one token, however the client bounds its output.
        p_body, d_body = fleet["up-0"].bodies[0], fleet["up-1"].bodies[0]
        assert (p_body["max_tokens"], p_body["max_completion_tokens"]) == (1, 1)
        assert d_body["max_completion_tokens"] == 7
    fleet.close()
    assert fleet.exchange.errors == []


def test_the_vllm_prefill_request_is_the_decodes_less_what_only_the_decode_needs():
    """vLLM's proxy flow (``toy_proxy_server.py``): the prefill request is the client's with
    ``kv_transfer_params`` = do_remote_decode, ``stream`` false, ``max_tokens`` and
    ``max_completion_tokens`` 1, and no ``stream_options`` / ``min_tokens`` /
    ``min_completion_tokens``; every other field as the decode request has it. The decode gets
    the client's request whole, with the prefill reply's ``kv_transfer_params``."""
    fleet = PdFleet("vllm", 1, 1)
    try:
        with GatewayServer(fleet.config()) as gw:
            only_decode = {"min_tokens": 3, "min_completion_tokens": 2}
            ask(
                gw,
                "Which fuel?",
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=9,
                max_completion_tokens=7,
                temperature=0.5,
                extra_body=only_decode,
            )
            (p_body,) = fleet["up-0"].bodies
            (d_body,) = fleet["up-1"].bodies
            assert {k: p_body.get(k, "absent") for k in PREFILL_ONLY} == {
                "kv_transfer_params": VLLM_PREFILL_PARAMS,
                "stream": False,
                "max_tokens": 1,
                "max_completion_tokens": 1,
                "stream_options": "absent",
                "min_tokens": "absent",
                "min_completion_tokens": "absent",
            }
            assert {
                k: d_body.get(k, "absent") for k in PREFILL_ONLY if k != "kv_transfer_params"
            } == {
                "stream": True,
                "max_tokens": 9,
                "max_completion_tokens": 7,
                "stream_options": {"include_usage": True},
                **only_decode,
            }
            rest = [set(b) - set(PREFILL_ONLY) for b in (p_body, d_body)]
            assert rest[0] == rest[1] and {"temperature", "messages", "cache_salt"} <= rest[0]
            assert {k: p_body[k] for k in rest[0]} == {k: d_body[k] for k in rest[1]}
            (key,) = fleet.exchange.pulled  # the decode pulled the KV the prefill offered
            assert d_body["kv_transfer_params"]["remote_engine_id"] == key[0] == "engine-up-0"
            idle(gw)
    finally:
        fleet.close()
    assert fleet.exchange.errors == []  # the engines found every field as they expect


PREFILL_ONLY = (
    "kv_transfer_params",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
)


def test_sglang_bootstrap_address_defaults():
    """The bootstrap host is the prefill worker URL's host, an IPv6 address in brackets (as
    SGLang's ``maybe_wrap_ipv6_address`` writes it); the port, when the worker sets none,
    SGLang's default ``--disaggregation-bootstrap-port`` 8998 — a pair through a prefill
    server listening for bootstrap there is served."""
    assert bootstrap_host("http://[::1]:30000") == "[::1]"
    assert bootstrap_host("http://[2001:db8::7]:30000/v1") == "[2001:db8::7]"
    assert bootstrap_host("http://10.1.2.3:30000") == "10.1.2.3"
    assert bootstrap_host("https://prefill-0.sglang.svc:30000/") == "prefill-0.sglang.svc"
    assert bootstrap_host("http://:30000") == ""  # no host: none to name
    fleet = PdFleet("sglang", 1, 1)
    fleet["up-0"].bootstrap_port = 8998  # the prefill server's own default
    config = fleet.config()
    del config["workers"][0]["bootstrap_port"]
    try:
        with GatewayServer(config) as gw:
            ask(gw, "Default port?")
            assert fleet["up-0"].bodies[0]["bootstrap_port"] == 8998
            assert len(fleet.exchange.consumed_rooms) == 1
            idle(gw)
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_prefill_half_feeds_the_learned_prefill_rate(protocol):
    """Without a configured ``prefill_tokens_per_second`` the SLO admission learns the rate from
    each prefill's first output: a pair's prefill half reports it (a whole, unstreamed pair,
    whose decode half reports none)."""
    fleet = PdFleet(protocol, 1, 1)
    with GatewayServer(fleet.config()) as gw:
        assert gw.gateway.admission.learned_rate is None
        ask(gw, "What fuels R7?")
        assert gw.gateway.admission.learned_rate > 0
        idle(gw)
    fleet.close()
    assert fleet.exchange.errors == []


def test_a_pair_served_whole_streams_as_asked():
    """vLLM, a threshold no prompt reaches: every pair is served whole on its decode worker, and a
    streamed request is streamed through as a stream there too — without the usage chunk the
    gateway asked the engine for (the client did not)."""
    fleet = PdFleet("vllm", 1, 1)
    with GatewayServer(fleet.config(threshold=10**6)) as gw:
        raw = gw.client("sk-acme").chat.completions.with_raw_response.create(
            model="ep-acme", messages=[{"role": "user", "content": "R8?"}], stream=True
        )
        assert raw.headers["x-kvroute-prefill-worker"] == raw.headers["x-kvroute-worker"] == "up-1"
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = list(raw.parse())
        assert chunks and all(c.usage is None for c in chunks)
        assert fleet["up-1"].bodies[0]["stream_options"] == {"include_usage": True}
        idle(gw)
    fleet.close()
    assert fleet.exchange.errors == []


def test_short_uncached_parts_stay_on_the_decode_worker():
    """vLLM, threshold 64 tokens: the first turn is split; the next turn, which the decode worker
    holds but for a few tokens, is prefilled there (no prefill request)."""
    fleet = PdFleet("vllm", 1, 1)
    with GatewayServer(fleet.config(threshold=64)) as gw:
        client = gw.client("sk-acme")
        turn = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Hi?"}]
        raw = client.chat.completions.with_raw_response.create(model="ep-acme", messages=turn)
        assert raw.headers["x-kvroute-prefill-worker"] == "up-0"
        turn += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "R1?"}]
        raw = client.chat.completions.with_raw_response.create(model="ep-acme", messages=turn)
        assert raw.headers["x-kvroute-prefill-worker"] == raw.headers["x-kvroute-worker"] == "up-1"
        assert len(fleet["up-0"].bodies) == 1
        assert "kv_transfer_params" not in fleet["up-1"].bodies[1]
        # The decode engine found the first turn cached: it had received its KV.
        assert raw.parse().usage.prompt_tokens_details.cached_tokens > 1800
        metrics = gw.metrics()
        assert 'kvroute_gateway_pd_pairs_total{reason="remote"} 1' in metrics
        assert 'kvroute_gateway_pd_pairs_total{reason="short"} 1' in metrics
        # One routing decision per worker sent to: up-0 and up-1 for the pair, up-1 for the
        # request it served whole.
        decisions: dict[str, float] = {}
        for (name, labels), value in metric_samples(metrics).items():
            if name == "kvroute_gateway_routing_decisions_total":
                worker = dict(labels)["worker"]
                decisions[worker] = decisions.get(worker, 0) + value
        assert decisions == {"up-0": 1, "up-1": 2}
        # The request served whole reports what its engine found cached, against its routed
        # prompt (a decode half reports nothing: the first turn's prefill half does).
        reported: dict[tuple[str, str], float] = {}
        for (name, labels), value in metric_samples(metrics).items():
            if name.endswith(("_cached_tokens_reported_total", "_prompt_tokens_total")):
                reported[(name.split("_")[2], dict(labels)["worker"])] = value
        assert reported[("prompt", "up-1")] > reported[("cached", "up-1")] > 1800
        assert reported[("cached", "up-0")] == 0 < reported[("prompt", "up-0")]
        idle(gw)
    fleet.close()
    assert fleet.exchange.errors == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_the_prefill_half_reports_what_its_engine_found_cached(protocol, stream):
    """The prefill's reply (vLLM's, read whole; SGLang's, read to its end and dropped: a JSON
    body's usage, or a stream's last usage chunk) tells the router what the prefill worker had
    cached: the second request's prompt prefix, on the one prefill worker. The decode half
    reports nothing (its engine counts the KV it received as cached)."""
    fleet = PdFleet(protocol, 1, 1)
    with GatewayServer(fleet.config()) as gw:
        _text, first = ask(gw, "What fuels R7?", stream=stream)
        _text, second = ask(gw, "And what fuels R8?", stream=stream)
        # The answer's header: the prefill half's predicted cached tokens (the router's).
        assert int(first["x-kvroute-cached-tokens"]) == 0
        assert int(second["x-kvroute-cached-tokens"]) > 1500
        idle(gw)
        samples = metric_samples(gw.metrics())
        cached = [r["cached_tokens"] for r in fleet["up-0"].records]
        assert cached[0] == 0 and cached[1] > 1500
        reported = {
            dict(labels)["worker"]: v
            for (name, labels), v in samples.items()
            if name == "kvroute_gateway_cached_tokens_reported_total" and v
        }
        assert reported == {"up-0": cached[1]}
    fleet.close()
    assert fleet.exchange.errors == []


def test_an_sglang_prefill_reports_the_usage_in_its_replys_last_64_kib():
    """An SGLang prefill's reply is read to its end keeping only its last 64 KiB, where its usage
    is looked for: a JSON body of exactly 64 KiB reports its cached tokens, one a byte longer
    (its opening brace gone) none; a stream longer than 64 KiB reports its last usage chunk."""
    fleet = PdFleet("sglang", 1, 1)
    prefill = fleet["up-0"]

    def reported(gw: GatewayServer) -> float:
        idle(gw)
        samples = metric_samples(gw.metrics())
        return sum(
            v
            for (name, labels), v in samples.items()
            if name == "kvroute_gateway_cached_tokens_reported_total"
            and dict(labels)["worker"] == "up-0"
        )

    with GatewayServer(fleet.config()) as gw:
        ask(gw, "What fuels R7?")  # the prefix cached on the prefill worker
        prefill.reply_bytes = 65536
        ask(gw, "And what fuels R8?")
        assert reported(gw) == prefill.records[-1]["cached_tokens"] > 1500
        prefill.reply_bytes = 65537
        ask(gw, "And what fuels R9?")
        assert prefill.records[-1]["cached_tokens"] > 1500
        assert reported(gw) == prefill.records[-2]["cached_tokens"]
        prefill.reply_bytes, prefill.chunks = 0, 600  # ~80 KB of chunks before the usage
        before = reported(gw)
        ask(gw, "And what fuels R10?", stream=True, stream_options={"include_usage": True})
        assert reported(gw) == before + prefill.records[-1]["cached_tokens"] > before + 1500
    fleet.close()
    assert fleet.exchange.errors == []


# ---- failover on each half -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_prefill_is_retried_on_another_prefill_worker(pd, stream):
    fleet, gw = pd
    (first,) = gw.gateway.router.endpoint_pool("ep-acme", phase="prefill")
    fleet[first].fail(500, times=1)  # the endpoint's prefill worker fails once: the retry
    text, headers = ask(gw, "Retry me?", stream=stream, rid="q-2")  # spills to the other
    decode = headers["x-kvroute-worker"]
    assert text.startswith(f"{decode} q-2") and headers["x-kvroute-attempts"] == "2"
    served = [n for n in fleet.names("prefill") if len(fleet[n].bodies) == 1]
    assert len(served) == 2  # one failed, the other served
    answers = [b for n in fleet.names("decode") for b in fleet[n].bodies]
    if fleet.protocol == "vllm":
        assert len(answers) == 1  # the decode started only after a prefill succeeded
    else:
        # The decode waiting on the failed prefill's room was aborted, then a new room served.
        wait_for(lambda: len(fleet.exchange.aborted_rooms) == 1, "the waiting decode to abort")
        assert len(fleet.exchange.consumed_rooms) == 1
        assert fleet.exchange.aborted_rooms != fleet.exchange.consumed_rooms
    idle(gw)


def test_an_unreachable_prefill_worker_is_ejected_and_skipped(pd):
    fleet, gw = pd
    (first,) = gw.gateway.router.endpoint_pool("ep-acme", phase="prefill")
    (other,) = set(fleet.names("prefill")) - {first}
    fleet.stop(first)
    for i in range(4):
        _text, headers = ask(gw, f"Still there {i}?", stream=i % 2 == 1)
        assert headers["x-kvroute-prefill-worker"] == other
    gw.wait_healthy(first, False)
    idle(gw)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_decode_is_retried_from_scratch(pd, stream):
    fleet, gw = pd
    (first,) = gw.gateway.router.endpoint_pool("ep-acme", phase="decode")
    fleet[first].fail(500, times=1)
    text, headers = ask(gw, "Decode again?", stream=stream, rid="q-3")
    decode = headers["x-kvroute-worker"]
    assert text.startswith(f"{decode} q-3") and headers["x-kvroute-attempts"] == "2"
    # Two decode workers tried (one failed), each with its own hand-over.
    assert sorted(len(fleet[n].bodies) for n in fleet.names("decode")) == [1, 1]
    assert sum(len(fleet[n].bodies) for n in fleet.names("prefill")) == 2
    idle(gw)


def test_a_prefill_refusal_is_the_clients_answer(pd):
    fleet, gw = pd
    for name in fleet.names("prefill"):
        fleet[name].fail(400)
    with pytest.raises(openai.BadRequestError) as e:
        ask(gw, "Bad?", rid="q-bad")
    (refuser,) = [n for n in fleet.names("prefill") if fleet[n].bodies]  # not retried
    assert len(fleet[refuser].bodies) == 1
    # The prefill worker's own answer, whole, with the client's request id.
    refusal = {"error": {"message": f"{refuser} failing", "type": "server_error"}}
    assert e.value.response.json() == refusal
    assert e.value.response.headers["x-request-id"] == "q-bad"
    idle(gw)


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_prefill_refusal_without_a_content_type_is_passed_on_as_json(protocol):
    """A prefill worker's 4xx answer that names no content type reaches the client as the
    JSON it is (the default for an upstream's answer, as for single requests)."""
    refusal = b'{"error": {"message": "no"}}'
    head = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    prefill = FaultServer(lambda body: [head % len(refusal) + refusal])
    fleet = PdFleet(protocol, 1, 1)  # up-0's place as the prefill worker goes to the fault server
    config = fleet.config()
    config["workers"][0]["url"] = prefill.url
    try:
        with GatewayServer(config) as gw:
            r = post_r1(gw)
            assert (r.status_code, r.content, r.headers["content-type"]) == (
                400,
                refusal,
                "application/json",
            )
            assert len(prefill.requests) == 1
            idle(gw)
    finally:
        prefill.stop()
        fleet.close()
    assert fleet.exchange.errors == []


def test_an_sglang_prefills_5xx_answer_is_passed_on_bounded():
    """The last attempt's SGLang prefill answered 5xx: the client gets that status, as for a
    single request, and none of a body past ``max_response_bytes``."""
    prefill = FaultServer(lambda body: [reply(500, b"x" * 5000)])
    fleet = PdFleet("sglang", 1, 1)
    config = fleet.config(gateway={"max_attempts": 1, "max_response_bytes": 4096})
    config["workers"][0]["url"] = prefill.url
    try:
        with GatewayServer(config) as gw:
            r = post_r1(gw)
            assert (r.status_code, r.content) == (500, b"")
            idle(gw)
    finally:
        prefill.stop()
        fleet.close()
    assert fleet.exchange.errors == []


def test_a_client_leaving_aborts_the_waiting_sglang_decode():
    """The client goes away while an SGLang pair waits (a slow prefill, the decode waiting for
    its KV): the decode request is aborted upstream at once, not left to take the KV later."""
    fleet = PdFleet("sglang", 1, 1)
    fleet["up-0"].stall = 3.0  # the prefill
    try:
        with GatewayServer(fleet.config()) as gw:
            with pytest.raises(httpx.ReadTimeout):
                post_r1(gw, timeout=httpx.Timeout(10, read=0.5))
            wait_for(lambda: len(fleet.exchange.aborted_rooms) == 1, "the decode to be aborted")
            assert fleet.exchange.consumed_rooms == []
    finally:
        fleet.close()


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_an_endpoints_priority_goes_with_both_halves(protocol):
    """Each half of a pair carries the endpoint's priority in its engine's direction (vLLM serves
    lower values first, SGLang higher), as a single request does."""
    fleet = PdFleet(protocol, 1, 1)
    config = fleet.config()
    config["endpoints"][0]["priority"] = 3  # ep-acme
    try:
        with GatewayServer(config) as gw:
            ask(gw, "Urgent?")
            want = -3 if protocol == "vllm" else 3
            assert [fleet[n].bodies[0]["priority"] for n in ("up-0", "up-1")] == [want, want]
            idle(gw)
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_first_attempt_stays_in_the_endpoints_pool_when_its_members_are_full(protocol):
    """Only a retry spills past an endpoint's pool (``Gateway``'s failover, as for single
    requests): a first attempt whose pool members are at ``max_in_flight_per_worker`` takes the
    pool's answer. vLLM's pool gives a ``no_prefill`` pair — its decode worker prefills the
    request itself; SGLang's gives none — the request is shed (429 ``worker_queue``). Neither
    reaches the prefill worker outside the pool, which is idle."""
    fleet = PdFleet(protocol, 2, 2)  # pool_size 1: one prefill and one decode worker in the pool
    config = fleet.config(gateway={"max_in_flight_per_worker": 1})
    try:
        with GatewayServer(config) as gw:
            router = gw.gateway.router
            (p_in,) = router.endpoint_pool("ep-acme", phase="prefill")
            (d_in,) = router.endpoint_pool("ep-acme", phase="decode")
            (p_out,) = set(fleet.names("prefill")) - {p_in}
            fleet[p_in].stall = 3.0  # its first request holds the pool's prefill worker
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                held = pool.submit(ask, gw, "Hold on?")
                wait_for(lambda: len(fleet[p_in].bodies) == 1, "the first request's prefill")
                if protocol == "vllm":
                    _text, headers = ask(gw, "Meanwhile?")
                    assert (headers["x-kvroute-prefill-worker"], headers["x-kvroute-worker"]) == (
                        d_in,
                        d_in,
                    )
                    assert "kv_transfer_params" not in fleet[d_in].bodies[-1]
                else:
                    r = post_r1(gw)
                    assert r.status_code == 429
                    assert r.json()["error"]["code"] == "worker_queue"
                assert fleet[p_out].bodies == []
                held.result()
            assert fleet[p_out].bodies == []
            idle(gw)
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


def test_no_prefill_worker_left_falls_back_or_fails_by_protocol():
    """vLLM's decode workers can prefill themselves; SGLang's cannot (503)."""
    for protocol in ("vllm", "sglang"):
        fleet = PdFleet(protocol, 1, 1)
        fleet.stop("up-0")
        with GatewayServer(fleet.config()) as gw:
            if protocol == "vllm":
                ask(gw, "First?")  # the prefill fails: retried on the decode worker alone
                gw.wait_healthy("up-0", False)
                _text, headers = ask(gw, "Alone?")
                assert headers["x-kvroute-prefill-worker"] == headers["x-kvroute-worker"]
            else:
                with pytest.raises(openai.APIStatusError) as e:
                    ask(gw, "First?")
                assert e.value.status_code in (502, 503)
                gw.wait_healthy("up-0", False)
                with pytest.raises(openai.APIStatusError) as e:
                    ask(gw, "Alone?")
                assert e.value.status_code == 503
            idle(gw)
        fleet.close()
        assert fleet.exchange.errors == []


# ---- config -------------------------------------------------------------------------------------


def test_pd_config_is_checked():
    fleet = PdFleet("vllm", 1, 1)
    try:
        good = fleet.config()
        parse_config(good)
        cases = [
            ({"pd": None}, "add a \\[pd\\] section"),
            ({"pd": {"protocol": "nixl"}}, "pd.protocol must be one of"),
            ({"pd": {"protocol": "vllm", "treshold": 3}}, "unknown key"),
            ({"pd": {"protocol": "sglang"}}, "workers \\['up-0', 'up-1'\\] are of another kind"),
            ({"pd": {"protocol": "vllm", "threshold": -1}}, "pd.threshold must be >= 0, got -1"),
        ]
        for change, message in cases:
            data = json.loads(json.dumps(good))
            if change["pd"] is None:
                del data["pd"]
            else:
                data["pd"] = change["pd"]
            with pytest.raises(ValueError, match=message):
                parse_config(data)
        data = json.loads(json.dumps(good))
        data["workers"][0]["role"] = "prefiller"
        with pytest.raises(ValueError, match="role must be one of"):
            parse_config(data)
        sg = PdFleet("sglang", 1, 1)
        data = sg.config()
        data["pd"]["threshold"] = 10
        with pytest.raises(ValueError, match="threshold does not apply to SGLang"):
            parse_config(data)
        data["pd"] = {"protocol": "sglang"}
        data["workers"][0]["bootstrap_port"] = 70000
        with pytest.raises(ValueError, match=r"bootstrap_port must be in 1\.\.65535"):
            parse_config(data)
        sg.close()
        # [pd] options reach the router.
        gw = GatewayServer({**good, "pd": {"protocol": "vllm", "threshold": 77, "saturation": 2.0}})
        config = gw.gateway.router.config
        assert (config["pd_threshold"], config["pd_saturation"]) == (77, 2.0)
        assert gw.gateway.router.roles == {"up-0": "prefill", "up-1": "decode"}
        gw.stop()
    finally:
        fleet.close()


# ---- load ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_load_loses_and_duplicates_nothing(protocol):
    """300 requests from 16 threads, a third streamed, while one prefill and one decode worker
    fail every seventh request: every request is answered once, with its own id, by exactly one
    decode that got its own prefill's KV."""
    fleet = PdFleet(protocol, 2, 3)
    failing = {"up-0": 7, "up-3": 7}
    counters = dict.fromkeys(failing, 0)

    # Deterministic intermittent faults: every seventh request on those workers answers 500.
    for name in failing:
        up = fleet[name]
        original = up._failing

        def flaky(up=up, name=name, original=original):
            with up.lock:
                counters[name] += 1
                if counters[name] % failing[name] == 0:
                    return 500
            return original()

        up._failing = flaky
    with GatewayServer(fleet.config(gateway={"max_attempts": 4, "eject_after": 1000})) as gw:

        def one(i: int) -> tuple[str, str, str]:
            text, headers = ask(gw, f"Load question {i % 40}?", stream=i % 3 == 0, rid=f"L-{i}")
            return f"L-{i}", text, headers["x-kvroute-worker"]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(300)))
        for rid, text, decode in results:
            assert text.startswith(f"{decode} {rid}")
        # Each id answered by exactly one decode worker (its successful attempt) …
        served = [r["id"] for n in fleet.names("decode") for r in fleet[n].records]
        answered = [
            r["id"]
            for n in fleet.names("decode")
            for r in fleet[n].records
            if r.get("cached_tokens") is not None
        ]
        assert sorted(answered) == sorted(f"L-{i}" for i in range(300))
        assert len(served) >= 300
        idle(gw)
        pd = gw.gateway.pd
        assert pd is not None  # background drains of SGLang prefill replies end
        wait_for(lambda: not pd.background, "the background drains to end", 10)
    fleet.close()
    ex = fleet.exchange
    assert ex.errors == []
    handed = [b for n in fleet.names("decode") for b in fleet[n].bodies]
    if protocol == "vllm":
        # Every decode request pulled its own prefill's KV once; no KV was left unclaimed.
        assert len(ex.pulled) == len(set(ex.pulled)) == len(handed)
        assert ex.offers == {}
    else:
        assert len(ex.consumed_rooms) == len(set(ex.consumed_rooms)) == len(handed)
