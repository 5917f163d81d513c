"""Decision instruments: what each routing decision saw, and what the request found later.

:class:`Recorder` wraps any simulator :class:`~kvroute.sim.engine.Policy` and records, for every
request, one :data:`DECISION_DTYPE` row:

- **At routing**, for the *chosen* worker and for the *holder* — the worker on which the longest
  prefix of the prompt was available then (the chosen one when it ties): the prefix held in the
  worker's real cache (``*_cached``, the engine's true state, whatever the policy knows) and the
  prefix held by requests routed there and not finished (``*_inflight``: queued, prefilling or
  decoding; a FIFO worker will hold those blocks when it reaches the new request); the engine's
  requests waiting and running there and the blocks its running requests pin; the policy's own
  value for the worker (``*_score``: kvroute's ``Decision.scores``, a peer's cost or score) and,
  for a :class:`kvroute.Router`, the load terms it read (``*_view_queue`` = its ``prefill_blocks``
  counter, ``*_view_decode`` = ``decode_blocks``).
- **At admission** (prefill start): the time and the leading blocks the chosen worker's cache
  really held then (``admitted_cached``); ``lost`` = blocks available at routing
  (``max(cached, inflight)``) that were gone by admission (evicted while the request queued).
- **Afterwards**, from the run's results: the true backlog, in seconds of prefill, on the chosen
  and on the holder worker when the request arrived (``*_backlog_s``: the remaining prefill of
  the requests routed there earlier whose first token was still to come). On the chosen worker
  this is the request's own queueing delay when every priority is equal (FIFO) and memory did
  not hold the admission back.

:func:`explain` condenses the rows of one run into the numbers a diagnosis needs (how often and
how much a policy left the prefix, what the holder's queue looked like when it did, blocks lost
while queued, prefixes visible only as in-flight, how many workers a session touched), and
:func:`render_explain` prints them as a table. ``kvroute simulate --explain`` prints it for every
policy; ``--decisions FILE.csv`` writes the rows.

Guarantees: the wrapped policy decides exactly as it would alone (the recorder only reads; the
engine state it reads is the same the policy could read); the rows are in request order, one per
request, and deterministic for a deterministic run.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from kvroute import PrefixIndex

from .engine import Fleet, Policy
from .peers import ActiveBlocks
from .report import RESULT_DTYPE

__all__ = [
    "DECISION_DTYPE",
    "Recorder",
    "explain",
    "render_explain",
    "write_decisions",
]

_SIDES = ("chosen", "holder")
_PER_SIDE = (
    ("cached", np.int32),  # leading blocks in the worker's real cache at routing
    ("inflight", np.int32),  # leading blocks held by requests in flight there at routing
    ("waiting", np.int32),  # engine: requests queued, prefill not started
    ("running", np.int32),  # engine: requests admitted, not finished
    ("pinned", np.int32),  # engine: distinct blocks pinned by running requests
    ("score", np.float64),  # the policy's own value for the worker (NaN: not exposed)
    ("view_queue", np.float64),  # kvroute Router: prefill_blocks counter (NaN for peers)
    ("view_decode", np.float64),  # kvroute Router: decode_blocks counter (NaN for peers)
    ("backlog_s", np.float64),  # true seconds of prefill queued ahead at routing
)

DECISION_DTYPE = np.dtype(
    [
        ("request", np.int64),
        ("arrival", np.float64),
        ("prompt_blocks", np.int32),
        ("chosen", np.int32),
        ("holder", np.int32),
        *[(f"{side}_{name}", t) for side in _SIDES for name, t in _PER_SIDE],
        ("admitted", np.float64),  # prefill start (s)
        ("admitted_cached", np.int32),  # leading blocks cached on the chosen worker then
        ("lost", np.int32),  # available at routing, gone at admission
        ("ttft", np.float64),
    ]
)


class Recorder(Policy):
    """Records every decision of ``inner`` (see the module docs); decides nothing itself.

    Use it in place of the policy: ``rec = Recorder(policy); results = run(workload, rec,
    model); rows = rec.rows(results)``.
    """

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.routes_endpoints = inner.routes_endpoints

    def bind(self, fleet: Fleet) -> None:
        self.inner.bind(fleet)
        super().bind(fleet)
        self.truth = PrefixIndex()  # every worker's real cache, from the engine's KV events
        fleet.subscribe(self.truth)
        self.inflight = ActiveBlocks(fleet.names)
        n = len(fleet.workload)
        self.out = np.zeros(n, dtype=DECISION_DTYPE)
        self.out["request"] = np.arange(n)
        self.out["chosen"] = -1
        self.out["holder"] = -1
        floats = [f"{s}_{name}" for s in _SIDES for name, t in _PER_SIDE if t is np.float64]
        for f in ("admitted", "ttft", *floats):
            self.out[f] = np.nan
        self._router = getattr(self.inner, "router", None)

    # -- what the policy saw -----------------------------------------------------------------
    def _views(self) -> list[dict[str, float]] | None:
        router = self._router
        if router is None:
            return None
        return [router.load(name) for name in self.fleet.names]

    def _scores(self, request: int) -> dict[int, float]:
        decisions = getattr(self.inner, "decisions", None)
        if isinstance(decisions, dict) and request in decisions:
            pos = self.fleet.position
            return {pos[name]: float(v) for name, v in decisions[request].scores.items()}
        last = getattr(self.inner, "last_scores", None)
        if last is not None:
            return {w: float(v) for w, v in enumerate(last)}
        return {}

    def route(self, request: int, chain: np.ndarray, now: float) -> int:
        fleet = self.fleet
        n = len(fleet.names)
        cached = np.zeros(n, dtype=np.int64)
        inflight = np.zeros(n, dtype=np.int64)
        if chain.shape[0]:
            for name, m in self.truth.match(chain).items():
                cached[fleet.position[name]] = m
            for name, m in self.inflight.index.match(chain).items():
                inflight[fleet.position[name]] = m
        views = self._views()
        w = self.inner.route(request, chain, now)
        avail = np.maximum(cached, inflight)
        best = int(avail.max()) if n else 0
        holder = w if avail[w] == best else int(np.argmax(avail))
        row = self.out[request]
        row["arrival"] = now
        row["prompt_blocks"] = chain.shape[0]
        row["chosen"] = w
        row["holder"] = holder
        scores = self._scores(request)
        for side, k in (("chosen", w), ("holder", holder)):
            row[f"{side}_cached"] = cached[k]
            row[f"{side}_inflight"] = inflight[k]
            row[f"{side}_waiting"] = fleet.waiting[k]
            row[f"{side}_running"] = fleet.running[k]
            row[f"{side}_pinned"] = len(fleet.pinned[k])
            row[f"{side}_score"] = scores.get(k, math.nan)
            if views is not None:
                row[f"{side}_view_queue"] = views[k].get("prefill_blocks", math.nan)
                row[f"{side}_view_decode"] = views[k].get("decode_blocks", math.nan)
        if chain.shape[0]:
            self.inflight.add(w, chain)
        return w

    def prefill_started(self, request: int, worker: int, cached_blocks: int, now: float) -> None:
        row = self.out[request]
        row["admitted"] = now
        row["admitted_cached"] = cached_blocks
        avail = max(int(row["chosen_cached"]), int(row["chosen_inflight"]))
        row["lost"] = max(0, avail - cached_blocks)
        self.inner.prefill_started(request, worker, cached_blocks, now)

    def first_token(self, request: int, worker: int, now: float) -> None:
        self.inner.first_token(request, worker, now)

    def finished(self, request: int, worker: int, cached_tokens: int, now: float) -> None:
        chain = self.fleet.workload.block_hashes(request)
        if chain.shape[0]:
            self.inflight.release(worker, chain)
        self.inner.finished(request, worker, cached_tokens, now)

    # -- afterwards ----------------------------------------------------------------------------
    def rows(self, results: np.ndarray) -> np.ndarray:
        """The decision rows, completed with the backlogs and TTFTs from ``results`` (the
        :data:`~kvroute.sim.report.RESULT_DTYPE` records of this run)."""
        if results.dtype != RESULT_DTYPE or results.shape != self.out.shape:
            raise ValueError("results must be this run's RESULT_DTYPE records")
        out = self.out.copy()
        out["ttft"] = results["first_token"] - results["arrival"]
        for side in _SIDES:
            out[f"{side}_backlog_s"] = backlog_at(results, out[side])
        return out


def backlog_at(results: np.ndarray, workers: np.ndarray) -> np.ndarray:
    """For each request ``i``: the seconds of prefill still queued or running on ``workers[i]``
    when ``i`` arrived — over the requests routed there before ``i`` whose first token came
    after ``i``'s arrival, their prefill time not yet spent (``first_token − max(arrival_i,
    prefill_start)``)."""
    n = results.shape[0]
    out = np.full(n, np.nan)
    served = results["worker"]
    arrival = results["arrival"]
    start = results["prefill_start"]
    first = results["first_token"]
    for w in np.unique(workers[workers >= 0]).tolist():
        on = np.flatnonzero(served == w)  # requests served by w, in routing order
        asks = np.flatnonzero(workers == w)  # requests asking about w
        s, f = start[on], first[on]
        for i in asks.tolist():
            t = arrival[i]
            k = np.searchsorted(on, i)  # those routed before i
            ff, ss = f[:k], s[:k]
            live = ff > t
            out[i] = float(np.sum(ff[live] - np.maximum(ss[live], t)))
    return out


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------
def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def explain(
    rows: np.ndarray,
    *,
    block_size: int,
    prefill_rate: float,
    sessions: Sequence[str | None] | None = None,
) -> dict[str, float]:
    """The diagnosis of one run's decision rows (all counts over requests, blocks over blocks):

    - ``left``: share of requests sent elsewhere than the holder while a longer prefix was
      available on it; ``left_blocks``: the blocks so given up ÷ all prompt blocks;
    - ``left_holder_backlog_s`` / ``left_chosen_backlog_s``: median true backlog on the holder
      and on the chosen worker at those decisions (the wait the policy avoided, and took);
    - ``left_recompute_s``: mean seconds of prefill a move added (blocks given up ×
      ``block_size`` ÷ ``prefill_rate``);
    - ``left_cost_gap``: median of the policy's own value on the holder minus on the chosen
      worker at those decisions (kvroute: cost in blocks; NaN when not exposed);
    - ``view_queue_ratio``: median over all decisions of the queue a kvroute Router counted on
      the chosen worker (``prefill_blocks`` × ``block_size`` ÷ ``prefill_rate``, seconds) ÷ the
      true backlog there, where both are above 0 (1 = exact; NaN for peers);
    - ``inflight_only``: share of available prefix blocks that were only in flight (not yet in
      any cache) at routing — what a router that sees only computed blocks cannot see;
    - ``lost``: blocks available at routing but evicted before admission ÷ all prompt blocks;
    - ``memory_wait_s``: median extra wait at admission beyond the backlog (memory pressure);
    - ``workers_per_session``: mean distinct workers a session's requests went to (NaN
      without sessions).
    """
    total = float(rows["prompt_blocks"].sum())
    avail_c = np.maximum(rows["chosen_cached"], rows["chosen_inflight"]).astype(np.int64)
    avail_h = np.maximum(rows["holder_cached"], rows["holder_inflight"]).astype(np.int64)
    left = avail_h > avail_c
    given_up = (avail_h - avail_c)[left]
    only_inflight = np.maximum(rows["holder_inflight"] - rows["holder_cached"], 0)
    view = rows["chosen_view_queue"] * block_size / prefill_rate
    backlog = rows["chosen_backlog_s"]
    ok = np.isfinite(view) & (view > 0) & (backlog > 0)
    wait = rows["admitted"] - rows["arrival"]
    extra = wait - rows["chosen_backlog_s"]
    out: dict[str, float] = {
        "requests": float(rows.shape[0]),
        "left": _share(float(left.sum()), rows.shape[0]),
        "left_blocks": _share(float(given_up.sum()), total),
        "left_holder_backlog_s": _median(rows["holder_backlog_s"][left]),
        "left_chosen_backlog_s": _median(rows["chosen_backlog_s"][left]),
        "left_recompute_s": float(given_up.mean()) * block_size / prefill_rate
        if left.any()
        else math.nan,
        "left_cost_gap": _median((rows["holder_score"] - rows["chosen_score"])[left]),
        "view_queue_ratio": _median(view[ok] / backlog[ok]),
        "inflight_only": _share(float(only_inflight.sum()), float(avail_h.sum())),
        "lost": _share(float(rows["lost"].sum()), total),
        "memory_wait_s": _median(extra[np.isfinite(extra)]),
        "workers_per_session": math.nan,
    }
    if sessions is not None and any(s is not None for s in sessions):
        spread: dict[str, set[int]] = {}
        for s, w in zip(sessions, rows["chosen"].tolist(), strict=True):
            if s is not None:
                spread.setdefault(s, set()).add(w)
        out["workers_per_session"] = float(np.mean([len(v) for v in spread.values()]))
    return out


def _median(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else math.nan


_EXPLAIN_COLUMNS = (
    ("left", "left holder", "{:.1%}"),
    ("left_blocks", "blocks given up", "{:.1%}"),
    ("left_holder_backlog_s", "holder backlog", "{:.2f} s"),
    ("left_chosen_backlog_s", "chosen backlog", "{:.2f} s"),
    ("left_recompute_s", "recompute", "{:.2f} s"),
    ("left_cost_gap", "cost gap", "{:.1f}"),
    ("view_queue_ratio", "queue seen/true", "{:.2f}"),
    ("inflight_only", "in-flight only", "{:.1%}"),
    ("lost", "lost queued", "{:.2%}"),
    ("memory_wait_s", "memory wait", "{:.2f} s"),
    ("workers_per_session", "workers/session", "{:.2f}"),
)


def render_explain(summaries: Mapping[str, Mapping[str, float]]) -> str:
    """The per-policy diagnoses as an aligned text table (see :func:`explain` for the columns:
    'left holder' = ``left``, 'holder backlog' / 'chosen backlog' / 'recompute' / 'cost gap' =
    the medians when it left, 'queue seen/true' = ``view_queue_ratio``, 'in-flight only',
    'lost queued', 'memory wait', 'workers/session')."""
    head = ["policy", *(label for _, label, _ in _EXPLAIN_COLUMNS)]
    table = [head]
    for name, s in summaries.items():
        cells = [name]
        for key, _, fmt in _EXPLAIN_COLUMNS:
            v = s.get(key, math.nan)
            cells.append("—" if not math.isfinite(v) else fmt.format(v))
        table.append(cells)
    widths = [max(len(r[c]) for r in table) for c in range(len(head))]
    lines = ["decisions (kvroute simulate --explain; see kvroute.sim.instruments)"]
    for k, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [r[c].rjust(widths[c]) for c in range(1, len(r))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def write_decisions(rows_by_policy: Mapping[str, np.ndarray], path: str | os.PathLike[str]):
    """Write every policy's decision rows to one CSV (a ``policy`` column first, then the
    :data:`DECISION_DTYPE` fields; worker columns are indexes, NaN written empty)."""
    names = list(DECISION_DTYPE.names or ())
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["policy", *names])
        for policy, rows in rows_by_policy.items():
            for r in rows.tolist():
                out.writerow([policy, *("" if isinstance(v, float) and v != v else v for v in r)])
