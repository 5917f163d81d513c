"""``kvroute serve`` in front of the e2e engines: a TOML config written per scenario, the gateway
run as a subprocess on 127.0.0.1 and always stopped, and the request helpers the scenarios use."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from engines import Engine, free_port, tied_to_us

#: The admin key of the gateways the e2e run starts (``/health`` details, ``/metrics``).
ADMIN_KEY = "sk-e2e-admin"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def config_text(
    engines: list[Engine],
    *,
    port: int,
    model_dir: str,
    policy: str = "kv_aware",
    index: str = "events",
    mode: str = "direct",
    hash_algo: str = "sha256",
    endpoints: tuple[str | dict[str, Any], ...] = (),
    roles: dict[str, str] | None = None,
    pd: dict[str, Any] | None = None,
    router_block_size: int | None = None,
) -> str:
    """The gateway's TOML for one scenario: events (direct/rehash) or approx index; ``roles``
    (worker name to role) and ``pd`` (the ``[pd]`` table) for a prefill/decode fleet. The
    router's block size is the engines' unless ``router_block_size`` says otherwise.
    ``endpoints``: ids (pools of one) or ``[[endpoints]]`` tables (``model`` is added)."""
    block_size = router_block_size or engines[0].block_size
    direct = index == "events" and mode == "direct"
    router: dict[str, Any] = {
        "policy": policy,
        "block_size": block_size,
        "hash_profile": "vllm" if direct else "native",
        "index": index,
    }
    options: dict[str, Any] = {"seed": 7}
    if direct:
        options["hash_algo"] = hash_algo
    if index == "approx":
        options["capacity_blocks"] = engines[0].num_blocks
    lines = [
        "[gateway]",
        'host = "127.0.0.1"',
        f"port = {port}",
        'models = ["tiny"]',
        "max_attempts = 3",
        "connect_timeout = 2.0",
        "read_timeout = 120.0",
        "health_interval = 0.5",
        "eject_seconds = 1.0",
        "eject_after = 1",
        f"admin_api_keys = [{_toml(ADMIN_KEY)}]",  # /health's worker and event details
        "",
        "[router]",
        *(f"{k} = {_toml(v)}" for k, v in router.items()),
        f"options = {_toml(options)}",
        "",
        "[tokenizer]",
        f"model_dir = {_toml(model_dir)}",
        "",
    ]
    if index == "events":
        lines += ["[events]", f"mode = {_toml(mode)}", ""]
    if pd is not None:
        lines += ["[pd]", *(f"{k} = {_toml(v)}" for k, v in pd.items()), ""]
    for e in engines:
        lines += [
            "[[workers]]",
            f"name = {_toml(e.name)}",
            f"url = {_toml(e.url)}",
            'kind = "vllm"',
        ]
        if roles and e.name in roles:
            lines.append(f"role = {_toml(roles[e.name])}")
        if index == "events":
            lines += [
                f"kv_events = {_toml(e.events)}",
                f"kv_replay = {_toml(e.replay)}",
                f"kv_events_bind = {_toml(e.subscriber_binds)}",
            ]
        lines.append("")
    for ep in endpoints:  # an id (a pool of one), or the table's keys
        table = {"id": ep, "pool_size": 1} if isinstance(ep, str) else ep
        lines += ["[[endpoints]]", 'model = "tiny"']
        lines += [*(f"{k} = {_toml(v)}" for k, v in table.items()), ""]
    return "\n".join(lines)


@dataclass
class Gateway:
    """``kvroute serve`` as a subprocess (its log in ``root``)."""

    root: Path
    config: str
    name: str = "gateway"
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{self.name}.toml"
        path.write_text(self.config)
        log = open(self.root / f"{self.name}.log", "wb")
        self.proc = subprocess.Popen(
            tied_to_us([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)]),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gateway not ready:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        p = self.root / f"{self.name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else ""

    def health(self) -> dict[str, Any]:
        """``/health`` with the worker and KV-event details (the admin key's view)."""
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.get(self.url + "/health", timeout=5.0, headers=headers).json()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_gateway(root: Path, name: str, engines: list[Engine], **kw: Any) -> Gateway:
    port = free_port()
    g = Gateway(root, config_text(engines, port=port, **kw), name=name, port=port)
    g.start()
    return g


@dataclass
class Result:
    """One request's outcome as the client saw it."""

    status: int
    worker: str | None
    predicted: int | None
    cached: int | None
    prompt: int | None
    ttft: float | None
    elapsed: float
    error: str | None = None


def send(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> Result:
    """A non-streamed request; the prediction from the routing headers, the truth from usage."""
    t0 = time.perf_counter()
    try:
        r = client.post(url + path, json=body)
    except httpx.HTTPError as e:
        return Result(0, None, None, None, None, None, time.perf_counter() - t0, repr(e))
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        return Result(r.status_code, None, None, None, None, None, elapsed, r.text[:300])
    usage = r.json().get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    predicted = r.headers.get("x-kvroute-cached-tokens")
    return Result(
        200,
        r.headers.get("x-kvroute-worker"),
        None if predicted is None else int(predicted),
        details.get("cached_tokens"),
        usage.get("prompt_tokens"),
        None,
        elapsed,
    )


def send_stream(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> Result:
    """A streamed request: time to the first generated token and the final usage chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    try:
        with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return Result(r.status_code, None, None, None, None, None, 0.0, r.text[:300])
            worker = r.headers.get("x-kvroute-worker")
            predicted = r.headers.get("x-kvroute-cached-tokens")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as e:
        return Result(0, None, None, None, None, None, time.perf_counter() - t0, repr(e))
    details = usage.get("prompt_tokens_details") or {}
    return Result(
        200,
        worker,
        None if predicted is None else int(predicted),
        details.get("cached_tokens"),
        usage.get("prompt_tokens"),
        ttft,
        time.perf_counter() - t0,
    )
