"""A Ray Serve deployment that models an LLM engine's prefix cache, for the KvRequestRouter tests.

Each replica holds a ``kvroute.BlockCache`` over 16-token blocks of the byte-level routing
tokens, rendered by ``gateway_upstream``'s reference rendering (written from the documentation of
``kvroute.gateway.prompt``, independently of the router's code). A request's full blocks are
matched (``cached_tokens`` = matched blocks × 16, at most the blocks before the prompt's last
token), inserted, and the uncached tokens are "prefilled" by sleeping ``prefill_s`` per token, one
prefill at a time per replica (an engine's prefill compute is one resource: queued prefills wait);
the answer is an OpenAI-style body with ``usage``.

Test controls, by the last message's content: ``SICK`` makes the replica publish
``{"healthy": False}`` from then on (``record_routing_stats``); ``FAIL`` makes it raise
``ValueError``; ``HOLD + directory`` makes it write
a file named ``<replica>.<n>`` there, then hold the request until a file ``release`` appears there
(at most ``HOLD_S`` seconds) — a request known to be executing on a known replica.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

from kvroute import BlockCache, BlockHasher
from ray import serve

from support.gateway_upstream import BLOCK, reference_render, reference_tokens

SICK = "kvroute-test: report yourself unhealthy"
FAIL = "kvroute-test: raise"
HOLD = "kvroute-test: hold until released: "
HOLD_S = 120.0


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4)
class CacheReplica:
    def __init__(self, capacity: int, prefill_s: float) -> None:
        self.cache = BlockCache(capacity)
        self.prefill_s = prefill_s
        self.prefill = asyncio.Lock()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.stats: dict[str, Any] = {}
        self.holds = itertools.count()

    async def __call__(self, body: Any) -> dict[str, Any]:
        messages = body["messages"] if isinstance(body, dict) else body.messages
        last = messages[-1]["content"]
        if last == SICK:
            self.stats = {"healthy": False}
        if last == FAIL:
            raise ValueError(f"{self.name} was asked to fail")
        if last.startswith(HOLD):
            await self.hold(Path(last[len(HOLD) :]))
        tokens = reference_tokens(reference_render(messages))
        hashes = BlockHasher(BLOCK).hash(tokens)
        matched = self.cache.match(hashes)
        self.cache.insert(hashes)
        cached = min(matched, max(len(tokens) - 1, 0) // BLOCK) * BLOCK
        async with self.prefill:
            await asyncio.sleep((len(tokens) - cached) * self.prefill_s)
        usage = {"prompt_tokens": len(tokens), "prompt_tokens_details": {"cached_tokens": cached}}
        return {"replica": self.name, "usage": usage}

    async def hold(self, directory: Path) -> None:
        (directory / f"{self.name}.{next(self.holds)}").touch()
        for _ in range(int(HOLD_S / 0.02)):
            if (directory / "release").exists():
                return
            await asyncio.sleep(0.02)

    def record_routing_stats(self) -> dict[str, Any]:
        return self.stats


@serve.deployment(ray_actor_options={"num_cpus": 0})
class FanOut:
    """An ingress fanning out: one request's bodies are sent to the engine deployment in
    parallel, so Ray gives every call the request's internal_request_id."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def __call__(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self.engine.remote(body) for body in bodies)))
