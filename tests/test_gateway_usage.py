"""Issue 20: DeepSeek-style cache fields in ``usage``, and the two-call experiment, unmodified,
against ``kvroute serve`` over the test upstreams (their prefix caches give the reference
counts)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.gateway_fleet import (
    Fleet,
    GatewayServer,
    chat,
    cli_serve,
    config_dict,
    messages,
)
from support.gateway_upstream import expected_cached, reference_render, reference_tokens

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "two_calls.py"


@pytest.fixture(scope="module")
def fleet():
    f = Fleet(2)
    yield f
    f.close()


def test_fields_in_non_streamed_replies(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        first, _ = chat(gw.client("sk-acme"), "ep-acme", "first")
        second, _ = chat(gw.client("sk-acme"), "ep-acme", "second")
        for done in (first, second):
            u = done.usage
            cached = u.prompt_tokens_details.cached_tokens  # the OpenAI field, kept
            assert u.prompt_cache_hit_tokens == cached
            assert u.prompt_cache_miss_tokens == u.prompt_tokens - cached
        assert first.usage.prompt_cache_hit_tokens == 0
        assert second.usage.prompt_cache_hit_tokens > 1500


def test_upstream_requests_ask_for_unencoded_bodies_with_the_workers_key(fleet):
    """The gateway reads the engines' replies (usage, stream events): every request asks for
    them without a content coding (``accept-encoding: identity``; without the header any coding
    is acceptable, RFC 9110 §12.5.3; codings are case-insensitive, §8.4.1), and carries its
    worker's ``api_key`` — as the upstream's HTTP library parses the request."""
    cfg = config_dict(fleet)
    for w in cfg["workers"]:
        w["api_key"] = f"key-of-{w['name']}"
    with GatewayServer(cfg) as gw:
        _, h = chat(gw.client("sk-acme"), "ep-acme", "identity")
    record = fleet[h["x-kvroute-worker"]].records[-1]
    assert record["accept_encoding"].lower() == "identity"
    assert record["authorization"] == f"Bearer key-of-{h['x-kvroute-worker']}"


def test_fields_in_the_final_usage_chunk_of_streams(fleet):
    with GatewayServer(config_dict(fleet)) as gw:
        client = gw.client("sk-globex")
        for q in ("one", "two"):
            chunks = list(
                client.chat.completions.create(
                    model="ep-globex",
                    messages=messages(q),
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usage = [c.usage for c in chunks if c.usage is not None]
            assert len(usage) == 1
            u = usage[0]
            assert u.prompt_cache_hit_tokens == u.prompt_tokens_details.cached_tokens
            assert u.prompt_cache_miss_tokens == u.prompt_tokens - u.prompt_cache_hit_tokens
        assert u.prompt_cache_hit_tokens > 1500


def test_absent_when_the_engine_reports_no_cached_tokens(fleet):
    for u in fleet.upstreams:
        u.report_cached = False
    try:
        with GatewayServer(config_dict(fleet)) as gw:
            done, _ = chat(gw.client("sk-acme"), "ep-acme", "unreported")
            extra = done.usage.model_extra or {}
            assert "prompt_cache_hit_tokens" not in extra
            assert "prompt_cache_miss_tokens" not in extra
    finally:
        for u in fleet.upstreams:
            u.report_cached = True


def test_switched_off(fleet):
    with GatewayServer(config_dict(fleet, gateway={"cache_usage_fields": False})) as gw:
        done, _ = chat(gw.client("sk-acme"), "ep-acme", "off")
        assert "prompt_cache_hit_tokens" not in (done.usage.model_extra or {})
        assert done.usage.prompt_tokens_details.cached_tokens is not None


def _example_system_prompt() -> str:
    spec = importlib.util.spec_from_file_location("two_calls", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SYSTEM_PROMPT


@pytest.mark.skipif(os.name != "posix", reason="subprocess signals")
def test_two_calls_example_against_kvroute_serve(fleet, tmp_path):
    """`examples/two_calls.py`, unmodified, against `kvroute serve` (the CLI, in a subprocess):
    0 hit tokens on the first call, then at least 90% of the system prompt's tokens."""
    with cli_serve(config_dict(fleet), tmp_path) as (url, _):
        env = {**os.environ, "KVROUTE_BASE_URL": url + "/v1", "KVROUTE_API_KEY": "sk-acme"}
        run = subprocess.run(
            [sys.executable, str(EXAMPLE), "--endpoint", "ep-acme"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 0, run.stdout + run.stderr
    hits = [int(h) for h in re.findall(r"prompt_cache_hit_tokens=(\d+)", run.stdout)]
    assert len(hits) == 2, run.stdout
    system = reference_render([{"role": "system", "content": _example_system_prompt()}])
    system_tokens = len(reference_tokens(system))
    assert hits[0] == 0
    assert hits[1] >= 0.9 * system_tokens
    assert hits[1] == expected_cached(system + "<|user|>\n")  # block-aligned shared prefix
    print(run.stdout)
