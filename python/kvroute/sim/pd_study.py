"""``kvroute simulate --pd``: the P/D modes side by side, and the conditional threshold's sweep.

:func:`pd_study` runs, at every point (P:D ratio × time scale), the aggregated and disaggregated
modes and the conditional mode at each threshold (:mod:`.pd`), all on the same arrivals.

The threshold's **loss** at a point is the mean, over TTFT p50, TTFT p99, TPOT p50 and TPOT p99,
of its excess over the best conditional threshold at that point for that metric (0 = best on all
four). :attr:`PdStudy.losses` gives it per threshold and point; the threshold with the smallest
worst-case loss over the points is the robust choice (:attr:`PdStudy.robust`): a default must
hold on workloads and fleets it was not tuned on, so the worst case, not the mean, decides.

Guarantees: deterministic for the same arguments; every run gets a fresh Router and fleet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .pd import PdModel, PdSummary, run_pd, summarize_pd
from .report import dump_json, text_table
from .sweep import comma_items
from .workloads import Workload

__all__ = ["PdPoint", "PdStudy", "parse_thresholds", "pd_study", "render_study"]

#: The metrics the loss averages.
LOSS_METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


def parse_thresholds(text: str) -> list[int]:
    """``"0,512,2048"`` → distinct thresholds (ints >= 0) in the order given."""
    out: list[int] = []
    for item in comma_items(text, "--pd-thresholds"):
        try:
            v = int(item)
        except ValueError:
            raise ValueError(f"--pd-thresholds: {item!r} is not a whole number of tokens") from None
        if v < 0:
            raise ValueError(f"--pd-thresholds: {v} is negative")
        if v not in out:
            out.append(v)
    return out


@dataclass
class PdPoint:
    """One ratio and time scale: ``modes`` maps ``aggregated``, ``disaggregated`` and
    ``conditional@T`` (threshold T; ``conditional`` for the Router's default) to summaries."""

    prefill: int
    decode: int
    time_scale: float
    modes: dict[str, PdSummary] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.prefill}:{self.decode} x{self.time_scale:g}"

    def conditional(self) -> dict[int, PdSummary]:
        """``{threshold: summary}`` of the conditional runs with an explicit threshold."""
        return {int(k.split("@")[1]): v for k, v in self.modes.items() if "@" in k}

    def losses(self) -> dict[int, float]:
        """Each threshold's loss at this point (see the module docs)."""
        runs = self.conditional()
        best = {m: min(getattr(s, m) for s in runs.values()) for m in LOSS_METRICS}
        return {
            t: sum(_excess(getattr(s, m), best[m]) for m in LOSS_METRICS) / len(LOSS_METRICS)
            for t, s in runs.items()
        }


def _excess(v: float, best: float) -> float:
    if math.isnan(v) or math.isnan(best):
        return math.nan
    return v / best - 1.0 if best > 0 else (0.0 if v <= best else math.inf)


@dataclass
class PdStudy:
    workload: str
    requests: int
    thresholds: list[int]
    points: list[PdPoint]

    def losses(self) -> dict[int, list[float]]:
        """``{threshold: [loss at each point]}``."""
        per_point = [p.losses() for p in self.points]
        return {t: [lp[t] for lp in per_point] for t in self.thresholds}

    @property
    def robust(self) -> int | None:
        """The threshold of least worst-case loss (ties: the smaller threshold); None without a
        threshold sweep."""
        if len(self.thresholds) < 2:
            return None
        losses = self.losses()
        return min(self.thresholds, key=lambda t: (max(losses[t]), t))

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "requests": self.requests,
            "thresholds": self.thresholds,
            "points": [
                {
                    "prefill": p.prefill,
                    "decode": p.decode,
                    "time_scale": p.time_scale,
                    "modes": {k: v.as_dict() for k, v in p.modes.items()},
                    "losses": {str(t): x for t, x in p.losses().items()},
                }
                for p in self.points
            ],
            "robust_threshold": self.robust,
        }

    def write_json(self, path: str) -> None:
        dump_json(self.to_json(), path)


def pd_study(
    workload: Workload,
    model: PdModel,
    *,
    ratios: Sequence[tuple[int, int]],
    time_scales: Sequence[float] = (1.0,),
    thresholds: Sequence[int] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> PdStudy:
    """Every mode at every (ratio, time scale); the conditional mode at each of ``thresholds``
    (None: once, at the Router's default). ``model`` gives everything but the pool sizes."""
    points = []
    for scale in time_scales:
        w = workload if scale == 1.0 else workload.time_scaled(scale)
        for p, d in ratios:
            m = replace(model, prefill=p, decode=d)
            point = PdPoint(p, d, float(scale))
            runs: list[tuple[str, str, int | None]] = [
                ("aggregated", "aggregated", None),
                ("disaggregated", "disaggregated", None),
            ]
            if thresholds is None:
                runs.append(("conditional", "conditional", None))
            else:
                runs += [(f"conditional@{t}", "conditional", t) for t in thresholds]
            for label, mode, t in runs:
                if progress is not None:
                    progress(f"{point.label} {label}")
                res = run_pd(w, m, mode, threshold=t, seed=seed)
                point.modes[label] = summarize_pd(res, 0 if mode == "aggregated" else p)
            points.append(point)
    return PdStudy(workload.name, len(workload), list(thresholds or []), points)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1%}"


def _s(x: float) -> str:
    return "-" if math.isnan(x) else (f"{x:.2f} s" if x >= 1 else f"{x * 1000:.0f} ms")


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.1f} ms"


def render_study(study: PdStudy) -> str:
    """The study as plain text: one table per point, then the threshold losses."""
    cols = ["mode", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "hit", "pool hit", "split"]
    out: list[str] = []
    for p in study.points:
        rows = [
            [
                label,
                _s(s.ttft_p50),
                _s(s.ttft_p99),
                _ms(s.tpot_p50),
                _ms(s.tpot_p99),
                _pct(s.hit_rate),
                _pct(s.prefill_pool_hit_rate),
                _pct(s.disaggregated),
            ]
            for label, s in p.modes.items()
        ]
        title = (
            f"{study.workload} ({study.requests:,} requests), {p.prefill} prefill + {p.decode} "
            f"decode workers (aggregated: {p.prefill + p.decode} doing both), time scale "
            f"{p.time_scale:g}"
        )
        out += text_table(title, cols, rows)
    if study.robust is not None:
        losses = study.losses()
        labels = [p.label for p in study.points]
        rows = [
            [str(t), *(_pct(x) for x in losses[t]), _pct(max(losses[t]))] for t in study.thresholds
        ]
        out += text_table(
            "conditional threshold: loss against the best threshold at each point "
            "(mean excess over TTFT p50/p99, TPOT p50/p99)",
            ["threshold", *labels, "worst"],
            rows,
        )
        out.append(f"least worst-case loss: threshold {study.robust} tokens")
    return "\n".join(out).rstrip() + "\n"
