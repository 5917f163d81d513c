"""A workload whose requests all arrive at one instant has no offered load as a rate: reported as
unbounded / n/a with the reason, and ``--sweep load=`` on it refused with that reason (it was
reported as 0% offered load and refused as 'no load')."""

from __future__ import annotations

import json
import math

import pytest
from kvroute.cli import main
from kvroute.sim.engine import FleetModel
from kvroute.sim.simulate import simulate
from kvroute.sim.sweep import offered_load, render_sweep, sweep
from kvroute.sim.traces import write_mooncake
from kvroute.sim.workloads import WorkloadBuilder


def burst(n: int = 6, at: float = 2.0):
    b = WorkloadBuilder(16)
    for i in range(n):
        b.add(at, [10 * i + 1, 10 * i + 2], 32, 4)
    return b.build(name="burst")


MODEL = FleetModel(workers=2)


def test_a_burst_offers_an_unbounded_load():
    w = burst()
    assert math.isinf(offered_load(w, MODEL))
    report, _ = simulate(w, model=MODEL, policies=["random"], progress=False)
    (note,) = [n for n in report.notes if n.startswith("Workload:")]
    assert note.startswith(
        "Workload: offered load n/a (all 6 requests arrive at the same instant (t = 2 s): no "
        "time span, the offered load is unbounded;"
    )
    assert "0%" not in note
    # One request more, a second later: a rate again.
    b = WorkloadBuilder(16)
    b.add(0.0, [1, 2], 32, 4)
    b.add(1.0, [3, 4], 32, 4)
    assert offered_load(b.build(name="two"), MODEL) == 64 / 1.0 / (2 * MODEL.prefill_rate)


def test_sweeping_a_burst():
    w = burst()
    with pytest.raises(ValueError, match="cannot scale it: all 6 requests arrive at the same"):
        sweep(w, model=MODEL, axis="load", values=[1.0], policies=["random"], progress=False)
    s = sweep(w, model=MODEL, axis="time-scale", values=[1.0], policies=["random"], progress=False)
    assert "unbounded" in render_sweep(s)


def test_cli_sweep_load_on_a_burst_trace(tmp_path, capsys):
    path = tmp_path / "burst.jsonl"
    write_mooncake(burst(), path)
    args = ["simulate", "--quiet", "--trace", str(path), "--policies", "random", "--workers", "2"]
    assert main([*args, "--sweep", "load=1"]) == 2
    assert "--sweep load=... cannot scale it: all 6 requests" in capsys.readouterr().err
    out = tmp_path / "o.json"
    assert main([*args, "--sweep", "time-scale=1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["points"][0]["offered_load"] is None  # JSON has no inf
