"""The e2e prefill/decode pair: two vLLM engines joined by a KV connector behind ``kvroute serve``.

vLLM 0.32's CPU build can hand KV over between two engine processes with its shared-storage
``ExampleConnector`` (formerly ``SharedStorageConnector``): the prefill engine (``kv_producer``)
writes each prompt's KV, layer by layer, under a folder named by the hash of its tokens; the decode
engine (``kv_consumer``) finds that folder for the same prompt and loads the KV instead of
computing it. It returns no ``kv_transfer_params`` (the hand-over is out of band), so the gateway's
vLLM flow sends the decode request without them. Why not the other connectors: README, "Real
engines: make e2e".

``scenario_pd`` asserts what a client of a disaggregated fleet relies on, each against the engines'
own counters (``vllm:prompt_tokens_by_source``) rather than the gateway's word: one answer, equal
(greedy text and per-token log-probabilities) to an aggregated engine's for the same request; the
prefill engine computed the prompt; the decode engine received it from the connector and computed
at most the prompt's last, partial block; the router's predicted prefix hit on the prefill worker
equals the prefill engine's for a second request sharing the prefix.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
from engines import Engine, engine_options
from gateway import start_gateway
from workload import sentence, system_prompt

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: Largest difference allowed between the pair's and the aggregated engine's log-probabilities of
#: the same greedy tokens (float32 on CPU: the same KV, summed in another order).
LOGPROB_TOLERANCE = 1e-3


def pd_engines(args: Any, root: Path) -> tuple[Engine, Engine]:
    """The prefill (``p0``, KV events on ``ipc://``) and decode (``d0``, ``tcp://``) engines,
    joined by the ``ExampleConnector`` over one KV folder under ``root``."""
    store = root / "kv-store"
    store.mkdir(parents=True, exist_ok=True)

    def connector(role: str) -> dict[str, Any]:
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }

    common = engine_options(args)
    prefill = Engine("p0", root=root / "p0", kv_transfer=connector("kv_producer"), **common)
    decode = Engine(
        "d0",
        root=root / "d0",
        kv_transfer=connector("kv_consumer"),
        events_mode="tcp",
        int_hashes=False,
        **common,
    )
    return prefill, decode


def _sources(engine: Engine) -> dict[str, float]:
    return {s: engine.metric("vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}


def _delta(engine: Engine, before: dict[str, float], total: int) -> dict[str, int]:
    """The engine's prompt tokens by source since ``before``, once they add up to ``total``
    (the counters follow the answer by a moment)."""
    deadline = time.monotonic() + 10.0
    while True:
        now = _sources(engine)
        d = {s: int(now[s] - before[s]) for s in SOURCES}
        if sum(d.values()) >= total or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def _complete(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A text completion (streamed when ``body`` says so): status, routing headers, text, the
    per-token log-probabilities and usage."""
    out: dict[str, Any] = {"text": "", "logprobs": [], "usage": None}
    if body.get("stream"):
        body = {**body, "stream_options": {"include_usage": True}}
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            out["status"], out["headers"] = r.status_code, dict(r.headers)
            if r.status_code != 200:
                out["error"] = r.read().decode(errors="replace")[:300]
                return out
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    out["text"] += choice.get("text") or ""
                    out["logprobs"] += (choice.get("logprobs") or {}).get("token_logprobs") or []
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
        return out
    r = client.post(url + "/v1/completions", json=body)
    out["status"], out["headers"] = r.status_code, dict(r.headers)
    if r.status_code != 200:
        out["error"] = r.text[:300]
        return out
    reply = r.json()
    choice = reply["choices"][0]
    out["text"] = choice["text"]
    out["logprobs"] = (choice.get("logprobs") or {}).get("token_logprobs") or []
    out["usage"] = reply.get("usage")
    return out


def _bodies() -> list[dict[str, Any]]:
    """Two text completions sharing a long prefix, each with a long question of its own (so the
    router disaggregates both), greedy, with log-probabilities; the second one streamed."""
    rng = random.Random("pd")
    prefix = "P/D tenant. " + system_prompt(rng, 300)
    out = []
    for stream in (False, True):
        question = " ".join(sentence(rng, 15, 20) for _ in range(6))
        out.append(
            {
                "model": "tiny",
                "prompt": f"{prefix}\n\n{question}",
                "max_tokens": 16,
                "temperature": 0,
                "logprobs": 1,
                "stream": stream,
            }
        )
    return out


def scenario_pd(
    tmp: Path, prefill: Engine, decode: Engine, reference: Engine, args: Any
) -> dict[str, Any]:
    """Two requests through ``kvroute serve`` with ``[pd] protocol = "vllm"`` (see the module
    docs); ``reference`` is an aggregated engine (no connector) serving the same model."""
    bs = prefill.block_size
    bodies = _bodies()
    reference.reset_prefix_cache()
    with httpx.Client(timeout=300.0) as client:
        want = [_complete(client, reference.url, {**b, "stream": False}) for b in bodies]
    g = start_gateway(
        tmp,
        "pd",
        [prefill, decode],
        model_dir=args.model,
        index="events",
        mode="direct",
        hash_algo=prefill.hash_algo,
        roles={prefill.name: "prefill", decode.name: "decode"},
        pd={"protocol": "vllm", "threshold": bs},
    )
    requests: list[dict[str, Any]] = []
    try:
        with httpx.Client(timeout=300.0) as client:
            for body, ref in zip(bodies, want, strict=True):
                p0, d0 = _sources(prefill), _sources(decode)
                got = _complete(client, g.url, body)
                usage = got["usage"] or {}
                prompt = usage.get("prompt_tokens") or 0
                h = got["headers"]
                diff = max(
                    (abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"], strict=False)),
                    default=None,
                )
                requests.append(
                    {
                        "stream": body["stream"],
                        "status": got["status"],
                        "error": got.get("error"),
                        "prefill_worker": h.get("x-kvroute-prefill-worker"),
                        "decode_worker": h.get("x-kvroute-worker"),
                        "predicted_prefill_cached": int(h.get("x-kvroute-cached-tokens", -1)),
                        "prompt_tokens": prompt,
                        "client_cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens"
                        ),
                        "same_text": got["text"] == ref["text"],
                        "same_length": len(got["logprobs"]) == len(ref["logprobs"]) > 0,
                        "max_logprob_diff": diff,
                        # The engines' own counters for this request (prompt tokens by source).
                        "prefill_engine": _delta(prefill, p0, prompt),
                        "decode_engine": _delta(decode, d0, prompt),
                    }
                )
        events = g.health().get("events", {})
    finally:
        g.stop()
    checks = _checks(requests, bs)
    return {
        "ok": all(checks.values()),
        "connector": "ExampleConnector",
        "checks": checks,
        "requests": requests,
        "router_events_blocks": {w: (events.get(w) or {}).get("blocks") for w in events},
    }


def _checks(requests: list[dict[str, Any]], bs: int) -> dict[str, bool]:
    """What the client relies on, per request (see the module docs)."""
    ok = {
        "answered": all(r["status"] == 200 for r in requests),
        "disaggregated": all(
            (r["prefill_worker"], r["decode_worker"]) == ("p0", "d0") for r in requests
        ),
        "same_answer_as_aggregated": all(
            r["same_text"]
            and r["same_length"]
            and r["max_logprob_diff"] is not None
            and r["max_logprob_diff"] <= LOGPROB_TOLERANCE
            for r in requests
        ),
        # The prefill engine computed (or held) the whole prompt itself: nothing came from
        # the connector there.
        "prefill_ran_prompt": all(
            r["prefill_engine"]["local_compute"] > 0
            and r["prefill_engine"]["external_kv_transfer"] == 0
            and r["prefill_engine"]["local_compute"] + r["prefill_engine"]["local_cache_hit"]
            == r["prompt_tokens"]
            for r in requests
        ),
        # The decode engine got the prompt's KV from the connector and computed at most the
        # last partial block (+1: the connector keys a prompt by its first len-1 tokens).
        "decode_did_not_recompute": all(
            r["decode_engine"]["external_kv_transfer"] > 0
            and r["decode_engine"]["local_compute"] <= bs + 1
            and sum(r["decode_engine"].values()) == r["prompt_tokens"]
            for r in requests
        ),
        # The router's prefix hit on the prefill worker is the prefill engine's, and the second
        # request's shared prefix was a hit.
        "prediction_matches_prefill_engine": all(
            r["predicted_prefill_cached"] == r["prefill_engine"]["local_cache_hit"]
            for r in requests
        )
        and requests[-1]["predicted_prefill_cached"] > 0,
    }
    return ok
