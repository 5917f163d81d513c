"""`kvroute simulate` end to end: JSON schema, scenarios, trace files, determinism, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvroute.cli import main
from kvroute.sim.policies import DEFAULT_POLICIES
from kvroute.sim.synthetic import rag_scenario
from kvroute.sim.traces import load_mooncake, write_mooncake

FIELDS = {"hit_rate", "ttft_p50", "ttft_p99", "imbalance", "throughput_rps"}


def simulate(tmp_path, *args, name="out.json"):
    path = tmp_path / name
    assert main(["simulate", "--quiet", "--json", str(path), *args]) == 0
    return json.loads(path.read_text())


def check_metrics(m):
    assert FIELDS <= set(m)
    assert 0.0 <= m["hit_rate"] <= 1.0
    assert 0.0 < m["ttft_p50"] <= m["ttft_p99"]
    assert m["imbalance"] >= 1.0
    assert m["unfinished"] == 0


def test_endpoint_scenario_json_schema(tmp_path, capsys):
    doc = simulate(tmp_path, "--scenario", "endpoint", "--duration", "30", "--seed", "2")
    assert set(doc) == {"policies", "oracles", "tenant", "public", "seeds"}
    assert list(doc["policies"]) == list(DEFAULT_POLICIES)
    for m in doc["policies"].values():
        check_metrics(m)
    assert set(doc["oracles"]) == {"infinite", "pooled_lru"}
    for o in doc["oracles"].values():
        assert 0.0 <= o["hit_rate"] <= 1.0
    assert doc["oracles"]["pooled_lru"]["hit_rate"] <= doc["oracles"]["infinite"]["hit_rate"]
    assert doc["seeds"] == [2, 3, 4, 5, 6]  # --seed and the next four
    for section in ("tenant", "public"):
        assert list(doc[section]) == ["random", "kv_aware", "endpoint", "no_reserve"]
        for setup in doc[section].values():
            assert len(setup["requests"]) == 5 and min(setup["requests"]) > 0
            for figure in ("ttft_p50", "ttft_p99"):
                s = setup[figure]
                assert len(s["per_seed"]) == 5
                assert s["min"] <= s["median"] <= s["max"] == max(s["per_seed"])
    for setup in doc["tenant"].values():
        assert 0.0 <= setup["hit_rate"]["min"] <= setup["hit_rate"]["max"] <= 1.0
        assert setup["ttft_p50"]["median"] <= setup["ttft_p90"]["median"]
    out = capsys.readouterr().out
    assert "Two-call demo" in out
    # The modelling assumptions are disclosed: the reservation needs engine support (the
    # 'no reserve' row is shown by default), and every request is taken as streamed.
    assert "endpoint (kv_aware), no" in out and "needs engine support" in out
    assert "Every request is simulated as streamed" in out
    assert "call 1: 0/" in out


def test_tenant_seeds_and_pressure_sweep(tmp_path, capsys):
    doc = simulate(
        tmp_path,
        "--duration",
        "30",
        "--workers",
        "4",
        "--policies",
        "kv_aware",
        "--seeds",
        "1,3",
        "--pressure",
        "1,4",
        "--pool-size",
        "2",
        "--priority",
        "2",
    )
    assert doc["seeds"] == [1, 3]  # exactly --seeds; the policies table on the first
    assert [p["factor"] for p in doc["pressure"]] == [1.0, 4.0]
    assert [p["capacity_blocks"] for p in doc["pressure"]] == [6912, 1728]
    for p in doc["pressure"]:
        assert list(p["tenant"]) == ["kv_aware", "endpoint", "no_reserve"]
        assert p["turnover_s"] > 0
    # At ×1 the pressure sweep's kv_aware and endpoint are the tenant table's runs.
    at1 = doc["pressure"][0]["tenant"]
    assert (
        at1["endpoint"] == doc["tenant"]["endpoint"]
        and at1["kv_aware"] == doc["tenant"]["kv_aware"]
    )
    out = capsys.readouterr().out
    assert "tenant under cache pressure" in out and "pool of 2" in out and "priority 2" in out


def test_mooncake_and_synthetic_scenarios(tmp_path):
    doc = simulate(
        tmp_path,
        "--scenario",
        "mooncake",
        "--requests",
        "400",
        "--workers",
        "4",
        "--policies",
        "random,kv_aware,dynamo",
    )
    assert set(doc) == {"policies", "oracles"}
    assert list(doc["policies"]) == ["random", "kv_aware", "dynamo"]
    for scenario in ("rag", "agent"):
        doc = simulate(
            tmp_path,
            "--scenario",
            scenario,
            "--duration",
            "20",
            "--policies",
            "kv_aware,sglang_cache_aware,llmd",
            "--index",
            "approx",
        )
        for m in doc["policies"].values():
            check_metrics(m)


def test_same_seed_same_report_other_seed_differs(tmp_path):
    args = ["--scenario", "rag", "--duration", "20", "--seed", "5"]
    a = simulate(tmp_path, *args, name="a.json")
    b = simulate(tmp_path, *args, name="b.json")
    assert a == b
    c = simulate(tmp_path, "--scenario", "rag", "--duration", "20", "--seed", "6", name="c.json")
    assert c != a


def test_trace_file_round_trip(tmp_path):
    # A Mooncake export of a scenario, loaded back with --trace, keeps the sharing structure:
    # every policy whose choices do not depend on hash values gives the same numbers.
    w = rag_scenario(duration=20, block_size=512)
    path = tmp_path / "rag.jsonl"
    write_mooncake(w, path)
    back = load_mooncake(path)
    assert np.array_equal(back.input_tokens, w.input_tokens)
    assert np.array_equal(back.num_blocks, w.num_blocks)
    same = np.equal.outer(w.hashes, w.hashes)
    assert np.array_equal(same, np.equal.outer(back.hashes, back.hashes))
    policies = "random,round_robin,sglang_cache_aware,dynamo,llmd"
    direct = simulate(
        tmp_path,
        "--scenario",
        "rag",
        "--duration",
        "20",
        "--block-size",
        "512",
        "--policies",
        policies,
        name="direct.json",
    )
    replay = simulate(tmp_path, "--trace", str(path), "--policies", policies, name="replay.json")
    assert direct["oracles"] == replay["oracles"]
    for name in policies.split(","):
        a, b = direct["policies"][name], replay["policies"][name]
        # Same decisions, same cached tokens; times differ by the export's µs rounding only.
        assert a["cached_tokens"] == b["cached_tokens"], name
        assert a["worker_prefill_tokens"] == b["worker_prefill_tokens"], name
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-5), (name, k)


def test_kv_cache_tester_trace(tmp_path):
    trace = Path(__file__).parent / "data" / "traces" / "trace_0002.json"
    doc = simulate(
        tmp_path, "--trace", str(trace), "--policies", "kv_aware,dynamo", "--workers", "2"
    )
    for m in doc["policies"].values():
        check_metrics(m)
    assert doc["policies"]["kv_aware"]["hit_rate"] > 0.5  # one conversation: its prefix grows


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    simulate(tmp_path, "--scenario", "rag", "--duration", "10", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "random,nope"], "unknown policy 'nope'"),
        (["--workers", "0"], "workers must be >= 1"),
        (["--trace", "/nonexistent/trace.jsonl"], "trace.jsonl"),
        (["--prefill-rate", "0"], "prefill_rate"),
        (["--trace", "tests/data/traces/trace_0002.json", "--block-size", "16"], "Mooncake"),
        (["--scenario", "rag", "--seeds", "0-2"], "need a scenario with a tenant"),
        (["--duration", "5", "--seeds", "3-1"], "empty range '3-1'"),
        (["--duration", "5", "--seeds", "x"], "'x' is not a seed"),
        (["--duration", "5", "--pressure", "0"], "finite and > 0"),
        (["--duration", "5", "--pressure", "1,64"], "do not fit"),
    ],
)
def test_bad_arguments(args, message, capsys):
    assert main(["simulate", "--quiet", *args]) == 2
    assert message in capsys.readouterr().err


def test_sticky_still_there(capsys):
    assert main(["sticky", "--workers", "4", "--endpoints", "100", "--show", "1"]) == 0
    assert "Sticky routing" in capsys.readouterr().out
