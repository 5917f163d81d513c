"""Simulator speed on the Mooncake conversation trace (12,031 requests), 16 workers.

The issue's bar: every policy plus the oracles in under 60 s. ``ops`` = simulated requests, so
the per-op time is the engine's cost per request (routing included). There is no peer simulator
to compare with; the per-policy rows show what each router costs inside the same engine.
"""

from __future__ import annotations

import pytest
from kvroute.sim import DEFAULT_POLICIES, FleetModel, make_policy, mooncake_conversation, run
from kvroute.sim import simulate as simulate_all


@pytest.fixture(scope="module")
def trace():
    return mooncake_conversation()


def test_simulate_all_policies(benchmark, trace):
    model = FleetModel(workers=16)
    benchmark.group = "simulate: Mooncake conversation, 16 workers, all policies + oracles"
    benchmark.extra_info["impl"] = "kvroute"
    benchmark.extra_info["ops"] = len(trace) * len(DEFAULT_POLICIES)
    report, _ = benchmark.pedantic(
        lambda: simulate_all(trace, model=model, progress=False), rounds=2, iterations=1
    )
    assert report.policies["kv_aware"].hit_rate > 2 * report.policies["random"].hit_rate


@pytest.mark.parametrize("policy", DEFAULT_POLICIES)
def test_engine_per_policy(benchmark, trace, policy):
    model = FleetModel(workers=16)
    benchmark.group = f"engine: Mooncake conversation, 16 workers, {policy}"
    benchmark.extra_info["impl"] = "kvroute"
    benchmark.extra_info["ops"] = len(trace)
    out = benchmark.pedantic(lambda: run(trace, make_policy(policy), model), rounds=2, iterations=1)
    assert out["cached_tokens"].sum() > 0
