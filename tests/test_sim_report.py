"""Report metrics on hand-computed results, JSON schema, table, progress and plot."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
from kvroute.sim import (
    RESULT_DTYPE,
    Progress,
    Report,
    RequestResult,
    empty_results,
    infinite_cache,
    pooled_lru,
    print_report,
    render_table,
    results_from_records,
    summarize,
    write_json,
    write_plot,
)
from kvroute.sim.scenario import Endpoint
from kvroute.sim.tenant import SetupRuns, TenantStudy
from kvroute.sim.workloads import WorkloadBuilder

NAN = math.nan


def _results() -> np.ndarray:
    return results_from_records(
        [
            RequestResult(0, 0, 0.0, 0.0, 1.0, 2.0, 100, 0, 10),
            RequestResult(1, 1, 0.5, 1.0, 1.5, 3.0, 100, 60, 10),
            RequestResult(2, 0, 1.0, 2.0, 2.5, 4.0, 200, 100, 10),
            RequestResult(3, -1, 3.0, NAN, NAN, NAN, 50, 0, 10),
        ]
    )


def test_summarize_hand_computed():
    m = summarize(_results(), num_workers=3)
    assert (m.requests, m.unfinished, m.prompt_tokens, m.cached_tokens) == (4, 1, 450, 160)
    assert m.hit_rate == pytest.approx(160 / 450)
    assert m.ttft_p50 == pytest.approx(1.0)
    assert m.ttft_p99 == pytest.approx(1.49)  # linear interpolation over [1.0, 1.0, 1.5]
    assert m.ttft_mean == pytest.approx(3.5 / 3)
    assert (m.queue_p50, m.queue_p99) == (pytest.approx(0.5), pytest.approx(0.99))
    assert m.worker_prefill_tokens == [200, 40, 0]
    assert m.imbalance == pytest.approx(200 / 80)  # the idle third worker counts in the mean
    assert m.makespan_s == pytest.approx(4.0)
    assert m.throughput_rps == pytest.approx(1.0)
    assert m.prompt_tokens_per_s == pytest.approx(112.5)


def test_summarize_mask_and_edge_cases():
    r = _results()
    m = summarize(r, num_workers=2, mask=np.array([False, True, False, False]))
    assert (m.requests, m.hit_rate, m.ttft_p50, m.imbalance) == (1, 0.6, 1.0, 2.0)
    idle = summarize(r[3:], num_workers=2)
    assert idle.imbalance == 1.0 and math.isnan(idle.ttft_p50) and idle.makespan_s == 0.0
    no_finish = r.copy()
    no_finish["finish"] = NAN
    assert summarize(no_finish, num_workers=3).makespan_s == pytest.approx(2.5)
    bad = r.copy()
    bad["cached_tokens"][0] = 101
    with pytest.raises(ValueError, match="cached_tokens"):
        summarize(bad, num_workers=3)
    with pytest.raises(ValueError, match="out of range"):
        summarize(r, num_workers=1)
    with pytest.raises(TypeError, match="RESULT_DTYPE"):
        summarize(np.zeros(3), num_workers=1)


def test_empty_results_is_ready_to_fill():
    e = empty_results(3)
    assert e.dtype == RESULT_DTYPE
    assert e["request"].tolist() == [0, 1, 2] and e["worker"].tolist() == [-1, -1, -1]
    assert np.all(np.isnan(e["first_token"]))


def _report(with_tenant: bool = True) -> Report:
    b = WorkloadBuilder(4)
    b.add(0.0, np.array([1, 2], dtype=np.uint64), 8, 1)
    b.add(1.0, np.array([1, 2], dtype=np.uint64), 8, 1, tenant="t")
    w = b.build(name="w")
    res = _results()
    m = summarize(res, num_workers=3)
    tenant = None
    if with_tenant:
        mask = np.array([True, False, True, False])
        runs = SetupRuns(
            [summarize(res, num_workers=3, mask=mask)], [summarize(res, num_workers=3, mask=~mask)]
        )
        tenant = TenantStudy(
            tenant="t",
            endpoint=Endpoint("t"),
            policy="kv_aware",
            seeds=[0],
            setups={"random": runs, "kv_aware": runs, "endpoint": runs},
        )
    return Report(
        policies={"random": m, "kv_aware": m},
        oracles={"infinite": infinite_cache(w), "pooled_lru": pooled_lru(w, 1)},
        tenant=tenant,
        title="demo",
        notes=["a note"],
    )


def test_json_schema(tmp_path):
    path = tmp_path / "r.json"
    write_json(_report(), path)
    doc = json.loads(path.read_text())
    assert set(doc) == {"policies", "oracles", "tenant", "public", "seeds"}
    assert set(doc["policies"]) == {"random", "kv_aware"}
    assert set(doc["oracles"]) == {"infinite", "pooled_lru"}
    assert list(doc["tenant"]) == ["random", "kv_aware", "endpoint"]
    for key in ("hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "imbalance", "throughput_rps"):
        assert isinstance(doc["policies"]["random"][key], float)
    # The tenant's figures: median, min, max and the value per seed; requests per seed.
    p99 = doc["tenant"]["endpoint"]["ttft_p99"]
    assert set(p99) == {"median", "min", "max", "per_seed"} and len(p99["per_seed"]) == 1
    assert doc["tenant"]["endpoint"]["requests"] == [2] and doc["public"]["random"]["requests"] == [
        2
    ]
    assert doc["seeds"] == [0]
    assert doc["oracles"]["infinite"]["hit_rate"] == 0.5
    assert doc["oracles"]["pooled_lru"]["capacity_blocks"] == 1
    assert doc["oracles"]["pooled_lru"]["hit_rate"] == 0.25  # keeps the first block
    write_json(_report(with_tenant=False), path)
    assert set(json.loads(path.read_text())) == {"policies", "oracles"}


def test_json_requires_both_oracles():
    r = _report()
    del r.oracles["pooled_lru"]
    with pytest.raises(ValueError, match="pooled_lru"):
        r.to_json()


def test_json_writes_nan_as_null():
    r = _report(with_tenant=False)
    r.policies["random"] = summarize(_results()[3:], num_workers=1)
    assert r.to_json()["policies"]["random"]["ttft_p50"] is None


def test_plain_table():
    text = render_table(_report())
    lines = text.splitlines()
    assert lines[0] == "demo"
    header = lines[1].split()
    assert header[:3] == ["policy", "hit", "rate"]
    row = next(line for line in lines if line.startswith("kv_aware"))
    assert "35.6%" in row and "1.00 s" in row and "1.49 s" in row and "2.50" in row
    assert any(line.startswith("oracle: infinite") and "50.0%" in line for line in lines)
    assert "tenant 't': its own requests (seed 0)" in text and text.rstrip().endswith("a note")
    assert "public traffic (seed 0)" in text
    buf = io.StringIO()
    print_report(_report(), buf, use_rich=False)
    assert buf.getvalue() == text


def test_rich_table_when_available():
    pytest.importorskip("rich")
    buf = io.StringIO()
    print_report(_report(), buf, use_rich=True)
    out = buf.getvalue()
    assert "kv_aware" in out and "35.6%" in out and "oracle: pooled_lru" in out


def test_plain_progress_line():
    buf = io.StringIO()
    with Progress(10, "sim", file=buf, use_rich=False) as p:
        p.advance(4)
        p.update(10)
    assert buf.getvalue() == "sim: 10/10 (100%)\n"  # not a terminal: one line at the end


def test_plot_or_clear_import_error(tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"kvroute\[sim\]"):
            write_plot(_report(), tmp_path / "p.png")
        return
    write_plot(_report(), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
