"""The fleet model: a discrete-event simulation of LLM workers with prefix caches, on virtual time.

One :func:`run` replays a :class:`~kvroute.sim.workloads.Workload` through a routing
:class:`Policy` on a fleet described by a :class:`FleetModel`, and returns one
:data:`~kvroute.sim.report.RESULT_DTYPE` record per request.

Model (each worker is one GPU serving one model; see :class:`FleetModel` for the defaults):

- **Memory.** A worker's KV memory is a :class:`kvroute.BlockCache` of ``capacity_blocks`` blocks
  of the workload's block size (LRU of unpinned leaves; see the cache's docs).
- **Routing** happens when a request arrives: the policy names a worker, and the request joins
  that worker's **prefill queue**, ordered by the request's priority (the scenario's; higher
  first) and then by arrival: first come, first served when every priority is 0 (the default).
  A running prefill is never interrupted: a priority request waits for it (vLLM's
  ``--scheduling-policy priority`` orders its waiting queue the same way and lets a started
  prefill finish; SGLang's ``--enable-priority-scheduling`` too, unless the priorities differ by
  its preemption threshold, 10 by default).
- **Admission** (prefill start) takes the queue's head when the worker is not prefilling. The
  head waits (and so does everyone behind it: no skipping) while the distinct blocks pinned
  by the worker's running requests plus the head's blocks not among them exceed the capacity and
  some request is still running — the scheduler of vLLM/SGLang also admits a prompt only when its
  blocks can be allocated. A prompt larger than the whole cache runs alone, and only the prefix
  that fits is cached.
- **The cached prefix is decided at admission**, not at routing: the worker's cache may have
  changed while the request queued. It is the leading run of the prompt's blocks in the cache
  (``BlockCache.match``, which refreshes them), and those blocks are pinned at once, so nothing
  the request relies on can be evicted under it. ``cached_tokens = min(blocks × block_size,
  prompt tokens)`` (see :meth:`Workload.cached_tokens`).
- **Prefill** is serial per worker: ``prefill_overhead + max(prompt − cached, 1) /
  prefill_rate`` seconds (at least one token is computed, for the first logits, as vLLM does when
  everything hits). Decode does not slow prefill in this model (with chunked prefill, a decode
  step costs a prefill chunk about one token per running sequence, a few percent).
- **Insertion at prefill end.** When the prefill completes, the whole prompt is inserted into the
  cache (``BlockCache.insert``; into the request's partition when the scenario gives it one and
  the worker reserves it, else the shared pool) and the newly stored blocks are pinned too. This
  is when an engine announces the blocks (vLLM's ``BlockStored`` events follow computation), so
  a KV-event index sees them then, and the evictions the insert caused (``BlockRemoved``). Only
  prompt blocks are cached: the blocks of generated tokens are not (a trace does not say which
  block ids a response will have), in every policy and oracle alike.
- **Decode** runs in a continuous batch, unbounded: the first output token is the end of the
  prefill (**TTFT = queueing + own prefill**), each further token takes ``decode_time_per_token``
  regardless of the batch, and the request finishes after ``output_tokens − 1`` of them. Then its
  blocks are unpinned (they stay cached, evictable) and the worker may admit a waiting head. The
  KV of generated tokens is not counted against the memory (prompts dominate it here: the
  Mooncake trace averages 12,035 prompt and 343 output tokens).
- **KV events.** Every index subscribed with :meth:`Fleet.subscribe` (a
  :class:`kvroute.PrefixIndex`, e.g. ``Router(index="events").index``) receives every insertion
  and eviction at once, as store/remove of the block hashes the engine caches (the scenario's
  ``chains``) — what a KV-event subscriber does with zero delivery delay. Policies that subscribe
  nothing see no cache state (approximate routers).
- **The scenario** (:class:`~kvroute.sim.scenario.Scenario`, default: the public fleet) says
  which caches reserve partitions, where each request's blocks go, which hashes the engine caches
  and each request's priority; the policy never changes it.

Guarantees: deterministic for a given workload, policy, scenario and model (ties in time are
broken by event creation order, completions before arrivals); every request is routed, and all
but those the policy drops (:data:`DROPPED`: a warm request the gateway would not send; worker
``-1``, no times) are admitted once and finish; per worker, prefills never overlap and, among
requests of equal priority, run in routing order; ``len(cache) <= capacity`` always, and pinned
blocks are never evicted (the cache enforces both); a reserved partition's blocks, up to its
reservation, are evicted only by inserts into that partition.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from kvroute import BlockCache, PrefixIndex

from .report import empty_results
from .scenario import Scenario
from .workloads import Workload

__all__ = [
    "DEFAULT_KV_TOKENS",
    "DROPPED",
    "Fleet",
    "FleetModel",
    "Policy",
    "mirror_insert",
    "run",
    "worker_names",
]

# --- Defaults: Llama-3-8B (bf16) on one A100-SXM 80 GB, served by vLLM --------------------------
#: KV bytes per token: 2 (K and V) × 32 layers × 8 KV heads × 128 head dim × 2 bytes = 131,072.
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
#: KV memory: 80 GiB × 0.9 (vLLM's gpu_memory_utilization) = 72 GiB, minus the weights (8.03e9
#: parameters × 2 bytes = 14.96 GiB) and ~3 GiB of activations / CUDA graphs = 54 GiB.
KV_MEMORY_BYTES = 54 * 2**30
#: 54 GiB ÷ 128 KiB = 442,368 tokens (vLLM logs ~440k for this setup).
DEFAULT_KV_TOKENS = KV_MEMORY_BYTES // KV_BYTES_PER_TOKEN
#: Prefill: 2 × 8.03e9 FLOPs per token for the weights plus ~1.6 GFLOPs of attention at a few
#: thousand tokens of context ≈ 17.7 GFLOPs; an A100 gives 312 TFLOPs (bf16 dense), about half of
#: it in practice: 156e12 / 17.7e9 ≈ 8,800 tokens/s. Rounded to 9,000.
DEFAULT_PREFILL_RATE = 9000.0
#: Fixed cost of a prefill (scheduling, a forward pass that computes at least one token): 20 ms.
DEFAULT_PREFILL_OVERHEAD = 0.02
#: Decode is memory-bound: the weights (16.1 GB) over 2.04 TB/s of HBM ≈ 7.9 ms per step, plus
#: the batch's KV (e.g. 16 sequences × 4k tokens × 128 KiB = 8.6 GB ≈ 4.2 ms) and overheads:
#: 15 ms per output token, about 65 tokens/s per stream.
DEFAULT_DECODE_TIME_PER_TOKEN = 0.015


@dataclass(frozen=True)
class FleetModel:
    """A fleet of identical workers. Defaults: Llama-3-8B on one A100-80GB each (arithmetic in
    this module's constants): KV memory for ``kv_tokens`` = 442,368 tokens, prefill at
    ``prefill_rate`` = 9,000 tokens/s plus ``prefill_overhead`` = 20 ms, decode at
    ``decode_time_per_token`` = 15 ms. ``capacity_blocks`` (per worker) overrides
    ``kv_tokens // block_size``. For an H100-80GB, prefill is ~2.5-3x faster
    (``prefill_rate`` ≈ 25,000) and decode ~1.6x (3.35 TB/s)."""

    workers: int = 8
    capacity_blocks: int | None = None
    kv_tokens: int = DEFAULT_KV_TOKENS
    prefill_rate: float = DEFAULT_PREFILL_RATE
    prefill_overhead: float = DEFAULT_PREFILL_OVERHEAD
    decode_time_per_token: float = DEFAULT_DECODE_TIME_PER_TOKEN

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int):
            raise TypeError(f"workers must be an int, got {self.workers!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if self.kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {self.kv_tokens}")
        if not (self.prefill_rate > 0 and math.isfinite(self.prefill_rate)):
            raise ValueError(f"prefill_rate must be positive, got {self.prefill_rate}")
        for name in ("prefill_overhead", "decode_time_per_token"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be >= 0 and finite, got {v}")

    def capacity(self, block_size: int) -> int:
        """Blocks of ``block_size`` tokens per worker."""
        return worker_capacity(self.capacity_blocks, self.kv_tokens, block_size)


def worker_capacity(capacity_blocks: int | None, kv_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens one worker holds: ``capacity_blocks`` when given, else
    its ``kv_tokens`` of KV memory in whole blocks (at least one)."""
    if capacity_blocks is not None:
        return int(capacity_blocks)
    return max(1, kv_tokens // int(block_size))


def worker_names(n: int) -> list[str]:
    """The fleet's worker names: ``w00``, ``w01``, ... (zero-padded so they sort by index)."""
    width = max(2, len(str(n - 1)))
    return [f"w{k:0{width}d}" for k in range(n)]


@dataclass
class Fleet:
    """What a policy may read about the running fleet (live engine state, updated in place).

    ``waiting[w]``: requests queued at ``w`` whose prefill has not started (vLLM's
    ``num_requests_waiting``); ``running[w]``: admitted, unfinished requests;
    ``pinned[w]``: ``{block hash: references}`` of the blocks held by ``w``'s running requests
    (``len`` = blocks in use, vLLM's ``kv_cache_usage_perc × capacity``). ``position[name]`` is
    the index of the worker called ``name``; ``scenario`` the deployment being run.
    """

    workload: Workload
    names: list[str]
    capacity: int
    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    pinned: list[dict[int, int]] = field(default_factory=list)
    scenario: Scenario = field(default_factory=Scenario)
    position: dict[str, int] = field(init=False)
    subscribers: list[PrefixIndex] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.position = {name: k for k, name in enumerate(self.names)}

    @property
    def block_size(self) -> int:
        return self.workload.block_size

    def subscribe(self, index: PrefixIndex) -> None:
        """``index`` receives every worker's KV events from now on (see the module docs)."""
        self.subscribers.append(index)


def mirror_insert(
    index: PrefixIndex, worker: str, chain: np.ndarray, stored: int, evicted: np.ndarray
) -> None:
    """Applies the outcome ``(stored, evicted)`` of inserting ``chain`` into ``worker``'s
    ``BlockCache`` to ``index``, so that the index keeps holding exactly the cache's blocks."""
    if evicted.shape[0]:
        index.remove(worker, evicted)
    if stored:
        index.store(worker, chain[:stored])


class Policy:
    """Base class of routing policies: ``route`` picks a worker index; the hooks are told when a
    request's prefill starts, when its first token is out, and when it finishes. ``fleet`` is
    set by :meth:`bind` before the first request; a policy that reads engine KV events subscribes
    its index there (:meth:`Fleet.subscribe`). ``route`` is handed the request's chain from the
    workload (unsalted). A policy that sets ``routes_endpoints`` sends a request of a dedicated
    endpoint (``fleet.scenario.endpoint_of``) to that endpoint; the others cannot run a scenario
    with endpoints. ``route`` may return :data:`DROPPED` for a warm request
    (``fleet.scenario.warm_target``) the gateway would not send; never for another. A policy
    object serves one run."""

    name: str = "policy"
    routes_endpoints: bool = False
    fleet: Fleet

    def bind(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        raise NotImplementedError

    def prefill_started(self, request: int, worker: int, cached_blocks: int, now: float) -> None:
        """Called at admission with the cached prefix found then."""

    def first_token(self, request: int, worker: int, now: float) -> None:
        """Called when the prefill completes."""

    def finished(self, request: int, worker: int, cached_tokens: int, now: float) -> None:
        """Called after the last output token."""


_FINISH, _PREFILL_DONE = 0, 1
#: What ``Policy.route`` returns for a request that is not sent to any worker.
DROPPED = -1


def run(
    workload: Workload,
    policy: Policy,
    model: FleetModel,
    *,
    scenario: Scenario | None = None,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Replay ``workload`` through ``policy`` on ``model`` deployed as ``scenario`` (default: the
    public fleet); one result record per request. ``progress(k)`` is called with the number of
    requests routed so far, every 256 arrivals and at the end.
    """
    n = len(workload)
    num_workers = model.workers
    block_size = workload.block_size
    cap = model.capacity(block_size)
    names = worker_names(num_workers)
    scenario = scenario if scenario is not None else Scenario()
    scenario.check(n, num_workers)
    if scenario.endpoints and not policy.routes_endpoints:
        raise ValueError(f"policy {policy.name!r} cannot route to dedicated endpoints")
    req_hashes, req_off = workload.hashes, workload.offsets.tolist()
    arrival = workload.arrival.tolist()
    input_tokens = workload.input_tokens.tolist()
    output_tokens = workload.output_tokens.tolist()

    fleet = Fleet(
        workload=workload,
        names=names,
        capacity=cap,
        waiting=[0] * num_workers,
        running=[0] * num_workers,
        pinned=[{} for _ in range(num_workers)],
        scenario=scenario,
    )
    policy.bind(fleet)
    reserved = scenario.reserved
    partitions = scenario.partitions
    caches = [
        BlockCache(cap, reserved=dict(reserved.get(w, {})) or None) for w in range(num_workers)
    ]
    has_partition = [set(reserved.get(w, {})) for w in range(num_workers)]
    hashes, offsets = scenario.chains or (workload.hashes, workload.offsets)
    off = offsets.tolist()
    subscribers = fleet.subscribers
    rank = [0] * n if scenario.priority is None else (-np.asarray(scenario.priority)).tolist()
    waiting, running, pinned = fleet.waiting, fleet.running, fleet.pinned

    rate = float(model.prefill_rate)
    overhead = float(model.prefill_overhead)
    tpot = float(model.decode_time_per_token)

    worker_of = [-1] * n
    start_t = [math.nan] * n
    first_t = [math.nan] * n
    finish_t = [math.nan] * n
    cached_tokens = [0] * n
    matched = [0] * n
    stored_of = [0] * n

    # Per worker, the waiting requests as a heap of (−priority, request): requests are routed
    # in index order, so the index is the routing order.
    queues: list[list[tuple[int, int]]] = [[] for _ in range(num_workers)]
    prefilling = [-1] * num_workers
    blocked = [False] * num_workers
    heap: list[tuple[float, int, int, int]] = []
    seq = count()
    push, pop = heapq.heappush, heapq.heappop

    def pin_refs(refs: dict[int, int], blocks: np.ndarray) -> None:
        get = refs.get
        for h in blocks.tolist():
            refs[h] = get(h, 0) + 1

    def try_admit(w: int, now: float) -> None:
        queue = queues[w]
        if prefilling[w] >= 0 or not queue:
            return
        i = queue[0][1]
        a, b = off[i], off[i + 1]
        chain = hashes[a:b]
        refs = pinned[w]
        if running[w] and len(refs) + (b - a) > cap:
            missing = sum(1 for h in chain.tolist() if h not in refs)
            if len(refs) + missing > cap:
                blocked[w] = True
                return
        blocked[w] = False
        pop(queue)
        waiting[w] -= 1
        running[w] += 1
        cache = caches[w]
        m = cache.match(chain) if b > a else 0
        if m:
            head = chain[:m]
            cache.pin(head)
            pin_refs(refs, head)
        matched[i] = m
        c = min(m * block_size, input_tokens[i])
        cached_tokens[i] = c
        start_t[i] = now
        prefilling[w] = i
        push(
            heap, (now + overhead + max(input_tokens[i] - c, 1) / rate, next(seq), _PREFILL_DONE, w)
        )
        policy.prefill_started(i, w, m, now)

    def prefill_done(w: int, now: float) -> None:
        i = prefilling[w]
        prefilling[w] = -1
        a, b = off[i], off[i + 1]
        if b > a:
            chain = hashes[a:b]
            part = partitions[i] if partitions is not None else None
            if part is not None and part not in has_partition[w]:
                part = None
            cache = caches[w]
            stored, evicted = cache.insert(chain, partition=part)
            for index in subscribers:
                mirror_insert(index, names[w], chain, stored, evicted)
            m = matched[i]
            if stored > m:
                fresh = chain[m:stored]
                cache.pin(fresh)
                pin_refs(pinned[w], fresh)
            stored_of[i] = stored
        first_t[i] = now
        done = now + max(output_tokens[i] - 1, 0) * tpot
        finish_t[i] = done
        push(heap, (done, next(seq), _FINISH, i))
        policy.first_token(i, w, now)
        try_admit(w, now)

    def finish(i: int, now: float) -> None:
        w = worker_of[i]
        s = stored_of[i]
        if s:
            a = off[i]
            held = hashes[a : a + s]
            caches[w].unpin(held)
            refs = pinned[w]
            for h in held.tolist():
                r = refs[h] - 1
                if r:
                    refs[h] = r
                else:
                    del refs[h]
        running[w] -= 1
        policy.finished(i, w, cached_tokens[i], now)
        if blocked[w]:
            try_admit(w, now)

    route = policy.route
    warm_target = scenario.warm_target
    inf = math.inf
    nxt = 0
    while True:
        t_arrival = arrival[nxt] if nxt < n else inf
        if heap and heap[0][0] <= t_arrival:
            now, _, kind, x = pop(heap)
            if kind == _FINISH:
                finish(x, now)
            else:
                prefill_done(x, now)
            continue
        if nxt >= n:
            break
        i = nxt
        nxt += 1
        w = route(i, req_hashes[req_off[i] : req_off[i + 1]], t_arrival)
        if w == DROPPED and warm_target is not None and warm_target[i] is not None:
            continue  # worker_of stays -1: never sent
        if not 0 <= w < num_workers:
            raise ValueError(f"policy {policy.name!r} chose worker {w} of {num_workers}")
        worker_of[i] = w
        push(queues[w], (rank[i], i))
        waiting[w] += 1
        # A head waiting for memory blocks the queue, unless the newcomer outranks it.
        if prefilling[w] < 0 and (not blocked[w] or queues[w][0][1] == i):
            try_admit(w, t_arrival)
        if progress is not None and nxt % 256 == 0:
            progress(nxt)
    if progress is not None:
        progress(n)

    out = empty_results(n)
    out["worker"] = worker_of
    out["arrival"] = workload.arrival
    out["prefill_start"] = start_t
    out["first_token"] = first_t
    out["finish"] = finish_t
    out["prompt_tokens"] = workload.input_tokens
    out["cached_tokens"] = cached_tokens
    out["output_tokens"] = workload.output_tokens
    return out
