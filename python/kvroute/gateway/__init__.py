"""``kvroute serve``: an OpenAI-compatible gateway that routes with ``kvroute.Router``.

``POST /v1/chat/completions`` and ``/v1/completions`` (streamed or not), ``GET /v1/models``,
``/health`` and ``/metrics`` (Prometheus), in front of a fleet of vLLM / SGLang / other
OpenAI-compatible servers named in a TOML file (``kvroute.gateway.config``). Requests for an
endpoint (``model: "ep-..."``) stay inside its sticky worker pool, behind its own API keys, with
its blocks (and, on vLLM/SGLang, the engine's cache) salted apart from every other tenant; the
upstream's reported ``cached_tokens`` feed back into the router. What the gateway guarantees —
failover, exactly-once load accounting, cancellation, limits — is stated in
``kvroute.gateway.app``; the routing-token rendering in ``kvroute.gateway.prompt``.

Upstream engines: vLLM reports ``cached_tokens`` with ``--enable-prompt-tokens-details``, SGLang
with ``--enable-cache-report``; without them the router runs on its own model uncorrected. For
``index = "events"``, give each worker the ZMQ endpoints its engine publishes KV events on (vLLM:
``--kv-events-config`` with ``enable_kv_cache_events``, ``publisher = "zmq"``, ``endpoint`` and
``replay_endpoint``) as ``kv_events`` / ``kv_replay``.

One gateway process holds one router. In approx mode the router's model of every worker's cache
lives in that process, so several gateway processes behind a load balancer each learn only their
own traffic; in events mode they all follow the engines' own reports and agree.

Needs the ``gateway`` extra (``pip install 'kvroute[gateway]'``: starlette, uvicorn, httpx, and
tomli before Python 3.11); an HF ``tokenizers`` file is optional.
"""

from __future__ import annotations

from .app import Gateway
from .config import GatewayConfig, load_config, parse_config

__all__ = ["Gateway", "GatewayConfig", "load_config", "parse_config", "serve"]


def serve(
    config: GatewayConfig | Gateway,
    *,
    host: str | None = None,
    port: int | None = None,
    access_log: bool = False,
    log_level: str = "info",
) -> None:
    """Runs the gateway under uvicorn until interrupted (one process, one event loop)."""
    import uvicorn

    gateway = config if isinstance(config, Gateway) else Gateway(config)
    server = gateway.config.server
    uvicorn.run(
        gateway.app,
        host=host if host is not None else server.host,
        port=port if port is not None else server.port,
        access_log=access_log,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=server.keep_alive_timeout,
    )
