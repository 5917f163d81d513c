"""KvRouteStrategy inside a real ``litellm.Router`` over this project's OpenAI-compatible test
upstreams (``gateway_upstream.Upstream``: a vLLM-like prefix cache per upstream, on 127.0.0.1).

Hit rates are what the upstreams reported (``usage.prompt_tokens_details.cached_tokens``);
LiteLLM's own strategies serve the same requests in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import litellm
import pytest
from kvroute import Router
from kvroute.integrations.litellm import KvRouteStrategy
from litellm.types.router import Deployment, RouterRateLimitError
from support.gateway_fleet import Fleet
from support.helpers import hit_rate, tenant_requests, tenant_system_prompts

README = Path(__file__).resolve().parent.parent / "README.md"
UPSTREAMS = 4
CAPACITY = 600  # blocks per upstream: ~6 of the 20 tenants' system prompts; the fleet holds all


@pytest.fixture(scope="module")
def fleet():
    f = Fleet(UPSTREAMS, capacity=CAPACITY)
    yield f
    f.close()


def model_list(fleet: Fleet, group: str = "base-model") -> list[dict]:
    return [
        {
            "model_name": group,
            "litellm_params": {
                "model": "openai/base-model",
                "api_base": f"http://127.0.0.1:{port}/v1",
                "api_key": "sk-test",
            },
            "model_info": {"id": u.name},
        }
        for u, port in zip(fleet.upstreams, fleet.ports, strict=True)
    ]


def fresh(fleet: Fleet) -> None:
    for u in fleet.upstreams:
        u.reset()


@contextlib.contextmanager
def installed(fleet: Fleet, *, router: dict | None = None, **strategy: Any):
    """A fresh fleet behind a ``litellm.Router`` (``router`` keywords) with a ``KvRouteStrategy``
    (``strategy`` keywords) installed; yields both, removes the strategy's callbacks after."""
    fresh(fleet)
    llm = litellm.Router(model_list=model_list(fleet), **(router or {}))
    kv = KvRouteStrategy(llm, **strategy).install()
    try:
        yield llm, kv
    finally:
        kv.close()


def chat(tenant: int, question: str) -> list[dict]:
    return [
        {"role": "system", "content": tenant_system_prompts()[tenant]},
        {"role": "user", "content": question},
    ]


async def drive(router, jobs, concurrency: int = 16):
    gate = asyncio.Semaphore(concurrency)

    async def one(tenant: int, question: str):
        async with gate:
            return await router.acompletion(model="base-model", messages=chat(tenant, question))

    started = asyncio.get_running_loop().time()
    answers = await asyncio.gather(*(one(t, q) for t, q in jobs))
    return answers, asyncio.get_running_loop().time() - started


async def settle(strategy: KvRouteStrategy) -> None:
    for _ in range(500):
        if strategy.in_flight() == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{strategy.in_flight()} attempts never finished")


def test_prompt_rendering_needs_no_gateway_extra():
    """The adapters render prompts with kvroute.gateway.prompt, which loads without the gateway
    extra (the app is imported lazily)."""
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in ("starlette", "uvicorn", "httpx"))
    code = f"import sys; {blocked}; import kvroute.gateway, kvroute.integrations.common"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hit_rate_against_litellms_strategies(fleet):
    jobs = tenant_requests(300)
    rates = {}

    async def run(name: str) -> None:
        fresh(fleet)
        shuffle = name in ("kvroute", "simple-shuffle")
        router = litellm.Router(
            model_list=model_list(fleet), routing_strategy="simple-shuffle" if shuffle else name
        )
        strategy = (
            KvRouteStrategy(router, capacity_blocks=CAPACITY).install()
            if name == "kvroute"
            else None
        )
        try:
            answers, seconds = await drive(router, jobs)
            assert len(answers) == len(jobs)
            rates[name] = hit_rate([a.usage for a in answers])
            served = sum(len(u.records) for u in fleet.upstreams)
            assert served == len(jobs)
            print(f"{name:>15}: hit {rates[name]:6.1%}  {len(jobs) / seconds:5.1f} req/s")
            if strategy is not None:
                await settle(strategy)
                kv = strategy.routers["base-model"]
                assert all(kv.load(w)["active"] == 0 for w in kv.workers)
        finally:
            if strategy is not None:
                strategy.close()

    async def main() -> None:
        for name in ("simple-shuffle", "least-busy", "kvroute"):
            await run(name)

    asyncio.run(main())
    assert rates["kvroute"] >= 2 * rates["simple-shuffle"]
    assert rates["kvroute"] >= 2 * rates["least-busy"]


def test_deployment_in_cooldown_gets_no_traffic(fleet):
    async def main() -> None:
        with installed(fleet, router={"num_retries": 0}) as (router, strategy):
            answers, _ = await drive(router, [(0, f"warm {i}") for i in range(5)])
            home = answers[0].choices[0].message.content.split()[0]  # tenant 0's upstream
            router.health().cooldowns.add_deployment_to_cooldown(
                home, RuntimeError("down"), 500, 60
            )
            before = len(fleet[home].records)
            answers, _ = await drive(router, [(0, f"q {i}") for i in range(20)])
            assert len(fleet[home].records) == before
            assert all(a.choices[0].message.content.split()[0] != home for a in answers)
            assert not strategy.routers["base-model"].is_healthy(home)
            await settle(strategy)

    asyncio.run(main())


def test_failing_deployment_is_cooled_down_and_retried_elsewhere(fleet):
    async def main() -> None:
        with installed(fleet, router={"num_retries": 3, "allowed_fails": 1}) as (router, strategy):
            answers, _ = await drive(router, [(1, "warm")])
            home = answers[0].choices[0].message.content.split()[0]
            fleet[home].fail(500)
            answers, _ = await drive(router, [(1, f"q {i}") for i in range(10)], concurrency=1)
            assert all(a.choices[0].message.content.split()[0] != home for a in answers)
            assert len(fleet[home].records) <= 1 + 2  # the warm-up, then failures until cooldown
            await settle(strategy)
            kv = strategy.routers["base-model"]
            assert all(kv.load(w)["active"] == 0 for w in kv.workers)

    asyncio.run(main())


def test_streaming_is_observed_and_finished(fleet):
    async def main() -> None:
        with installed(fleet) as (router, strategy):
            for i in range(3):
                stream = await router.acompletion(
                    model="base-model", messages=chat(2, f"q {i}"), stream=True
                )
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks)
                assert text.startswith("up-")
                assert all(c.choices for c in chunks)  # the usage chunk is not forwarded
            await settle(strategy)
            records = [r for u in fleet.upstreams for r in u.records]
            assert len(records) == 3 and all(r["stream"] for r in records)
            assert all(r["stream_options"] == {"include_usage": True} for r in records)
            assert len({r["id"] for r in records}) <= 3
            assert sum(r["cached_tokens"] for r in records) > 0  # same upstream, prefix reused
            kv = strategy.routers["base-model"]
            assert all(kv.load(w)["active"] == 0 for w in kv.workers)

    asyncio.run(main())


def test_500_concurrent_calls_none_lost(fleet):
    async def main() -> None:
        with installed(fleet) as (router, strategy):
            jobs = tenant_requests(500, seed=3)
            answers, _ = await drive(router, jobs, concurrency=500)
            assert len(answers) == 500
            served = [r for u in fleet.upstreams for r in u.records]
            assert len(served) == 500
            await settle(strategy)

    asyncio.run(main())


def test_dedicated_endpoint_is_sticky_and_salted(fleet):
    async def main() -> None:
        with installed(fleet, endpoints={"ep-acme": {"pool_size": 1}}) as (router, strategy):
            replies = []
            for i in range(6):
                r = await router.acompletion(
                    model="base-model",
                    messages=chat(i, "hello"),
                    metadata={"kvroute_endpoint": "ep-acme"},
                )
                replies.append(r.choices[0].message.content.split()[0])
            kv = strategy.routers["base-model"]
            assert set(replies) == set(kv.endpoint_pool("ep-acme"))
            salt = kv.endpoint_salt("ep-acme")
            salts = {r["cache_salt"] for u in fleet.upstreams for r in u.records}
            assert salt and salts == {salt}
            with pytest.raises(Exception, match="ep-nope"):
                await router.acompletion(
                    model="base-model",
                    messages=chat(0, "x"),
                    metadata={"kvroute_endpoint": "ep-nope"},
                )
            await settle(strategy)

    asyncio.run(main())


def test_readme_example_routes_through_the_fleet(fleet):
    """The README's LiteLLM example, pointed at the test upstreams, serves calls."""
    text = README.read_text()
    section = text[text.index("### LiteLLM") :]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    for i, port in enumerate(fleet.ports):
        block = block.replace(f"http://10.0.0.{i + 1}:8000/v1", f"http://127.0.0.1:{port}/v1")
    assert "10.0.0." not in block
    fresh(fleet)
    ns: dict = {}
    exec(compile(block, str(README), "exec"), ns)
    try:
        answer = asyncio.run(ns["router"].acompletion(model="llama", messages=chat(3, "hi")))
        assert answer.choices[0].message.content.startswith("up-")
    finally:
        ns["strategy"].close()


def test_a_retry_goes_to_another_deployment_than_the_failed_one(fleet):
    """Under LiteLLM's defaults (num_retries 2, allowed_fails 3) a 500 cools nothing down: the
    retry must still leave the deployment that failed, as LiteLLM's own pick does."""

    async def main() -> None:
        with installed(fleet) as (router, strategy):
            answers, _ = await drive(router, [(7, "warm")])
            home = answers[0].choices[0].message.content.split()[0]
            fleet[home].fail(500)
            answers, _ = await drive(router, [(7, "again")])
            assert answers[0].choices[0].message.content.split()[0] != home
            assert len(fleet[home].records) == 1 + 1  # the warm-up, then one failed attempt
            await settle(strategy)

    asyncio.run(main())


def test_retries_try_every_deployment_before_a_failed_one_again(fleet):
    async def main() -> None:
        with installed(fleet, router={"num_retries": 5, "allowed_fails": 100}) as (router, _):
            for u in fleet.upstreams:
                u.fail(500)
            with pytest.raises(litellm.InternalServerError):
                await drive(router, [(7, "again")])
            tries = sorted(len(u.records) for u in fleet.upstreams)
            assert sum(tries) == 6 and tries[0] >= 1  # 4 first tries on 4 upstreams, 2 repeats

    asyncio.run(main())


def test_a_sync_retry_goes_to_another_deployment_than_the_failed_one(fleet):
    """Router.completion (no per-attempt hooks) under LiteLLM's defaults: the retry leaves the
    deployment that failed, as LiteLLM's own pick does."""
    with installed(fleet) as (router, _):

        def ask(question: str) -> str:
            answer = router.completion(model="base-model", messages=chat(7, question))
            return answer.choices[0].message.content.split()[0]

        home = ask("warm")
        fleet[home].fail(500)
        elsewhere = ask("again")
        assert elsewhere != home
        assert len(fleet[home].records) == 1 + 1  # the warm-up, then one failed attempt
        fleet[home].fail(500, times=0)
        router.health().cooldowns.add_deployment_to_cooldown(elsewhere, RuntimeError(), 500, 60)
        assert ask("home again") == home  # another call: the earlier failure is not its own


def test_a_failure_is_avoided_by_its_own_calls_retries_only(fleet):
    """A metadata dict the caller passes to every call collects every call's attempt tokens: a
    failure in one call must not steer the next call away from that deployment."""

    async def main() -> None:
        meta: dict = {}
        with installed(fleet) as (router, strategy):

            async def ask(question: str) -> str:
                answer = await router.acompletion(
                    model="base-model", messages=chat(7, question), metadata=meta
                )
                return answer.choices[0].message.content.split()[0]

            home = await ask("warm")
            fleet[home].fail(500, times=1)
            elsewhere = await ask("fails once at home")
            assert elsewhere != home and len(fleet[home].records) == 2
            cooldowns = router.health().cooldowns
            cooldowns.add_deployment_to_cooldown(elsewhere, RuntimeError(), 500, 60)
            assert await ask("home again") == home  # tenant 7's cache, not avoided
            await settle(strategy)

    asyncio.run(main())


def test_sync_calls_send_the_endpoints_cache_salt(fleet):
    with installed(fleet, endpoints={"ep-acme": {"pool_size": 1}}) as (router, strategy):
        for i in range(3):
            router.completion(
                model="base-model",
                messages=chat(i, "sync"),
                metadata={"kvroute_endpoint": "ep-acme"},
            )
        salt = strategy.routers["base-model"].endpoint_salt("ep-acme")
        salts = [r.get("cache_salt") for r in fleet.records()]
        assert salt and salts == [salt] * 3


def test_sync_calls_with_every_deployment_cooling_raise_litellms_error(fleet):
    with installed(fleet, router={"num_retries": 0}) as (router, _):
        for u in fleet.upstreams:
            router.health().cooldowns.add_deployment_to_cooldown(u.name, RuntimeError("x"), 500, 60)
        errors = []
        for call in (
            lambda: router.completion(model="base-model", messages=chat(0, "c")),
            lambda: asyncio.run(router.acompletion(model="base-model", messages=chat(0, "c"))),
        ):
            with pytest.raises(RouterRateLimitError) as caught:
                call()
            errors.append(str(caught.value))
        assert errors[0] == errors[1]  # the sync path raises what the async one does
        assert fleet.records() == []


def test_responses_input_items_are_routed_not_refused(fleet):
    """A body kvroute cannot render (a Responses ``input`` of items) is routed on load alone: the
    call reaches a deployment and is answered there."""

    async def main() -> None:
        with installed(fleet, router={"num_retries": 0}) as (router, strategy):
            for item in (
                {"role": "user", "content": "hi there"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
            ):
                picked = await strategy.async_get_available_deployment(
                    "base-model", None, [item], False, {"input": [item]}
                )
                assert picked["model_info"]["id"] in strategy.routers["base-model"].workers
                answer = await router.aresponses(model="base-model", input=[item])
                assert answer.output[0].content[0].text.startswith("up-")
            await settle(strategy)

    asyncio.run(main())


def test_weights_send_standby_deployments_nothing_as_litellm_does(fleet):
    """LiteLLM's simple-shuffle (the reference, same run): once a deployment has a positive
    ``weight``, those with weight 0 or none get no traffic while a weighted one is a candidate."""
    weights = {"up-0": 0, "up-1": None, "up-2": 2, "up-3": 1}
    deployments = model_list(fleet)
    for d in deployments:
        if weights[d["model_info"]["id"]] is not None:
            d["litellm_params"]["weight"] = weights[d["model_info"]["id"]]

    async def served(with_kv: bool) -> set[str]:
        fresh(fleet)
        router = litellm.Router(model_list=deployments, num_retries=0)
        strategy = KvRouteStrategy(router).install() if with_kv else None
        try:
            answers, _ = await drive(router, [(t, "q") for t in range(16)])
            if strategy is not None:
                await settle(strategy)
                assert sorted(strategy.routers["base-model"].workers) == ["up-2", "up-3"]
                for w in ("up-2", "up-3"):  # every weighted one cooling: a standby serves
                    router.health().cooldowns.add_deployment_to_cooldown(w, RuntimeError(), 500, 60)
                answers += (await drive(router, [(0, "standby")]))[0]
                assert answers[-1].choices[0].message.content.split()[0] in ("up-0", "up-1")
                answers.pop()
            return {a.choices[0].message.content.split()[0] for a in answers}
        finally:
            if strategy is not None:
                strategy.close()

    assert asyncio.run(served(False)) <= {"up-2", "up-3"}  # the reference reads weights so
    assert asyncio.run(served(True)) == {"up-2", "up-3"}


def test_an_alias_shares_its_groups_router(fleet):
    async def main() -> None:
        with installed(fleet, router={"model_group_alias": {"alias": "base-model"}}) as (
            router,
            strategy,
        ):
            first = await router.acompletion(model="base-model", messages=chat(0, "a"))
            again = await router.acompletion(model="alias", messages=chat(0, "b"))
            assert list(strategy.routers) == ["base-model"]
            served = [r.choices[0].message.content.split()[0] for r in (first, again)]
            assert served[0] == served[1]  # the alias's call found tenant 0's cache
            assert again.usage.prompt_tokens_details.cached_tokens > 0
            await settle(strategy)

    asyncio.run(main())


def test_an_endpoints_pool_grows_with_its_group(fleet):
    """pool_size 2 with one deployment, then four: the pool is what a kvroute Router that had the
    four from the start forms (the reference)."""
    from litellm.router_api import ChangeSet

    async def main() -> None:
        fresh(fleet)
        deployments = model_list(fleet)
        router = litellm.Router(model_list=deployments[:1], num_retries=0)
        strategy = KvRouteStrategy(router, endpoints={"ep-acme": {"pool_size": 2}}).install()
        md = {"kvroute_endpoint": "ep-acme"}
        try:
            await router.acompletion(model="base-model", messages=chat(0, "a"), metadata=md)
            assert strategy.routers["base-model"].endpoint_pool("ep-acme") == ["up-0"]
            router.apply(ChangeSet(upsert=[Deployment(**d) for d in deployments[1:]]))
            await router.acompletion(model="base-model", messages=chat(0, "b"), metadata=md)
            reference = Router([u.name for u in fleet.upstreams])
            reference.add_endpoint("ep-acme", pool_size=2)
            pool = strategy.routers["base-model"].endpoint_pool("ep-acme")
            assert sorted(pool) == sorted(reference.endpoint_pool("ep-acme"))
            await settle(strategy)
        finally:
            strategy.close()

    asyncio.run(main())


def test_an_endpoint_that_does_not_fit_is_logged_and_left_out(fleet, caplog):
    """An endpoint whose reservation fits no deployment's modelled cache is left out with an
    error logged (as the Ray adapter does), not raised into every LiteLLM call: calls without it
    are served, and one naming it fails as for an unknown endpoint."""
    endpoints = {"big": {"pool_size": 1, "reserved_blocks": 100}, "ep": {"pool_size": 1}}

    async def main() -> None:
        with (
            caplog.at_level("WARNING", logger="kvroute.integrations.litellm"),
            installed(fleet, endpoints=endpoints, capacity_blocks=64) as (router, strategy),
        ):
            reply = await router.acompletion(model="base-model", messages=chat(0, "a"))
            assert reply.choices[0].message.content
            kv = strategy.routers["base-model"]
            assert "big" not in kv.endpoints and "ep" in kv.endpoints
            md = {"kvroute_endpoint": "ep"}
            await router.acompletion(model="base-model", messages=chat(1, "b"), metadata=md)
            await settle(strategy)

    asyncio.run(main())
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert [m for m in errors if m.startswith("endpoint big is left out")] == [errors[0]]
