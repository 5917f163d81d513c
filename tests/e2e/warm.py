"""A dedicated endpoint's shared prefix kept warm on its whole pool, checked on the engines.

Two chat requests of the endpoint share a system prompt; the gateway learns it and sends it to
each pool member as a 1-token completion of its token ids with the endpoint's ``cache_salt``
(``kvroute.gateway.warm``). The engines are the judges: each is then asked directly (not through
the gateway) for the prefix and a tail of its own, salted as the tenant's requests are, and must
report the prefix's whole blocks as cached — also the engine that served neither request, which
only the warm request can have filled. Under another salt the same prompt finds nothing cached
(the hits are the tenant's partition, not a shared one).
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any

import httpx
from engines import Engine
from gateway import ADMIN_KEY, start_gateway
from workload import system_prompt

ENDPOINT = "ep-warm"
SALT = "warm-salt"


def _cached(engine: Engine, tokens: list[int], salt: str) -> int | None:
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 1, "cache_salt": salt}
    r = httpx.post(engine.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    details = r.json().get("usage", {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def _warm_counts(url: str) -> dict[str, dict[str, float]]:
    page = httpx.get(
        url + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    ).text
    out: dict[str, dict[str, float]] = {}
    row = r'_warm_requests_total\{endpoint="[^"]*",worker="([^"]+)",result="(\w+)"\} (\S+)'
    for worker, result, value in re.findall(row, page):
        out.setdefault(worker, {})[result] = float(value)
    return out


def scenario_warm(tmp: Path, engines: list[Engine], model: str) -> dict[str, Any]:
    """Runs the check (module docs); ``ok`` and what it saw."""
    table = {
        "id": ENDPOINT,
        "pool_size": len(engines),
        "salt": SALT,
        "warm_interval": 2.0,
    }
    g = start_gateway(tmp, "warm", engines, model_dir=model, endpoints=(table,))
    try:
        system = system_prompt(random.Random(17), 400)
        served = []
        with httpx.Client(timeout=300) as client:
            for question in ("What is the first rule?", "Summarise the second part."):
                body = {
                    "model": ENDPOINT,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": 4,
                }
                r = client.post(g.url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                served.append(r.headers.get("x-kvroute-worker"))
            deadline = time.monotonic() + 120
            counts: dict[str, dict[str, float]] = {}
            while time.monotonic() < deadline:
                counts = _warm_counts(g.url)
                done = [w for w in counts if counts[w].get("hit", 0) + counts[w].get("filled", 0)]
                if len(done) == len(engines):
                    break
                time.sleep(0.5)
            warm = g.health().get("warm", {}).get(ENDPOINT, {})
            n = int(warm.get("prefix_tokens") or 0)
            tok = client.post(engines[0].url + "/tokenize", json={**body, "model": "tiny"})
            tok.raise_for_status()
            prefix = tok.json()["tokens"][:n]
        block = engines[0].block_size
        tail = [13, 14, 15, 16, 17, 18, 19, 20] * 5
        want = n // block * block
        cached = {e.name: _cached(e, prefix + tail, SALT) for e in engines}
        control = {e.name: _cached(e, prefix + tail, "another-salt") for e in engines}
        ok = (
            want >= 4 * block
            and all(c is not None and c >= want for c in cached.values())
            and all(c == 0 for c in control.values())
            and all("failed" not in counts.get(e.name, {}) for e in engines)
        )
        return {
            "ok": ok,
            "prefix_tokens": n,
            "served": served,
            "cached": cached,
            "other_salt_cached": control,
            "warm_requests": counts,
        }
    finally:
        g.stop()
