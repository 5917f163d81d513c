"""The gateway in events mode: upstreams publish KV events over ZMQ (SGLang's BlockStored /
BlockRemoved with ``cache_salt``), the gateway's KvEventSubscriber feeds the router's index, and
routing follows what the engines really hold — including prompts that never went through the
gateway, and endpoint prompts salted by the ``cache_salt`` the gateway sent upstream."""

from __future__ import annotations

import openai
import pytest
from support.gateway_fleet import GatewayServer, chat, config_dict, wait_for
from support.publishing_upstream import (
    indexed,
    publishing_fleet,
    wait_subscribed,
    with_kv_events,
)


@pytest.fixture
def fleet():
    with publishing_fleet(3) as f:
        yield f


@pytest.fixture
def gw(fleet):
    cfg = config_dict(fleet, router={"policy": "kv_aware", "index": "events"})
    with GatewayServer(with_kv_events(cfg, fleet)) as g:
        wait_subscribed(fleet)
        yield g


def test_routes_to_where_the_engine_reports_the_prefix(fleet, gw):
    router = gw.gateway.router
    # A prompt sent straight to up-2, bypassing the gateway: only its KV events tell.
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.ports[2]}/v1", api_key="x")
    chat(direct, "base-model", "asked directly")
    wait_for(lambda: indexed(router, "up-2") > 0, "up-2's KV events")
    done, h = chat(gw.client(None), "base-model", "asked through the gateway")
    assert h["x-kvroute-worker"] == "up-2"
    cached = done.usage.prompt_tokens_details.cached_tokens
    assert cached > 1500 and int(h["x-kvroute-cached-tokens"]) == cached
    # /health says what the event stream did for each worker.
    events = gw.get("/health").json()["events"]
    assert events["up-2"]["blocks"] == indexed(router, "up-2") > 0
    assert events["up-2"]["disconnects"] == 0 and events["up-2"]["last_seq"] >= 0
    # The engine's block size as its events give it (the router's here: nothing skipped).
    assert (events["up-2"]["engine_block_size"], events["up-2"]["skipped_block_size"]) == (16, 0)
    assert (events["up-2"]["malformed"], events["up-2"]["foreign_hashes"]) == (0, 0)
    assert events["up-2"]["skipped_partial"] == 0  # whole engine blocks: none partial


def test_endpoint_salt_reaches_the_engine_and_back(fleet, gw):
    router = gw.gateway.router
    client = gw.client("sk-globex")
    _, h1 = chat(client, "ep-globex", "first")
    worker = h1["x-kvroute-worker"]
    salt = router.endpoint_salt("ep-globex")
    assert fleet[worker].records[-1]["cache_salt"] == salt
    wait_for(lambda: indexed(router, worker) > 0, "KV events of the salted prompt")
    done, h2 = chat(client, "ep-globex", "second")
    assert h2["x-kvroute-worker"] == worker
    cached = done.usage.prompt_tokens_details.cached_tokens
    assert cached > 1500 and int(h2["x-kvroute-cached-tokens"]) == cached
    # The same prompt without the endpoint is not matched by the salted blocks.
    _, h3 = chat(gw.client(None), "base-model", "second")
    assert int(h3["x-kvroute-cached-tokens"]) == 0
    subscriber = gw.gateway.subscriber
    assert subscriber is not None and subscriber.stats()[worker]["malformed"] == 0
