"""The cost per request of ``kvroute serve`` against the gateways users would pick instead.

Side by side in one run, on 127.0.0.1, in front of the same two upstreams
(``benches/gateway_load.py``: canned OpenAI-compatible answers, so the upstreams cost next to
nothing): ``kvroute serve`` (``kv_aware`` routing, an endpoint with its key, its salted pool and
its usage fields), LiteLLM's proxy (``litellm --config``, simple shuffle) and SMG, SGLang's Rust
gateway (``smg launch --policy cache_aware``). ``make bench`` installs both (SMG with the ``bench``
extra, LiteLLM's proxy into ``.venv-litellm``); a peer that is not installed is reported as
missing, and the comparison needs both.

For each gateway: ``REQUESTS`` non-streamed chat requests (a ~2,000-character system prompt and a
different question each) at concurrency ``CONCURRENCY`` from a lean asyncio client, after a
warm-up. Measured: wall time (throughput) and the CPU time of the gateway's process tree (user +
system, from /proc) per request. Each gateway is pinned to one core (``taskset -c 1``) when the
machine has two or more, the upstreams and the client to another, so CPU per request is the cost
of the gateway alone and ``1 / CPU per request`` its throughput per core.

Run: ``make bench`` or ``pytest -q -s benches/bench_gateway.py``; the summary prints each
peer's CPU per request and throughput against kvroute's. Knobs: ``KVROUTE_BENCH_REQUESTS``,
``KVROUTE_BENCH_CONCURRENCY``, ``KVROUTE_BENCH_UPSTREAM=test`` (the tests' upstreams,
``tests/support/gateway_upstream.py``, which model a prefix cache per request, instead of the
lean canned ones).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from gateway_load import load  # noqa: E402

REQUESTS = int(os.environ.get("KVROUTE_BENCH_REQUESTS", "2000"))
CONCURRENCY = int(os.environ.get("KVROUTE_BENCH_CONCURRENCY", "16"))
WARMUP = 200
UPSTREAM = os.environ.get("KVROUTE_BENCH_UPSTREAM", "lean")  # or "test"
LITELLM_KEY = "sk-" + os.urandom(32).hex()  # LiteLLM's proxy refuses to start without one
SYSTEM = "You are the support assistant of ACME Rockets. " + " ".join(
    f"Rule {i}: rockets of model R{i} take mixture M{i % 7}." for i in range(40)
)


def _bodies(n: int, model: str, prefix: str) -> list[bytes]:
    return [
        json.dumps(
            {
                "model": model,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {
                        "role": "user",
                        "content": f"{prefix} question {i}: which mixture for R{i % 40}?",
                    },
                ],
                "max_tokens": 16,
            }
        ).encode()
        for i in range(n)
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(cpu: int) -> list[str]:
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        return ["taskset", "-c", str(cpu)]
    return []


def _tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo.extend(c for c, parent in parents.items() if parent == p)
    return total


def _wait_up(url: str, proc: subprocess.Popen, what: str, headers=None, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, trust_env=False, timeout=2, headers=headers).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up at {url}")


def _answers_chat(port: int, path: str, model: str, auth: dict, timeout: float = 60.0) -> bool:
    """Whether the gateway on ``port`` answers a chat request 200 within ``timeout`` seconds
    (ready means that: SMG registers its workers after it listens)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            body = _bodies(1, model, "ready")
            _, ready = asyncio.run(load("127.0.0.1", port, path, body, 1, auth))
        except OSError:  # refused or reset: not listening yet (or for a moment again)
            ready = {}
        if set(ready) == {200}:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def test_waiting_for_a_gateway_outlasts_a_refused_port():
    """A port nobody listens on (as SMG's, for a moment while it starts) is not ready yet: the
    wait goes on to its deadline instead of failing the benchmark with ConnectionRefusedError."""
    assert not _answers_chat(_free_port(), "/v1/chat/completions", "m", {}, timeout=1.0)


@pytest.fixture(scope="module")
def upstreams():
    if UPSTREAM == "test":  # the tests' upstreams: a prefix-cache model per request (slower)
        script = [str(HERE.parent / "tests" / "support" / "gateway_upstream.py"), "2"]
    else:
        script = [str(HERE / "gateway_load.py"), "upstream", "2"]
    proc = subprocess.Popen(
        [*_pin(0), sys.executable, *script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield [f"http://127.0.0.1:{p}" for p in json.loads(proc.stdout.readline())]
    finally:
        proc.stdin.close()
        proc.wait(10)


def _kvroute(urls: list[str], port: int, tmp: Path) -> tuple[list[str], str, dict, str]:
    from support.gateway_fleet import toml_text

    config = {
        "gateway": {"models": ["m"], "max_attempts": 2, "admin_api_keys": ["sk-admin"]},
        "router": {"policy": "kv_aware", "block_size": 16},
        "workers": [{"name": f"w-{i}", "url": url, "kind": "vllm"} for i, url in enumerate(urls)],
        "endpoints": [{"id": "ep-bench", "model": "m", "pool_size": 2, "api_keys": ["sk-bench"]}],
    }
    path = tmp / "kvroute.toml"
    path.write_text(toml_text(config))
    cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)]
    cmd += ["--port", str(port), "--log-level", "warning"]
    return cmd, "/health", {"authorization": "Bearer sk-bench"}, "ep-bench"


def _litellm(urls: list[str], port: int, tmp: Path) -> tuple[list[str], str, dict, str]:
    # `make bench` installs the proxy into its own venv (see the Makefile: LITELLM_VENV).
    own = HERE.parent / ".venv-litellm" / "bin" / "litellm"
    exe = str(own) if own.exists() else shutil.which("litellm")
    if exe is None:
        pytest.skip("LiteLLM's proxy is a bench peer: `make bench` installs it (.venv-litellm)")
    deployments = "\n".join(
        f"  - model_name: m\n    litellm_params:\n      model: openai/m\n"
        f"      api_base: {url}/v1\n      api_key: x\n"
        for url in urls
    )
    path = tmp / "litellm.yaml"
    path.write_text(
        f"model_list:\n{deployments}"
        "litellm_settings:\n  drop_params: true\n  set_verbose: false\n"
        "router_settings:\n  routing_strategy: simple-shuffle\n"
        f"general_settings:\n  master_key: {LITELLM_KEY}\n"
    )
    cmd = [exe, "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--num_workers", "1"]
    return cmd, "/health/liveliness", {"authorization": f"Bearer {LITELLM_KEY}"}, "m"


def _smg(urls: list[str], port: int, tmp: Path) -> tuple[list[str], str, dict, str]:
    exe = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    if not Path(exe).exists():
        pytest.skip("SMG is a bench peer: pip install 'kvroute[bench]'")
    cmd = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    cmd += ["--policy", "cache_aware", "--log-level", "warn"]
    cmd += ["--prometheus-port", str(_free_port()), "--prometheus-host", "127.0.0.1"]
    return cmd, "/health", {}, "m"


GATEWAYS = {"kvroute": _kvroute, "litellm": _litellm, "smg": _smg}


@pytest.mark.parametrize("impl", list(GATEWAYS))
def test_gateway_cost_per_request(benchmark, upstreams, tmp_path, impl):
    port = _free_port()
    cmd, health, headers, model = GATEWAYS[impl](upstreams, port, tmp_path)
    env = {**os.environ, "LITELLM_LOG": "ERROR", "NO_PROXY": "*"}
    proc = subprocess.Popen(
        [*_pin(1), *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    try:
        _wait_up(f"http://127.0.0.1:{port}{health}", proc, impl, headers)
        auth = {k: v for k, v in headers.items() if k == "authorization"}
        path = "/v1/chat/completions"
        assert _answers_chat(port, path, model, auth), f"{impl} answered no chat request"
        warm = _bodies(WARMUP, model, "warm")
        _, statuses = asyncio.run(load("127.0.0.1", port, path, warm, CONCURRENCY, auth))
        assert set(statuses) == {200}, statuses
        bodies = _bodies(REQUESTS, model, "measured")
        result = {}
        benchmark.group = (
            f"gateway: {REQUESTS} chat requests, concurrency {CONCURRENCY}, {UPSTREAM} upstreams"
        )

        def run() -> None:
            cpu0 = _tree_cpu(proc.pid)
            seconds, statuses = asyncio.run(
                load("127.0.0.1", port, path, bodies, CONCURRENCY, auth)
            )
            result.update(seconds=seconds, statuses=statuses, cpu=_tree_cpu(proc.pid) - cpu0)

        benchmark.pedantic(run, rounds=1, iterations=1)
        assert result["statuses"] == {200: REQUESTS}, result["statuses"]
        cpu = result["cpu"] / REQUESTS
        benchmark.extra_info.update(
            impl=impl,
            ops=REQUESTS,
            cpu_s_per_op=cpu,
            requests_per_s=REQUESTS / result["seconds"],
            requests_per_cpu_s=1 / cpu if cpu else float("inf"),
        )
        print(
            f"\n{impl}: {REQUESTS / result['seconds']:,.0f} req/s, gateway CPU "
            f"{cpu * 1e3:.3f} ms/request ({1 / cpu if cpu else float('inf'):,.0f} req/s per core)"
        )
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
