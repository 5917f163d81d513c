"""Decision instruments: rows worked out by hand, explain() on them, a Recorder that only reads."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from kvroute.sim.engine import FleetModel, Policy, run
from kvroute.sim.instruments import DECISION_DTYPE, Recorder, explain, write_decisions
from kvroute.sim.policies import make_policy
from kvroute.sim.synthetic import agent_scenario
from support.sim_helpers import make_workload

# One block per second: 4-token blocks at 4 tokens/s, no overhead, no decode time.
MODEL = FleetModel(
    workers=2, capacity_blocks=100, prefill_rate=4.0, prefill_overhead=0.0, decode_time_per_token=0
)


class Fixed(Policy):
    """Sends request i to choices[i]."""

    name = "fixed"

    def __init__(self, choices):
        self.choices = choices

    def route(self, request, chain, now):
        return self.choices[request]


def recorded(workload, policy, model=MODEL):
    rec = Recorder(policy)
    results = run(workload, rec, model)
    return rec.rows(results), results


# r0 computes blocks [1..4] from t=0 to 4; r1 continues the conversation at t=1, while r0's
# prefix is still being computed (in flight, in no cache yet); r2 is unrelated.
CONVERSATION = [
    (0.0, [1, 2, 3, 4], 16, 1),
    (1.0, [1, 2, 3, 4, 5], 20, 1),
    (1.5, [9, 8], 8, 1),
]


def test_follow_up_sees_the_prefix_in_flight_and_the_backlog_ahead():
    rows, _ = recorded(make_workload(CONVERSATION), Fixed([0, 0, 1]))
    r1 = rows[1]
    assert (r1["chosen"], r1["holder"]) == (0, 0)
    assert (r1["chosen_cached"], r1["chosen_inflight"]) == (0, 4)
    assert r1["chosen_waiting"] == 0 and r1["chosen_running"] == 1
    assert r1["chosen_backlog_s"] == pytest.approx(3.0)  # r0's prefill left at t=1
    assert r1["chosen_backlog_s"] == pytest.approx(r1["admitted"] - r1["arrival"])
    assert (r1["admitted"], r1["admitted_cached"], r1["lost"]) == (4.0, 4, 0)
    assert r1["ttft"] == pytest.approx(4.0)  # 3 s queued + 1 block
    assert math.isnan(r1["chosen_score"])  # a policy that exposes no values
    assert rows[2]["holder"] == rows[2]["chosen"] == 1
    assert np.array_equal(rows["request"], np.arange(3))
    assert rows.dtype == DECISION_DTYPE


def test_leaving_the_holder_is_recorded_with_both_backlogs():
    rows, _ = recorded(make_workload(CONVERSATION), Fixed([0, 1, 1]))
    r1 = rows[1]
    assert (r1["chosen"], r1["holder"]) == (1, 0)
    assert (r1["holder_inflight"], r1["chosen_inflight"]) == (4, 0)
    assert r1["holder_backlog_s"] == pytest.approx(3.0)
    assert r1["chosen_backlog_s"] == 0.0
    s = explain(rows, block_size=4, prefill_rate=4.0, sessions=["a", "a", "b"])
    assert s["left"] == pytest.approx(1 / 3)
    assert s["left_blocks"] == pytest.approx(4 / 11)  # 4 of the 4 + 5 + 2 prompt blocks
    assert s["left_holder_backlog_s"] == pytest.approx(3.0)
    assert s["left_chosen_backlog_s"] == 0.0
    assert s["left_recompute_s"] == pytest.approx(4.0)  # 4 blocks of 4 tokens at 4 tokens/s
    assert s["inflight_only"] == pytest.approx(1.0)  # the only available prefix was in flight
    assert s["lost"] == 0.0
    assert s["workers_per_session"] == pytest.approx(1.5)  # "a" on 2 workers, "b" on 1


def test_blocks_evicted_while_queued_are_counted_as_lost():
    # One worker of 5 blocks: r2's 3-block prefix is cached when it is routed (t=4.5), but r1's
    # prefill (t=4..8) then inserts 4 blocks and the LRU evicts two of them before r2 starts.
    rows, res = recorded(
        make_workload(
            [
                (0.0, [1, 2, 3], 12, 1),
                (4.0, [7, 8, 9, 10], 16, 1),
                (4.5, [1, 2, 3, 4], 16, 1),
            ]
        ),
        Fixed([0, 0, 0]),
        FleetModel(
            workers=1,
            capacity_blocks=5,
            prefill_rate=4.0,
            prefill_overhead=0.0,
            decode_time_per_token=0,
        ),
    )
    r2 = rows[2]
    assert r2["chosen_cached"] == 3
    assert r2["chosen_backlog_s"] == pytest.approx(3.5)
    assert (r2["admitted"], r2["admitted_cached"], r2["lost"]) == (8.0, 1, 2)
    assert res["cached_tokens"][2] == 4
    s = explain(rows, block_size=4, prefill_rate=4.0)
    assert s["lost"] == pytest.approx(2 / 11)
    assert math.isnan(s["workers_per_session"])


@pytest.mark.parametrize("name", ["kv_aware", "random", "sglang_cache_aware", "dynamo", "llmd"])
def test_recorder_changes_no_decision(name):
    wl = agent_scenario(seed=3, duration=20)
    model = FleetModel(workers=4)
    alone = run(wl, make_policy(name, seed=1), model)
    rec = Recorder(make_policy(name, seed=1))
    watched = run(wl, rec, model)
    assert alone.tobytes() == watched.tobytes()
    rows = rec.rows(watched)
    assert np.array_equal(rows["chosen"], watched["worker"])
    assert np.all(rows["holder"] >= 0)
    # The holder has at least the prefix the chosen worker has; the row's TTFT is the run's.
    avail = lambda side: np.maximum(rows[f"{side}_cached"], rows[f"{side}_inflight"])  # noqa: E731
    assert np.all(avail("holder") >= avail("chosen"))
    assert np.allclose(rows["ttft"], watched["first_token"] - watched["arrival"])
    # FIFO without memory waits: the wait is the backlog found on the chosen worker.
    wait = watched["prefill_start"] - watched["arrival"]
    assert np.allclose(rows["chosen_backlog_s"], wait, atol=1e-9)
    if name == "kv_aware":  # kvroute's Router exposes its cost and the load terms it read
        assert np.all(np.isfinite(rows["chosen_score"]))
        assert np.all(rows["chosen_score"] <= rows["holder_score"] + 1e-9)
        assert np.all(np.isfinite(rows["chosen_view_queue"]))


def test_write_decisions_csv(tmp_path):
    rows, _ = recorded(make_workload(CONVERSATION), Fixed([0, 1, 1]))
    path = tmp_path / "d.csv"
    write_decisions({"fixed": rows, "again": rows}, path)
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["policy", *DECISION_DTYPE.names]
    assert len(table) == 1 + 2 * len(rows)
    assert table[2][0] == "fixed" and table[2][table[0].index("holder")] == "0"
    assert table[1][table[0].index("chosen_score")] == ""  # NaN written empty


def test_cli_explain_and_decisions(tmp_path, capsys):
    from kvroute.cli import main

    out, dec = tmp_path / "r.json", tmp_path / "d.csv"
    args = ["simulate", "--quiet", "--scenario", "claude-code", "--requests", "30"]
    args += ["--workers", "2", "--policies", "kv_aware,llmd", "--time-scale", "0.05"]
    assert main([*args, "--explain", "--decisions", str(dec), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decisions (kvroute simulate --explain" in text and "in-flight only" in text
    doc = json.loads(out.read_text())
    assert set(doc["decisions"]) == {"kv_aware", "llmd"}
    assert 0.0 <= doc["decisions"]["llmd"]["left"] <= 1.0
    with open(dec, newline="") as f:
        assert sum(1 for _ in f) == 1 + 2 * 30
