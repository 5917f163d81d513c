"""Clients that do not stream (``non_streamed``, ``kvroute simulate --non-streamed``): the router
learns a request's prefill is over when the gateway's model predicts it, as ``kvroute serve``
does — checked against reference policies written from that rule, and the CLI's handling."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from kvroute.cli import main
from kvroute.gateway.admission import PrefillModel
from kvroute.sim import FleetModel, run
from kvroute.sim.policies import RouterPolicy
from support.sim_helpers import family_trace

MODEL = FleetModel(workers=3, capacity_blocks=40, prefill_rate=400.0)


def trace(n=240, seed=5):
    return family_trace(n, seed, families=6, first=2000, ids=4, extra=(1, 8), gap=0.02, out=40)


class Reference(RouterPolicy):
    """The rule from the gateway's side, with the requests that stream given: a streamed request
    is prefilled at its first token and is a sample (work = prefill tokens queued on the worker
    at begin + its own uncached, seconds since begin); any other at begin + work / rate (the
    configured rate) or the learned fit's prediction at begin; without one, never (its finish)."""

    def __init__(self, streamed, rate=None):
        super().__init__("kv_aware", index="events", seed=0)
        self.given, self.rate = streamed, rate

    def bind(self, fleet):
        super().bind(fleet)
        self.fit, self.when, self.timers, self.told = PrefillModel(), {}, [], set()

    def _due(self, now):
        while self.timers and self.timers[0][0] <= now:
            _, r = heapq.heappop(self.timers)
            if r in self.decisions and r not in self.told:
                self.told.add(r)
                self.router.prefilled(self.decisions[r])

    def route(self, request, chain, now):
        self._due(now)
        d = self.router.route(block_hashes=chain, key=self.sessions[request], now=now)
        ahead = self.router.begin(d) * self.router.block_size
        self.decisions[request] = d
        work = ahead + max(d.prompt_tokens - d.cached_tokens, 0)
        self.when[request] = (now, work)
        if not self.given[request]:
            t = work / self.rate if self.rate else self.fit.predict(work)
            if t is not None:
                heapq.heappush(self.timers, (now + t, request))
        return self.fleet.position[d.worker]

    def first_token(self, request, worker, now):
        self._due(now)
        if self.given[request]:
            self.told.add(request)
            self.router.prefilled(self.decisions[request])
            begun, work = self.when[request]
            if not self.rate:
                self.fit.add(work, now - begun)

    def finished(self, request, worker, cached_tokens, now):
        self._due(now)
        d = self.decisions.pop(request)
        self.router.observe(d, cached_tokens, now=now)
        self.router.finish(d, now=now)


def same(a, b) -> bool:
    return all(np.array_equal(a[k], b[k], equal_nan=True) for k in a.dtype.names)


@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("rate", [None, 150.0])
def test_the_router_is_told_as_the_reference_says(share, rate):
    w = trace()
    options = {"non_streamed": share, "prefill_tokens_per_second": rate}
    policy = RouterPolicy("kv_aware", seed=0, options=options)
    got = run(w, policy, MODEL)
    streamed = policy.streamed
    assert sum(not s for s in streamed) == pytest.approx(share * len(w), abs=0.12 * len(w))
    assert same(got, run(w, Reference(streamed, rate), MODEL))
    for name in policy.router.workers:
        load = policy.router.load(name)
        assert (load["active"], load["prefill_blocks"]) == (0, 0)


def test_no_share_is_the_streamed_simulation_and_every_share_matters():
    w = trace()
    plain = run(w, RouterPolicy("kv_aware", seed=0), MODEL)
    assert same(plain, run(w, RouterPolicy("kv_aware", seed=0, options={"non_streamed": 0}), MODEL))
    never = run(w, RouterPolicy("kv_aware", seed=0, options={"non_streamed": 1.0}), MODEL)
    assert not same(plain, never)  # nothing to predict from: each counts as prefilling to its end


def test_the_same_requests_stream_for_every_policy_of_a_seed():
    w = trace()
    masks = []
    for name in ("kv_aware", "random", "least_loaded"):
        p = RouterPolicy(name, seed=7, options={"non_streamed": 0.5})
        run(w, p, MODEL)
        masks.append(p.streamed)
    assert masks[0] == masks[1] == masks[2]
    other = RouterPolicy("kv_aware", seed=8, options={"non_streamed": 0.5})
    run(w, other, MODEL)
    assert other.streamed != masks[0]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "half"])
def test_a_share_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="non_streamed must be a share from 0 to 1"):
        RouterPolicy("kv_aware", options={"non_streamed": bad})
    with pytest.raises(ValueError, match="prefill_tokens_per_second must be positive"):
        RouterPolicy("kv_aware", options={"prefill_tokens_per_second": 0})


def test_the_cli_runs_it_and_says_so(capsys):
    args = ["simulate", "--quiet", "--scenario", "rag", "--requests", "200", "--workers", "3"]
    assert main([*args, "--policies", "kv_aware,dynamo", "--non-streamed", "0.5"]) == 0
    assert "50% of the requests are not streamed" in " ".join(capsys.readouterr().out.split())
    assert main([*args, "--policies", "kv_aware"]) == 0
    assert "--non-streamed SHARE models clients" in " ".join(capsys.readouterr().out.split())
    for extra, why in (
        (["--non-streamed", "1.5"], "--non-streamed must be a share from 0 to 1, got 1.5"),
        (["--non-streamed", "0.5", "--replicas", "1,2"], "--non-streamed does not apply to --pd"),
        (["--non-streamed", "0.5", "--pd", "1:3"], "--non-streamed does not apply to --pd"),
    ):
        assert main([*args, *extra]) == 2
        assert why in capsys.readouterr().err
