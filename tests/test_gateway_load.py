"""Load: 2,000 requests from 64 concurrent OpenAI clients through `kvroute serve`.

Three processes on 127.0.0.1: four test upstreams (``support/gateway_upstream.py``), the gateway
started with the real command line (``python -m kvroute.cli serve --config ...``), and this test
as the caller (``openai.AsyncOpenAI``). Every request carries a unique ``x-request-id``; each
upstream records the ids it served and echoes the id in its answer. Asserted: no request lost
(every call answered 200 with its own id), none duplicated (every id served exactly once across
the fleet), none misrouted within its endpoint (the answer comes from the worker the gateway
named). A quarter of the requests stream.

Timing is measured, never asserted: the same workload is sent straight to the upstreams first,
then through the gateway, and the difference of the latency percentiles (the gateway's overhead
at this concurrency) is printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from support.gateway_fleet import toml_text

HERE = Path(__file__).parent
REQUESTS = int(os.environ.get("KVROUTE_LOAD_REQUESTS", "2000"))
CLIENTS = 64
UPSTREAMS = 4
ENDPOINTS = 8
WARMUP = 64
UNLOADED = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, trust_env=False, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def _system(ep: int) -> str:
    return f"Endpoint {ep} instructions. " + " ".join(
        f"Clause {ep}.{i}: answer in style S{(ep * 7 + i) % 11}." for i in range(60)
    )


def _workload(prefix: str) -> list[dict]:
    """Request specs: endpoint, id, messages, streaming flag."""
    out = []
    for i in range(REQUESTS):
        ep = (i * 5 + i // 7) % ENDPOINTS
        out.append(
            {
                "ep": ep,
                "id": f"{prefix}-{i:05d}",
                "stream": i % 4 == 3,
                "messages": [
                    {"role": "system", "content": _system(ep)},
                    {"role": "user", "content": f"Question number {i} for endpoint {ep}?"},
                ],
            }
        )
    return out


async def _call(client, model: str, spec: dict) -> tuple[str, str | None]:
    """One call; returns (answer text, the worker named by the gateway's header)."""
    headers = {"x-request-id": spec["id"]}
    if spec["stream"]:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=spec["messages"], stream=True, extra_headers=headers
        )
        text = ""
        async for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text, raw.headers.get("x-kvroute-worker")
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=spec["messages"], extra_headers=headers
    )
    return raw.parse().choices[0].message.content, raw.headers.get("x-kvroute-worker")


async def _run(
    specs: list[dict], clients: dict[int, object], model_of, concurrency: int = CLIENTS
) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    latencies: list[float] = []
    answers: dict[str, tuple[str, str | None]] = {}
    failures: list[tuple[str, str]] = []

    async def worker() -> None:
        while True:
            try:
                spec = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            try:
                answers[spec["id"]] = await _call(clients[spec["ep"]], model_of(spec), spec)
            except Exception as e:  # recorded: a lost request fails the test below
                failures.append((spec["id"], repr(e)))
                continue
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {
        "latencies": latencies,
        "answers": answers,
        "failures": failures,
        "seconds": time.perf_counter() - t0,
    }


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    up = subprocess.Popen(
        [sys.executable, str(HERE / "support" / "gateway_upstream.py"), str(UPSTREAMS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    gw = None
    try:
        ports = json.loads(up.stdout.readline())
        config = {
            "gateway": {"max_attempts": 2, "admin_api_keys": ["sk-admin"]},
            "router": {"policy": "kv_aware", "block_size": 16},
            "workers": [
                {"name": f"up-{i}", "url": f"http://127.0.0.1:{p}", "kind": "vllm"}
                for i, p in enumerate(ports)
            ],
            "endpoints": [
                {"id": f"ep-{e}", "model": "m", "pool_size": 1 + e % 2, "api_keys": [f"sk-{e}"]}
                for e in range(ENDPOINTS)
            ],
        }
        path = tmp_path_factory.mktemp("gw") / "gateway.toml"
        path.write_text(toml_text(config))
        port = _free_port()
        gw = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvroute.cli",
                "serve",
                "--config",
                str(path),
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
        )
        url = f"http://127.0.0.1:{port}"
        _wait_up(url + "/health", gw)
        yield {
            "gateway": url,
            "gateway_pid": gw.pid,
            "upstreams": [f"http://127.0.0.1:{p}" for p in ports],
        }
    finally:
        if gw is not None:
            gw.terminate()
            gw.wait(20)
        up.stdin.close()
        up.wait(20)


def test_load_no_request_lost_or_duplicated(servers):
    async def main():
        direct_clients = {
            e: openai.AsyncOpenAI(
                base_url=servers["upstreams"][e % UPSTREAMS] + "/v1",
                api_key="x",
                max_retries=0,
                timeout=60,
            )
            for e in range(ENDPOINTS)
        }
        gw_clients = {
            e: openai.AsyncOpenAI(
                base_url=servers["gateway"] + "/v1", api_key=f"sk-{e}", max_retries=0, timeout=60
            )
            for e in range(ENDPOINTS)
        }
        warm = _workload("warm")[:WARMUP]
        await _run(warm, direct_clients, lambda s: "m")
        await _run(warm, gw_clients, lambda s: f"ep-{s['ep']}")
        # Unloaded: one client, one request at a time.
        alone = _workload("alone")[:UNLOADED]
        direct1 = await _run(alone, direct_clients, lambda s: "m", concurrency=1)
        via1 = await _run(alone, gw_clients, lambda s: f"ep-{s['ep']}", concurrency=1)
        direct = await _run(_workload("direct"), direct_clients, lambda s: "m")
        cpu0 = _cpu_seconds(servers["gateway_pid"])
        via = await _run(_workload("gw"), gw_clients, lambda s: f"ep-{s['ep']}")
        cpu1 = _cpu_seconds(servers["gateway_pid"])
        via["cpu"] = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        for c in (*direct_clients.values(), *gw_clients.values()):
            await c.close()
        return direct, via, direct1, via1

    direct, via, direct1, via1 = asyncio.run(main())
    assert not direct["failures"]
    assert not via["failures"], via["failures"][:5]

    # Nothing lost, every answer the caller's own, from the worker the gateway named.
    specs = _workload("gw")
    assert len(via["answers"]) == REQUESTS
    for spec in specs:
        text, worker = via["answers"][spec["id"]]
        assert text.startswith(f"{worker} {spec['id']}")

    # Nothing duplicated: every id was served exactly once across the fleet.
    served: Counter[str] = Counter()
    for url in servers["upstreams"]:
        for r in httpx.get(url + "/_test/records", trust_env=False).json()["records"]:
            if r["id"].startswith("gw-"):
                served[r["id"]] += 1
    assert set(served) == {s["id"] for s in specs}
    assert set(served.values()) == {1}

    metrics = httpx.get(
        servers["gateway"] + "/metrics",
        headers={"authorization": "Bearer sk-admin"},
        trust_env=False,
    ).text
    assert "kvroute_gateway_retries_total 0" in metrics
    assert all(
        line.endswith(" 0")
        for line in metrics.splitlines()
        if line.startswith("kvroute_gateway_in_flight{")
    )

    assert not direct1["failures"] and not via1["failures"]

    def table(title: str, a: dict, b: dict, n: int) -> None:
        rates = f"direct {n / a['seconds']:.0f} req/s, via gateway {n / b['seconds']:.0f} req/s"
        print(f"{title}; {rates}")
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            x, y = _pct(a["latencies"], q) * 1e3, _pct(b["latencies"], q) * 1e3
            print(
                f"  {name}: direct {x:7.2f} ms  via gateway {y:7.2f} ms  overhead {y - x:7.2f} ms"
            )

    print()
    title = f"load: {REQUESTS} requests, {CLIENTS} concurrent clients, {UPSTREAMS} upstreams"
    table(title, direct, via, REQUESTS)
    if via["cpu"] is not None:
        print(f"  gateway CPU: {via['cpu'] / REQUESTS * 1e3:.2f} ms per request")
    table(f"unloaded: {UNLOADED} requests, one at a time", direct1, via1, UNLOADED)
