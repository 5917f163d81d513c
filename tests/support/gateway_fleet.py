"""Fixtures' machinery for the gateway tests: a fleet of test upstreams, a gateway over it (both
under uvicorn on 127.0.0.1, ephemeral ports) and the official OpenAI client pointed at it."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
from kvroute.gateway import Gateway, parse_config
from kvroute.gateway.listener import uvicorn_config
from prometheus_client import parser as prometheus_parser

from support.gateway_upstream import ServerThread, Upstream
from support.helpers import wait_for

ADMIN_KEY = "sk-admin"

LONG_SYSTEM = "You are the support assistant of ACME Rockets. Policy handbook follows. " + " ".join(
    f"Rule {i}: rockets of model R{i} must be fuelled with mixture M{i % 7}." for i in range(120)
)


class Fleet:
    """``n`` upstreams named up-0 … up-(n-1), each in its own uvicorn thread."""

    def __init__(self, n: int, factory: Any = Upstream, **upstream: Any) -> None:
        self.upstreams = [factory(f"up-{i}", **upstream) for i in range(n)]
        self.servers: list[ServerThread | None] = [ServerThread(u.app) for u in self.upstreams]
        self.ports = [s.port for s in self.servers if s is not None]

    def __getitem__(self, name: str) -> Upstream:
        return self.upstreams[int(name.rsplit("-", 1)[1])]

    def stop(self, name: str) -> None:
        i = int(name.rsplit("-", 1)[1])
        server = self.servers[i]
        if server is not None:
            server.stop()
            self.servers[i] = None

    def start(self, name: str) -> None:
        """(Re)starts an upstream on its port with a fresh engine state (empty cache)."""
        i = int(name.rsplit("-", 1)[1])
        self.stop(name)
        self.upstreams[i].reset()
        self.servers[i] = ServerThread(self.upstreams[i].app, port=self.ports[i])

    def close(self) -> None:
        for u in self.upstreams:
            self.stop(u.name)

    def records(self) -> list[dict[str, Any]]:
        """Every upstream's records, in arrival order."""
        return sorted((r for u in self.upstreams for r in u.records), key=lambda r: r["seq"])


def config_dict(fleet: Fleet, **sections: Any) -> dict[str, Any]:
    """A gateway config over ``fleet``; keyword sections override/extend the defaults."""
    gateway = {
        "models": ["base-model"],
        "connect_timeout": 1.0,
        "read_timeout": 10.0,
        "health_interval": 0.05,
        "eject_seconds": 0.2,
        "admin_api_keys": [ADMIN_KEY],
    }
    gateway.update(sections.pop("gateway", {}))
    data: dict[str, Any] = {
        "gateway": gateway,
        "router": {"policy": "kv_aware", "block_size": 16},
        "workers": [
            {"name": u.name, "url": f"http://127.0.0.1:{p}", "kind": "vllm"}
            for u, p in zip(fleet.upstreams, fleet.ports, strict=True)
        ],
        "endpoints": [
            {
                "id": "ep-acme",
                "model": "acme-model",
                "pool_size": 1,
                "api_keys": ["sk-acme"],
                "reserved_blocks": 256,
            },
            {"id": "ep-globex", "model": "globex-model", "pool_size": 2, "api_keys": ["sk-globex"]},
        ],
    }
    data.update(sections)
    return data


def wait_cluster(gw: GatewayServer, *shares: str) -> None:
    """The replica connected to NATS, and each of its ``shares`` (``limits``, ``responses``)."""
    wait_for(lambda: gw.get("/health").json()["cluster"]["connected"], "NATS")
    for part in shares:
        wait_for(
            lambda part=part: gw.get("/health").json()["cluster"][part]["connected"],
            f"{part} shared",
        )


class GatewayServer:
    """A ``Gateway`` served by uvicorn in a thread."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.gateway = g = Gateway(parse_config(config))
        uvicorn = uvicorn_config(
            g.app,
            g.guard,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = ServerThread(g.app, config=uvicorn)
        self.url = self.server.url

    def client(self, key: str | None = "sk-acme", **kw: Any) -> openai.OpenAI:
        """An OpenAI client with ``key`` as its bearer token (None: a key no endpoint accepts)."""
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=key or "unused", max_retries=0, timeout=20, **kw
        )

    def get(self, path: str, **kw: Any) -> httpx.Response:
        """``GET path``, with the admin key unless ``headers`` are given."""
        kw.setdefault("headers", {"authorization": f"Bearer {ADMIN_KEY}"})
        return httpx.get(self.url + path, timeout=10, trust_env=False, **kw)

    def metrics(self) -> str:
        return self.get("/metrics").text

    def wait_healthy(self, worker: str, healthy: bool = True, timeout: float = 10.0) -> None:
        wait_for(
            lambda: self.get("/health").json()["workers"][worker] is healthy,
            f"{worker} to become {'healthy' if healthy else 'ejected'}",
            timeout,
        )

    def active(self) -> dict[str, float]:
        """The router's count of begun-but-unfinished requests per worker."""
        router = self.gateway.router
        return {w: router.load(w)["active"] for w in router.workers}

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> GatewayServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def toml_text(config: dict[str, Any]) -> str:
    """A TOML document for a config dict (tables and arrays of tables one level deep)."""
    lines = []
    for key, value in config.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in value.items()]
        elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            for item in value:
                lines.append(f"[[{key}]]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in item.items()]
        else:
            lines.insert(0, f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def messages(question: str, system: str = LONG_SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus exposition, parsed by prometheus_client (the oracle of the
    text format): ``{(name, sorted label pairs): value}``."""
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def chat(client: openai.OpenAI, model: str, question: str, system: str = LONG_SYSTEM, **kw: Any):
    """One chat call; returns (parsed completion, response headers)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        **kw,
    )
    return raw.parse(), raw.headers


@contextlib.contextmanager
def cli_serve(config: dict[str, Any], tmp_path: Any) -> Iterator[tuple[str, list[bytes]]]:
    """``kvroute serve --config FILE`` in a subprocess, up and answering ``/health``: yields
    (its base URL, a list that receives its output once it has stopped). Stopped with SIGINT,
    which it must survive with exit status 0."""
    path = tmp_path / "gw.toml"
    path.write_text(toml_text(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", trust_env=False).is_success
        except httpx.HTTPError:
            return False

    output: list[bytes] = []
    try:
        wait_for(up, "kvroute serve", timeout=30)
        yield url, output
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        output.append(out)
    assert proc.returncode == 0, out.decode()


def closed_port() -> int:
    """A local port nobody listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def samples(gw: GatewayServer, name: str) -> dict[tuple, float]:
    """``{labels: value}`` of one gateway series (labels as sorted pairs), zero samples left out."""
    return {
        labels: v
        for (n, labels), v in metric_samples(gw.metrics()).items()
        if n == f"kvroute_gateway_{name}" and v
    }


def lines(caplog: Any, logger: str) -> list[str]:
    """The messages ``logger`` logged during the test (pytest's ``caplog``)."""
    return [r.getMessage() for r in caplog.records if r.name == logger]
