"""The gateway reads each engine's KV block size: a vLLM worker's from its ``/metrics`` (without
``[cluster]``, whose scraper reads it with the load), an SGLang worker's ``page_size`` from its
server info (always: SGLang's ``/metrics`` has none).

The router then counts the worker's cached prefix in whole engine blocks
(``Router.set_engine_block_size``; tests/test_router_engine_blocks.py checks the counting). The
engines here are Starlette apps: vLLM's serves its ``cache_config_info`` family (the page of
tests/test_cluster.py, vLLM's metric names and types), unavailable for its first reads as an
engine still loading its model is; SGLang's serves what its ``http_server.py`` answers on
``GET /server_info`` (and on ``/get_server_info``, its name before late 2025): its server
arguments as a dict (``dataclasses.asdict(server_args)``, ``page_size`` among them), the
scheduler's info, ``internal_states`` and ``version`` — behind its API key when it has one.
"""

from __future__ import annotations

import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
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


class SglangEngine:
    """SGLang's server info on ``paths`` (module docs), ``page_size`` = ``page`` (absent when
    ``...``), behind ``api_key``; 503 for its first ``unavailable`` reads."""

    def __init__(
        self,
        page: object,
        *,
        paths: tuple[str, ...] = ("/server_info", "/get_server_info"),
        api_key: str | None = None,
        unavailable: int = 0,
    ) -> None:
        self.reads: list[str] = []
        self.unavailable = unavailable
        args = {"model_path": "m", "tp_size": 1, "chunked_prefill_size": 8192}
        if page is not ...:
            args["page_size"] = page
        info = {
            **args,
            "max_total_num_tokens": 65536,
            "max_req_input_len": 8191,
            "internal_states": [{"last_gen_throughput": 0.0}],
            "version": "0.5.4",
        }

        async def server_info(request: Request) -> Response:
            self.reads.append(request.url.path)
            if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            if len(self.reads) <= self.unavailable:
                return JSONResponse({**info, "page_size": 999}, status_code=503)
            return JSONResponse(info)

        async def health(request: Request) -> Response:
            return Response()

        routes = [Route(p, server_info) for p in paths] + [Route("/health", health)]
        self.server = ServerThread(Starlette(routes=routes))


def config(engines: dict, keys: dict[str, str] | None = None, **router) -> dict:
    keys = keys or {}
    return {
        "gateway": {"models": ["m"], "health_interval": 0.05, "admin_api_keys": [ADMIN_KEY]},
        "router": {"block_size": 16, **router},
        "workers": [
            {"name": name, "url": e.server.url, "kind": kind}
            | ({"api_key": keys[name]} if name in keys else {})
            for name, (e, kind) in engines.items()
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


def test_each_sglang_workers_page_size_is_read_from_its_server_info():
    new = SglangEngine(64, unavailable=2)  # /server_info answers (SGLang since late 2025)
    old = SglangEngine(16, paths=("/get_server_info",))  # before: the new path is a 404
    keyed = SglangEngine(32, api_key="sk-engine")  # its key goes with the read
    tokens = SglangEngine(1)  # SGLang's default: token by token
    unset = SglangEngine(None)  # no usable size: read again, never taken
    absent = SglangEngine(...)
    flag = SglangEngine(True)  # a bool is no size (nor 0, nor a float: the router refuses them)
    engines = {"a": (new, "sglang"), "b": (old, "sglang"), "c": (keyed, "sglang")}
    engines |= {"d": (tokens, "sglang"), "e": (unset, "sglang"), "f": (absent, "sglang")}
    engines["g"] = (flag, "sglang")
    try:
        with GatewayServer(config(engines, {"c": "sk-engine"})) as gw:
            router = gw.gateway.router
            wait_for(lambda: router.engine_block_size("a") == 64, "a's page size", 10)
            # Refused (503) on both paths, then read on the new one.
            assert new.reads[:3] == ["/server_info", "/get_server_info", "/server_info"]
            wait_for(lambda: len(unset.reads) >= 3 and len(flag.reads) >= 3, "more reads", 10)
            sizes = gw.get("/health").json()["engine_block_sizes"]
            assert sizes == {"a": 64, "b": 16, "c": 32, "d": 1, "e": None, "f": None, "g": None}
            assert old.reads == ["/get_server_info"]  # after /server_info's 404
            reads = [len(e.reads) for e in (new, old, keyed, tokens)]
            time.sleep(0.3)
            assert [len(e.reads) for e in (new, old, keyed, tokens)] == reads  # known: left alone
            assert set(unset.reads) == {"/server_info"}  # an answer without a size ends a read
    finally:
        for e, _ in engines.values():
            e.server.stop()


def test_a_cluster_gateway_leaves_vllm_to_its_scraper_and_reads_sglang():
    """With ``[cluster]`` the scraper reads vLLM's block size with the load (test_cluster.py);
    SGLang's page size is in no metric, so the gateway still reads its server info."""
    from kvroute.gateway import Gateway, parse_config

    vllm, sglang = Engine(VLLM_METRICS), SglangEngine(64)
    try:
        data = config({"a": (vllm, "vllm"), "b": (sglang, "sglang")})
        assert Gateway(parse_config(data)).engine_sizes.names == ["a", "b"]
        data["cluster"] = {"nats": "nats://127.0.0.1:1"}  # not connected: never started
        assert Gateway(parse_config(data)).engine_sizes.names == ["b"]
    finally:
        vllm.server.stop()
        sglang.server.stop()
