"""Load sweeps: every policy at several offered loads, the curve router papers show.

:func:`sweep` replays one workload at each point of an axis — ``time-scale`` (arrival times
multiplied by the value: 0.5 = twice the load) or ``load`` (the offered load wanted, as a
fraction of the fleet's prefill capacity before caching; the arrival times are scaled to reach
it) — with :func:`~kvroute.sim.simulate.simulate`, so each point runs every policy on the same
arrivals plus both oracles. The result (:class:`Sweep`) prints as three tables (hit rate, TTFT
p50, TTFT p99 per point and policy), writes as JSON (:meth:`Sweep.to_json`) and plots hit rate
and TTFT p50/p99 against offered load (:func:`write_sweep_plot`).

When ``kv_aware`` and at least one peer emulation ran, :meth:`Sweep.verdicts` states at every
point how ``kv_aware`` compares with the best peer (the highest peer hit rate, the lowest peer
TTFT p50 and p99, each taken separately) and with the pooled-LRU oracle:
``hit ≥ 0.95 × best peer`` and ``hit ≥ 0.9 × oracle`` (where some policy reaches 0.9 × oracle:
the oracle ignores load, and at high load no placement can keep every prefix in one place), and
``TTFT p50, p99 ≤ 1.05 × best peer``; a point where both TTFT figures beat every peer passes
whatever the hit rate.

Offered load = prompt tokens per second ÷ (workers × prefill rate): 1.0 means the fleet could
just prefill every prompt with nothing cached.

Guarantees: points run in the order given, each on fresh policies (nothing is carried from one
point to the next); the same arguments give the same sweep.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engine import FleetModel
from .policies import DEFAULT_POLICIES, PEER_POLICIES
from .report import Report, _fmt_s, dump_json, pyplot, text_table
from .simulate import simulate, unbounded_load
from .workloads import Workload

__all__ = [
    "SWEEP_AXES",
    "Sweep",
    "SweepPoint",
    "offered_load",
    "parse_sweep",
    "positive_numbers",
    "render_sweep",
    "sweep",
    "write_sweep_json",
    "write_sweep_plot",
]

#: The axes a sweep can run along.
SWEEP_AXES = ("time-scale", "load")
#: The goal ``kv_aware`` is held to at every point (see the module docs).
HIT_VS_PEER, HIT_VS_ORACLE, TTFT_VS_PEER = 0.95, 0.9, 1.05


def positive_numbers(text: str, what: str) -> list[float]:
    """``"1,2,4"`` → [1.0, 2.0, 4.0], in the order given; ``ValueError`` naming ``what`` and the
    bad item unless every value is a finite number > 0 and there is at least one."""
    values: list[float] = []
    for item in comma_items(text, what):
        try:
            v = float(item)
        except ValueError:
            raise ValueError(f"{what}: {item!r} is not a number") from None
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{what}: values must be finite and > 0, got {item}")
        values.append(v)
    return values


def comma_items(text: str, what: str) -> list[str]:
    """The non-empty items of a comma-separated option value, stripped; ``ValueError`` naming
    ``what`` when there is none."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"{what}: no values given")
    return items


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``"time-scale=1,0.3,0.1"`` or ``"load=0.5,1,2"`` → (axis, values). Values must be finite
    and > 0; they run in the order given."""
    axis, sep, rest = text.partition("=")
    axis = axis.strip()
    if not sep or axis not in SWEEP_AXES:
        raise ValueError(
            f"--sweep must be AXIS=V1,V2,... with AXIS one of {', '.join(SWEEP_AXES)}; got {text!r}"
        )
    return axis, positive_numbers(rest, f"--sweep {axis}")


def offered_load(workload: Workload, model: FleetModel) -> float:
    """Prompt tokens per second ÷ the fleet's prefill capacity (see the module docs); ``inf``
    when the requests have no time span (:func:`unbounded_load`)."""
    if unbounded_load(workload) is not None:
        return math.inf
    rate = workload.summary()["prompt_tokens_per_s"]
    return float(rate) / (model.workers * model.prefill_rate)


@dataclass
class SweepPoint:
    """One point: the axis value, the time scale applied, the offered load, and its report."""

    value: float
    time_scale: float
    offered_load: float
    report: Report


@dataclass
class Sweep:
    """All the points of a sweep, in the order run."""

    axis: str
    points: list[SweepPoint] = field(default_factory=list)
    title: str = ""

    @property
    def policies(self) -> list[str]:
        return list(self.points[0].report.policies) if self.points else []

    def verdicts(self) -> list[dict[str, Any]] | None:
        """Per point, ``kv_aware`` against the best peer and the oracle (None without
        ``kv_aware`` or without a peer): ratios and ``ok`` (see the module docs)."""
        peers = [p for p in self.policies if p in PEER_POLICIES]
        if "kv_aware" not in self.policies or not peers:
            return None
        out = []
        for pt in self.points:
            pol = pt.report.policies
            kv = pol["kv_aware"]
            hit_by = max(peers, key=lambda p: pol[p].hit_rate)
            p50_by = min(peers, key=lambda p: pol[p].ttft_p50)
            p99_by = min(peers, key=lambda p: pol[p].ttft_p99)
            hit, p50, p99 = pol[hit_by].hit_rate, pol[p50_by].ttft_p50, pol[p99_by].ttft_p99
            oracle = pt.report.oracles["pooled_lru"].hit_rate
            best_any = max(m.hit_rate for m in pol.values())
            reachable = oracle > 0 and best_any >= HIT_VS_ORACLE * oracle
            hit_ok = kv.hit_rate >= HIT_VS_PEER * hit and (
                not reachable or kv.hit_rate >= HIT_VS_ORACLE * oracle
            )
            ttft_ok = kv.ttft_p50 <= TTFT_VS_PEER * p50 and kv.ttft_p99 <= TTFT_VS_PEER * p99
            beats = kv.ttft_p50 < p50 and kv.ttft_p99 < p99
            out.append(
                {
                    "value": pt.value,
                    "offered_load": pt.offered_load,
                    "kv_aware": {"hit": kv.hit_rate, "p50": kv.ttft_p50, "p99": kv.ttft_p99},
                    "best_peer": {
                        "hit": [hit_by, hit],
                        "p50": [p50_by, p50],
                        "p99": [p99_by, p99],
                    },
                    "oracle": oracle,
                    "hit_vs_peer": _ratio(kv.hit_rate, hit),
                    "hit_vs_oracle": _ratio(kv.hit_rate, oracle),
                    "oracle_reachable": reachable,
                    "p50_vs_peer": _ratio(kv.ttft_p50, p50),
                    "p99_vs_peer": _ratio(kv.ttft_p99, p99),
                    "ok": bool((hit_ok and ttft_ok) or beats),
                }
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """``{"axis", "title", "points": [{"value", "time_scale", "offered_load", "policies",
        "oracles"}], "verdicts"}`` — each point's ``policies`` / ``oracles`` exactly as in
        ``kvroute simulate --json``; ``verdicts`` as :meth:`verdicts` (null when not
        applicable)."""
        points = []
        for pt in self.points:
            doc = pt.report.to_json()
            points.append(
                {
                    "value": pt.value,
                    "time_scale": pt.time_scale,
                    "offered_load": pt.offered_load,
                    "policies": doc["policies"],
                    "oracles": doc["oracles"],
                }
            )
        return {
            "axis": self.axis,
            "title": self.title,
            "points": points,
            "verdicts": self.verdicts(),
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def sweep(
    workload: Workload,
    *,
    model: FleetModel,
    axis: str,
    values: Sequence[float],
    policies: Sequence[str] = DEFAULT_POLICIES,
    index: str = "events",
    seed: int = 0,
    progress: bool = True,
    policy_options: dict[str, dict[str, Any]] | None = None,
) -> Sweep:
    """Run :func:`~kvroute.sim.simulate.simulate` at every point of ``axis`` (see the module
    docs); ``workload`` is the unscaled workload."""
    if axis not in SWEEP_AXES:
        raise ValueError(f"axis must be one of {SWEEP_AXES}, got {axis!r}")
    natural = offered_load(workload, model)
    result = Sweep(axis=axis)
    for v in values:
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"sweep values must be finite and > 0, got {v}")
        if axis == "time-scale":
            scale = float(v)
        else:
            reason = unbounded_load(workload)
            if reason is not None:
                raise ValueError(
                    f"--sweep load=... cannot scale it: {reason} (spread the arrivals with "
                    "--spread SECONDS first)"
                )
            if natural <= 0:
                raise ValueError("the workload offers no load to scale")
            scale = natural / float(v)
        wl = workload if scale == 1.0 else workload.time_scaled(scale)
        report, _ = simulate(
            wl,
            model=model,
            policies=policies,
            index=index,
            seed=seed,
            progress=progress,
            policy_options=policy_options,
        )
        result.points.append(SweepPoint(float(v), scale, offered_load(wl, model), report))
        if not result.title:
            result.title = report.title
    return result


# ---------------------------------------------------------------------------------------------
# Text, JSON, plot
# ---------------------------------------------------------------------------------------------
def _table(title: str, head: list[str], rows: list[list[str]]) -> list[str]:
    return text_table(title, head, rows, left=0)  # every column holds numbers


def _axis_cells(s: Sweep, pt: SweepPoint) -> list[str]:
    load = "unbounded" if math.isinf(pt.offered_load) else f"{pt.offered_load:.0%}"
    return [f"{pt.value:g}", load]


def render_sweep(s: Sweep) -> str:
    """The sweep as plain text: hit rate (with the pooled-LRU oracle), TTFT p50, TTFT p99, and
    ``kv_aware`` against the best peer when :meth:`Sweep.verdicts` applies."""
    names = s.policies
    head = [s.axis, "offered", *names]
    out = [s.title, ""] if s.title else []
    hit_rows = [
        [
            *_axis_cells(s, pt),
            *(f"{pt.report.policies[n].hit_rate:.1%}" for n in names),
            f"{pt.report.oracles['pooled_lru'].hit_rate:.1%}",
        ]
        for pt in s.points
    ]
    out += _table("hit rate", [*head, "oracle"], hit_rows)
    for label, attr in (("TTFT p50", "ttft_p50"), ("TTFT p99", "ttft_p99")):
        rows = [
            [*_axis_cells(s, pt), *(_fmt_s(getattr(pt.report.policies[n], attr)) for n in names)]
            for pt in s.points
        ]
        out += _table(label, head, rows)
    verdicts = s.verdicts()
    if verdicts is not None:
        out += _table(
            "kv_aware against the best peer emulation (goal: hit >= 0.95x the best peer's and "
            ">= 0.9x the oracle's where reached, TTFT p50 and p99 <= 1.05x the best peer's; or "
            "both TTFTs below every peer's)",
            [
                s.axis,
                "offered",
                "kv_aware hit / p50 / p99",
                "best peer hit",
                "best peer p50",
                "best peer p99",
                "oracle",
                "goal",
            ],
            [_verdict_row(v) for v in verdicts],
        )
    return "\n".join(out).rstrip() + "\n"


def _short(peer: str) -> str:
    return {"sglang_cache_aware": "sglang"}.get(peer, peer)


def _verdict_row(v: dict[str, Any]) -> list[str]:
    kv, best = v["kv_aware"], v["best_peer"]
    oracle = f"{v['oracle']:.1%}" + ("" if v["oracle_reachable"] else " (unreached)")
    return [
        f"{v['value']:g}",
        f"{v['offered_load']:.0%}",
        f"{kv['hit']:.1%} / {_fmt_s(kv['p50'])} / {_fmt_s(kv['p99'])}",
        f"{best['hit'][1]:.1%} ({_short(best['hit'][0])})",
        f"{_fmt_s(best['p50'][1])} ({_short(best['p50'][0])})",
        f"{_fmt_s(best['p99'][1])} ({_short(best['p99'][0])})",
        oracle,
        "ok" if v["ok"] else "MISS",
    ]


def write_sweep_json(s: Sweep, path: str | os.PathLike[str]) -> None:
    """Write :meth:`Sweep.to_json` (UTF-8, indented, NaN as null)."""
    dump_json(s.to_json(), path)


def write_sweep_plot(s: Sweep, path: str | os.PathLike[str]) -> None:
    """A PNG with three panels against offered load (log scale): hit rate (the pooled-LRU oracle
    dashed), TTFT p50 and TTFT p99 (log scale). Needs matplotlib (the ``sim`` extra)."""
    plt = pyplot()
    x = np.array([pt.offered_load for pt in s.points])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name in s.policies:
        style = {"lw": 2.5} if name == "kv_aware" else {"lw": 1.2}
        axes[0].plot(
            x,
            [100 * pt.report.policies[name].hit_rate for pt in s.points],
            "o-",
            label=name,
            **style,
        )
        axes[1].plot(
            x, [pt.report.policies[name].ttft_p50 for pt in s.points], "o-", label=name, **style
        )
        axes[2].plot(
            x, [pt.report.policies[name].ttft_p99 for pt in s.points], "o-", label=name, **style
        )
    axes[0].plot(
        x,
        [100 * pt.report.oracles["pooled_lru"].hit_rate for pt in s.points],
        "k--",
        label="oracle: pooled LRU",
    )
    axes[0].set_ylabel("hit rate (% of prompt tokens)")
    axes[0].set_ylim(0, 100)
    axes[1].set_ylabel("TTFT p50 (s)")
    axes[2].set_ylabel("TTFT p99 (s)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("offered load (prompt tokens ÷ fleet prefill capacity)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[1:]:
        ax.set_yscale("log")
    axes[0].legend(fontsize="small")
    if s.title:
        fig.suptitle(s.title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
