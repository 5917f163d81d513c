"""The gateway's pure parts: config validation, prompt rendering and tokenization (held against
the reference re-implementation in ``gateway_upstream``, driven by Hypothesis), unit
conversion, and the metrics exposition (read back with prometheus_client's parser)."""

from __future__ import annotations

import hashlib
import math

import kvroute
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.gateway import load_config, parse_config
from kvroute.gateway.config import key_digest
from kvroute.gateway.prompt import (
    ByteTokenizer,
    HFTokenizer,
    RequestError,
    load_tokenizer,
    prompt_of,
    render_chat,
    to_routing_tokens,
)
from kvroute.server.metrics import Counter, Gauge, Histogram, Registry
from kvroute.server.routing import build_router
from support.gateway_fleet import toml_text
from support.gateway_upstream import reference_render, reference_tokens

# ---- config ----------------------------------------------------------------------------------


def minimal(**more):
    data = {"workers": [{"name": "w0", "url": "http://127.0.0.1:9000"}]}
    data.update(more)
    return data


FULL = {
    "gateway": {
        "host": "0.0.0.0",
        "port": 8080,
        "models": ["llama"],
        "api_keys": ["sk-direct"],
        "max_body_bytes": 1024,
        "max_attempts": 2,
        "routing_headers": False,
        "connect_timeout": 1,
        "read_timeout": 60.5,
        "write_timeout": 5.0,
        "pool_timeout": 2.0,
        "upstream_keepalive": 3.0,
        "keep_alive_timeout": 30.0,
        "health_path": "/healthz",
        "health_interval": 0.5,
        "eject_seconds": 0.0,
        "eject_after": 5,
        "max_ejected_fraction": 0.25,
        "header_timeout": 3,
        "body_timeout": 7.5,
        "max_connections": 99,
        "max_response_bytes": 1000,
        "max_event_bytes": 500,
        "admin_host": "0.0.0.0",
        "admin_port": 9100,
        "admin_api_keys": ["sk-admin"],
        "key_requests_per_minute": 60,
        "key_tokens_per_minute": 6000,
        "max_in_flight": 40,
        "max_in_flight_per_worker": 8,
        "prefill_tokens_per_second": 5000,
        "cache_usage_fields": False,
    },
    "router": {
        "policy": "hash",
        "block_size": 32,
        "hash_profile": "vllm",
        "index": "events",
        "options": {"seed": 7},
    },
    "tokenizer": {"bytes_per_token": 2, "model_dir": "/models/llama"},
    "events": {"topic": "kv", "mode": "direct"},
    "workers": [
        {
            "name": "gpu-0",
            "url": "http://10.0.0.1:8000/",
            "kind": "sglang",
            "weight": 2,
            "api_key": "up",
            "max_connections": 16,
            "kv_events": "tcp://10.0.0.1:5557",
            "kv_replay": "tcp://10.0.0.1:5558",
            "kv_events_bind": True,
        },
        {"name": "gpu-1", "url": "https://gpu1.internal", "kind": "openai"},
    ],
    "endpoints": [
        {
            "id": "ep-a",
            "model": "llama",
            "pool_size": 2,
            "reserved_blocks": 0,
            "api_keys": ["k1", "k2"],
            "api_key_sha256": [hashlib.sha256(b"k3").hexdigest()],
            "salt": "secret-salt",
            "cache_salt": False,
            "requests_per_minute": 10,
            "tokens_per_minute": 100,
            "weight": 3,
            "priority": -2,
        }
    ],
}


def test_full_config_from_toml(tmp_path):
    path = tmp_path / "gw.toml"
    path.write_text(toml_text(FULL))
    c = load_config(path)
    assert c.server.port == 8080 and c.server.host == "0.0.0.0"
    assert c.server.models == ("llama",) and c.server.key_digests == (key_digest("sk-direct"),)
    assert c.server.connect_timeout == 1.0 and isinstance(c.server.connect_timeout, float)
    assert c.health.eject_seconds == 0.0 and c.health.eject_after == 5
    assert c.server.routing_headers is False and c.health.path == "/healthz"
    assert c.router.policy == "hash" and c.router.block_size == 32 and c.router.index == "events"
    assert dict(c.router.options) == {"seed": 7}
    assert c.tokenizer.path is None and c.tokenizer.bytes_per_token == 2
    assert c.tokenizer.model_dir == "/models/llama"
    assert c.events.topic == "kv" and c.events.mode == "direct"
    w0, w1 = c.workers
    assert w0.url == "http://10.0.0.1:8000" and w0.weight == 2.0 and w0.sends_cache_salt
    assert w0.kv_replay == "tcp://10.0.0.1:5558" and w0.max_connections == 16
    assert w1.kind == "openai" and not w1.sends_cache_salt and w1.kv_events is None
    assert w0.kv_events_bind and not w1.kv_events_bind
    (ep,) = c.endpoints
    assert ep.key_digests == tuple(key_digest(k) for k in ("k1", "k2", "k3"))
    assert ep.salt == "secret-salt" and ep.cache_salt is False and ep.reserved_blocks == 0
    assert (ep.requests_per_minute, ep.tokens_per_minute, ep.weight) == (10, 100, 3.0)
    s = c.server
    assert (s.header_timeout, s.body_timeout, s.max_connections) == (3.0, 7.5, 99)
    assert (s.max_response_bytes, s.max_event_bytes) == (1000, 500)
    assert (s.admin_host, s.admin_port) == ("0.0.0.0", 9100)
    assert s.admin_key_digests == (key_digest("sk-admin"),)
    assert (s.key_requests_per_minute, s.key_tokens_per_minute) == (60, 6000)
    assert (s.max_in_flight, s.max_in_flight_per_worker) == (40, 8)
    assert s.prefill_tokens_per_second == 5000.0 and s.cache_usage_fields is False
    assert c.health.max_ejected_fraction == 0.25
    assert ep.priority == -2
    assert c.worker("gpu-1") is w1
    with pytest.raises(KeyError, match="nope"):
        c.worker("nope")


def test_defaults():
    c = parse_config(minimal())
    assert c.server.max_attempts == 3 and c.server.routing_headers
    # [router] left out: the Router's own defaults, which the config does not repeat.
    assert (c.router.policy, c.router.block_size, c.router.index) == (None, None, None)
    built = build_router(c.workers, c.router).config
    defaults = kvroute.Router(["w"]).config
    for key in ("policy", "block_size", "hash_profile", "index"):
        assert built[key] == defaults[key]
    assert c.workers[0].kind == "vllm" and c.endpoints == ()


def _with(path, value):
    data = minimal(
        endpoints=[{"id": "ep-a", "model": "m"}],
        gateway={"models": ["m"]},
    )
    node = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
    node[keys[-1]] = value
    return data


def test_in_flight_bound_up_to_every_workers_pool_is_accepted():
    """max_in_flight_per_worker equal to the smallest max_connections is in force as given."""
    workers = [
        {"name": "a", "url": "http://x", "max_connections": 5},
        {"name": "b", "url": "http://y", "max_connections": 9},
    ]
    c = parse_config(minimal(gateway={"max_in_flight_per_worker": 5}, workers=workers))
    assert c.server.max_in_flight_per_worker == 5
    assert [w.max_connections for w in c.workers] == [5, 9]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "at least one"),
        (minimal(extra=1), "unknown key.*extra"),
        (_with("gateway.colour", 1), r"unknown key\(s\) in gateway: colour"),
        (_with("gateway.port", "80"), "gateway.port must be an integer, got '80'"),
        (_with("gateway.port", 70000), "gateway.port must be in 0..65535, got 70000"),
        (_with("gateway.max_attempts", 0), "gateway.max_attempts must be > 0, got 0"),
        (_with("gateway.read_timeout", -1.0), "read_timeout must be > 0, got -1.0"),
        (_with("gateway.read_timeout", math.inf), "read_timeout must be > 0, got inf"),
        (_with("gateway.routing_headers", 1), "routing_headers must be true or false, got 1"),
        (_with("gateway.max_body_bytes", True), "max_body_bytes must be an integer, got True"),
        (_with("gateway.health_path", "health"), "health_path must start with '/'"),
        (_with("gateway.admin_port", 70000), "admin_port must be in 0..65535"),
        (_with("gateway.max_ejected_fraction", 1.5), "max_ejected_fraction must be in"),
        (_with("gateway.header_timeout", 0), "header_timeout must be > 0"),
        (_with("endpoints.0.weight", -1), "weight must be > 0"),
        (_with("gateway.admin_api_key_sha256", ["xyz"]), "admin_api_key_sha256 entries"),
        (_with("gateway.api_keys", [""]), "api_keys must hold non-empty strings"),
        (_with("gateway.api_key_sha256", ["abc"]), "64 hex digits, got 'abc'"),
        (_with("workers.0.kind", "tgi"), "kind must be one of .*got 'tgi'"),
        (_with("workers.0.url", "ftp://x"), "url must be an http\\(s\\) URL, got 'ftp://x'"),
        (_with("workers.0.weight", 0), "weight must be > 0, got 0"),
        (_with("workers.0.kv_replay", "tcp://x:1"), "kv_replay 'tcp://x:1' given without"),
        (_with("workers.0.kv_events_bind", True), "kv_events_bind given without kv_events"),
        (_with("workers.0.kv_events_bind", 1), "kv_events_bind must be true or false"),
        (_with("workers.0.kv_events", "tcp://x:1"), "have kv_events but router.index"),
        (_with("router.index", "events"), "needs kv_events on at least one worker"),
        (_with("router.index", "exact"), "router.index must be 'approx' or 'events'"),
        (_with("router.options", {"policy": "hash"}), r"must not repeat \['policy'\]"),
        (_with("tokenizer.bytes_per_token", 8), "bytes_per_token must be 1..4"),
        (_with("endpoints.0.pool_size", 2), "pool_size 2 exceeds the 1 workers"),
        (
            minimal(
                gateway={"max_in_flight_per_worker": 5},
                workers=[
                    {"name": "a", "url": "http://x", "max_connections": 5},
                    {"name": "b", "url": "http://y", "max_connections": 4},
                ],
            ),
            "max_in_flight_per_worker 5 exceeds the max_connections 4 of worker 'b'",
        ),
        (_with("endpoints.0.id", "m"), r"endpoint id\(s\) \['m'\] are also listed"),
        (_with("endpoints.0.model", ""), "id and model must not be empty"),
        (_with("endpoints.0.priority", 2**31), r"priority must be in -2\*\*31..2\*\*31-1"),
        (_with("endpoints.0.priority", 1.5), "priority must be"),
        (
            minimal(workers=[{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]),
            r"duplicate worker name\(s\): \['a'\]",
        ),
        (
            minimal(endpoints=[{"id": "e", "model": "m"}, {"id": "e", "model": "m"}]),
            r"duplicate endpoint id\(s\): \['e'\]",
        ),
        (minimal(workers=[{"url": "http://x"}]), r"workers\[0\].name is required"),
        (minimal(gateway=[1]), "config.gateway must be a table, got \\[1\\]"),
    ],
)
def test_invalid_configs_name_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        parse_config(data)


# ---- prompt rendering and tokens ---------------------------------------------------------------

text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), text)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": text})}
    ),
    st.dictionaries(text, json_leaf, max_size=3),
)
content = st.one_of(st.none(), text, st.lists(part, max_size=4), st.integers())
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": content},
        optional={
            "name": text,
            "tool_calls": st.lists(st.dictionaries(text, json_leaf, max_size=2), max_size=2),
        },
    ),
    json_leaf,
)
messages = st.lists(message, max_size=6)
tools = st.one_of(st.none(), st.lists(st.dictionaries(text, json_leaf, max_size=3), max_size=2))


@settings(max_examples=300, deadline=None)
@given(messages, tools)
def test_render_matches_the_documented_rendering(msgs, tls):
    rendered = render_chat(msgs, tls)
    assert rendered == reference_render(msgs, tls)
    assert ByteTokenizer(4).encode(rendered).tolist() == reference_tokens(rendered)


@settings(max_examples=200, deadline=None)
@given(messages, tools, st.integers(0, 6))
def test_render_of_a_conversation_extends_its_prefix(msgs, tls, k):
    assert render_chat(msgs, tls).startswith(render_chat(msgs[:k], tls))


@settings(max_examples=200, deadline=None)
@given(text, text, st.sampled_from([1, 2, 4]))
def test_shared_bytes_give_shared_pseudo_tokens(a, b, width):
    tok = ByteTokenizer(width)
    x, y = a.encode(), b.encode()
    common = 0
    while common < min(len(x), len(y)) and x[common] == y[common]:
        common += 1
    ta, tb = tok.encode(a), tok.encode(b)
    assert len(ta) == -(-len(x) // width)
    shared = common // width
    assert ta[:shared].tolist() == tb[:shared].tolist()
    for i in range(len(ta)):  # each pseudo-token is its bytes, little-endian, zero-padded
        chunk = x[i * width : (i + 1) * width]
        assert int(ta[i]) == int.from_bytes(chunk.ljust(width, b"\0"), "little")


def test_render_rejects_non_list_messages():
    with pytest.raises(RequestError, match="'messages' must be a list, got str"):
        render_chat("hello")


def test_completion_prompts():
    assert prompt_of("abc") == "abc"
    assert prompt_of(["first", "second"]) == "first"
    assert prompt_of([1, 2, 3]).tolist() == [1, 2, 3]
    assert prompt_of([[4, 5], [6]]).tolist() == [4, 5]
    for bad in (None, 5, [], [True], [-1], [2**32], [1.5], [{"a": 1}]):
        with pytest.raises(RequestError):
            prompt_of(bad)


def test_byte_tokenizer_widths():
    with pytest.raises(ValueError, match="1, 2 or 4, got 3"):
        ByteTokenizer(3)
    assert ByteTokenizer(1).encode("ab").tolist() == [97, 98]
    assert ByteTokenizer(2).encode("abc").tolist() == [97 + 98 * 256, 99]


@given(st.integers(0, 10_000), st.integers(1, 10_000), st.integers(0, 10_000))
def test_engine_tokens_to_routing_tokens(cached, engine_prompt, routing_prompt):
    cached = min(cached, engine_prompt)
    got = to_routing_tokens(cached, engine_prompt, routing_prompt)
    assert 0 <= got <= routing_prompt
    assert abs(got - cached * routing_prompt / engine_prompt) <= 0.5 + 1e-9
    if engine_prompt == routing_prompt:
        assert got == cached
    assert to_routing_tokens(cached, None, routing_prompt) == min(cached, routing_prompt)


def test_hf_tokenizer_from_a_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = "you are a helpful assistant answer briefly <|system|> <|user|>".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = load_tokenizer(str(path))
    assert isinstance(hf, HFTokenizer) and hf.slow
    sample = "<|system|> you are a helpful assistant zebra"
    assert hf.encode(sample).tolist() == tok.encode(sample, add_special_tokens=False).ids
    assert hf.encode(sample).dtype.name == "uint32"
    with pytest.raises(ValueError, match="cannot load tokenizer file"):
        HFTokenizer(str(tmp_path / "missing.json"))


# ---- metrics exposition --------------------------------------------------------------------------


def test_metrics_exposition_parses_and_counts():
    parser = pytest.importorskip("prometheus_client.parser")
    reg = Registry()
    c = reg.add(Counter("t_requests_total", "Requests.", ("route", "status")))
    h = reg.add(Histogram("t_latency_seconds", "Latency.", ("route",), buckets=(0.1, 1.0)))
    g = reg.add(Gauge("t_up", "Up.", ("worker",), lambda: [(("a",), 1), (('b"\\\n',), 0)]))
    plain = reg.add(Counter("t_plain_total", "No labels."))
    c.inc("/x", "200")
    c.inc("/x", "200", by=2)
    c.inc('/"y"', "500")
    values = [0.05, 0.1, 0.5, 1.0, 7.0]
    for v in values:
        h.observe(v, "/x")
    assert (c.get("/x", "200"), plain.get()) == (3, 0)
    samples = {}
    for family in parser.text_string_to_metric_families(reg.render()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("t_requests_total", (("route", "/x"), ("status", "200")))] == 3
    assert samples[("t_requests_total", (("route", '/"y"'), ("status", "500")))] == 1
    assert samples[("t_plain_total", ())] == 0
    for le, expected in (("0.1", 2), ("1.0", 4), ("+Inf", 5)):
        assert samples[("t_latency_seconds_bucket", (("le", le), ("route", "/x")))] == expected
    assert samples[("t_latency_seconds_count", (("route", "/x"),))] == 5
    assert samples[("t_latency_seconds_sum", (("route", "/x"),))] == pytest.approx(sum(values))
    assert samples[("t_up", (("worker", 'b"\\\n'),))] == 0
    assert g.kind == "gauge"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (minimal(gateway={"port": "x"}), "gateway.port must be an integer"),
        (minimal(router={"options": {"colour": 1}}), "colour"),  # the Router refuses it
        (minimal(router={"policy": "fastest"}), "fastest"),
    ],
)
def test_serve_refuses_a_bad_config(tmp_path, capsys, data, message):
    from kvroute.cli import main

    path = tmp_path / "bad.toml"
    path.write_text(toml_text(data))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"bad config {path}" in err and message in err


def test_events_mode_reaches_the_routers_own_applier():
    """[events] mode decides how the router's applier hashes (it used to be ignored)."""
    from kvroute.server.config import EventsConfig, RouterConfig, WorkerConfig
    from kvroute.server.routing import build_router

    workers = [WorkerConfig("w", "http://127.0.0.1:1", kv_events="tcp://127.0.0.1:2")]
    events = RouterConfig(index="events", hash_profile="vllm", options={"hash_algo": "sha256"})
    direct = build_router(workers, events, EventsConfig(mode="direct"))
    assert direct.event_applier.mode == "direct"
    assert build_router(workers, events, EventsConfig()).event_applier.mode == "rehash"
    assert build_router(workers, RouterConfig()).event_applier is None
