"""Load from the engines: their Prometheus ``/metrics``, read into ``Router.set_load``.

A replica's router counts the requests it began itself (and, with replica sync, the others'
as they announce them). The engine knows its whole load. :class:`EngineScraper` reads every
``vllm`` and ``sglang`` worker's ``GET /metrics`` every ``interval`` seconds and gives the router
the engine's figures, which it keeps as a baseline for its own changes until the next scrape
(``Router.set_load``: what the router does not account for itself is the others' load):

- ``active`` = running + waiting requests: vLLM ``vllm:num_requests_running`` +
  ``vllm:num_requests_waiting``; SGLang ``sglang:num_running_reqs`` + ``sglang:num_queue_reqs``;
  ``queued`` = the waiting ones.
- ``decode_blocks`` = the KV the running requests hold, in the router's blocks: vLLM
  ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before 0.10) × the cache's
  tokens (``vllm:cache_config_info``'s ``num_gpu_blocks`` × ``block_size`` labels); SGLang
  ``sglang:num_used_tokens`` (else ``sglang:token_usage`` × ``sglang:max_total_num_tokens``).
- ``prefill_blocks`` = waiting requests × their mean uncached prompt, in blocks: the mean prompt
  from vLLM's ``vllm:request_prompt_tokens`` histogram (``_sum``/``_count``), less the prefix
  cache's hit ratio (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``); SGLang's
  ``sglang:prompt_tokens_total`` / ``sglang:num_requests_total`` less ``sglang:cache_hit_rate``.
- ``block_size`` = the engine's KV block size (vLLM's ``cache_config_info`` label), given to
  ``Router.set_engine_block_size``: the router counts the worker's cached prefixes in whole
  engine blocks, as the engine serves them. One that differs from the router's is logged once
  per worker (info when a multiple of the router's, which is then exact; else a warning: the
  count is rounded down to router blocks). vLLM >= 0.34 uses 64-token blocks on GPU by default,
  16 before; in events mode the engine's stores may be skipped (``kvroute.events`` says which).

A figure an engine does not publish is left as it was (``None``); series with several label sets
(data-parallel engines) are summed. A scrape that fails or times out changes nothing and is
counted (``kvroute_cluster_scrapes_total{worker,outcome}``). ``openai`` workers are not scraped.
The text is parsed by ``prometheus_client``'s parser (the ``cluster`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvroute.server.metrics import Counter, Registry
from kvroute.server.tasks import cancel_tasks

__all__ = ["EngineLoad", "EngineScraper", "parse_engine_metrics"]

log = logging.getLogger("kvroute.cluster")

SCRAPED_KINDS = ("vllm", "sglang")


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load, in the router's blocks (None: not published by the engine)."""

    active: int | None
    queued: int | None
    prefill_blocks: int | None
    decode_blocks: int | None
    #: The engine's KV block size in tokens (None: not published, or engines that disagree).
    block_size: int | None = None


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if math.isfinite(s.value):
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _sum(samples: dict[str, list[tuple[dict[str, str], float]]], *names: str) -> float | None:
    """The sum over label sets of the first of ``names`` published."""
    for name in names:
        rows = samples.get(name)
        if rows:
            return sum(v for _, v in rows)
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def parse_engine_metrics(text: str, kind: str, block_size: int) -> EngineLoad:
    """The load figures of a vLLM or SGLang ``/metrics`` page (see the module docs)."""
    s = _samples(text)
    if kind == "vllm":
        running = _sum(s, "vllm:num_requests_running")
        waiting = _sum(s, "vllm:num_requests_waiting")
        usage = _sum(s, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
        capacity = 0.0
        sizes = set()
        for labels, _ in s.get("vllm:cache_config_info", []):
            with contextlib.suppress(KeyError, ValueError):
                size = float(labels["block_size"])
                sizes.add(int(size) if size.is_integer() and size >= 1 else None)
                # A CPU engine (or one still sizing its cache) may give no GPU block count.
                capacity += float(labels["num_gpu_blocks"]) * size
        engine_block_size = sizes.pop() if len(sizes) == 1 else None
        used = usage * capacity if usage is not None and capacity else None
        if usage is not None and len(s.get("vllm:cache_config_info", [])) > 1:
            used = None  # usage is a per-engine fraction: only meaningful for one engine
        mean_prompt = _ratio(
            _sum(s, "vllm:request_prompt_tokens_sum"), _sum(s, "vllm:request_prompt_tokens_count")
        )
        hit = _ratio(
            _sum(s, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
            _sum(s, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        )
    elif kind == "sglang":
        running = _sum(s, "sglang:num_running_reqs")
        waiting = _sum(s, "sglang:num_queue_reqs")
        used = _sum(s, "sglang:num_used_tokens")
        if used is None:
            usage = _sum(s, "sglang:token_usage")
            total = _sum(s, "sglang:max_total_num_tokens")
            used = usage * total if usage is not None and total is not None else None
        mean_prompt = _ratio(
            _sum(s, "sglang:prompt_tokens_total"), _sum(s, "sglang:num_requests_total")
        )
        hit = _sum(s, "sglang:cache_hit_rate")
        engine_block_size = None
    else:
        raise ValueError(f"cannot read the load of a {kind!r} worker (vllm or sglang)")
    active = None if running is None and waiting is None else (running or 0) + (waiting or 0)
    prefill = None
    if waiting is not None and mean_prompt is not None:
        miss = 1.0 - min(max(hit or 0.0, 0.0), 1.0)
        prefill = waiting * mean_prompt * miss / block_size
    return EngineLoad(
        active=None if active is None else round(active),
        queued=None if waiting is None else round(waiting),
        prefill_blocks=None if prefill is None else round(prefill),
        decode_blocks=None if used is None else round(used / block_size),
        block_size=engine_block_size,
    )


class EngineScraper:
    """Reads every vLLM / SGLang worker's ``/metrics`` into ``router.set_load`` (module docs).

    ``workers``: ``(name, base url, kind, bearer key or None)``; workers of other kinds are
    skipped. Runs on the caller's event loop with its own ``httpx.AsyncClient``.
    """

    def __init__(
        self,
        router: Any,
        workers: Iterable[tuple[str, str, str, str | None]],
        *,
        interval: float,
        timeout: float,
        registry: Registry | None = None,
    ) -> None:
        self.router = router
        self.workers = [w for w in workers if w[2] in SCRAPED_KINDS]
        self.interval = interval
        self.timeout = timeout
        self.block_size = int(router.block_size)
        self.last: dict[str, EngineLoad] = {}
        self._sizes_told: dict[str, int] = {}  # worker -> the engine block size last logged
        self.outcomes = (registry or Registry()).add(
            Counter(
                "kvroute_cluster_scrapes_total",
                "Engine /metrics scrapes by outcome (ok, error).",
                ("worker", "outcome"),
            )
        )
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._started = False

    def set_workers(self, workers: Iterable[tuple[str, str, str, str | None]]) -> None:
        """Scrapes these workers from the next round on (a server whose fleet changes); the
        last figures of the workers gone, or now at another address (a new engine under the
        name), are forgotten."""
        before = {w[0]: w[1] for w in self.workers}
        self.workers = [w for w in workers if w[2] in SCRAPED_KINDS]
        same = {w[0] for w in self.workers if before.get(w[0]) == w[1]}
        self.last = {n: load for n, load in self.last.items() if n in same}
        self._sizes_told = {n: size for n, size in self._sizes_told.items() if n in same}
        if self._started:
            self._ensure_task()

    def start(self) -> None:
        """Scrapes every ``interval`` seconds in the background (once there are workers)."""
        self._started = True
        self._ensure_task()

    def _ensure_task(self) -> None:
        if self._task is None and self.workers and self.interval > 0:
            import httpx

            self._client = httpx.AsyncClient(timeout=self.timeout, trust_env=False)
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        self._started = False
        task, self._task = self._task, None
        await cancel_tasks(task)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _loop(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.interval)

    async def scrape_all(self) -> None:
        """One round: every worker at once; each result applied as it comes."""
        await asyncio.gather(*(self._scrape(*w) for w in self.workers))

    async def _scrape(self, name: str, url: str, kind: str, key: str | None) -> None:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            resp = await self._client.get(url + "/metrics", headers=headers)
            resp.raise_for_status()
            load = parse_engine_metrics(resp.text, kind, self.block_size)
            self.router.set_load(
                name,
                active=load.active,
                queued=load.queued,
                prefill_blocks=load.prefill_blocks,
                decode_blocks=load.decode_blocks,
            )
        except Exception as e:  # an engine's failure never reaches the request path
            self.outcomes.inc(name, "error")
            log.debug("scrape of %s failed: %s", name, e)
            return
        self.last[name] = load
        self.outcomes.inc(name, "ok")
        engine = load.block_size
        if engine is None:
            return
        with contextlib.suppress(KeyError):  # the worker left the router meanwhile
            self.router.set_engine_block_size(name, engine)
        if engine != self.block_size and self._sizes_told.get(name) != engine:
            self._sizes_told[name] = engine
            exact = engine % self.block_size == 0
            (log.info if exact else log.warning)(
                "worker %s: the engine's KV blocks are %d tokens and the router's %d: the router "
                "counts this worker's cached prefixes in whole engine blocks%s. Set the router's "
                "block_size to %d to index the engine's own blocks (vLLM >= 0.34 defaults to 64 "
                "on GPU).",
                name,
                engine,
                self.block_size,
                "" if exact else ", rounded down to its own",
                engine,
            )

    def describe(self) -> dict[str, Any]:
        """The last figures read per worker (``/health``)."""
        return {
            name: {
                "active": load.active,
                "queued": load.queued,
                "prefill_blocks": load.prefill_blocks,
                "decode_blocks": load.decode_blocks,
                "block_size": load.block_size,
            }
            for name, load in self.last.items()
        }
