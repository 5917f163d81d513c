"""``kvroute epp`` driven as Envoy drives it (``epp_client.EnvoyClient``), against test upstreams.

The reference for "the picked endpoint is kvroute's choice" is a second ``kvroute.Router`` of the
same configuration, fed what the picker is documented to feed it: the gateway's documented
rendering and byte-level tokens (re-implemented in ``gateway_upstream``), ``begin``, ``observe``
with the upstream's reported ``cached_tokens``, ``finish`` — its choice must be the pick, request by
request.
"""

from __future__ import annotations

import asyncio
import re
import signal
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvroute import Router
from kvroute.epp.picker import endpoint_key
from kvroute.epp.protocol import BODY_CHUNK
from prometheus_client.parser import text_string_to_metric_families
from support.epp_client import EnvoyClient, EppThread, epp_config
from support.gateway_fleet import LONG_SYSTEM, Fleet, toml_text, wait_for
from support.gateway_upstream import expected_cached, reference_render, reference_tokens
from support.helpers import free_ports


@pytest.fixture(scope="module")
def fleet():
    f = Fleet(4)
    yield f
    f.close()


@pytest.fixture
def fresh(fleet):
    for u in fleet.upstreams:
        u.reset()
    return fleet


def run(coro_fn: Any, port: int, **kw: Any) -> Any:
    async def main() -> Any:
        client = EnvoyClient(port, **kw)
        try:
            return await coro_fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


def chat(model: str, question: str, system: str = LONG_SYSTEM, **kw: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": model, "messages": messages, **kw}


def worker_of(epp: EppThread, address: str) -> str:
    return epp.server.picker.by_key[endpoint_key(address)].name


def record(fleet: Fleet, result: Any) -> dict[str, Any]:
    """The upstream record of the request ``result`` made (by its x-request-id)."""
    rid = result.upstream_headers["x-request-id"]
    return next(r for u in fleet.upstreams for r in u.records if r["id"] == rid)


def test_the_pick_is_the_routers_choice(fresh):
    config = epp_config(fresh, router={"policy": "kv_aware", "block_size": 16, "options": {}})
    reference = Router(
        [u.name for u in fresh.upstreams], policy="kv_aware", block_size=16, capacity_blocks=32768
    )
    systems = [LONG_SYSTEM, "Tenant B. " * 300, "Tenant C. " * 250]
    requests = [chat("base-model", f"q{i}", systems[i % 3]) for i in range(18)]

    async def body(client: EnvoyClient) -> list[Any]:
        return [await client.exchange(r) for r in requests]

    with EppThread(config) as epp:
        results = run(body, epp.port)
        for r, req in zip(results, requests, strict=True):
            assert r.status == 200
            tokens = np.asarray(reference_tokens(reference_render(req["messages"])), np.uint32)
            d = reference.route(tokens=tokens)
            picked = worker_of(epp, r.picked)
            assert picked == d.worker  # the pick is kvroute's choice …
            rid = r.upstream_headers["x-request-id"]
            upstream = next(
                rec for rec in fresh[picked].records if rec["id"] == rid
            )  # it served it
            reference.begin(d)
            reference.observe(d, upstream["cached_tokens"])
            reference.finish(d)
        # prefix affinity through the picker: every repeat of a tenant's prompt hit its cache
        hits = [rec["cached_tokens"] for u in fresh.upstreams for rec in u.records]
        assert sum(h > 0 for h in hits) == len(requests) - 3
        assert max(hits) == expected_cached(reference_render(requests[0]["messages"][:1]))
        assert epp.router.load(picked)["active"] == 0


def test_fallbacks_are_the_next_best_workers_that_take_the_same_request(fresh):
    """``epp.fallbacks = 1``: after the pick, the best other candidate by the reference router's
    scores (lower first, name on ties) among those the request prepared for the pick suits (up-3
    has its own API key: it takes none of the others' requests, nor they its), none outside the
    subset hint."""
    config = epp_config(fresh, epp={"fallbacks": 1})
    config["workers"][3]["api_key"] = "sk-up3"
    reference = Router(
        [u.name for u in fresh.upstreams], policy="kv_aware", block_size=16, capacity_blocks=32768
    )
    systems = [LONG_SYSTEM, "Tenant B. " * 300, "Tenant C. " * 250, "Tenant D. " * 280]
    requests = [chat("base-model", f"q{i}", systems[i % 4]) for i in range(12)]
    hinted = ["up-0", "up-2", "up-3"]

    with EppThread(config) as epp:
        names = {epp.address(n): n for n in epp.router.workers}

        async def body(client: EnvoyClient) -> list[Any]:
            out = []
            for i, r in enumerate(requests):
                subset = [epp.address(n) for n in hinted] if i >= 8 else None
                out.append(await client.exchange(r, subset=subset))
            return out

        results = run(body, epp.port)
        lists = []
        for i, (r, req) in enumerate(zip(results, requests, strict=True)):
            assert r.status == 200
            tokens = np.asarray(reference_tokens(reference_render(req["messages"])), np.uint32)
            allowed = hinted if i >= 8 else list(names.values())
            d = reference.route(tokens=tokens, exclude=set(names.values()) - set(allowed) or None)
            keyed = d.worker == "up-3"
            ranked = [n for _, n in sorted((s, n) for n, s in d.scores.items())]
            want = [n for n in ranked if n != d.worker and (n == "up-3") == keyed][:1]
            listed = [names[a] for a in r.picked.split(",")]
            assert listed == [d.worker, *want]
            lists.append(listed)
            upstream = record(fresh, r)
            reference.begin(d)
            reference.observe(d, upstream["cached_tokens"])
            reference.finish(d)
        # Both kinds of list were seen: with its fallback (of two or more eligible), and without
        # (up-3's: no other worker takes its request).
        assert {len(x) for x in lists} == {1, 2}
    refused = (
        "epp.fallbacks = 1 needs router.policy 'kv_aware' or 'least_loaded' (their scores rank "
        "every candidate), got 'hash'"
    )
    with pytest.raises(ValueError, match=re.escape(refused)):
        EppThread(epp_config(fresh, epp={"fallbacks": 1}, router={"policy": "hash"}))
    with pytest.raises(ValueError, match=re.escape("epp.fallbacks must be >= 0, got -1")):
        EppThread(epp_config(fresh, epp={"fallbacks": -1}))


def test_body_chunks_and_buffered_mode(fresh):
    question = "x" * (3 * BODY_CHUNK)  # streamed back in several chunks of <= 62,000 bytes

    async def body(client: EnvoyClient) -> Any:
        a = await client.exchange(chat("base-model", question))
        b = await client.exchange(chat("base-model", question), mode="buffered")
        return a, b

    with EppThread(epp_config(fresh)) as epp:
        a, b = run(body, epp.port, chunk=4096)
        assert a.status == b.status == 200
        assert a.upstream_body == b.upstream_body  # the caller's bytes, unchanged
        assert a.picked == b.picked  # the second request finds the first's prefix there


def test_subset_hint_is_obeyed(fresh):
    with EppThread(epp_config(fresh)) as epp:
        allowed = [epp.address("up-1"), epp.address("up-3")]

        async def body(client: EnvoyClient) -> Any:
            picks = []
            for i in range(12):
                hint: Any = allowed if i % 2 else ",".join(allowed)  # list, or one string
                r = await client.exchange(chat("base-model", f"q{i}", f"S{i}" * 200), subset=hint)
                assert r.status == 200
                picks.append(r.picked)
            unknown = await client.exchange(chat("base-model", "q"), subset=["127.0.0.2:1"])
            empty = await client.exchange(chat("base-model", "q"), subset=[])
            return picks, unknown, empty

        picks, unknown, empty = run(body, epp.port)
        assert set(picks) <= set(allowed) and len(set(picks)) == 2
        for r in (unknown, empty):
            assert r.status == 503 and r.json["error"]["code"] == "no_endpoint"
        # an endpoint's pool outside the hint: 503 as well, never a pick outside it
        pool = epp.router.endpoint_pool("ep-acme")
        outside = [a for n, a in ((n, epp.address(n)) for n in epp.router.workers) if n not in pool]

        async def endpoint(client: EnvoyClient) -> Any:
            return await client.exchange(
                chat("ep-acme", "q"), headers={"authorization": "Bearer sk-acme"}, subset=outside
            )

        r = run(endpoint, epp.port)
        assert r.status == 503


def test_503_when_no_worker_is_eligible(fresh):
    with EppThread(epp_config(fresh)) as epp:
        for w in epp.router.workers:
            epp.router.set_healthy(w, False)

        async def body(client: EnvoyClient) -> Any:
            return await client.exchange(chat("base-model", "q"))

        r = run(body, epp.port)
        assert r.status == 503 and r.json["error"]["code"] == "no_endpoint"
        assert "0 healthy" in r.json["error"]["message"]  # the router says why
        assert r.immediate.details == "kvroute_no_endpoint"
        epp.router.set_healthy("up-2", True)
        r = run(body, epp.port)
        assert r.status == 200 and r.picked == epp.address("up-2")


def test_429_sheds_only_sheddable_requests(fresh):
    config = epp_config(
        fresh,
        epp={
            "objectives": {"batch": -1, "chat": 5},
            "saturation_active": 1,
            "prefill_tokens_per_second": 1000.0,
        },
    )
    with EppThread(config) as epp:
        busy = [
            epp.router.route(
                tokens=np.arange(4, dtype=np.uint32),
                exclude=[w for w in epp.router.workers if w != n],
            )
            for n in epp.router.workers[:3]
        ]
        for d in busy:
            epp.router.begin(d)
        batch = {"x-gateway-inference-objective": "batch"}

        async def body(client: EnvoyClient) -> Any:
            free = await client.exchange(chat("base-model", "q"), headers=batch)
            return free

        free = run(body, epp.port)
        assert free.status == 200 and free.picked == epp.address("up-3")  # one worker left
        last = epp.router.route(
            tokens=np.arange(4, dtype=np.uint32), exclude=epp.router.workers[:3]
        )
        epp.router.begin(last)

        async def saturated(client: EnvoyClient) -> Any:
            shed = await client.exchange(chat("base-model", "q1"), headers=batch)
            kept = await client.exchange(
                chat("base-model", "q2"), headers={"x-gateway-inference-objective": "chat"}
            )
            plain = await client.exchange(chat("base-model", "q3"))
            return shed, kept, plain

        shed, kept, plain = run(saturated, epp.port)
        assert shed.status == 429 and shed.json["error"]["code"] == "shed"
        assert kept.status == 200 and plain.status == 200  # priority >= 0: never shed
        for d in [*busy, last]:
            epp.router.finish(d)

        # x-slo-ttft-ms: ~1,400 uncached routing tokens at 1,000 tokens/s is ~1.4 s
        async def slo(client: EnvoyClient) -> Any:
            tight = {**batch, "x-slo-ttft-ms": "200"}
            loose = {**batch, "x-slo-ttft-ms": "60000"}
            return (
                await client.exchange(
                    chat("base-model", "s1", "fresh prompt " * 400), headers=tight
                ),
                await client.exchange(
                    chat("base-model", "s2", "fresh prompt " * 400), headers=loose
                ),
                await client.exchange(
                    chat("base-model", "s3", "other prompt " * 400),
                    headers={"x-slo-ttft-ms": "200"},
                ),
            )

        tight, loose, protected = run(slo, epp.port)
        assert tight.status == 429 and tight.json["error"]["code"] == "slo"
        assert loose.status == 200 and protected.status == 200
        text = epp.metrics()
        assert 'kvroute_epp_rejected_total{status="429",code="shed"} 1' in text


def test_dedicated_endpoints_keys_and_rewritten_body(fresh):
    with EppThread(epp_config(fresh)) as epp:
        pool = epp.router.endpoint_pool("ep-globex")
        salt = epp.router.endpoint_salt("ep-globex")
        key = {"authorization": "Bearer sk-globex"}

        async def body(client: EnvoyClient) -> Any:
            by_model = await client.exchange(chat("ep-globex", "q", stream=True), headers=key)
            by_header = await client.exchange(
                chat("globex-model", "q2"), headers={**key, "x-kvroute-endpoint": "ep-globex"}
            )
            missing = await client.exchange(chat("ep-globex", "q"))
            wrong = await client.exchange(
                chat("ep-globex", "q"), headers={"authorization": "Bearer sk-acme"}
            )
            unknown = await client.exchange(chat("ep-nope", "q"), headers=key)
            bad_header = await client.exchange(
                chat("base-model", "q"), headers={"x-kvroute-endpoint": "base-model"}
            )
            return by_model, by_header, missing, wrong, unknown, bad_header

        by_model, by_header, missing, wrong, unknown, bad_header = run(body, epp.port)
        for r in (by_model, by_header):
            assert r.status == 200 and worker_of(epp, r.picked) in pool
            rec = record(fresh, r)
            assert rec["model"] == "globex-model" and rec["cache_salt"] == salt
            assert rec["authorization"] is None  # the caller's key never reaches the worker
        # the picker asked for the stream's usage, and removed that chunk again
        assert record(fresh, by_model)["stream_options"] == {"include_usage": True}
        assert b'"usage"' not in by_model.body and by_model.body.endswith(b"data: [DONE]\n\n")
        assert (missing.status, wrong.status, unknown.status, bad_header.status) == (
            401,
            404,
            404,
            404,
        )
        assert epp.metrics().count("kvroute_epp_cached_tokens_reported_total{") == 1


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(fresh):
    with EppThread(epp_config(fresh, epp={"max_body_bytes": 4096})) as epp:

        async def body(client: EnvoyClient) -> Any:
            out = {
                "json": await client.exchange(raw=b'{"model": "base-model", "messages": ['),
                "array": await client.exchange(raw=b"[1, 2]"),
                "messages": await client.exchange({"model": "base-model", "messages": "hi"}),
                "large": await client.exchange(chat("base-model", "y" * 5000, "short")),
            }
            out["ok"] = await client.exchange(chat("base-model", "fine", "short"))
            return out

        out = run(body, epp.port)
        assert (
            out["json"].status == 400 and "not valid JSON" in out["json"].json["error"]["message"]
        )
        assert out["array"].status == 400 and "JSON object" in out["array"].json["error"]["message"]
        assert (
            out["messages"].status == 400
            and "'messages' must be a list" in out["messages"].json["error"]["message"]
        )
        assert out["large"].status == 413
        assert out["ok"].status == 200

        # a stream that breaks the protocol: aborted, naming the fault; the next one is served
        async def broken(client: EnvoyClient) -> Any:
            from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

            call = client.stub.Process()
            await call.write(
                pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "before the request headers" in err.value.details()
            return await client.exchange(chat("base-model", "after", "short"))

        assert run(broken, epp.port).status == 200


def test_a_stream_closed_early_ends_the_requests_accounting(fresh):
    with EppThread(epp_config(fresh)) as epp:

        async def body(client: EnvoyClient) -> Any:
            picked = asyncio.Event()
            task = asyncio.ensure_future(
                client.exchange(chat("base-model", "q"), picked=picked, pause=asyncio.Event())
            )
            await picked.wait()
            active = sum(epp.router.load(w)["active"] for w in epp.router.workers)
            task.cancel()  # the client went away: Envoy resets the ext_proc stream
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if sum(epp.router.load(w)["active"] for w in epp.router.workers) == 0:
                    break
                await asyncio.sleep(0.01)
            return active, await client.exchange(chat("base-model", "again"))

        active, again = run(body, epp.port)
        assert active == 1
        assert sum(epp.router.load(w)["active"] for w in epp.router.workers) == 0
        assert again.status == 200
        assert 'kvroute_epp_stream_errors_total{kind="closed_early"} 1' in epp.metrics()


def test_served_elsewhere_moves_the_request(fresh):
    with EppThread(epp_config(fresh)) as epp:

        async def body(client: EnvoyClient) -> Any:
            first = await client.exchange(chat("base-model", "q"))
            other = next(
                epp.address(w) for w in epp.router.workers if epp.address(w) != first.picked
            )
            r = await client.exchange(chat("base-model", "q2"), served=other)
            return first, other, r

        first, other, r = run(body, epp.port)
        assert r.picked == first.picked and r.status == 200
        assert fresh[worker_of(epp, other)].ids[-1] == r.upstream_headers["x-request-id"]
        assert all(epp.router.load(w)["active"] == 0 for w in epp.router.workers)
        assert "kvroute_epp_served_elsewhere_total 1" in epp.metrics()


def test_thousand_concurrent_streams(fresh):
    n = 1000
    with EppThread(epp_config(fresh)) as epp:

        async def body(client: EnvoyClient) -> Any:
            pause = asyncio.Event()
            events = [asyncio.Event() for _ in range(n)]
            tasks = [
                asyncio.ensure_future(
                    client.exchange(
                        chat("base-model", f"q{i}", f"T{i % 50}" * 100), picked=e, pause=pause
                    )
                )
                for i, e in enumerate(events)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            open_streams = epp.server.service.streams
            active = sum(epp.router.load(w)["active"] for w in epp.router.workers)
            pause.set()
            results = await asyncio.gather(*tasks)
            return open_streams, active, results

        open_streams, active, results = run(body, epp.port)
        assert open_streams == n and active == n  # all open and picked at once
        assert all(r.status == 200 for r in results)
        served = sorted(rec["id"] for u in fresh.upstreams for rec in u.records)
        assert served == sorted(r.upstream_headers["x-request-id"] for r in results)
        assert sum(epp.router.load(w)["active"] for w in epp.router.workers) == 0
        assert epp.server.service.streams == 0


def test_health_services_and_metrics(fresh):
    with EppThread(epp_config(fresh)) as epp:

        async def body(client: EnvoyClient) -> Any:
            stub = health_pb2_grpc.HealthStub(client.channel)
            out = {}
            for name in (
                "liveness",
                "readiness",
                "envoy.service.ext_proc.v3.ExternalProcessor",
                "",
            ):
                out[name] = (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
            await client.exchange(chat("base-model", "q"))
            return out

        statuses = run(body, epp.port)
        assert set(statuses.values()) == {health_pb2.HealthCheckResponse.SERVING}
        families = {f.name: f for f in text_string_to_metric_families(epp.metrics())}
        assert families["kvroute_epp_requests"].samples[0].labels == {
            "model": "base-model",
            "status": "200",
        }
        assert "kvroute_epp_pick_duration_seconds" in families


def test_5xx_answers_eject_a_worker_until_its_health_endpoint_answers(fresh):
    with EppThread(epp_config(fresh, epp={"eject_after": 2})) as epp:
        bad = "up-1"
        fresh[bad].fail(500, times=2)
        fresh[bad].health_status = 503
        subset = [epp.address(bad)]

        async def body(client: EnvoyClient) -> Any:
            return [
                await client.exchange(chat("base-model", f"q{i}"), subset=subset) for i in range(3)
            ]

        first, second, third = run(body, epp.port)
        assert first.status == second.status == 500  # the worker's own answers pass through
        assert third.status == 503  # then it is out: nothing left in the subset
        assert not epp.router.is_healthy(bad)
        fresh[bad].health_status = 200
        wait_for(lambda: epp.router.is_healthy(bad), "the probe to readmit the worker")
        again = run(lambda c: c.exchange(chat("base-model", "q"), subset=subset), epp.port)
        assert again.status == 200 and again.picked == epp.address(bad)


def test_cli_validates_the_config_and_serves(fresh, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[epp]\nport = 1\nmodels = ["m"]\n[[workers]]\nname = "a"\nurl = "http://gpu-0:8000"\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "epp", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "must have an IP address as host" in out.stderr
    good = tmp_path / "good.toml"
    grpc_port, metrics_port = free_ports(2)
    good.write_text(
        toml_text(epp_config(fresh, epp={"port": grpc_port, "metrics_port": metrics_port}))
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "epp", "--config", str(good)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: _answers(metrics_port), "kvroute epp to serve", timeout=30)
        r = run(lambda c: c.exchange(chat("base-model", "q")), grpc_port)
        assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stdout.read() if proc.stdout else ""


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_requests_naming_no_model_are_direct_access(fresh):
    with EppThread(epp_config(fresh, epp={"api_keys": ["sk-direct"]})) as epp:

        async def body(client: EnvoyClient) -> Any:
            bare = await client.exchange(None, path="/v1/models")
            keyed = await client.exchange(
                None, path="/v1/models", headers={"authorization": "Bearer sk-direct"}
            )
            return bare, keyed

        bare, keyed = run(body, epp.port)
        assert bare.status == 401 and bare.json["error"]["code"] == "invalid_api_key"
        assert keyed.status == 200 and keyed.json["data"][0]["id"] == "m"
        assert "authorization" not in keyed.upstream_headers  # the caller's key stays here
        assert epp.router.load(worker_of(epp, keyed.picked))["active"] == 0


def test_subset_hint_entries_are_compared_as_addresses():
    """A subset hint names endpoints as the data plane spells them: an IPv6 address with or
    without brackets, in any valid spelling (RFC 5952's canonical one or not, any case), with a
    port or bare (every port of it). Each names the member at that address, as Python's
    ``ipaddress`` reads it; anything else names nothing."""
    from kvroute.epp.config import parse_config
    from kvroute.epp.picker import Picker

    workers = [("p0", "http://[fd00::1]:8000"), ("p1", "http://10.0.0.2:8000")]
    workers.append(("p2", "http://[fd00::1]:8001"))
    config = parse_config(
        {"workers": [{"name": n, "url": u, "kind": "vllm"} for n, u in workers], "epp": {}}
    )
    picker = Picker(config)
    cases = {
        "[fd00::1]:8000": {"p0"},
        "[fd00:0:0::1]:8000": {"p0"},
        "[FD00:0000::0001]:8000": {"p0"},
        "fd00::1": {"p0", "p2"},
        "[fd00::1]": {"p0", "p2"},
        "10.0.0.2": {"p1"},
        "10.0.0.2:8000": {"p1"},
        " 10.0.0.2:8000 ": {"p1"},
        "10.0.0.2:9": set(),
        "fd00::1:8000": set(),  # a bare IPv6 address: fd00::1:8000, not fd00::1 port 8000
        "[fd00::1": set(),
        "[fd00::1]x": set(),
        "10.0.0.2:http": set(),
        "pod-a:8000": set(),
    }
    for hint, want in cases.items():
        assert picker._allowed([hint]) == want, hint
    assert picker._allowed(["[fd00::1]:8001", "10.0.0.2"]) == {"p1", "p2"}
