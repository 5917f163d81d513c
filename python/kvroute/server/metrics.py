"""Prometheus metrics for kvroute's servers, rendered in the text exposition format (0.0.4).

Hand-written (no dependency): counters, gauges read at scrape time, and cumulative histograms.
Every server part (the gateway, the EPP, the event relay) builds its series on one ``Registry``
and serves ``Registry.render()``. Updates happen on the server's event loop, so no lock is taken;
a scrape renders a consistent snapshot because rendering does not yield. Label sets must stay
bounded by the configuration (routes, configured models, workers, status codes, error kinds):
a label value taken from a request would let callers grow the registry without end.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["DEFAULT_BUCKETS", "Counter", "Gauge", "Histogram", "Registry"]

DEFAULT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=False)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.label_names = tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        if not self.values and not self.label_names:
            lines.append(f"{self.name} 0")
        for key, v in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, key)} {_number(v)}")
        return lines


class Gauge(_Metric):
    """A gauge whose samples are read from ``read()`` at scrape time."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help: str,
        labels: Sequence[str],
        read: Callable[[], Iterable[tuple[tuple[str, ...], float]]],
    ) -> None:
        super().__init__(name, help, labels)
        self.read = read

    def render(self) -> list[str]:
        lines = self.header()
        for key, v in sorted(self.read()):
            lines.append(f"{self.name}{_labels(self.label_names, key)} {_number(v)}")
        return lines


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        super().__init__(name, help, labels)
        self.bounds = tuple(sorted(buckets))
        self.series: dict[tuple[str, ...], list[float]] = {}  # per-bucket counts, then sum

    def observe(self, value: float, *labels: str) -> None:
        row = self.series.get(labels)
        if row is None:
            row = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        row[bisect.bisect_left(self.bounds, value)] += 1  # bucket i: value <= bounds[i]
        row[-1] += value

    def render(self) -> list[str]:
        lines = self.header()
        for key, row in sorted(self.series.items()):
            running = 0.0
            for bound, count in zip((*self.bounds, float("inf")), row, strict=False):
                running += count
                le = 'le="' + ("+Inf" if bound == float("inf") else repr(float(bound))) + '"'
                lines.append(
                    f"{self.name}_bucket{_labels(self.label_names, key, le)} {_number(running)}"
                )
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(row[-1])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {_number(running)}")
        return lines


M = TypeVar("M", bound=_Metric)


class Registry:
    """An ordered set of metrics rendered together."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: M) -> M:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
