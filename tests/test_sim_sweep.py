"""Load sweeps: axis parsing, the points' scaling and structure, verdicts, text, JSON, plot, CLI."""

from __future__ import annotations

import json
import math

import pytest
from kvroute.cli import main
from kvroute.sim.engine import FleetModel
from kvroute.sim.report import Report
from kvroute.sim.sweep import (
    Sweep,
    SweepPoint,
    offered_load,
    parse_sweep,
    render_sweep,
    sweep,
    write_sweep_json,
    write_sweep_plot,
)
from kvroute.sim.synthetic import rag_scenario
from support.sim_helpers import metrics

POLICIES = ["random", "kv_aware", "llmd"]


@pytest.fixture(scope="module")
def small():
    wl = rag_scenario(seed=2, duration=15, rate=4.0)
    model = FleetModel(workers=2)
    result = sweep(
        wl, model=model, axis="time-scale", values=[1, 0.5], policies=POLICIES, progress=False
    )
    return wl, model, result


def test_parse_sweep():
    assert parse_sweep("time-scale=1,0.3, 0.1") == ("time-scale", [1.0, 0.3, 0.1])
    assert parse_sweep("load=0.5,2") == ("load", [0.5, 2.0])
    for bad, match in [
        ("time-scale", "AXIS=V1"),
        ("speed=1,2", "AXIS=V1"),
        ("load=", "no values"),
        ("load=1,x", "'x' is not a number"),
        ("time-scale=1,0", "finite and > 0"),
        ("load=inf", "finite and > 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_sweep(bad)


def test_time_scale_points_scale_the_offered_load(small):
    wl, model, s = small
    assert s.axis == "time-scale" and s.policies == POLICIES
    assert [pt.value for pt in s.points] == [1.0, 0.5]
    assert [pt.time_scale for pt in s.points] == [1.0, 0.5]
    base = offered_load(wl, model)
    assert s.points[0].offered_load == pytest.approx(base)
    assert s.points[1].offered_load == pytest.approx(2 * base, rel=1e-6)
    for pt in s.points:
        assert list(pt.report.policies) == POLICIES
        assert set(pt.report.oracles) == {"infinite", "pooled_lru"}
        for m in pt.report.policies.values():
            assert m.requests == len(wl) and m.unfinished == 0


def test_load_axis_reaches_the_requested_load():
    wl = rag_scenario(seed=2, duration=15, rate=4.0)
    model = FleetModel(workers=2)
    s = sweep(wl, model=model, axis="load", values=[0.2, 0.6], policies=["random"], progress=False)
    assert [pt.offered_load for pt in s.points] == pytest.approx([0.2, 0.6], rel=1e-6)
    assert s.points[1].time_scale == pytest.approx(s.points[0].time_scale / 3)
    assert s.verdicts() is None  # no kv_aware against a peer here


def test_json_text_and_plot(small, tmp_path):
    _, _, s = small
    path = tmp_path / "sweep.json"
    write_sweep_json(s, path)
    doc = json.loads(path.read_text())
    assert set(doc) == {"axis", "title", "points", "verdicts"}
    assert [p["value"] for p in doc["points"]] == [1.0, 0.5]
    for p in doc["points"]:
        assert set(p) == {"value", "time_scale", "offered_load", "policies", "oracles"}
        assert list(p["policies"]) == POLICIES
        assert {"hit_rate", "ttft_p50", "ttft_p99"} <= set(p["policies"]["kv_aware"])
    assert len(doc["verdicts"]) == 2
    assert set(doc["verdicts"][0]) == {
        "value",
        "offered_load",
        "kv_aware",
        "best_peer",
        "oracle",
        "hit_vs_peer",
        "hit_vs_oracle",
        "oracle_reachable",
        "p50_vs_peer",
        "p99_vs_peer",
        "ok",
    }
    text = render_sweep(s)
    for title in ("hit rate", "TTFT p50", "TTFT p99", "kv_aware against the best peer"):
        assert title in text
    assert text.count("\n0.5 ") + text.count("   0.5 ") >= 1
    pytest.importorskip("matplotlib", reason="matplotlib is in the sim extra make installs")
    png = tmp_path / "sweep.png"
    write_sweep_plot(s, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _metrics(hit, p50, p99):
    return metrics(hit=hit, mean=p50, p50=p50, p99=p99)


class _Oracle:
    def __init__(self, hit):
        self.hit_rate = hit


@pytest.mark.parametrize(
    ("kv", "ok"),
    [
        ((0.50, 1.00, 2.00), True),  # as good as the best peer on every figure
        ((0.48, 1.05, 2.10), True),  # within 0.95x hit and 1.05x TTFT
        ((0.47, 1.00, 2.00), False),  # hit below 0.95x the best peer's 0.5
        ((0.50, 1.06, 2.00), False),  # p50 over 1.05x the best peer's
        ((0.30, 0.90, 1.90), True),  # lower hit, but both TTFTs beat every peer
        ((0.30, 0.90, 2.01), False),  # ... not when one of them does not
    ],
)
def test_verdict_rules(kv, ok):
    # Best peer figures taken separately: hit 0.5 (llmd), p50 1.0 (dynamo), p99 2.0 (llmd).
    policies = {
        "kv_aware": _metrics(*kv),
        "llmd": _metrics(0.5, 1.2, 2.0),
        "dynamo": _metrics(0.4, 1.0, 3.0),
        "random": _metrics(0.1, 0.5, 1.0),  # not a peer: never the reference
    }
    report = Report(policies=policies, oracles={"pooled_lru": _Oracle(0.52)})
    s = Sweep(axis="load", points=[SweepPoint(1.0, 1.0, 1.0, report)])
    (v,) = s.verdicts()
    assert v["ok"] is ok
    assert v["hit_vs_peer"] == pytest.approx(kv[0] / 0.5)
    assert v["p99_vs_peer"] == pytest.approx(kv[2] / 2.0)
    assert v["oracle_reachable"] is True  # llmd reaches 0.5 >= 0.9 x 0.52
    assert v["best_peer"] == {"hit": ["llmd", 0.5], "p50": ["dynamo", 1.0], "p99": ["llmd", 2.0]}


def test_unreached_oracle_is_not_a_bar():
    policies = {"kv_aware": _metrics(0.5, 1.0, 2.0), "llmd": _metrics(0.5, 1.0, 2.0)}
    report = Report(policies=policies, oracles={"pooled_lru": _Oracle(0.9)})
    (v,) = Sweep(axis="load", points=[SweepPoint(1.0, 1.0, 1.0, report)]).verdicts()
    assert v["oracle_reachable"] is False and v["ok"] is True
    assert math.isclose(v["hit_vs_oracle"], 0.5 / 0.9)


def test_cli_sweep(tmp_path, capsys):
    out = tmp_path / "s.json"
    png = tmp_path / "s.png"
    args = ["simulate", "--quiet", "--scenario", "rag", "--duration", "10", "--workers", "2"]
    args += ["--policies", "random,kv_aware,dynamo", "--sweep", "time-scale=1,0.5"]
    assert main([*args, "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "TTFT p99" in text and "kv_aware against the best peer" in text
    doc = json.loads(out.read_text())
    assert doc["axis"] == "time-scale" and len(doc["points"]) == 2
    assert png.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sweep", "speed=2"], "AXIS=V1"),
        (["--sweep", "load=1", "--time-scale", "0.5"], "exclusive"),
        (["--sweep", "load=1", "--explain"], "one run"),
    ],
)
def test_cli_sweep_errors(extra, message, capsys):
    assert main(["simulate", "--quiet", "--scenario", "rag", *extra]) == 2
    assert message in capsys.readouterr().err
