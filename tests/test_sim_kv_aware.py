"""kv_aware on small seeded scenarios: better than random, and immune to the issue 11 collapse.

The collapse (issue 11): real agent sessions compressed in time, so a conversation's next turn
arrives while the previous one is still queued. A router that credits only blocks the engines have
announced (KV events follow computation) sees no prefix anywhere, spreads each session over every
worker, and each miss adds a whole ~100k-token prompt to a queue. ``Blind`` below is that former
cost, written out in Python as the reference of the collapse: ``(prompt − cached) + 0.5 · queued
prefill + 0.05 · held``, with the queue counted at what was predicted at routing.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvroute import BlockCache, PrefixIndex
from kvroute.sim.engine import FleetModel, Policy, run
from kvroute.sim.instruments import Recorder, explain
from kvroute.sim.oracles import pooled_lru
from kvroute.sim.policies import make_policy
from kvroute.sim.report import summarize
from kvroute.sim.synthetic import agent_scenario, rag_scenario
from kvroute.sim.traces import claude_code_sessions


class Blind(Policy):
    """The former kv_aware cost, fed by KV events only (the issue's collapse case)."""

    name = "blind"

    def bind(self, fleet):
        super().bind(fleet)
        self.index = PrefixIndex()
        fleet.subscribe(self.index)
        n = len(fleet.names)
        self.queue = np.zeros(n)
        self.held = np.zeros(n)
        self.left = {}

    def route(self, request, chain, now):
        cached = np.zeros(len(self.fleet.names))
        for name, m in (self.index.match(chain) if chain.shape[0] else {}).items():
            cached[self.fleet.position[name]] = m
        cost = (chain.shape[0] - cached) + 0.5 * self.queue + 0.05 * self.held
        w = int(np.argmin(cost))
        self.left[request] = chain.shape[0] - cached[w]
        self.queue[w] += self.left[request]
        self.held[w] += chain.shape[0]
        return w

    def first_token(self, request, worker, now):
        self.queue[worker] -= self.left.pop(request)

    def finished(self, request, worker, cached_tokens, now):
        self.held[worker] -= self.fleet.workload.block_hashes(request).shape[0]


def outcome(workload, policy, workers):
    rec = Recorder(policy)
    results = run(workload, rec, FleetModel(workers=workers))
    rows = rec.rows(results)
    why = explain(
        rows, block_size=workload.block_size, prefill_rate=9000.0, sessions=workload.session
    )
    return summarize(results, num_workers=workers), why


@pytest.fixture(scope="module")
def overlapped_sessions():
    # The run, smaller: the first 70 requests of the four Claude Code sessions, arrivals
    # compressed 100x (offered load ~6x the fleet's prefill capacity before caching).
    return claude_code_sessions().head(70).time_scaled(0.01)


def test_the_collapse_reproduced_small_and_kv_aware_immune(overlapped_sessions):
    wl = overlapped_sessions
    oracle = pooled_lru(wl, 4 * 6912, cache=BlockCache(4 * 6912)).hit_rate
    blind, blind_why = outcome(wl, Blind(), 4)
    rand, _ = outcome(wl, make_policy("random"), 4)
    kv, kv_why = outcome(wl, make_policy("kv_aware"), 4)
    # The collapse: most available prefixes are still in flight; the blind cost leaves them and
    # does no better than random.
    assert blind_why["inflight_only"] > 0.5
    assert blind_why["left"] > 0.5 and blind_why["workers_per_session"] > 3
    assert blind.hit_rate < rand.hit_rate + 0.05
    # kv_aware credits what is in flight: it stays with the prefix and reaches the oracle.
    assert kv_why["left"] < 0.05 and kv_why["workers_per_session"] < 1.6
    assert kv.hit_rate >= 0.95 * oracle
    assert kv.hit_rate > blind.hit_rate + 0.1
    assert kv.ttft_p50 < blind.ttft_p50 / 3 and kv.ttft_p99 < blind.ttft_p99


@pytest.mark.parametrize(
    ("make", "scale"),
    [
        (lambda: rag_scenario(seed=5, duration=60), 1.0),
        (lambda: rag_scenario(seed=5, duration=60), 0.3),
        (lambda: agent_scenario(seed=5, duration=60), 1.0),
        (lambda: agent_scenario(seed=5, duration=60), 0.3),
    ],
)
def test_kv_aware_beats_random(make, scale):
    wl = make().time_scaled(scale)
    rand, _ = outcome(wl, make_policy("random", seed=5), 4)
    kv, _ = outcome(wl, make_policy("kv_aware", seed=5), 4)
    assert kv.hit_rate >= rand.hit_rate
    assert kv.ttft_p50 <= rand.ttft_p50 and kv.ttft_p99 <= rand.ttft_p99
