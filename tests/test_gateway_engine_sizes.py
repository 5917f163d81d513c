"""A gateway without ``[cluster]`` reads each vLLM worker's KV block size from its ``/metrics``.

The router then counts the worker's cached prefix in whole engine blocks
(``Router.set_engine_block_size``; tests/test_router_engine_blocks.py checks the counting). The
engine here is a Starlette app serving vLLM's ``cache_config_info`` family (the page of
tests/test_cluster.py, vLLM's metric names and types), unavailable for its first reads as an
engine still loading its model is.
"""

from __future__ import annotations

import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from support.gateway_fleet import ADMIN_KEY, GatewayServer
from support.gateway_upstream import ServerThread
from support.helpers import wait_for
from test_cluster import VLLM_METRICS


class Engine:
    """``/metrics`` (503 for its first ``unavailable`` reads, with a page whose block size is
    not the engine's: a refused read's body is not trusted) and ``/health``."""

    def __init__(self, page: str, unavailable: int = 0) -> None:
        self.page, self.unavailable, self.reads = page, unavailable, 0

        async def metrics(request: Request) -> Response:
            self.reads += 1
            if self.reads <= self.unavailable:
                return PlainTextResponse(VLLM_METRICS, status_code=503)
            return PlainTextResponse(self.page)

        async def health(request: Request) -> Response:
            return Response()

        self.server = ServerThread(
            Starlette(routes=[Route("/metrics", metrics), Route("/health", health)])
        )


def config(engines: dict[str, tuple[Engine, str]], **router) -> dict:
    return {
        "gateway": {"models": ["m"], "health_interval": 0.05, "admin_api_keys": [ADMIN_KEY]},
        "router": {"block_size": 16, **router},
        "workers": [
            {"name": name, "url": e.server.url, "kind": kind} for name, (e, kind) in engines.items()
        ],
    }


def test_each_vllm_workers_block_size_is_read_until_known_then_left_alone():
    starting = Engine(VLLM_METRICS.replace('block_size="32"', 'block_size="64"'), unavailable=3)
    ready = Engine(VLLM_METRICS)
    blank = Engine("")  # a vLLM worker whose page has no cache_config_info
    other = Engine(VLLM_METRICS)  # an OpenAI-compatible server: never read
    engines = {"a": (starting, "vllm"), "b": (ready, "vllm"), "c": (blank, "vllm")}
    engines["d"] = (other, "openai")
    try:
        with GatewayServer(config(engines)) as gw:
            router = gw.gateway.router
            wait_for(lambda: router.engine_block_size("a") == 64, "a's block size", 10)
            assert router.engine_block_size("b") == 32
            assert starting.reads == 4  # three refused, then read
            reads = (starting.reads, ready.reads)
            wait_for(lambda: blank.reads >= reads[0] + 3, "more reads of c's page", 10)
            time.sleep(0.2)
            assert (starting.reads, ready.reads) == reads  # known: never read again
            assert router.engine_block_size("c") is None and router.engine_block_size("d") is None
            assert other.reads == 0
            sizes = gw.get("/health").json()["engine_block_sizes"]
            assert sizes == {"a": 64, "b": 32, "c": None, "d": None}
    finally:
        for e, _ in engines.values():
            e.server.stop()


def test_a_cluster_gateway_leaves_the_reads_to_its_scraper():
    """With ``[cluster]`` the scraper reads the block size with the load (test_cluster.py)."""
    from kvroute.gateway import Gateway, parse_config

    engine = Engine(VLLM_METRICS)
    try:
        data = config({"a": (engine, "vllm")})
        assert Gateway(parse_config(data)).engine_sizes is not None
        data["cluster"] = {"nats": "nats://127.0.0.1:1"}  # not connected: never started
        assert Gateway(parse_config(data)).engine_sizes is None
    finally:
        engine.server.stop()
