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

import asyncio
import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute import BlockHasher
from kvroute.gateway.config import parse_config
from kvroute.server.warm import WarmPrefix, shared_prefix
from starlette.responses import Response
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
    alone = WarmPrefix(BLOCK, cap)  # the rule by itself: what each request did
    want: list[int] | None = None
    last: list[int] | None = None
    for i, (start, keep, tail) in enumerate(requests):
        tokens = [100 + start] * keep + [1000 + i * 100 + j for j in range(tail)]
        warmer.wake.clear()
        warmer.learn("ep", np.array(tokens, np.uint32))
        warmer.learn("other", np.array(tokens, np.uint32))  # not an endpoint kept warm
        kind = alone.learn(np.array(tokens, np.uint32))
        first = False  # the first prefix learnt starts a pass at once; later ones wait
        want_kind = "same"
        if last is not None:
            n = reference_shared(last, tokens, BLOCK)
            if cap is not None:
                n = min(n, cap - cap % BLOCK)
            if n and tokens[:n] != want:
                first = want is None
                want_kind = "first" if first else "new"
                want = tokens[:n]
        last = tokens
        got = None if ep.prefix is None else ep.prefix.tolist()
        assert got == want
        assert warmer.wake.is_set() is first
        assert kind == want_kind
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


def in_loop(server: GatewayServer, coro: Any) -> Any:
    """Runs ``coro`` on the gateway's event loop (where its router and warmer live)."""
    loop = server.gateway.warmer.runner.get_loop()
    return asyncio.run_coroutine_threadsafe(coro, loop).result(10)


async def route_on(server: GatewayServer, worker: str, tokens: list[int]) -> Any:
    """The router's decision for the tenant's ``tokens`` on ``worker`` (then withdrawn)."""
    router = server.gateway.router
    others = [w for w in server.gateway.workers if w != worker]
    d = router.route(tokens=np.array(tokens, np.uint32), endpoint="ep-acme", exclude=others)
    router.withdraw(d)
    return d


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
        warm = server.get("/health").json()["warm"]["ep-acme"]
        assert (warm["prefix_tokens"], warm["interval"]) == (64, 0.2)
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
        # The member the tenant had not used: its first warm request filled the prefix, later
        # ones found it; the router knows it holds it (its prediction for the tenant there),
        # from the engine's report (counted as any request's).
        tenants = {
            w
            for w in pool
            for r in fleet[w].records
            if not r["upstream_id"].startswith("kvroute-warm-")
        }
        (unused,) = set(pool) - tenants
        assert counts[unused, "filled"] == 1
        d = in_loop(server, route_on(server, unused, [*range(1, 71), 7]))
        assert d.cached_tokens == 64
        page = server.metrics()
        assert f'prompt_tokens_total{{worker="{unused}"}}' in page
        assert all(re.fullmatch(r"kvroute-warm-[0-9a-f]{16}", r["upstream_id"]) for r in records)
        warmer = server.gateway.warmer
        wait_for(lambda: not warmer.tasks and not warmer.busy, "the passes' tasks to end", 5)


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


def answer_warm_with(fleet: Fleet, reply: Callable[[], Any]) -> None:
    """Every upstream answers warm requests with ``reply()`` (a Starlette response)."""
    for u in fleet.upstreams:
        original = u._answer

        async def answer(request: Any, *args: Any, _o: Any = original, **kw: Any) -> Any:
            if request.headers.get("x-request-id", "").startswith("kvroute-warm-"):
                return reply()
            return await _o(request, *args, **kw)

        u._answer = answer  # type: ignore[method-assign]


REPLIES = {
    # (what the engine answers, the result counted, what is logged)
    "no cached tokens": (None, "sent", None),
    "a JSON list": (lambda: Response(b"[1]", media_type="application/json"), "sent", None),
    "not JSON": (lambda: Response(b"<html>", media_type="text/html"), "sent", None),
    "JSON nested too deep": (lambda: Response(b"[" * 100_000), "sent", None),
    "too large": (
        lambda: Response(b" " * (2 << 20), media_type="application/json"),
        "failed",
        "warm request of endpoint ep-acme on {w}: BodyTooLarge(",
    ),
    "a 503": (
        lambda: Response(b"{}", status_code=503),
        "failed",
        "warm request of endpoint ep-acme on {w}: status 503",
    ),
}


@pytest.mark.parametrize("case", list(REPLIES))
def test_each_warm_result_says_what_the_engine_answered(
    fleet: Fleet, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    reply, result, logged = REPLIES[case]
    if reply is None:
        for u in fleet.upstreams:
            u.report_cached = False
    else:
        answer_warm_with(fleet, reply)
    caplog.set_level(logging.INFO, logger="kvroute.gateway")
    with serving(warm_config(fleet, interval=30.0)) as server:
        client = server.client("sk-acme")
        for i in range(2):
            ask(client, i)
        pool = server.gateway.router.endpoint_pool("ep-acme")
        wait_for(lambda: sum(warm_counts(server).values()) >= 2, "the first pass answered")
        assert warm_counts(server) == {(w, result): 1.0 for w in pool}
        for w in pool:
            assert server.get("/health").json()["workers"][w] is True  # nobody ejected
            if logged is not None:
                assert any(m.startswith(logged.format(w=w)) for m in caplog.messages), w


def test_a_member_the_router_cannot_route_to_is_a_failed_warm(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.gateway")
    with serving(warm_config(fleet, interval=30.0)) as server:
        client = server.client("sk-acme")
        for i in range(2):
            ask(client, i)
        warmer = server.gateway.warmer
        pool = server.gateway.router.endpoint_pool("ep-acme")
        outside = next(w for w in server.gateway.workers if w not in pool)
        result = in_loop(server, warmer.warm(warmer.endpoints["ep-acme"], outside))
        assert result == "failed"
        assert warm_counts(server)[outside, "failed"] == 1
        said = f"warm request of endpoint ep-acme: {outside} cannot be routed to now"
        assert said in caplog.messages
        assert not [r for r in fleet[outside].records if r["upstream_id"].startswith("kvroute")]


def test_what_raises_in_a_pass_is_logged_and_warming_goes_on(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """A warm request that raises (not an upstream failure) is a ``failed`` one; a pass that
    raises is logged; the next pass runs."""
    caplog.set_level(logging.INFO, logger="kvroute.gateway")
    with serving(warm_config(fleet, interval=0.1)) as server:
        warmer = server.gateway.warmer
        warm_pool, raw = warmer.warm_pool, warmer._warm
        raised: list[str] = []

        def pool_once(ep: Any) -> None:
            if "pass" not in raised:
                raised.append("pass")
                raise RuntimeError("pass broke")
            warm_pool(ep)

        async def warm_once(ep: Any, worker: str) -> str:
            if "warm" not in raised:
                raised.append("warm")
                raise RuntimeError("warm broke")
            return await raw(ep, worker)

        warmer.warm_pool, warmer._warm = pool_once, warm_once  # type: ignore[method-assign]
        client = server.client("sk-acme")
        for i in range(2):
            ask(client, i)
        pool = server.gateway.router.endpoint_pool("ep-acme")
        wait_for(lambda: all(holds(fleet, w, list(range(1, 65))) == 4 for w in pool), "warm")
        assert sum(v for (_, r), v in warm_counts(server).items() if r == "failed") == 1
        assert "warm pass of endpoint ep-acme" in caplog.messages
        (broke,) = [r for r in caplog.records if r.getMessage().startswith("warm request of")]
        assert broke.getMessage() in {f"warm request of endpoint ep-acme on {w}" for w in pool}
        assert broke.exc_info is not None


def test_a_busy_or_unhealthy_member_holds_up_no_other(fleet: Fleet) -> None:
    """Members are skipped one by one: the first in the pool's order unhealthy (the router's
    pool then has another worker in its place, warmed instead), then busy; the second is
    warmed on every pass all the same."""
    with serving(warm_config(fleet, interval=0.1)) as server:
        client = server.client("sk-acme")
        router = server.gateway.router
        first, second = router.endpoint_pool("ep-acme")

        def answered(w: str) -> float:
            return sum(v for (m, _), v in warm_counts(server).items() if m == w)

        in_loop(server, _set_healthy(router, first, False))
        for i in range(2):
            ask(client, i)
        wait_for(lambda: answered(second) >= 3, "passes on the second member")
        assert answered(first) == 0
        (stand_in,) = set(router.endpoint_pool("ep-acme")) - {second}
        assert stand_in != first and answered(stand_in) >= 1
        fleet[first].stall = 10.0  # its next warm request runs for 10 s: it is busy
        in_loop(server, _set_healthy(router, first, True))
        wait_for(
            lambda: server.get("/health").json()["warm"]["ep-acme"]["warming"] == [first],
            "a warm request stalled on the first member",
            5,
        )
        before = answered(second)
        wait_for(lambda: answered(second) >= before + 3, "passes while the first is busy", 4)


async def _set_healthy(router: Any, worker: str, ok: bool) -> None:
    router.set_healthy(worker, ok)


def test_start_runs_one_warmer_and_stop_ends_it(fleet: Fleet) -> None:
    with serving(warm_config(fleet, interval=0.1)) as server:
        warmer = server.gateway.warmer
        runner = warmer.runner
        assert runner is not None
        in_loop(server, _start_again(warmer))
        assert warmer.runner is runner
        client = server.client("sk-acme")
        for i in range(2):
            ask(client, i)
        (first, _) = server.gateway.router.endpoint_pool("ep-acme")
        fleet[first].stall = 10.0  # a warm request in flight when the warmer stops
        wait_for(lambda: warmer.busy, "a warm request in flight", 5)
        tasks = list(warmer.tasks)
        # Stopped while the gateway still runs: the runner and the requests in flight end.
        assert in_loop(server, _stop(warmer)) is True
        assert warmer.runner is None and runner.done()
        assert tasks and all(t.done() for t in tasks)


async def _start_again(warmer: Any) -> None:
    warmer.start()


async def _stop(warmer: Any) -> bool:
    runner = warmer.runner
    tasks = list(warmer.tasks)
    await warmer.stop()
    return runner.done() and all(t.done() for t in tasks)


def test_a_member_nobody_answers_is_a_failed_warm_and_is_not_ejected(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """A warm request that cannot connect is counted and logged with the failure's kind; only
    health checks eject (a warm request does not count as a request's failure)."""
    caplog.set_level(logging.INFO, logger="kvroute.gateway")
    data = warm_config(fleet, interval=30.0, pool_size=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    data["workers"].append({"name": "dead", "url": f"http://127.0.0.1:{port}", "kind": "vllm"})
    with serving(data) as server:
        client = server.client("sk-acme")
        for i in range(2):
            ask(client, i)
        wait_for(lambda: warm_counts(server).get(("dead", "failed")) == 1, "the dead member")
        said = "warm request of endpoint ep-acme on dead: connect"
        assert said in caplog.messages
        assert server.get("/health").json()["workers"]["dead"] is True
