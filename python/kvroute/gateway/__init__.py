"""``kvroute serve``: an OpenAI-compatible gateway that routes with ``kvroute.Router``.

``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` (streamed or not;
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` at the worker holding the
response: ``kvroute.gateway.responses_api``), ``GET /v1/models``, ``/health`` and ``/metrics``
(Prometheus; on the admin listener or behind an admin key), in front of a fleet of vLLM /
SGLang / other OpenAI-compatible servers named in a TOML file
(``kvroute.gateway.config``). Requests for an
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

Needs the ``gateway`` extra (``pip install 'kvroute[gateway]'``: starlette, uvicorn, httptools,
uvloop, and tomli before Python 3.11); an HF ``tokenizers`` file is optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import GatewayConfig, load_config, parse_config

if TYPE_CHECKING:
    from .app import Gateway

__all__ = ["Gateway", "GatewayConfig", "load_config", "parse_config", "serve"]


def __getattr__(name: str) -> Any:
    # The app needs the `gateway` extra (starlette, httpx); `kvroute.gateway.prompt` and `.config`
    # do not, so the integrations can render prompts without it.
    if name == "Gateway":
        from .app import Gateway

        return Gateway
    raise AttributeError(f"module 'kvroute.gateway' has no attribute {name!r}")


def serve(
    config: GatewayConfig | Gateway,
    *,
    host: str | None = None,
    port: int | None = None,
    access_log: bool = False,
    log_level: str = "info",
) -> None:
    """Runs the gateway (and its admin listener, with ``admin_port``) under uvicorn until
    interrupted: one process, one event loop (uvloop when installed)."""
    import asyncio
    import logging

    from .app import Gateway
    from .listener import raise_open_file_limit, run_servers, uvicorn_config

    gateway = config if isinstance(config, Gateway) else Gateway(config)
    s = gateway.config.server
    limit = raise_open_file_limit()
    upstream = sum(w.max_connections for w in gateway.config.workers)
    room = limit - upstream - 64  # the admin listener, event sockets, files
    if room < gateway.guard.max_connections:
        gateway.guard.max_connections = max(room, 16)
        logging.getLogger("kvroute.gateway").warning(
            "max_connections lowered to %d: the open-file limit is %d and the workers may take %d",
            gateway.guard.max_connections,
            limit,
            upstream,
        )
    common = {"access_log": access_log, "log_level": log_level}
    configs = [
        uvicorn_config(
            gateway.app,
            gateway.guard,
            host=host if host is not None else s.host,
            port=port if port is not None else s.port,
            lifespan="on",
            **common,
        )
    ]
    if s.admin_port is not None:
        configs.append(
            uvicorn_config(
                gateway.admin_app,
                None,
                host=s.admin_host,
                port=s.admin_port,
                lifespan="off",
                **common,
            )
        )
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(run_servers(configs))
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled once it has shut down
        pass
