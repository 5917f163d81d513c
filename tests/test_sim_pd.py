"""The P/D fleet model (kvroute.sim.pd) against a pure-Python reference of its timing, and the
conditional mode's two ends against the other modes."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from kvroute.cli import main
from kvroute.sim.pd import PdModel, run_pd, summarize_pd
from kvroute.sim.pd_study import parse_thresholds
from support.sim_helpers import make_workload

BS = 16
MODEL = PdModel(prefill=1, decode=1)


def reference(rows, model, split):
    """Times of ``rows`` (arrival, block ids, prompt, output) on ONE worker doing both phases
    (``split`` False) or one prefill + one decode worker (``split`` True), from the model's
    rules, stepping from event to event with every request's remaining work (no virtual clock):
    no block is shared, so nothing is cached. Returns ``[(first token, finish)]``."""
    rate, chunk = model.prefill_rate, model.prefill_chunk / model.prefill_rate
    n = len(rows)
    first, finish = [math.nan] * n, [math.nan] * n
    # worker -> {"queue", "pre": [request, work left] | None, "dec": {request: tokens left}}
    ws = [{"queue": [], "pre": None, "dec": {}} for _ in range(2 if split else 1)]
    transfers = {}  # request -> arrival time at the decode worker
    arrivals = list(range(n))
    now = 0.0

    def step(w):
        s = model.decode_step_time + model.decode_kv_time_per_token * sum(
            rows[i][2] for i in w["dec"]
        )
        return s + chunk if w["pre"] is not None else s

    def rates(w):
        """(prefill work per second, decode tokens per second)."""
        if not w["dec"]:
            return (1.0 if w["pre"] is not None else 0.0), 0.0
        s = step(w)
        return (chunk / s if w["pre"] is not None else 0.0), 1.0 / s

    def start(w):
        if w["pre"] is None and w["queue"]:
            i = w["queue"].pop(0)
            w["pre"] = [i, model.prefill_overhead + rows[i][2] / rate]

    def join(w, i, t):
        first[i] = t
        if rows[i][3] <= 1:
            finish[i] = t
        else:
            w["dec"][i] = float(rows[i][3] - 1)

    while arrivals or transfers or any(w["pre"] or w["dec"] or w["queue"] for w in ws):
        # The next event: an arrival, a transfer's end, a prefill's or a decode's end.
        cands = []
        if arrivals:
            cands.append((rows[arrivals[0]][0], "arrive", arrivals[0]))
        for i, t in transfers.items():
            cands.append((t, "transfer", i))
        for k, w in enumerate(ws):
            pr, dr = rates(w)
            if w["pre"] is not None:
                cands.append((now + w["pre"][1] / pr, "prefill", k))
            for i, left in w["dec"].items():
                cands.append((now + left / dr, "decode", (k, i)))
        t, kind, x = min(cands, key=lambda c: (c[0], c[1] != "decode"))
        for w in ws:  # advance everyone to t
            pr, dr = rates(w)
            if w["pre"] is not None:
                w["pre"][1] -= (t - now) * pr
            for i in w["dec"]:
                w["dec"][i] -= (t - now) * dr
        now = t
        if kind == "arrive":
            arrivals.pop(0)
            ws[0]["queue"].append(x)
            start(ws[0])
        elif kind == "prefill":
            w = ws[x]
            i = w["pre"][0]
            w["pre"] = None
            if split:
                transfers[i] = (
                    now
                    + model.kv_transfer_overhead
                    + (rows[i][2] * model.kv_transfer_time_per_token)
                )
            else:
                join(w, i, now)
            start(w)
        elif kind == "transfer":
            del transfers[x]
            join(ws[1], x, now)
        else:
            k, i = x
            del ws[k]["dec"][i]
            finish[i] = now
    return list(zip(first, finish, strict=True))


def distinct_rows(n, seed, *, prompt=(16, 4000), output=(1, 300), gap=0.3):
    """``n`` requests with no shared block, seeded arrival / prompt / output."""
    rng = random.Random(seed)
    rows, t, next_id = [], 0.0, 1
    for _ in range(n):
        t += rng.expovariate(1 / gap)
        p = rng.randint(*prompt)
        blocks = list(range(next_id, next_id + p // BS))
        next_id += len(blocks) + 1
        rows.append((t, blocks, p, rng.randint(*output)))
    return rows


def times(res):
    return list(zip(res["first_token"].tolist(), res["finish"].tolist(), strict=True))


def test_one_request_closed_form():
    rows = [(1.0, list(range(1, 501)), 8000, 101)]
    w = make_workload(rows, block_size=BS)
    m = MODEL
    tpot = m.decode_step_time + m.decode_kv_time_per_token * 8000
    prefill = m.prefill_overhead + 8000 / m.prefill_rate
    transfer = m.kv_transfer_overhead + 8000 * m.kv_transfer_time_per_token
    (r,) = run_pd(w, m, "disaggregated")
    assert r["first_token"] - 1.0 == pytest.approx(prefill + transfer, abs=1e-9)
    assert r["finish"] - r["first_token"] == pytest.approx(100 * tpot, abs=1e-9)
    assert (r["prefill_worker"], r["decode_worker"], r["disaggregated"]) == (0, 1, True)
    (r,) = run_pd(w, PdModel(prefill=0, decode=1), "aggregated")
    assert r["first_token"] - 1.0 == pytest.approx(prefill, abs=1e-9)
    assert r["finish"] - r["first_token"] == pytest.approx(100 * tpot, abs=1e-9)


def test_progress_is_reported_every_256_arrivals_and_at_the_end():
    # The same reports as `kvroute.sim.engine.run`: each 256th request routed, then all.
    w = make_workload([(float(k), [k % 7], 4, 1) for k in range(600)], block_size=BS)
    seen = []
    run_pd(w, PdModel(prefill=1, decode=1), "aggregated", progress=seen.append)
    assert seen == [256, 512, 600]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("split", [False, True])
def test_matches_reference_model(seed, split):
    rows = distinct_rows(25, seed)
    w = make_workload(rows, block_size=BS)
    model = MODEL if split else PdModel(prefill=0, decode=1)
    res = run_pd(w, model, "disaggregated" if split else "aggregated")
    want = reference(rows, model, split)
    np.testing.assert_allclose(times(res), want, rtol=1e-9, atol=1e-7)
    assert (res["cached_tokens"] == 0).all()


def interference_rows():
    """Long chats decoding while long documents arrive: prefills stall decodes when shared."""
    rows, next_id = [], 1
    for k in range(40):
        p = 200 if k % 2 == 0 else 12_000
        out = 400 if k % 2 == 0 else 2
        blocks = list(range(next_id, next_id + p // BS))
        next_id += len(blocks) + 1
        rows.append((k * 0.5, blocks, p, out))
    return make_workload(rows, block_size=BS)


def tiny_rows():
    """Short prompts, short answers: nothing to gain from moving KV."""
    rows = distinct_rows(60, 9, prompt=(16, 64), output=(2, 20), gap=0.2)
    return make_workload(rows, block_size=BS)


def test_disaggregation_wins_on_interference():
    w = interference_rows()
    m = PdModel(prefill=1, decode=1)
    agg = summarize_pd(run_pd(w, m, "aggregated"), 0)
    dis = summarize_pd(run_pd(w, m, "disaggregated"), 1)
    assert dis.tpot_p99 < 0.5 * agg.tpot_p99
    assert dis.tpot_p50 < agg.tpot_p50


def test_disaggregation_loses_on_tiny_prompts():
    w = tiny_rows()
    m = PdModel(prefill=1, decode=1)
    agg = summarize_pd(run_pd(w, m, "aggregated"), 0)
    dis = summarize_pd(run_pd(w, m, "disaggregated"), 1)
    assert dis.ttft_p50 > agg.ttft_p50 + m.kv_transfer_overhead * 0.9
    # ... and the conditional mode at the default threshold keeps them local.
    cond = summarize_pd(run_pd(w, m, "conditional"), 1)
    assert cond.disaggregated == 0.0
    assert cond.ttft_p50 < dis.ttft_p50


def test_threshold_zero_is_disaggregated():
    w = make_workload(distinct_rows(40, 4), block_size=BS)
    m = PdModel(prefill=2, decode=3)
    zero = run_pd(w, m, "conditional", threshold=0)
    assert zero["disaggregated"].all()
    np.testing.assert_array_equal(zero, run_pd(w, m, "disaggregated"))


def test_infinite_threshold_is_local_prefill():
    w = make_workload(distinct_rows(40, 5), block_size=BS)
    big = run_pd(w, PdModel(prefill=2, decode=3), "conditional", threshold=2**40)
    alone = run_pd(w, PdModel(prefill=0, decode=3), "conditional")  # no prefill worker at all
    assert not big["disaggregated"].any()
    np.testing.assert_array_equal(big["decode_worker"] - 2, alone["decode_worker"])
    np.testing.assert_array_equal(big["prefill_worker"], big["decode_worker"])
    np.testing.assert_allclose(times(big), times(alone), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated", "conditional"])
def test_router_index_mirrors_every_cache(mode):
    """The Router's index is fed only by the workers' KV events: at the end it holds, for every
    prompt and worker, the prefix that worker's cache holds (small caches: evictions too, and
    the decode workers cache the prompts they receive)."""
    rows = []
    for k in range(60):
        doc = k % 7
        rows.append((k * 0.05, list(range(1000 * doc + 1, 1000 * doc + 41 + k % 3)), 700, 5))
    w = make_workload(rows, block_size=BS)
    seen = {}

    def inspect(router, caches):
        seen["router"], seen["caches"] = router, caches

    model = PdModel(prefill=2, decode=2, capacity_blocks=90)
    threshold = 256 if mode == "conditional" else None
    res = run_pd(w, model, mode, threshold=threshold, inspect=inspect)
    router, caches = seen["router"], seen["caches"]
    names = ["p00", "p01", "d00", "d01"]
    held = 0
    for i in range(len(w)):
        chain = w.block_hashes(i)
        found = router.index.match(chain)
        for k, name in enumerate(names):
            depth = caches[k].match(chain)
            held += depth
            assert found.get(name, 0) == depth, (i, name)
    assert held > 0
    assert res["finish"].max() > 0


def test_cli_pd_json(tmp_path, capsys):
    path = tmp_path / "pd.json"
    args = ["simulate", "--quiet", "--scenario", "rag", "--requests", "120", "--pd", "1:2,2:1"]
    assert main([*args, "--pd-thresholds", "0,4096", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "least worst-case loss: threshold" in text
    doc = json.loads(path.read_text())
    assert [(p["prefill"], p["decode"]) for p in doc["points"]] == [(1, 2), (2, 1)]
    modes = doc["points"][0]["modes"]
    assert set(modes) == {"aggregated", "disaggregated", "conditional@0", "conditional@4096"}
    assert modes["disaggregated"]["disaggregated"] == 1.0
    assert doc["robust_threshold"] in (0, 4096)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pd", "4"], "P:D"),
        (["--pd", "1:0"], "D >= 1"),
        (["--pd", "0:4"], "--pd needs P >= 1 prefill and D >= 1 decode workers, got '0:4'"),
        (["--pd", "1:1", "--policies", "kv_aware"], "--policies"),
        (["--pd", "1:1", "--pd-thresholds", "-3"], "negative"),
        (["--pd", "1:1", "--sweep", "load=1,2"], "time-scale"),
    ],
)
def test_cli_pd_bad_arguments(args, message, capsys):
    assert main(["simulate", "--quiet", "--scenario", "rag", *args]) == 2
    assert message in capsys.readouterr().err


def test_parse_thresholds():
    assert parse_thresholds("0, 512,512,2048") == [0, 512, 2048]
    with pytest.raises(ValueError, match="whole number"):
        parse_thresholds("1.5")
