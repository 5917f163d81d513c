"""Per-request results, policy metrics, and the simulator's report (table, JSON, plot).

The engine produces one :data:`RESULT_DTYPE` record per request (a NumPy structured array; see
:func:`empty_results`); everything in a report is computed from those records:

- ``hit_rate`` = Σ cached prompt tokens / Σ prompt tokens (token-weighted, all requests);
- ``ttft_p50`` / ``ttft_p90`` / ``ttft_p99`` / ``ttft_mean``: time to first token =
  ``first_token - arrival`` (seconds; percentiles by linear interpolation, NumPy's default);
  ``queue_p50`` / ``queue_p99``: ``prefill_start - arrival``;
- ``imbalance`` = max over workers of the prefill tokens a worker computed (prompt − cached
  tokens of the requests it served) ÷ their mean over **all** ``num_workers`` workers (idle ones
  count as 0); 1.0 is perfect balance, ``num_workers`` means one worker did everything; 1.0 when
  nothing was computed;
- ``makespan_s`` = last ``finish`` (or ``first_token`` where ``finish`` is NaN) − first arrival;
  ``throughput_rps`` = requests / makespan and ``prompt_tokens_per_s`` = prompt tokens / makespan.

Requests without a finite ``first_token`` count as ``unfinished`` and are left out of the TTFT
statistics (not of the token counts). :func:`write_json` writes exactly
``{"policies": {NAME: {...}}, "oracles": {"infinite": {...}, "pooled_lru": {...}}}`` plus, when
the report has a tenant study (:mod:`.tenant`), ``"tenant": {SETUP: {FIGURE: {"median", "min",
"max", "per_seed"}, "requests": [...]}}``, the same for the public traffic under ``"public"``,
``"seeds"``, and ``"pressure"`` / ``"pressure_wins_from"`` when a pressure sweep ran.
Rich tables and matplotlib plots are optional (``pip install kvroute[sim]``); without rich the
table is aligned plain text and the progress bar a plain stderr line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from .oracles import OracleResult

if TYPE_CHECKING:
    from .tenant import TenantStudy

__all__ = [
    "RESULT_DTYPE",
    "PolicyMetrics",
    "Progress",
    "Report",
    "RequestResult",
    "empty_results",
    "print_report",
    "render_table",
    "results_from_records",
    "summarize",
    "write_json",
    "write_plot",
]

RESULT_DTYPE = np.dtype(
    [
        ("request", np.int64),  # index into the workload
        ("worker", np.int32),  # index of the worker that served it (-1: never routed)
        ("arrival", np.float64),  # s
        ("prefill_start", np.float64),  # s, when its prefill began (after queueing)
        ("first_token", np.float64),  # s, end of prefill = first output token
        ("finish", np.float64),  # s, last output token (NaN if not modelled)
        ("prompt_tokens", np.int64),
        ("cached_tokens", np.int64),  # prompt tokens served from the worker's cache
        ("output_tokens", np.int64),
    ]
)


@dataclass(frozen=True)
class RequestResult:
    """One request's outcome (the record the engine produces; see :data:`RESULT_DTYPE`)."""

    request: int
    worker: int
    arrival: float
    prefill_start: float
    first_token: float
    finish: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


def empty_results(n: int) -> np.ndarray:
    """``n`` result records to fill in: times NaN, worker -1, counts 0."""
    out = np.zeros(n, dtype=RESULT_DTYPE)
    out["request"] = np.arange(n)
    out["worker"] = -1
    for f in ("arrival", "prefill_start", "first_token", "finish"):
        out[f] = np.nan
    return out


def results_from_records(records: Iterable[RequestResult]) -> np.ndarray:
    """A :data:`RESULT_DTYPE` array from :class:`RequestResult` objects."""
    rows = [tuple(asdict(r)[name] for name in RESULT_DTYPE.names) for r in records]
    return np.array(rows, dtype=RESULT_DTYPE)


@dataclass
class PolicyMetrics:
    """The numbers a report shows for one policy (or for one tenant's requests under it)."""

    requests: int
    unfinished: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    ttft_mean: float
    queue_p50: float
    queue_p99: float
    imbalance: float
    makespan_s: float
    throughput_rps: float
    prompt_tokens_per_s: float
    ttft_p90: float = math.nan
    worker_prefill_tokens: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return json_ready(asdict(self))


def json_ready(x: Any) -> Any:
    """``x`` with every float that is not finite (NaN, ±inf: JSON has none) replaced by None,
    through dicts, lists and tuples (tuples become lists, as JSON writes them)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    return x


def dump_json(doc: Any, path: str | os.PathLike[str]) -> None:
    """Writes ``doc`` to ``path`` (UTF-8, indented, non-finite numbers as null)."""
    text = json.dumps(json_ready(doc), indent=2, allow_nan=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else math.nan


def summarize(
    results: np.ndarray, *, num_workers: int, mask: np.ndarray | None = None
) -> PolicyMetrics:
    """Metrics of ``results`` (a :data:`RESULT_DTYPE` array), optionally of the ``mask``-ed rows.

    ``num_workers`` is the fleet size the imbalance is measured over (see the module docs).
    """
    if results.dtype != RESULT_DTYPE:
        raise TypeError("results must be a RESULT_DTYPE array (see kvroute.sim.report)")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    r = results if mask is None else results[np.asarray(mask, dtype=bool)]
    n = int(r.shape[0])
    prompt = int(r["prompt_tokens"].sum())
    cached = int(r["cached_tokens"].sum())
    if np.any(r["cached_tokens"] > r["prompt_tokens"]) or np.any(r["cached_tokens"] < 0):
        raise ValueError("cached_tokens must lie in [0, prompt_tokens] for every request")
    done = np.isfinite(r["first_token"])
    ttft = (r["first_token"] - r["arrival"])[done]
    queue = (r["prefill_start"] - r["arrival"])[done & np.isfinite(r["prefill_start"])]
    workers = r["worker"]
    if np.any(workers >= num_workers):
        raise ValueError(
            f"worker index {int(workers.max())} out of range for {num_workers} workers"
        )
    served = workers >= 0
    per_worker = np.bincount(
        workers[served],
        weights=(r["prompt_tokens"] - r["cached_tokens"])[served].astype(np.float64),
        minlength=num_workers,
    )
    mean = per_worker.mean()
    imbalance = float(per_worker.max() / mean) if mean > 0 else 1.0
    end = np.where(np.isfinite(r["finish"]), r["finish"], r["first_token"])
    end = end[np.isfinite(end)]
    makespan = float(end.max() - r["arrival"].min()) if end.size and n else 0.0
    return PolicyMetrics(
        requests=n,
        unfinished=int(n - done.sum()),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50=_pct(ttft, 50),
        ttft_p99=_pct(ttft, 99),
        ttft_mean=float(ttft.mean()) if ttft.size else math.nan,
        ttft_p90=_pct(ttft, 90),
        queue_p50=_pct(queue, 50),
        queue_p99=_pct(queue, 99),
        imbalance=imbalance,
        makespan_s=makespan,
        throughput_rps=n / makespan if makespan > 0 else 0.0,
        prompt_tokens_per_s=prompt / makespan if makespan > 0 else 0.0,
        worker_prefill_tokens=[int(x) for x in per_worker],
    )


ORACLE_NAMES = ("infinite", "pooled_lru")


@dataclass
class Report:
    """Everything ``kvroute simulate`` prints and writes: policies, oracles, tenant view."""

    policies: dict[str, PolicyMetrics]
    oracles: dict[str, OracleResult]
    tenant: TenantStudy | None = None
    title: str = ""
    notes: list[str] = field(default_factory=list)
    #: Per policy, the :func:`kvroute.sim.instruments.explain` summary (``--explain``).
    decisions: dict[str, dict[str, float]] | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (see the module docs); checks the required keys."""
        missing = [k for k in ORACLE_NAMES if k not in self.oracles]
        if missing:
            raise ValueError(f"report lacks oracle(s) {missing}; expected {list(ORACLE_NAMES)}")
        doc: dict[str, Any] = {
            "policies": {name: m.to_dict() for name, m in self.policies.items()},
            "oracles": {name: self.oracles[name].to_dict() for name in ORACLE_NAMES},
        }
        if self.tenant is not None:
            doc.update(self.tenant.to_json())
        if self.decisions is not None:
            doc["decisions"] = json_ready(self.decisions)
        return doc


def write_json(report: Report, path: str | os.PathLike[str]) -> None:
    """Write :meth:`Report.to_json` to ``path`` (UTF-8, indented, NaN written as null)."""
    dump_json(report.to_json(), path)


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------
_COLUMNS = (
    "policy",
    "hit rate",
    "TTFT p50",
    "TTFT p99",
    "imbalance",
    "req/s",
    "prompt tok/s",
    "requests",
)


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _policy_row(name: str, m: PolicyMetrics) -> list[str]:
    return [
        name,
        f"{m.hit_rate:.1%}",
        _fmt_s(m.ttft_p50),
        _fmt_s(m.ttft_p99),
        f"{m.imbalance:.2f}",
        f"{m.throughput_rps:.2f}",
        f"{m.prompt_tokens_per_s:,.0f}",
        f"{m.requests:,}" + (f" ({m.unfinished} unfinished)" if m.unfinished else ""),
    ]


def _oracle_row(name: str, o: OracleResult) -> list[str]:
    return [
        f"oracle: {name}",
        f"{o.hit_rate:.1%}",
        "—",
        "—",
        "—",
        "—",
        "—",
        f"{len(o.cached_blocks):,}",
    ]


Section = tuple[str, Sequence[str], list[list[str]]]


def _sections(report: Report) -> list[Section]:
    """(title, columns, rows) of every table of the report."""
    rows = [_policy_row(k, m) for k, m in report.policies.items()]
    rows += [_oracle_row(k, o) for k, o in report.oracles.items()]
    sections: list[Section] = [(report.title or "policies", _COLUMNS, rows)]
    if report.tenant is not None:
        sections.extend(report.tenant.sections())
    return sections


def text_table(
    title: str, columns: Sequence[str], rows: list[list[str]], *, left: int = 1
) -> list[str]:
    """The lines of an aligned plain-text table: ``title``, the header, a dashed rule, the rows
    and a blank line; the first ``left`` columns flush left, the others right."""
    table = [list(columns), *rows]
    widths = [max(len(r[c]) for r in table) for c in range(len(columns))]
    out = [title]
    for k, r in enumerate(table):
        cells = [v.ljust(widths[c]) if c < left else v.rjust(widths[c]) for c, v in enumerate(r)]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    out.append("")
    return out


def render_table(report: Report) -> str:
    """The report as aligned plain text (the fallback when rich is not installed)."""
    out: list[str] = []
    for title, columns, rows in _sections(report):
        out += text_table(title, columns, rows)
    out.extend(report.notes)
    if report.decisions:
        out.extend(["", _decisions_text(report)])
    return "\n".join(out).rstrip() + "\n"


def _decisions_text(report: Report) -> str:
    from .instruments import render_explain

    return render_explain(report.decisions or {})


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def print_report(report: Report, file: IO[str] | None = None, *, use_rich: bool | None = None):
    """Print the report: a rich table when rich is installed (or ``use_rich``), else plain text."""
    file = file if file is not None else sys.stdout
    if use_rich is None:
        use_rich = _rich_available()
    if not use_rich:
        file.write(render_table(report))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    is_tty = bool(getattr(file, "isatty", lambda: False)())
    console = Console(file=file, width=None if is_tty else 160)  # files: no column squeezing
    for title, columns, rows in _sections(report):
        table = Table(title=escape(title))
        for k, col in enumerate(columns):
            table.add_column(escape(col), justify="left" if k == 0 else "right")
        for r in rows:
            table.add_row(*map(escape, r))
        console.print(table)
    for note in report.notes:
        console.print(note, markup=False, highlight=False)
    if report.decisions:
        console.print("\n" + _decisions_text(report), markup=False, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------
class Progress:
    """A progress bar on stderr: rich's when installed, else one plain line rewritten in place
    (on a terminal) or a single line at the end (otherwise). Use as a context manager."""

    def __init__(
        self,
        total: int,
        description: str = "",
        *,
        file: IO[str] | None = None,
        use_rich: bool | None = None,
    ) -> None:
        self.total = max(0, int(total))
        self.description = description
        self.done = 0
        self.file = file if file is not None else sys.stderr
        self._tty = bool(getattr(self.file, "isatty", lambda: False)())
        self._use_rich = _rich_available() if use_rich is None else use_rich
        self._rich: Any = None
        self._task: Any = None
        self._last = 0.0

    def __enter__(self) -> Progress:
        if self._use_rich:
            from rich.console import Console
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(console=Console(file=self.file), transient=True)
            self._rich.__enter__()
            self._task = self._rich.add_task(self.description, total=self.total)
        return self

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def update(self, done: int) -> None:
        self.done = min(int(done), self.total) if self.total else int(done)
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done)
            return
        now = time.monotonic()
        if self._tty and (now - self._last >= 0.2 or self.done == self.total):
            self._last = now
            self.file.write(f"\r{self._line()}")
            self.file.flush()

    def _line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.description}: {self.done:,}/{self.total:,} ({pct:.0f}%)"

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
            return
        self.file.write(("\r" if self._tty else "") + self._line() + "\n")
        self.file.flush()


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------
def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend; ``ImportError`` naming the ``sim``
    extra when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib: pip install 'kvroute[sim]' (or matplotlib)"
        ) from e
    return plt


def write_plot(report: Report, path: str | os.PathLike[str]) -> None:
    """Write a PNG with hit rate (oracles as dashed lines) and TTFT p50/p99 per policy, and
    with a tenant study a second row: the tenant's TTFT figures per setup (median, min–max
    whiskers over the seeds) and its hit rate per setup or, when swept, against cache pressure.

    Raises ``ImportError`` naming the ``sim`` extra when matplotlib is not installed.
    """
    plt = pyplot()
    names = list(report.policies)
    x = np.arange(len(names))
    rows = 1 if report.tenant is None else 2
    fig, axes = plt.subplots(rows, 2, figsize=(max(11.0, 1.6 * len(names) + 4), 4.5 * rows))
    ax_hit, ax_ttft = axes[0] if rows == 2 else axes
    ax_hit.bar(x, [100 * report.policies[n].hit_rate for n in names], color="tab:blue")
    styles = {"infinite": "tab:green", "pooled_lru": "tab:orange"}
    for name, o in report.oracles.items():
        ax_hit.axhline(
            100 * o.hit_rate, ls="--", color=styles.get(name, "gray"), label=f"oracle: {name}"
        )
    ax_hit.set_ylabel("hit rate (% of prompt tokens)")
    ax_hit.set_ylim(0, 100)
    ax_hit.legend(loc="lower right", fontsize="small")
    width = 0.38
    ax_ttft.bar(x - width / 2, [report.policies[n].ttft_p50 for n in names], width, label="p50")
    ax_ttft.bar(x + width / 2, [report.policies[n].ttft_p99 for n in names], width, label="p99")
    ax_ttft.set_ylabel("TTFT (s)")
    ax_ttft.legend(fontsize="small")
    for ax in (ax_hit, ax_ttft):
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right")
    if report.tenant is not None:
        report.tenant.plot(axes[1][0], axes[1][1])
    if report.title:
        fig.suptitle(report.title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
