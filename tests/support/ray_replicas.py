"""A Ray Serve deployment that models an LLM engine's prefix cache, for the KvRequestRouter tests.

Each replica holds a ``kvroute.BlockCache`` over 16-token blocks of the byte-level routing
tokens, rendered by ``gateway_upstream``'s reference rendering (written from the documentation of
``kvroute.gateway.prompt``, independently of the router's code). A request's full blocks are
matched (``cached_tokens`` = matched blocks × 16, at most the blocks before the prompt's last
token), inserted, and the uncached tokens are "prefilled" by sleeping ``prefill_s`` per token; the
answer is an OpenAI-style body with ``usage``. A replica that receives the message ``SICK``
publishes ``{"healthy": False}`` from then on (``record_routing_stats``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvroute import BlockCache, BlockHasher
from ray import serve

from support.gateway_upstream import BLOCK, reference_render, reference_tokens

SICK = "kvroute-test: report yourself unhealthy"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4)
class CacheReplica:
    def __init__(self, capacity: int, prefill_s: float) -> None:
        self.cache = BlockCache(capacity)
        self.prefill_s = prefill_s
        self.name = serve.get_replica_context().replica_id.unique_id
        self.stats: dict[str, Any] = {}

    async def __call__(self, body: Any) -> dict[str, Any]:
        messages = body["messages"] if isinstance(body, dict) else body.messages
        if messages[-1]["content"] == SICK:
            self.stats = {"healthy": False}
        tokens = reference_tokens(reference_render(messages))
        hashes = BlockHasher(BLOCK).hash(tokens)
        matched = self.cache.match(hashes)
        self.cache.insert(hashes)
        cached = min(matched, max(len(tokens) - 1, 0) // BLOCK) * BLOCK
        await asyncio.sleep((len(tokens) - cached) * self.prefill_s)
        usage = {"prompt_tokens": len(tokens), "prompt_tokens_details": {"cached_tokens": cached}}
        return {"replica": self.name, "usage": usage}

    def record_routing_stats(self) -> dict[str, Any]:
        return self.stats
