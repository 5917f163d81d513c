"""The prefill/decode fleet model: aggregated, disaggregated and conditional serving.

:func:`run_pd` replays a :class:`~kvroute.sim.workloads.Workload` on a fleet of ``prefill`` +
``decode`` workers (one GPU each, :class:`PdModel`) through ONE :class:`kvroute.Router`
(``kv_aware``, index fed by the workers' KV events), driven as ``kvroute serve`` drives it:

- ``aggregated``: every worker does both phases (role ``both``); ``Router.route`` at arrival,
  ``begin``, ``prefilled`` at the first token, ``observe`` + ``finish`` at the end.
- ``disaggregated``: roles ``prefill`` / ``decode`` and ``pd_local_prefill=False`` (SGLang's
  rule: a decode worker takes KV only from a prefill worker), so ``Router.route_pd`` splits every
  request: the prefill half runs on the prefill worker, its KV moves to the decode worker, the
  decode half runs there.
- ``conditional``: the same roles with ``pd_local_prefill=True`` and a ``pd_threshold`` (the
  Router's default unless given): ``route_pd`` decides, and a pair it does not disaggregate is
  one whole request prefilled and decoded on the decode worker.

Each half is begun, prefilled, observed and finished with the Router as the gateway does; the
prefill half is finished when its KV has been handed over.

Model (per worker, on virtual time; defaults in the constants below):

- **Prefill** is serial per worker in arrival order. Its work is ``prefill_overhead + max(prompt
  − cached, 1) / prefill_rate`` seconds at full speed; ``cached`` is the worker's cached prefix
  at the prefill's start (``BlockCache.match``). At its end the prompt's blocks are inserted into
  the worker's cache and announced as KV events to the Router's index.
- **Decode** is one continuous batch per worker. A step takes ``decode_step_time +
  decode_kv_time_per_token × (prompt tokens of the batch)``: decode is memory-bound, every step
  reads the weights and the batch's KV once, so the time per output token grows with the number
  (and length) of the concurrent decodes. Every member gains one token per step; the first output
  token is the end of the prefill (or of the KV transfer), the request finishes after
  ``output − 1`` more. Generated tokens' KV is neither counted nor cached (as in :mod:`.engine`).
- **Contention** on a worker that both prefills and decodes: prefill is chunked as vLLM's is
  (``prefill_chunk`` tokens per step): while a prefill runs beside a non-empty batch, every step
  also computes a chunk, so a step lasts ``chunk / prefill_rate`` longer and the prefill advances
  by one chunk per step. With an empty batch the prefill runs at full speed.
- **KV transfer** (disaggregated pairs): after the prefill, the tokens of the prompt the decode
  worker does not hold move at ``kv_transfer_time_per_token`` each plus ``kv_transfer_overhead``;
  then the decode worker caches the prompt (KV events) and the request joins its batch. TTFT is
  arrival → first token (prefill end, or KV arrival for a pair).
- Memory: decode batches are unbounded (no admission wait), caches are ``BlockCache``\\s of the
  worker's KV capacity for the hit rate.

Guarantees: deterministic for a given workload, model, mode and threshold; every request is
routed once and finishes once; prefills on a worker never overlap and run in routing order.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import numpy as np

from kvroute import BlockCache

from .engine import (
    DEFAULT_KV_TOKENS,
    DEFAULT_PREFILL_OVERHEAD,
    DEFAULT_PREFILL_RATE,
    KV_BYTES_PER_TOKEN,
    Fleet,
    mirror_insert,
    worker_capacity,
)
from .policies import fleet_router
from .workloads import Workload

__all__ = [
    "MODES",
    "PD_DTYPE",
    "PdModel",
    "PdSummary",
    "parse_ratio",
    "run_pd",
    "summarize_pd",
]

#: The serving modes :func:`run_pd` compares.
MODES = ("aggregated", "disaggregated", "conditional")

# --- Defaults: Llama-3-8B (bf16) on A100-SXM 80 GB, as in :mod:`.engine` ----------------------
#: HBM bandwidth of an A100-SXM 80 GB (NVIDIA's data sheet): 2.039 TB/s.
HBM_BYTES_PER_S = 2.039e12
#: A decode step reads the weights once (8.03e9 parameters × 2 bytes / 2.039 TB/s = 7.9 ms) plus
#: ~2 ms of scheduling, sampling and kernel launches: 10 ms.
DEFAULT_DECODE_STEP_TIME = 0.010
#: ... and each token of KV in the batch once: 131,072 bytes / 2.039 TB/s = 64 ns per token per
#: step (16 decodes of 4k tokens: +4.2 ms, the 15 ms per token of :mod:`.engine`'s default).
DEFAULT_DECODE_KV_TIME_PER_TOKEN = KV_BYTES_PER_TOKEN / HBM_BYTES_PER_S
#: vLLM's chunked-prefill budget for ``vllm serve`` on an A100 (``max_num_batched_tokens`` =
#: 2048, vllm/engine/arg_utils.py).
DEFAULT_PREFILL_CHUNK = 2048
#: KV moves over one 200 Gb/s HDR InfiniBand NIC per GPU (a DGX A100 has one ConnectX-6 per GPU):
#: 25 GB/s, 131,072 bytes per token → 5.2 µs per token (a 12k-token prompt: 63 ms).
DEFAULT_KV_TRANSFER_TIME_PER_TOKEN = KV_BYTES_PER_TOKEN / 25e9
#: Fixed cost of a hand-over: the proxy's second request (the decode worker's, with the
#: prefill's transfer parameters) and the connector's metadata exchange, ~2 ms on a LAN.
DEFAULT_KV_TRANSFER_OVERHEAD = 0.002


@dataclass(frozen=True)
class PdModel:
    """A fleet of ``prefill`` + ``decode`` identical GPUs (see the module docs and constants
    for the defaults' arithmetic). In ``aggregated`` mode all of them do both phases."""

    prefill: int = 4
    decode: int = 12
    kv_tokens: int = DEFAULT_KV_TOKENS
    capacity_blocks: int | None = None
    prefill_rate: float = DEFAULT_PREFILL_RATE
    prefill_overhead: float = DEFAULT_PREFILL_OVERHEAD
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    decode_step_time: float = DEFAULT_DECODE_STEP_TIME
    decode_kv_time_per_token: float = DEFAULT_DECODE_KV_TIME_PER_TOKEN
    kv_transfer_time_per_token: float = DEFAULT_KV_TRANSFER_TIME_PER_TOKEN
    kv_transfer_overhead: float = DEFAULT_KV_TRANSFER_OVERHEAD

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "prefill_chunk", "kv_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need prefill >= 0 and decode >= 1, got {self.prefill}:{self.decode}")
        if self.prefill_chunk < 1 or self.kv_tokens < 1:
            raise ValueError("prefill_chunk and kv_tokens must be >= 1")
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if not (self.prefill_rate > 0 and math.isfinite(self.prefill_rate)):
            raise ValueError(f"prefill_rate must be positive, got {self.prefill_rate}")
        for name in (
            "prefill_overhead",
            "decode_step_time",
            "decode_kv_time_per_token",
            "kv_transfer_time_per_token",
            "kv_transfer_overhead",
        ):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be >= 0 and finite, got {v}")
        if self.decode_step_time + self.decode_kv_time_per_token <= 0:
            raise ValueError("a decode step must take some time")

    def capacity(self, block_size: int) -> int:
        """Blocks of ``block_size`` tokens per worker (as the aggregated simulator counts them)."""
        return worker_capacity(self.capacity_blocks, self.kv_tokens, block_size)


def parse_ratio(text: str) -> tuple[int, int]:
    """``"P:D"`` → ``(P, D)`` with P >= 1 and D >= 1 (every mode needs a prefill worker: the
    disaggregated and conditional modes prefill there, and the aggregated fleet is P + D)."""
    p, colon, d = str(text).partition(":")
    try:
        if not colon:
            raise ValueError
        pair = int(p), int(d)
    except ValueError:
        raise ValueError(f"--pd must be P:D (prefill:decode workers), got {text!r}") from None
    if pair[0] < 1 or pair[1] < 1:
        raise ValueError(f"--pd needs P >= 1 prefill and D >= 1 decode workers, got {text!r}")
    return pair


#: One record per request.
PD_DTYPE = np.dtype(
    [
        ("arrival", "f8"),
        ("first_token", "f8"),
        ("finish", "f8"),
        ("prompt_tokens", "i8"),
        ("output_tokens", "i8"),
        ("cached_tokens", "i8"),  # the prefill worker's cached prefix at the prefill's start
        ("prefill_worker", "i4"),
        ("decode_worker", "i4"),
        ("disaggregated", "?"),
    ]
)


class _Worker:
    """One GPU: a serial chunked prefill and a continuous decode batch, on a fluid clock."""

    __slots__ = (
        "batch",
        "clock",
        "ctx",
        "last",
        "prefilling",
        "queue",
        "version",
        "work",
    )

    def __init__(self) -> None:
        self.queue: deque[int] = deque()
        self.prefilling = -1
        self.work = 0.0  # prefill seconds left at full speed
        self.batch: list[tuple[float, int, int]] = []  # (clock at finish, seq, request)
        self.clock = 0.0  # decode tokens every batch member has gained
        self.ctx = 0  # prompt tokens of the batch
        self.last = 0.0
        self.version = 0


def run_pd(
    workload: Workload,
    model: PdModel,
    mode: str,
    *,
    threshold: int | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    inspect: Callable[[Any, list[BlockCache]], None] | None = None,
) -> np.ndarray:
    """Replay ``workload`` on ``model`` in ``mode`` (one of :data:`MODES`); ``threshold`` is the
    Router's ``pd_threshold`` in conditional mode (None: the Router's default). One
    :data:`PD_DTYPE` record per request. Worker indices: the prefill pool first, then the decode
    pool."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if threshold is not None and mode != "conditional":
        raise ValueError("a threshold applies to the conditional mode only")
    n = len(workload)
    bs = workload.block_size
    cap = model.capacity(bs)
    n_workers = model.prefill + model.decode
    names = [f"p{k:02d}" for k in range(model.prefill)] + [f"d{k:02d}" for k in range(model.decode)]
    options: dict[str, Any] = {}
    if mode != "aggregated":
        options["roles"] = {
            name: ("prefill" if k < model.prefill else "decode") for k, name in enumerate(names)
        }
        options["pd_local_prefill"] = mode == "conditional"
        if threshold is not None:
            options["pd_threshold"] = int(threshold)
    fleet = Fleet(workload=workload, names=names, capacity=cap)
    router = fleet_router(fleet, "kv_aware", index="events", seed=seed, options=options)
    index = router.index
    position = fleet.position
    sessions = workload.session

    hashes, off = workload.hashes, workload.offsets.tolist()
    arrival = workload.arrival.tolist()
    prompt = workload.input_tokens.tolist()
    output = workload.output_tokens.tolist()
    rate = float(model.prefill_rate)
    overhead = float(model.prefill_overhead)
    chunk_s = model.prefill_chunk / rate
    step0 = float(model.decode_step_time)
    kv_step = float(model.decode_kv_time_per_token)
    xfer_tok = float(model.kv_transfer_time_per_token)
    xfer0 = float(model.kv_transfer_overhead)

    caches = [BlockCache(cap) for _ in range(n_workers)]
    workers = [_Worker() for _ in range(n_workers)]
    out = np.zeros(n, dtype=PD_DTYPE)
    first_t = [math.nan] * n
    finish_t = [math.nan] * n
    cached = [0] * n
    p_of = [-1] * n
    d_of = [-1] * n
    halves: list[Any] = [None] * n  # (prefill decision, decode decision), the same when whole
    heap: list[tuple[float, int, int, int, int]] = []
    seq = count()
    push, pop = heapq.heappush, heapq.heappop
    _WORKER, _TRANSFER = 0, 1

    def step_time(wk: _Worker) -> float:
        """Seconds of one decode step now (prefill chunk included)."""
        s = step0 + kv_step * wk.ctx
        return s + chunk_s if wk.prefilling >= 0 else s

    def advance(wk: _Worker, now: float) -> None:
        dt = now - wk.last
        wk.last = now
        if dt <= 0:
            return
        if wk.batch:
            s = step_time(wk)
            wk.clock += dt / s
            if wk.prefilling >= 0:
                wk.work -= dt * chunk_s / s
        elif wk.prefilling >= 0:
            wk.work -= dt

    def schedule(w: int, now: float) -> None:
        """Pushes worker ``w``'s next internal event (older ones go stale)."""
        wk = workers[w]
        wk.version += 1
        t = math.inf
        if wk.batch:
            s = step_time(wk)
            t = now + max(wk.batch[0][0] - wk.clock, 0.0) * s
            if wk.prefilling >= 0:
                t = min(t, now + max(wk.work, 0.0) * s / chunk_s)
        elif wk.prefilling >= 0:
            t = now + max(wk.work, 0.0)
        if t < math.inf:
            push(heap, (t, next(seq), _WORKER, w, wk.version))

    def cache_insert(w: int, i: int) -> None:
        chain = hashes[off[i] : off[i + 1]]
        if chain.shape[0]:
            stored, evicted = caches[w].insert(chain)
            mirror_insert(index, names[w], chain, stored, evicted)

    def start_prefill(w: int, now: float) -> None:
        wk = workers[w]
        if wk.prefilling >= 0 or not wk.queue:
            return
        i = wk.queue.popleft()
        chain = hashes[off[i] : off[i + 1]]
        m = caches[w].match(chain) if chain.shape[0] else 0
        c = min(m * bs, prompt[i])
        cached[i] = c
        wk.prefilling = i
        wk.work = overhead + max(prompt[i] - c, 1) / rate

    def join_batch(w: int, i: int, now: float) -> None:
        first_t[i] = now
        wk = workers[w]
        push(wk.batch, (wk.clock + max(output[i] - 1, 0), next(seq), i))
        wk.ctx += prompt[i]

    def prefill_done(w: int, now: float) -> None:
        wk = workers[w]
        i = wk.prefilling
        wk.prefilling = -1
        cache_insert(w, i)
        p_half, d_half = halves[i]
        router.prefilled(p_half)
        if p_half is d_half:
            join_batch(w, i, now)
            return
        router.observe(p_half, cached[i], now=now)
        d = d_of[i]
        chain = hashes[off[i] : off[i + 1]]
        held = min(caches[d].match(chain) * bs, prompt[i]) if chain.shape[0] else 0
        push(heap, (now + xfer0 + (prompt[i] - held) * xfer_tok, next(seq), _TRANSFER, i, 0))

    def transfer_done(i: int, now: float) -> None:
        p_half, d_half = halves[i]
        router.finish(p_half, now=now)
        d = d_of[i]
        wk = workers[d]
        advance(wk, now)
        cache_insert(d, i)
        router.prefilled(d_half)
        join_batch(d, i, now)
        schedule(d, now)

    def worker_event(w: int, now: float) -> None:
        wk = workers[w]
        advance(wk, now)
        if wk.prefilling >= 0 and wk.work <= 1e-9:
            prefill_done(w, now)
            start_prefill(w, now)
        batch = wk.batch
        while batch and batch[0][0] <= wk.clock + 1e-9:
            _, _, i = pop(batch)
            wk.ctx -= prompt[i]
            finish_t[i] = now
            p_half, d_half = halves[i]
            if p_half is d_half:
                router.observe(d_half, cached[i], now=now)
            router.finish(d_half, now=now)
            halves[i] = None
        if not batch:
            wk.clock = 0.0  # nobody holds a clock value: restart it (keeps it small)
        schedule(w, now)

    def route(i: int, now: float) -> None:
        chain = hashes[off[i] : off[i + 1]]
        if mode == "aggregated":
            d = router.route(block_hashes=chain, key=sessions[i], now=now)
            router.begin(d)
            pair = (d, d)
        else:
            pd = router.route_pd(block_hashes=chain, key=sessions[i], now=now)
            if pd.disaggregate:
                router.begin(pd.prefill)
                router.begin(pd.decode)
                pair = (pd.prefill, pd.decode)
            else:
                router.begin(pd.decode)
                pair = (pd.decode, pd.decode)
        halves[i] = pair
        p, d = position[pair[0].worker], position[pair[1].worker]
        p_of[i], d_of[i] = p, d
        wk = workers[p]
        wk.queue.append(i)
        if wk.prefilling < 0:
            advance(wk, now)
            start_prefill(p, now)
            schedule(p, now)

    nxt = 0
    inf = math.inf
    while True:
        t_arrival = arrival[nxt] if nxt < n else inf
        if heap and heap[0][0] <= t_arrival:
            now, _, kind, x, version = pop(heap)
            if kind == _TRANSFER:
                transfer_done(x, now)
            elif version == workers[x].version:
                worker_event(x, now)
            continue
        if nxt >= n:
            break
        route(nxt, t_arrival)
        nxt += 1
        if progress is not None and nxt % 256 == 0:
            progress(nxt)
    if progress is not None:
        progress(n)
    if inspect is not None:
        inspect(router, caches)

    out["arrival"] = workload.arrival
    out["first_token"] = first_t
    out["finish"] = finish_t
    out["prompt_tokens"] = workload.input_tokens
    out["output_tokens"] = workload.output_tokens
    out["cached_tokens"] = cached
    out["prefill_worker"] = p_of
    out["decode_worker"] = d_of
    out["disaggregated"] = np.asarray(p_of) != np.asarray(d_of)
    return out


@dataclass(frozen=True)
class PdSummary:
    """What one P/D run measured. ``tpot``: (finish − first token) / (output − 1) per request
    with at least two output tokens; ``hit_rate``: cached / prompt tokens of every prefill
    wherever it ran; ``prefill_pool_hit_rate``: the same over the prefills run by the prefill
    pool (NaN when it ran none); ``disaggregated``: share of requests split."""

    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    hit_rate: float
    prefill_pool_hit_rate: float
    disaggregated: float

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def summarize_pd(res: np.ndarray, prefill_workers: int) -> PdSummary:
    """The :class:`PdSummary` of ``run_pd``'s records (``prefill_workers``: the pool's size)."""

    def pct(x: np.ndarray, q: float) -> float:
        return float(np.percentile(x, q)) if x.shape[0] else math.nan

    ttft = res["first_token"] - res["arrival"]
    many = res["output_tokens"] > 1
    tpot = (res["finish"][many] - res["first_token"][many]) / (res["output_tokens"][many] - 1)
    prompt = res["prompt_tokens"].astype(np.float64)
    pool = res["prefill_worker"] < prefill_workers
    return PdSummary(
        ttft_p50=pct(ttft, 50),
        ttft_p99=pct(ttft, 99),
        tpot_p50=pct(tpot, 50),
        tpot_p99=pct(tpot, 99),
        hit_rate=float(res["cached_tokens"].sum() / prompt.sum()) if res.shape[0] else math.nan,
        prefill_pool_hit_rate=(
            float(res["cached_tokens"][pool].sum() / prompt[pool].sum()) if pool.any() else math.nan
        ),
        disaggregated=float(res["disaggregated"].mean()) if res.shape[0] else math.nan,
    )


def compare_modes(
    workload: Workload,
    model: PdModel,
    *,
    threshold: int | None = None,
    seed: int = 0,
    modes: Sequence[str] = MODES,
) -> dict[str, PdSummary]:
    """Every mode on the same workload and fleet: ``{mode: summary}``."""
    return {
        m: summarize_pd(
            run_pd(
                workload,
                model,
                m,
                threshold=threshold if m == "conditional" else None,
                seed=seed,
            ),
            0 if m == "aggregated" else model.prefill,
        )
        for m in modes
    }
