"""Emulations of the routing policies of SGLang, Dynamo and llm-d, from their published formulas.

Each class is a simulator :class:`~kvroute.sim.engine.Policy` that decides exactly as the peer's
source says (``docs/peers.md`` gives the sources, versions, defaults and the mapping to block
space; nothing here is copied from them). The peers' own data structures are modelled with
kvroute's (``PrefixIndex`` for "who holds which prefix", ``BlockCache`` for an LRU of leaves), so
only their *decisions* are emulated, not their speed.

- :class:`SGLangCacheAware` — SGLang router ``cache_aware`` (sgl-model-gateway / smg): in-flight
  request counts; an approximate per-worker prefix tree fed only by its own decisions.
- :class:`DynamoKv` — Dynamo KV router (``dynamo-kv-router`` 1.6.1): exact overlap from KV events,
  prefill tokens in flight and active blocks; minimum cost.
- :class:`LlmdScheduler` — llm-d inference scheduler default profile: prefix-cache (approximate,
  per-worker hash LRU), KV-cache-utilisation and queue scorers weighted 3 : 2 : 2; maximum score.

Ties that the peers break at random are broken with a seeded ``random.Random`` (deterministic per
seed).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np

from kvroute import BlockCache, PrefixIndex

from .engine import Fleet, Policy, mirror_insert

__all__ = ["ActiveBlocks", "DynamoKv", "LlmdScheduler", "SGLangCacheAware"]


def _best(scores: list[float], best: float, rng: random.Random) -> int:
    """The worker whose score is ``best``; among several, one drawn with ``rng`` (the peers break
    ties at random)."""
    ties = [w for w, s in enumerate(scores) if s == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


# ---------------------------------------------------------------------------------------------
class SGLangCacheAware(Policy):
    """SGLang's ``cache_aware`` policy (docs/peers.md §1), with the Rust ``CacheAwareConfig``
    defaults the issue names: ``cache_threshold`` 0.5, ``balance_abs_threshold`` 32,
    ``balance_rel_threshold`` 1.1.

    Per request: ``load`` = in-flight requests per worker (routing to last token). If
    ``max − min > balance_abs`` and ``max > balance_rel × min`` the fleet is imbalanced and the
    least-loaded worker takes it. Otherwise the approximate tree is walked: ``matched`` = the
    longest prefix of the prompt held by *any* worker, ``match_rate = min(matched × B, isl) /
    isl``; above ``cache_threshold`` the request goes to the worker holding the deepest matched
    block (the one that most recently received it), else to the least-loaded worker. Least loaded
    breaks ties by fewest requests routed so far, then lowest index (smg). The prompt is then
    inserted into the tree under the chosen worker, in every case.

    The tree is per worker a ``BlockCache`` of ``max_tree_tokens // B`` blocks (LRU of leaves: a
    worker's least recently used leaves go first, as SGLang's eviction does) mirrored into one
    ``PrefixIndex`` for the walk. SGLang trims every ``eviction_interval`` (30 s) down to
    ``max_tree_size``; here the cache trims on insert, so the tree never exceeds the size (the
    same blocks leave, up to 30 s sooner). ``max_tree_tokens`` defaults to 2^24 tokens: the
    launcher's 2^26 characters at 4 characters per token (the Rust default of 10,000 characters,
    ~2,500 tokens, would leave SGLang almost no tree; docs/peers.md).
    """

    name = "sglang_cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.1,
        max_tree_tokens: int = 2**24,
    ) -> None:
        self.cache_threshold = float(cache_threshold)
        self.balance_abs = balance_abs_threshold
        self.balance_rel = float(balance_rel_threshold)
        self.max_tree_tokens = int(max_tree_tokens)

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        n = len(fleet.names)
        self.load = [0] * n
        self.routed = [0] * n
        self.index = PrefixIndex()
        blocks = max(1, self.max_tree_tokens // fleet.block_size)
        self.trees = [BlockCache(blocks) for _ in range(n)]
        self.last_holder: dict[int, int] = {}  # block hash -> worker that last received it
        self.isl = fleet.workload.input_tokens.tolist()

    def _least_loaded(self) -> int:
        load, routed = self.load, self.routed
        return min(range(len(load)), key=lambda w: (load[w], routed[w], w))

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        load = self.load
        lo, hi = min(load), max(load)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            w = self._least_loaded()
        else:
            matches = self.index.match(chain) if chain.shape[0] else {}
            deepest = max(matches.values(), default=0)
            isl = self.isl[request]
            if min(deepest * self.fleet.block_size, isl) / isl > self.cache_threshold:
                holders = [self.fleet.position[name] for name, m in matches.items() if m == deepest]
                w = self.last_holder.get(int(chain[deepest - 1]), -1)
                if w not in holders:
                    w = min(holders)
            else:
                w = self._least_loaded()
        if chain.shape[0]:
            stored, evicted = self.trees[w].insert(chain)
            mirror_insert(self.index, self.fleet.names[w], chain, stored, evicted)
            self.last_holder.update(dict.fromkeys(chain.tolist(), w))
        load[w] += 1
        self.routed[w] += 1
        return w

    def finished(self, request: int, worker: int, cached_tokens: int, now: float) -> None:
        self.load[worker] -= 1


# ---------------------------------------------------------------------------------------------
class ActiveBlocks:
    """Distinct prompt blocks of in-flight requests, per worker, with reference counts, mirrored
    into a ``PrefixIndex`` so that "deepest prefix of this prompt held by each worker's in-flight
    requests" is one index walk. Blocks with a reference form a prefix-closed set (a chain's
    prefix is referenced by every request that references the chain), which is what lets the
    index hold them."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.refs: list[dict[int, int]] = [{} for _ in names]
        self.index = PrefixIndex()

    def add(self, worker: int, chain: np.ndarray) -> None:
        refs = self.refs[worker]
        first_new = -1
        for j, h in enumerate(chain.tolist()):
            r = refs.get(h, 0)
            if r == 0 and first_new < 0:
                first_new = j
            refs[h] = r + 1
        if first_new >= 0:
            parent = int(chain[first_new - 1]) if first_new else None
            self.index.store(self.names[worker], chain[first_new:], parent)

    def release(self, worker: int, chain: np.ndarray) -> None:
        refs = self.refs[worker]
        first_gone = -1
        for j, h in enumerate(chain.tolist()):
            r = refs[h] - 1
            if r:
                refs[h] = r
            else:
                del refs[h]
                if first_gone < 0:
                    first_gone = j
        if first_gone >= 0:
            self.index.remove(self.names[worker], chain[first_gone : first_gone + 1])

    def count(self, worker: int) -> int:
        return len(self.refs[worker])


class DynamoKv(Policy):
    """Dynamo's KV router (docs/peers.md §2), ``KvRouterConfig::default`` of dynamo-kv-router
    1.6.1: ``overlap_score_credit`` 1.0, ``prefill_load_scale`` 1.0 (the documented
    ``kv-overlap-score-weight`` 1.0), ``decode_active_request_weight`` 0, temperature 0, KV events
    on (exact overlap), output blocks not tracked.

    For worker ``w``, with ``B`` the block size and ``isl`` the prompt tokens::

        prefill_cost = max(0, (active_prefill_tokens_w + isl) / B − overlap_w)
        decode_cost  = active_blocks_w + (prompt blocks − deepest prefix held by w's in-flight)
        cost_w       = prefill_cost + decode_cost

    ``overlap_w``: leading prompt blocks in ``w``'s cache, from the exact index the engine feeds.
    ``active_prefill_tokens_w``: Σ of ``isl − overlap × B`` (taken at routing, at least 0) over
    the requests routed to ``w`` whose first token is not out yet. ``active_blocks_w``: distinct
    prompt blocks of ``w``'s in-flight requests (routing to last token). Minimum cost wins, ties
    uniformly at random.
    """

    name = "dynamo"

    def __init__(
        self,
        *,
        overlap_score_credit: float = 1.0,
        prefill_load_scale: float = 1.0,
        decode_active_request_weight: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.credit = float(overlap_score_credit)
        self.scale = float(prefill_load_scale)
        self.request_weight = float(decode_active_request_weight)
        self.rng = random.Random(seed)
        self.events_index = PrefixIndex()

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        fleet.subscribe(self.events_index)
        n = len(fleet.names)
        self.prefill_tokens = [0.0] * n
        self.active = [0] * n
        self.blocks = ActiveBlocks(fleet.names)
        self.pending: dict[int, float] = {}  # request -> its prefill tokens still counted
        self.isl = fleet.workload.input_tokens.tolist()

    def costs(self, request: int, chain: np.ndarray) -> tuple[list[float], list[int]]:
        """Each worker's cost for this request (lower is better), and its overlap in blocks."""
        b = self.fleet.block_size
        isl = self.isl[request]
        nb = chain.shape[0]
        if nb:
            cached = self.events_index.match(chain)
            inflight = self.blocks.index.match(chain)
        else:
            cached = inflight = {}
        costs, overlaps = [], []
        for w, name in enumerate(self.fleet.names):
            o = cached.get(name, 0)
            prefill = self.scale * max(0.0, (self.prefill_tokens[w] + isl) / b - self.credit * o)
            decode = self.blocks.count(w) + nb - inflight.get(name, 0)
            costs.append(prefill + decode + self.request_weight * self.active[w])
            overlaps.append(o)
        return costs, overlaps

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        costs, overlaps = self.costs(request, chain)
        w = _best(costs, min(costs), self.rng)
        tokens = max(0.0, self.isl[request] - overlaps[w] * self.fleet.block_size)
        self.prefill_tokens[w] += tokens
        self.pending[request] = tokens
        self.active[w] += 1
        if chain.shape[0]:
            self.blocks.add(w, chain)
        return w

    def first_token(self, request: int, worker: int, now: float) -> None:
        self.prefill_tokens[worker] -= self.pending.pop(request)

    def finished(self, request: int, worker: int, cached_tokens: int, now: float) -> None:
        self.active[worker] -= 1
        wl = self.fleet.workload
        chain = wl.block_hashes(request)
        if chain.shape[0]:
            self.blocks.release(worker, chain)


# ---------------------------------------------------------------------------------------------
class LlmdScheduler(Policy):
    """llm-d's default scheduling profile (docs/peers.md §3): ``prefix-cache-scorer`` weight 3,
    ``kv-cache-utilization-scorer`` 2, ``queue-scorer`` 2, max-score picker (ties at random).

    ``score_w = 3 · match_w / total + 2 · (1 − usage_w) + 2 · queue_w`` where

    - prefix: per worker an LRU of block hashes (capacity = the worker's cache blocks, what
      ``autoTune`` reads from the engine) fed after each decision with the request's first
      ``max_prefix_blocks`` (256) hashes, first to last, into the chosen worker's LRU only;
      ``total`` = those hashes; walk them in order, stop at the first hash **no** worker holds;
      ``match_w`` = how many hashes of that run ``w`` holds (not necessarily contiguous);
    - ``usage_w`` = blocks held by ``w``'s running requests ÷ capacity (vLLM's
      ``kv_cache_usage_perc``), read live from the engine (llm-d scrapes every 50 ms: at the
      arrival rates simulated here the difference is negligible);
    - ``queue_w = (q_max − q_w) / (q_max − q_min)`` with ``q`` = requests waiting for prefill
      (vLLM's ``num_requests_waiting``), 1 for all when equal.
    """

    name = "llmd"

    def __init__(
        self,
        *,
        prefix_weight: float = 3.0,
        kv_weight: float = 2.0,
        queue_weight: float = 2.0,
        max_prefix_blocks: int = 256,
        lru_capacity: int | None = None,
        seed: int = 0,
    ) -> None:
        self.weights = (float(prefix_weight), float(kv_weight), float(queue_weight))
        self.max_prefix_blocks = int(max_prefix_blocks)
        self.lru_capacity = lru_capacity
        self.rng = random.Random(seed)

    def bind(self, fleet: Fleet) -> None:
        super().bind(fleet)
        n = len(fleet.names)
        self.lrus: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
        self.owners: dict[int, int] = {}  # block hash -> bitmask of workers whose LRU holds it
        self.capacity = self.lru_capacity or fleet.capacity

    def scores(self, chain: np.ndarray) -> list[float]:
        """Each worker's score for this prompt (higher is better)."""
        fleet = self.fleet
        n = len(fleet.names)
        wp, wk, wq = self.weights
        hashes = chain[: self.max_prefix_blocks].tolist()
        total = len(hashes)
        prefix = [0.0] * n
        if total:
            owners = self.owners
            masks = []
            for h in hashes:
                m = owners.get(h, 0)
                if not m:
                    break
                masks.append(m)
            counts = [0] * n
            for m in masks:
                while m:
                    low = m & -m
                    counts[low.bit_length() - 1] += 1
                    m ^= low
            prefix = [c / total for c in counts]
        q = fleet.waiting
        q_min, q_max = min(q), max(q)
        cap = fleet.capacity
        out = []
        for w in range(n):
            queue = 1.0 if q_max == q_min else (q_max - q[w]) / (q_max - q_min)
            usage = min(1.0, len(fleet.pinned[w]) / cap)
            out.append(wp * prefix[w] + wk * (1.0 - usage) + wq * queue)
        return out

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        scores = self.scores(chain)
        w = _best(scores, max(scores), self.rng)
        self._record(w, chain[: self.max_prefix_blocks].tolist())
        return w

    def _record(self, w: int, hashes: list[int]) -> None:
        lru, owners, bit = self.lrus[w], self.owners, 1 << w
        move = lru.move_to_end
        for h in hashes:
            if h in lru:
                move(h)
            else:
                lru[h] = None
                owners[h] = owners.get(h, 0) | bit
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            m = owners[old] & ~bit
            if m:
                owners[old] = m
            else:
                del owners[old]
