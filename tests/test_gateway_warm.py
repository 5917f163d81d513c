"""Keeping a dedicated endpoint's shared prefix warm on its pool (``[[endpoints]] warm_interval``,
``kvroute.gateway.warm``).

What is learnt is checked against a reference written from the module's guarantees (Hypothesis:
sequences of requests sharing prefixes of random lengths); the passes against the test upstreams
of ``support.gateway_upstream``, which model vLLM's prefix cache (salted chains, whole blocks,
``cached_tokens``): after two tenant requests sharing a prefix every pool member — and no other
worker — holds the tenant's salted blocks, warm requests are 1-token completions of the prefix's
token ids at priority 0 that take nothing from the tenant's rate limits, a failing worker is
counted and not ejected, and a worker never has two warm requests at once. The real engine's
side (vLLM caching the warm request's blocks for the tenant's next request) is
tests/e2e/scenarios.py's ``warm`` check.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute import BlockHasher
from kvroute.gateway.config import parse_config
from kvroute.server.warm import WarmPrefix, shared_prefix
from support.gateway_fleet import Fleet, GatewayServer, config_dict
from support.helpers import wait_for

BLOCK = 16
MODEL_DIR = "tests/data/tiny_llama"
SALT = "acme-salt"


def reference_shared(a: list[int], b: list[int], block: int) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n - n % block


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=80),
    st.lists(st.integers(0, 3), max_size=80),
    st.sampled_from([1, 4, 16]),
)
def test_shared_prefix_is_whole_blocks_of_the_common_start(
    a: list[int], b: list[int], block: int
) -> None:
    got = shared_prefix(np.array(a, np.uint32), np.array(b, np.uint32), block)
    assert got == reference_shared(a, b, block)


class _Router:
    block_size = BLOCK


class _Gateway:
    router = _Router()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 80), st.integers(0, 40)),
        min_size=1,
        max_size=8,
    ),
    st.one_of(st.none(), st.integers(0, 96)),
)
def test_the_prefix_learnt_follows_consecutive_requests(
    requests: list[tuple[int, int, int]], cap: int | None
) -> None:
    """Each request: one of four shared starts (``start`` token repeated), cut at ``keep``
    tokens, then ``tail`` tokens of its own. Reference: after each request, the prefix is the
    whole blocks it shares with the one before (capped), when that is at least a block; else
    unchanged. Only the first prefix wakes the warmer."""
    from kvroute.gateway.warm import WarmEndpoint, Warmer

    learnt = WarmPrefix(BLOCK, cap)
    warmer = Warmer(_Gateway(), {"ep": WarmEndpoint("ep", "m", 1.0, learnt, None)})  # type: ignore[arg-type]
    ep = warmer.endpoints["ep"]
    want: list[int] | None = None
    last: list[int] | None = None
    for i, (start, keep, tail) in enumerate(requests):
        tokens = [100 + start] * keep + [1000 + i * 100 + j for j in range(tail)]
        warmer.wake.clear()
        warmer.learn("ep", np.array(tokens, np.uint32))
        warmer.learn("other", np.array(tokens, np.uint32))  # not an endpoint kept warm
        first = False  # the first prefix learnt starts a pass at once; later ones wait
        if last is not None:
            n = reference_shared(last, tokens, BLOCK)
            if cap is not None:
                n = min(n, cap - cap % BLOCK)
            if n:
                first = want is None
                want = tokens[:n]
        last = tokens
        got = None if ep.prefix is None else ep.prefix.tolist()
        assert got == want
        assert warmer.wake.is_set() is first
    assert list(warmer.endpoints) == ["ep"]


def warm_config(fleet: Fleet, interval: float = 0.2, **endpoint: Any) -> dict[str, Any]:
    data = config_dict(
        fleet,
        tokenizer={"model_dir": MODEL_DIR},
        endpoints=[
            {
                "id": "ep-acme",
                "model": "acme-model",
                "pool_size": 2,
                "api_keys": ["sk-acme"],
                "salt": SALT,
                "priority": 3,
                "requests_per_minute": 3,
                "warm_interval": interval,
                **endpoint,
            }
        ],
    )
    return data


def tenant_prompt(tail: int) -> list[int]:
    """A 70-token shared start (4 whole blocks of it) and a tail of its own."""
    return [*range(1, 71), 5000 + tail, 6000 + tail]


@contextlib.contextmanager
def serving(config: dict[str, Any]) -> Iterator[GatewayServer]:
    """A gateway over ``config``, stopped however the block ends."""
    server = GatewayServer(config)
    try:
        yield server
    finally:
        server.stop()


def ask(client: Any, i: int, prompt: list[int] | None = None) -> Any:
    """One tenant request (``tenant_prompt(i)`` unless ``prompt``) through the endpoint."""
    return client.completions.create(
        model="ep-acme", prompt=prompt or tenant_prompt(i), max_tokens=2
    )


def warm_records(fleet: Fleet) -> list[dict[str, Any]]:
    return [r for r in fleet.records() if r["upstream_id"].startswith("kvroute-warm-")]


def holds(fleet: Fleet, worker: str, tokens: list[int]) -> int:
    """Blocks of ``tokens`` (the tenant's salted chain) in the upstream's cache."""
    return fleet[worker].cache.match(BlockHasher(BLOCK, salt=SALT).hash(tokens))


def warm_counts(server: GatewayServer) -> dict[tuple[str, str], float]:
    out = {}
    pattern = r'_warm_requests_total\{endpoint="ep-acme",worker="([^"]+)",result="(\w+)"\} (\S+)'
    for worker, result, value in re.findall(pattern, server.metrics()):
        out[worker, result] = float(value)
    return out


@pytest.fixture
def fleet() -> Any:
    f = Fleet(3)
    yield f
    f.close()


def test_two_requests_sharing_a_prefix_warm_every_pool_member_and_no_other(fleet: Fleet) -> None:
    with serving(warm_config(fleet)) as server:
        client = server.client("sk-acme")
        ask(client, 0)
        assert server.get("/health").json()["warm"]["ep-acme"]["prefix_tokens"] == 0
        assert not warm_records(fleet)  # one request teaches nothing
        ask(client, 1)
        pool = server.gateway.router.endpoint_pool("ep-acme")
        shared = list(range(1, 65))
        wait_for(lambda: all(holds(fleet, w, shared) == 4 for w in pool), "both pool members warm")
        outside = next(w for w in server.gateway.workers if w not in pool)
        assert holds(fleet, outside, shared) == 0
        records = warm_records(fleet)
        assert {r["path"] for r in records} == {"/v1/completions"}
        assert {r["cache_salt"] for r in records} == {SALT}
        assert {r["priority"] for r in records} == {None}  # priority 0: vLLM's default
        assert {r["model"] for r in records} == {"acme-model"}
        assert all(fleet[u.name].records for u in fleet.upstreams if u.name in pool)
        assert server.get("/health").json()["warm"]["ep-acme"]["prefix_tokens"] == 64
        # The tenant's third request is its third admission: the warm requests took none.
        ask(client, 2)
        # Later passes touch what the pool holds: hits on both members.
        wait_for(
            lambda: all(warm_counts(server).get((w, "hit"), 0) >= 1 for w in pool),
            "a hit on each pool member",
        )
        counts = warm_counts(server)
        assert not any(w == outside for w, _ in counts)
        assert not any(result == "failed" for _, result in counts)


def test_a_warm_request_is_one_token_of_the_prefix_ids(fleet: Fleet) -> None:
    bodies: list[dict[str, Any]] = []
    for u in fleet.upstreams:
        original = u._answer

        async def answer(request: Any, body: Any, *args: Any, _o: Any = original, **kw: Any) -> Any:
            if request.headers.get("x-request-id", "").startswith("kvroute-warm-"):
                bodies.append(body)
            return await _o(request, body, *args, **kw)

        u._answer = answer  # type: ignore[method-assign]
    with serving(warm_config(fleet, interval=30.0)) as server:
        client = server.client("sk-acme")
        for i in range(2):
            ask(client, i)
        wait_for(lambda: len(bodies) >= 2, "the first pass's warm requests")
        for body in bodies:
            assert body["prompt"] == list(range(1, 65))
            assert body["max_tokens"] == 1
            assert body["stream"] is False
            assert body["cache_salt"] == SALT
            assert "priority" not in body


@pytest.mark.parametrize(("reserved", "tokens"), [(2, 32), (0, 64)])
def test_the_prefix_is_capped_at_the_reserved_blocks(
    fleet: Fleet, reserved: int, tokens: int
) -> None:
    """At most the reserved blocks; ``reserved_blocks = 0`` reserves nothing: no bound."""
    with serving(warm_config(fleet, reserved_blocks=reserved)) as server:
        client = server.client("sk-acme")
        for i in range(2):
            ask(client, i)
        wait_for(lambda: len(warm_records(fleet)) >= 2, "warm requests")
        assert server.get("/health").json()["warm"]["ep-acme"]["prefix_tokens"] == tokens


def test_a_failing_member_is_counted_not_ejected_and_retried(fleet: Fleet) -> None:
    with serving(warm_config(fleet, interval=0.1)) as server:
        client = server.client("sk-acme")
        ask(client, 0)
        pool = server.gateway.router.endpoint_pool("ep-acme")
        served = next(w for w in pool if fleet[w].records)
        other = next(w for w in pool if w != served)
        fleet[other].fail(500)
        ask(client, 1)
        wait_for(lambda: warm_counts(server).get((other, "failed"), 0) >= 3, "failed passes")
        assert server.get("/health").json()["workers"][other] is True
        fleet[other].fail(500, times=0)
        wait_for(lambda: holds(fleet, other, list(range(1, 65))) == 4, "the retried warm")


def test_a_member_is_never_warmed_twice_at_once(fleet: Fleet) -> None:
    with serving(warm_config(fleet, interval=0.05)) as server:
        client = server.client("sk-acme")
        ask(client, 0)
        pool = server.gateway.router.endpoint_pool("ep-acme")
        for w in pool:
            fleet[w].stall = 0.6
        second = threading.Thread(target=ask, args=(client, 1))
        second.start()
        wait_for(lambda: len(warm_records(fleet)) >= 2, "the first pass")
        warming = server.get("/health").json()["warm"]["ep-acme"]["warming"]
        assert warming == sorted(pool)
        second.join()
        wait_for(lambda: sum(warm_counts(server).values()) >= 2, "the first pass answered", 5)
        # Twelve intervals passed while each member answered: one warm request each.
        assert len(warm_records(fleet)) <= 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer": {}}, "needs \\[tokenizer\\] model_dir"),
        ({"pd": {"protocol": "vllm"}}, "\\[pd\\] does not support"),
        ({"warm_interval": 0.0}, "warm_interval must be > 0"),
        ({"warm_interval": float("nan")}, "warm_interval must be > 0"),
    ],
)
def test_config_errors_name_the_fault(change: dict[str, Any], message: str) -> None:
    data = warm_config(SimpleNamespace(upstreams=[], ports=[]))  # type: ignore[arg-type]
    data["workers"] = [
        {"name": f"w{i}", "url": f"http://127.0.0.1:{9000 + i}", "role": "both"} for i in range(3)
    ]
    if "warm_interval" in change:
        data["endpoints"][0]["warm_interval"] = change["warm_interval"]
    else:
        data.update(change)
    with pytest.raises(ValueError, match=message):
        parse_config(data)


def test_without_warm_interval_nothing_is_warmed(fleet: Fleet) -> None:
    data = warm_config(fleet)
    del data["endpoints"][0]["warm_interval"]
    with serving(data) as server:
        assert server.gateway.warmer is None
        assert "warm" not in server.get("/health").json()
        client = server.client("sk-acme")
        for i in range(3):
            ask(client, i)
        assert not warm_records(fleet)


def test_kvroute_epp_reads_a_shared_file_and_says_it_does_not_warm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvroute.epp.config import parse_config as parse_epp

    data = {
        "epp": {},
        "workers": [{"name": "w0", "url": "http://127.0.0.1:9000", "kind": "vllm"}],
        "endpoints": [{"id": "ep-acme", "model": "m", "warm_interval": 5.0}],
    }
    with caplog.at_level("WARNING", logger="kvroute.epp"):
        config = parse_epp(data)
    assert config.endpoints[0].warm_interval == 5.0
    assert "'ep-acme': warm_interval is kept by kvroute serve only" in caplog.text
    caplog.clear()
    del data["endpoints"][0]["warm_interval"]
    with caplog.at_level("WARNING", logger="kvroute.epp"):
        parse_epp(data)
    assert "warm_interval" not in caplog.text


def test_a_new_prefix_waits_for_the_next_pass(fleet: Fleet) -> None:
    """However often the tenant's prefix changes, a member gets one warm request per interval:
    the first prefix is warmed at once, a second one only at the next pass (30 s away here)."""
    with serving(warm_config(fleet, interval=30.0, requests_per_minute=60)) as server:
        client = server.client("sk-acme")
        for i in range(2):
            ask(client, i)
        wait_for(lambda: sum(warm_counts(server).values()) >= 2, "the first pass answered")
        other = [[9, *tenant_prompt(i)] for i in range(2)]  # another start: a new prefix
        for prompt in other:
            ask(client, 0, prompt)
        assert server.get("/health").json()["warm"]["ep-acme"]["prefix_tokens"] == 64
        assert server.gateway.warmer.endpoints["ep-acme"].prefix.tolist()[0] == 9
        time.sleep(0.5)
        assert len(warm_records(fleet)) == 2
