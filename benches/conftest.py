"""Shared benchmark plumbing: peers run in the same process, and the summary prints ratios.

Each benchmark sets ``benchmark.group`` (one workload) and ``benchmark.extra_info["impl"]``
("kvroute" or the peer's name), and ``extra_info["ops"]`` when one round does many operations.
At the end of the session every peer in a group is compared with kvroute on the median time per
operation: ``speedup = peer / kvroute`` (> 1 means kvroute is faster).
"""

from __future__ import annotations

from collections import defaultdict

import pytest


@pytest.fixture
def per_call(benchmark):
    """``per_call(fn, *args)`` times single calls with a fixed number of calls per round.

    pytest-benchmark's calibration can settle on one call per round for a sub-microsecond
    function and then mostly time its own timer; fixing the counts treats every implementation
    in a group alike.
    """

    def run(fn, *args):
        return benchmark.pedantic(fn, args=args, iterations=2000, rounds=200, warmup_rounds=5)

    return run


def _per_op(bench) -> float:
    return bench.stats.median / float(bench.extra_info.get("ops", 1))


def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups = defaultdict(list)
    for bench in session.benchmarks:
        groups[bench.group].append(bench)
    terminalreporter.section("kvroute speedup vs peers (median time per op, same run)")
    for group in sorted(groups, key=str):
        items = groups[group]
        ours = [b for b in items if b.extra_info.get("impl") == "kvroute"]
        if not ours:
            continue
        best = min(ours, key=_per_op)
        for peer in sorted(items, key=lambda b: b.name):
            if peer.extra_info.get("impl") == "kvroute":
                continue
            ratio = _per_op(peer) / _per_op(best)
            terminalreporter.write_line(
                f"{group}: {peer.extra_info.get('impl')} {_per_op(peer) * 1e9:,.1f} ns/op, "
                f"kvroute {_per_op(best) * 1e9:,.1f} ns/op -> {ratio:,.1f}x"
            )
        cpu = {b.extra_info.get("impl"): b.extra_info.get("cpu_s_per_op") for b in items}
        if cpu.get("kvroute"):
            for impl, value in sorted(cpu.items()):
                if impl != "kvroute" and value:
                    terminalreporter.write_line(
                        f"{group}: CPU per op {impl} {value * 1e3:,.3f} ms, kvroute "
                        f"{cpu['kvroute'] * 1e3:,.3f} ms -> {value / cpu['kvroute']:,.2f}x"
                    )
