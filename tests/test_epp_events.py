"""``kvroute epp`` in events mode: the engines' KV events (published over ZMQ like SGLang's) feed
the router's index, so the picker sends a prompt where an engine reports holding it — including a
prompt that never went through the picker."""

from __future__ import annotations

import asyncio

import openai
import pytest
from support.epp_client import EnvoyClient, EppThread, epp_config
from support.gateway_fleet import LONG_SYSTEM, chat, wait_for
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


def test_the_pick_follows_the_engines_kv_events(fleet):
    cfg = epp_config(fleet, router={"policy": "kv_aware", "index": "events"})
    with EppThread(with_kv_events(cfg, fleet)) as epp:
        wait_subscribed(fleet)
        direct = openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.ports[2]}/v1", api_key="x")
        chat(direct, "base-model", "asked directly")  # bypasses the picker: only events tell
        wait_for(lambda: indexed(epp.router, "up-2") > 0, "up-2's KV events")

        async def ask() -> object:
            client = EnvoyClient(epp.port)
            try:
                messages = [
                    {"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": "asked through the picker"},
                ]
                return await client.exchange({"model": "base-model", "messages": messages})
            finally:
                await client.close()

        r = asyncio.run(ask())
        assert r.status == 200 and r.picked == epp.address("up-2")
        assert fleet["up-2"].records[-1]["cached_tokens"] > 1500
        assert epp.server.subscriber.stats()["up-2"]["malformed"] == 0
