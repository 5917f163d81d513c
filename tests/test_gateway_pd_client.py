"""``kvroute serve`` with ``[pd]``: what a pair's client is told, and what is left upstream and
in the router when the client goes away mid-pair (test upstreams of ``support.pd_upstream``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from support.gateway_fleet import LONG_SYSTEM, GatewayServer, metric_samples, wait_for
from test_gateway_pd import PdFleet


def usage_of(gw: GatewayServer, question: str, *, stream: bool) -> dict[str, Any]:
    """The usage a client is shown for one chat call (a stream's usage chunk)."""
    client = gw.client("sk-acme")
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
    if not stream:
        reply = client.chat.completions.create(model="ep-acme", messages=messages)
        return reply.model_dump()["usage"]
    chunks = client.chat.completions.create(
        model="ep-acme", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    usages = [c.usage.model_dump() for c in chunks if c.usage is not None]
    assert len(usages) == 1
    return usages[0]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_pairs_client_is_told_what_its_prefill_found_cached(protocol, stream):
    """A disaggregated pair's usage reports the cached tokens of its prefill worker (what the
    prefill engine's records say it had), never the KV its decode worker received: a cold
    prompt is a miss, whole; a warm one is its prefill's hit. Both DeepSeek-style fields follow.
    (An SGLang prefill's reply is read while the decode answers: should the decode's usage come
    first, nothing is known and the client's usage has no cached count — never the decode's.)"""
    fleet = PdFleet(protocol, 1, 1)
    try:
        with GatewayServer(fleet.config()) as gw:
            for question in ("What fuels R7?", "And what fuels R8?"):
                usage = usage_of(gw, question, stream=stream)
                cached = fleet["up-0"].records[-1]["cached_tokens"]
                if protocol == "sglang" and "prompt_cache_hit_tokens" not in usage:
                    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens") is None
                    continue
                assert usage["prompt_tokens_details"]["cached_tokens"] == cached
                assert usage["prompt_cache_hit_tokens"] == cached
                assert usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"] - cached
            assert fleet["up-0"].records[0]["cached_tokens"] == 0
            assert fleet["up-0"].records[1]["cached_tokens"] > 1500
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_pair_whose_prefill_reports_no_cache_shows_none(protocol, stream):
    """A prefill engine that reports no cached tokens (vLLM without
    ``--enable-prompt-tokens-details``): the client's usage has no cached count and no hit/miss
    fields, though the decode engine reported the KV it received."""
    fleet = PdFleet(protocol, 1, 1)
    fleet["up-0"].report_cached = False
    try:
        with GatewayServer(fleet.config()) as gw:
            usage = usage_of(gw, "What fuels R7?", stream=stream)
            assert fleet["up-1"].records[-1]["cached_tokens"] > 1500  # the decode's received KV
            details = usage.get("prompt_tokens_details") or {}
            assert details.get("cached_tokens") is None
            assert "prompt_cache_hit_tokens" not in usage
            assert "prompt_cache_miss_tokens" not in usage
            assert usage["completion_tokens"] > 0
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


# ---- a client leaving mid-pair -------------------------------------------------------------------


def leave(gw: GatewayServer, payload: dict[str, Any]) -> None:
    """Sends ``payload`` and goes away before the answer (the prefill stalls far longer); returns
    once the gateway has counted the request's 499 (its handler has unwound)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gw.url + "/v1/chat/completions",
            json=payload,
            headers={"authorization": "Bearer sk-acme"},
            trust_env=False,
            timeout=httpx.Timeout(10, read=0.5),
        )

    def gone() -> bool:
        return any(
            name == "kvroute_gateway_requests_total" and dict(labels)["status"] == "499" and v
            for (name, labels), v in metric_samples(gw.metrics()).items()
        )

    wait_for(gone, "the request's 499")


def test_a_vllm_client_leaving_during_the_prefill_withdraws_the_decode_half():
    """The client goes away while the vLLM prefill runs: the prefill request is abandoned and
    the decode half, routed but never sent, leaves the router's model — so the same prompt
    again is disaggregated as a cold one (the decode workers never saw it), not kept whole on a
    decode worker the router believes holds it."""
    fleet = PdFleet("vllm", 1, 2)
    system = LONG_SYSTEM + LONG_SYSTEM  # ~3800 tokens: above the default threshold (2048)
    payload = {
        "model": "ep-acme",
        "max_tokens": 5,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Q?"}],
    }
    try:
        with GatewayServer(fleet.config(threshold=None)) as gw:
            fleet["up-0"].stall = 60.0
            leave(gw, payload)
            wait_for(lambda: len(fleet["up-0"].abandoned) == 1, "the prefill to be abandoned")
            wait_for(lambda: all(v == 0 for v in gw.active().values()), "no flight left")
            fleet["up-0"].stall = 0.0
            assert all(fleet[w].bodies == [] for w in fleet.names("decode"))
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json=payload,
                headers={"authorization": "Bearer sk-acme"},
                trust_env=False,
                timeout=10,
            )
            assert r.status_code == 200
            assert r.headers["x-kvroute-prefill-worker"] == "up-0"
            assert r.headers["x-kvroute-worker"] in fleet.names("decode")
            assert fleet.exchange.pulled  # handed over, not computed whole on the decode
    finally:
        fleet.close()
    assert fleet.exchange.errors == []


def test_an_sglang_client_leaving_mid_pair_cancels_the_prefill_too():
    """The client goes away while an SGLang pair waits (prefill computing, decode waiting for
    its room): the decode is aborted and the prefill request is given up too — no decode will
    ever take its room — rather than left running to its end in the background."""
    fleet = PdFleet("sglang", 1, 1)
    fleet["up-0"].stall = 60.0
    try:
        with GatewayServer(fleet.config()) as gw:
            leave(gw, {"model": "ep-acme", "messages": [{"role": "user", "content": "R1?"}]})
            # Both halves were given up before the handler unwound (the prefill would otherwise
            # be drained until the gateway's read timeout, 10 s here, or its 60 s stall).
            assert gw.gateway.pd.background == set()
            assert all(v == 0 for v in gw.active().values())
            wait_for(lambda: len(fleet.exchange.aborted_rooms) == 1, "the decode to be aborted")
            wait_for(lambda: len(fleet["up-0"].abandoned) == 1, "the prefill to be abandoned")
            assert fleet.exchange.consumed_rooms == [] and fleet.exchange.rooms == {}
    finally:
        fleet.close()
