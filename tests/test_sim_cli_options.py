"""`kvroute simulate`'s option checks: a bad option or output file is refused before anything is
simulated (exit 2, a message naming the option and the value, no traceback), and an option that
does not apply to the chosen mode is refused, never silently ignored."""

from __future__ import annotations

import importlib
import json

import pytest
from kvroute.cli import main


@pytest.fixture
def no_run(monkeypatch):
    """Every simulation entry point of the CLI fails the test if it is reached."""

    def ran(*args, **kwargs):
        raise AssertionError("simulated before the options were checked")

    for module, name in (
        ("kvroute.sim.simulate", "simulate"),
        ("kvroute.sim.sweep", "sweep"),
        ("kvroute.sim.pd_study", "pd_study"),
        ("kvroute.sim.replicas", "replica_study"),
    ):
        monkeypatch.setattr(importlib.import_module(module), name, ran)


def refused(capsys, *args) -> str:
    assert main(["simulate", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute simulate: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--reserved-blocks", "100000"], "--reserved-blocks: 100000 per pool worker) do not fit"),
        (["--reserved-blocks", "-1"], "--reserved-blocks must be >= 0, got -1"),
        (["--warm-interval", "0"], "--warm-interval must be > 0 seconds and finite, got 0"),
        (["--warm-interval", "inf"], "--warm-interval must be > 0 seconds and finite, got inf"),
        (["--capacity-blocks", "10"], "default: 2x the tenant's system prompt: 126 per pool"),
        (["--seed", "-1"], "--seed must be in [0, 2**64), got -1"),
        (["--seed", str(2**64)], f"--seed must be in [0, 2**64), got {2**64}"),
        (["--seeds", f"{2**64 - 1}-{2**64}"], f"--seeds must be in [0, 2**64), got {2**64}"),
    ],
)
def test_endpoint_and_seed_values_refused_before_the_run(no_run, capsys, args, message):
    assert message in refused(capsys, "--duration", "30", *args)


def test_output_files_checked_before_the_run(no_run, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    base = ["--scenario", "rag", "--duration", "5"]
    for option in ("--json", "--decisions", "--export-trace"):
        err = refused(capsys, *base, option, "/nonexistent/dir/x.out")
        assert f"{option} /nonexistent/dir/x.out: directory /nonexistent/dir does not exist" in err
        err = refused(capsys, *base, option, str(tmp_path))
        assert f"{option} {tmp_path}: is a directory" in err
    err = refused(capsys, *base, "--plot", str(tmp_path / "x.txt"))
    assert "--plot" in err and "suffix .txt is not an image format" in err and "png" in err
    err = refused(capsys, *base, "--plot", str(tmp_path / "x"))
    assert "no suffix" in err
    # The --pd mode checks them too.
    err = refused(capsys, "--scenario", "mooncake", "--pd", "2:2", "--json", "/nonexistent/d/x")
    assert "--json /nonexistent/d/x" in err


TRACE = ["--scenario", "rag", "--duration", "5"]  # a workload without a tenant
TENANT = ["--duration", "5"]  # the endpoint scenario
REPLICAS = [*TRACE, "--policies", "kv_aware", "--replicas", "2"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [*TENANT, "--sweep", "time-scale=1", "--pool-size", "2"],
            "--pool-size does not apply to --sweep",
        ),
        (
            [*TENANT, "--sweep", "time-scale=1", "--priority", "0", "--reserved-blocks", "0"],
            "--priority, --reserved-blocks do not apply to --sweep",
        ),
        ([*TRACE, "--sweep", "load=1", "--replicas", "2"], "--sweep does not apply to --replicas"),
        (
            [*REPLICAS, "--decisions", "d.csv", "--plot", "r.png", "--explain"],
            "--decisions, --plot, --explain do not apply to --replicas",
        ),
        ([*REPLICAS, "--index", "events"], "--index does not apply to --replicas"),
        (
            [*REPLICAS, "--replica-scrape", "-1"],
            "--replica-scrape must be a finite number of seconds > 0, got -1",
        ),
        ([*REPLICAS[:-1], "x"], "--replicas must list counts >= 1, got 'x'"),
        (
            [
                "--scenario",
                "mooncake",
                "--pd",
                "2:2",
                "--index",
                "approx",
                "--pool-size",
                "3",
                "--priority",
                "0",
                "--reserved-blocks",
                "5",
                "--export-trace",
                "x.jsonl",
            ],
            "--index, --pool-size, --priority, --reserved-blocks, --export-trace do not apply to "
            "--pd",
        ),
        (
            ["--scenario", "mooncake", "--pd", "2:2", "--policies", ""],
            "--policies lists no policy",
        ),
        ([*TRACE, "--pool-size", "0"], "--pool-size must be >= 1, got 0"),
        (
            [*TRACE, "--priority", "9"],
            "--priority does not apply without a tenant: the dedicated endpoint is the endpoint "
            "scenario's (not --scenario rag's)",
        ),
        ([*TRACE, "--reserved-blocks", "5"], "--reserved-blocks does not apply without a tenant"),
        ([*TRACE, "--warm-interval", "5"], "--warm-interval does not apply without a tenant"),
        (
            ["--scenario", "mooncake", "--pd", "2:2", "--warm-interval", "5"],
            "--warm-interval do not apply to --pd",
        ),
        ([*TRACE, "--pd-thresholds", "1"], "--pd-thresholds does not apply without --pd"),
        ([*TRACE, "--replica-sync", "bogus"], "--replica-sync does not apply without --replicas"),
        ([*TRACE, "--replica-scrape", "1"], "--replica-scrape does not apply without --replicas"),
        ([*TRACE, "--requests", "0"], "--requests must be >= 1, got 0"),
        ([*TRACE, "--requests", "-5"], "--requests must be >= 1, got -5"),
        ([*TRACE, "--policies", ""], "--policies lists no policy, got ''"),
        ([*TRACE, "--policies", " , "], "--policies lists no policy, got ' , '"),
    ],
)
def test_options_that_do_not_apply_are_refused_before_the_run(no_run, capsys, args, message):
    assert message in refused(capsys, *args)


def test_seeds_are_exactly_the_ones_given(tmp_path, capsys):
    base = ["--duration", "10", "--workers", "4", "--policies", "kv_aware", "--quiet"]
    out = tmp_path / "s.json"
    assert main(["simulate", *base, "--seeds", "3-4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["seeds"] == [3, 4]  # not 0, 3, 4
    assert "kvroute index events, seed 3 \n" in capsys.readouterr().out  # the policies table
    assert main(["simulate", *base, "--seeds", "4,3", "--seed", "3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["seeds"] == [4, 3]  # in the order given
    err = refused(capsys, *base, "--seeds", "3-4", "--seed", "5")
    assert "--seed 5 is not among --seeds 3-4" in err


def test_export_warns_of_the_tenants_and_sessions_it_drops(tmp_path, capsys):
    path = tmp_path / "cc.jsonl"
    args = ["--scenario", "claude-code", "--requests", "8", "--policies", "random"]
    assert main(["simulate", "--quiet", *args, "--export-trace", str(path)]) == 0
    err = capsys.readouterr().err
    assert (
        f"kvroute simulate: warning: --export-trace {path}: Mooncake rows carry no tenant " in err
    )
    assert "sessions; replaying it routes every request as an anonymous public one" in err
    # A workload without tenants or sessions (the replay itself) exports without a warning.
    again = tmp_path / "again.jsonl"
    argv = ["simulate", "--quiet", "--trace", str(path), "--policies", "random"]
    assert main([*argv, "--export-trace", str(again)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert again.read_text() == path.read_text()
