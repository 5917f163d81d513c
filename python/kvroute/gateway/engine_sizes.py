"""The engines' KV block sizes for a gateway without ``[cluster]``, read from their ``/metrics``.

A router counts each worker's cached prefix in whole blocks of its engine's size once it knows
that size (``Router.set_engine_block_size``); KV events teach it to an events-mode router, and
``[cluster]``'s scraper reads it with the load. Without either — a lone gateway in approx mode,
the default — :class:`EngineBlockSizes` reads each ``vllm`` worker's ``vllm:cache_config_info``
(its ``block_size`` label; parsed as the scraper parses it) through the worker's connection pool:
at start, then again while some worker's size is still unknown (an engine still starting
answers later) after ``interval`` seconds, twice that, … up to ``MAX_WAIT``, and never again for
a worker once known. A read that fails or
finds no size changes nothing and is logged at debug; other kinds publish no block size.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from typing import Any

log = logging.getLogger("kvroute.gateway")

#: The longest pause between two reads of a worker whose size is still unknown (seconds).
MAX_WAIT = 30.0


class EngineBlockSizes:
    """Reads the block size of every ``vllm`` worker in ``workers`` (name → kind) into
    ``router`` (module docs); ``fetch(worker, path)`` returns a ``GET``'s 200 body or None."""

    def __init__(self, router: Any, workers: dict[str, str], fetch: Any, interval: float) -> None:
        self.router = router
        self.names = [name for name, kind in workers.items() if kind == "vllm"]
        self.fetch = fetch
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if not self.names:
            return
        if importlib.util.find_spec("prometheus_client") is None:
            log.info("the engines' block sizes are not read: install kvroute[gateway]")
            return
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

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
        from kvroute.cluster.scrape import parse_engine_metrics

        try:
            body = await self.fetch(name, "/metrics")
            if body is None:
                return
            load = parse_engine_metrics(body.decode("utf-8", "replace"), "vllm", 1)
            if load.block_size is not None:
                self.router.set_engine_block_size(name, load.block_size)
                log.info("worker %s: the engine's KV blocks are %d tokens", name, load.block_size)
        except Exception as e:  # an engine's failure never reaches the request path
            log.debug("reading the block size of %s failed: %s", name, e)
