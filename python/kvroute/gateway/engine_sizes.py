"""The engines' KV block sizes for the gateway, read from what each engine publishes.

A router counts each worker's cached prefix in whole blocks of its engine's size once it knows
that size (``Router.set_engine_block_size``); KV events teach it to an events-mode router, and
``[cluster]``'s scraper reads vLLM's with the load. :class:`EngineBlockSizes` reads the rest:
each ``vllm`` worker's ``vllm:cache_config_info`` (its ``block_size`` label, parsed as the scraper
parses it) when there is no ``[cluster]``, and each ``sglang`` worker's ``page_size`` (the unit
its radix cache matches and stores in), which SGLang's ``/metrics`` does not carry, from its
server info (``GET /server_info``; ``/get_server_info`` before SGLang renamed it, still read
when the new path fails). Reads go through the worker's connection pool (with its API key): at
start, then again while some worker's size is still unknown (an engine still starting answers
later) after ``interval`` seconds, twice that, … up to ``MAX_WAIT``, and never again for a worker
once known. A read that fails or finds no size changes nothing and is logged at debug; other
kinds publish no block size.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from typing import Any

from kvroute.server.tasks import cancel_tasks

log = logging.getLogger("kvroute.gateway")

#: The longest pause between two reads of a worker whose size is still unknown (seconds).
MAX_WAIT = 30.0

#: SGLang's server info, newest path first (the JSON of its server arguments, ``page_size`` too).
SGLANG_INFO_PATHS = ("/server_info", "/get_server_info")


class EngineBlockSizes:
    """Reads the block size of every worker in ``workers`` (name → kind) whose kind is in
    ``kinds`` into ``router`` (module docs); ``fetch(worker, path)`` returns a ``GET``'s 200 body
    or None."""

    def __init__(
        self,
        router: Any,
        workers: dict[str, str],
        fetch: Any,
        interval: float,
        kinds: tuple[str, ...] = ("vllm", "sglang"),
    ) -> None:
        self.router = router
        self.kinds = {name: kind for name, kind in workers.items() if kind in kinds}
        self.names = list(self.kinds)
        self.fetch = fetch
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if not self.names:
            return
        if "vllm" in self.kinds.values() and importlib.util.find_spec("prometheus_client") is None:
            log.info("the vLLM engines' block sizes are not read: install kvroute[gateway]")
            self.names = [n for n in self.names if self.kinds[n] != "vllm"]
            if not self.names:
                return
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_tasks(task)

    def unknown(self) -> list[str]:
        return [n for n in self.names if self.router.engine_block_size(n) is None]

    async def _loop(self) -> None:
        wait = self.interval
        while names := self.unknown():
            await asyncio.gather(*(self.read(n) for n in names))
            if self.unknown():
                await asyncio.sleep(wait)
                wait = min(2 * wait, MAX_WAIT)

    async def read(self, name: str) -> None:
        """One read of worker ``name``'s block size."""
        try:
            size = await (self._sglang(name) if self.kinds[name] == "sglang" else self._vllm(name))
            if size is not None:
                self.router.set_engine_block_size(name, size)
                log.info("worker %s: the engine's KV blocks are %d tokens", name, size)
        except Exception as e:  # an engine's failure never reaches the request path
            log.debug("reading the block size of %s failed: %s", name, e)

    async def _vllm(self, name: str) -> int | None:
        from kvroute.cluster.scrape import parse_engine_metrics

        body = await self.fetch(name, "/metrics")
        if body is None:
            return None
        return parse_engine_metrics(body.decode("utf-8", "replace"), "vllm", 1).block_size

    async def _sglang(self, name: str) -> Any:
        for path in SGLANG_INFO_PATHS:
            body = await self.fetch(name, path)
            if body is None:
                continue
            info = json.loads(body)
            page = info.get("page_size") if isinstance(info, dict) else None
            if page is None:
                log.debug("the server info of %s (%s) has no page_size", name, path)
            # Anything but a size (0, a bool, a float) is refused by the router, logged by `read`.
            return page
        return None
