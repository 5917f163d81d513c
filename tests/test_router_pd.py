"""Router.route_pd (prefill/decode pairs) and worker roles against a pure-Python reference.

The reference model keeps its own record of which prompts each worker holds (events mode: the
test stores them in the index itself), of the prompts begun there and not finished (the router's
in-flight record: a worker will hold them when it reaches the next request) and of every begun
half's load, and recomputes each pair: each worker's credit = the longer of the two prefixes, the
decode worker of least ``(decode_blocks + prompt_blocks - credit) / weight`` (ties by rendezvous
of the first block, ``kvroute.Rendezvous``), the threshold on the tokens that worker lacks, the
prefill pick (``least_loaded`` here, so the reference stays independent of the ``kv_aware``
formula; ``kv_aware`` is checked on its own below), the saturation rule on the ``kv_aware`` cost
(``(queue_weight * prefill_blocks + (1 + delayed) * left + decode_weight * written_blocks) /
weight``, ``delayed = 1 +`` the fewest queued requests among the prefill candidates), and what
``begin``, ``prefilled`` and ``finish`` do to each worker's counters. Endpoint pools per phase
are checked against the first healthy workers of each phase in ``kvroute.Rendezvous``'s order,
under churn.
"""

from __future__ import annotations

import collections
import math
import re
import types

import kvroute
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

BS = 4
ROLES = ("prefill", "decode", "both")
QUEUE_W, DECODE_W = 1.0, 0.5


def toks(seed: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) + np.uint32(seed * 100_000)).astype(np.uint32)


# Prompts that share prefixes: a base (seed) and a tail, so overlaps vary between workers.
def prompt(base: int, length: int, tail: int) -> np.ndarray:
    head = toks(base, length)
    return np.concatenate([head, toks(1000 + tail, 8 * (tail % 3))]).astype(np.uint32)


def does(role: str, phase: str) -> bool:
    return role == "both" or role == phase


def common_blocks(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def tie_first(tied: list[str], weights: dict[str, float], key: int) -> str:
    order = kvroute.Rendezvous(weights).preference(key, len(weights))
    return next(n for n in order if n in tied)


def argmin(costs: dict[str, float], weights: dict[str, float], key: int) -> str:
    low = min(costs.values())
    tied = [n for n, c in costs.items() if c - low <= 1e-9 * max(1.0, abs(low))]
    return tied[0] if len(tied) == 1 else tie_first(tied, weights, key)


class PdMachine(RuleBasedStateMachine):
    """route_pd, begin and finish of both halves, roles, health and membership against the
    reference."""

    @initialize(
        threshold=st.sampled_from([0, 8, 40]),
        saturation=st.sampled_from([None, 0.5, 1.0, 3.0]),
        local=st.booleans(),
        roles=st.lists(st.sampled_from(ROLES), min_size=1, max_size=5),
    )
    def setup(self, threshold, saturation, local, roles):
        self.threshold, self.saturation, self.local = threshold, saturation, local
        self.weights = {f"w{i}": 1.0 + (i % 2) for i in range(len(roles))}
        self.role = dict(zip(self.weights, roles, strict=True))
        self.healthy = set(self.weights)
        self.r = kvroute.Router(
            self.weights,
            roles=self.role,
            index="events",
            policy="least_loaded",
            block_size=BS,
            queue_weight=QUEUE_W,
            decode_weight=DECODE_W,
            pd_threshold=threshold,
            pd_saturation=saturation,
            pd_local_prefill=local,
        )
        self.hasher = kvroute.BlockHasher(BS)
        self.held: dict[str, list[np.ndarray]] = {n: [] for n in self.weights}
        # active, prefill blocks, decode blocks, queued, written blocks
        self.load = {n: [0, 0, 0, 0, 0] for n in self.weights}
        # (decision, its prefill blocks, decode blocks, prompt hashes)
        self.begun: list[tuple[kvroute.Decision, int, int, np.ndarray]] = []
        self.next = len(roles)

    def overlap(self, worker: str, hashes: np.ndarray) -> int:
        return max((common_blocks(h, hashes) for h in self.held.get(worker, [])), default=0)

    def in_flight(self, worker: str, hashes: np.ndarray) -> int:
        return max(
            (common_blocks(h, hashes) for d, _, _, h in self.begun if d.worker == worker),
            default=0,
        )

    def kv_cost(self, w: str, blocks: int, credit: int, delayed: float) -> float:
        _, pre, _, _, written = self.load[w]
        left = max(blocks - credit, 0)
        return (QUEUE_W * pre + (1 + delayed) * left + DECODE_W * written) / self.weights[w]

    @rule(base=st.integers(0, 3), length=st.sampled_from([8, 40, 64]), tail=st.integers(0, 5))
    def store(self, base, length, tail):
        """The engine of some worker announces a prompt (as KV events would)."""
        w = sorted(self.weights)[(base + tail) % len(self.weights)]
        h = self.hasher.hash(prompt(base, length, tail))
        self.r.index.store(w, h)
        self.held[w].append(h)

    @rule(
        base=st.integers(0, 3),
        length=st.sampled_from([8, 40, 64]),
        tail=st.integers(0, 5),
        excluded=st.sets(st.integers(0, 6), max_size=2),
        start=st.booleans(),
    )
    def route_pd(self, base, length, tail, excluded, start):
        tokens = prompt(base, length, tail)
        hashes = self.hasher.hash(tokens)
        blocks, n_tokens = len(hashes), len(tokens)
        names = sorted(self.weights)
        exclude = sorted({names[i % len(names)] for i in excluded})
        ok = [n for n in self.weights if n in self.healthy and n not in exclude]
        pre = [n for n in ok if does(self.role[n], "prefill")]
        dec = [n for n in ok if does(self.role[n], "decode")]
        if not pre and not self.local:
            dec = [n for n in dec if self.role[n] == "both"]
        if not dec:
            with pytest.raises(kvroute.NoWorkerError):
                self.r.route_pd(tokens, exclude=exclude, now=0.0)
            return
        pair = self.r.route_pd(tokens, exclude=exclude, now=0.0)
        key = int(hashes[0])
        overlap = {n: self.overlap(n, hashes) for n in self.weights}
        credit = {n: max(overlap[n], self.in_flight(n, hashes)) for n in self.weights}
        dcost = {n: (self.load[n][2] + blocks - credit[n]) / self.weights[n] for n in dec}
        d = argmin(dcost, self.weights, key)
        assert pair.decode.worker == d
        assert pair.decode.scores == pytest.approx(dcost)
        local_ok = self.local or self.role[d] == "both"
        uncached = n_tokens - credit[d] * BS
        reason = "remote"
        p = None
        if not pre:
            reason = "no_prefill"
        elif local_ok and uncached <= self.threshold:
            reason = "short"
        else:
            loads = {n: self.load[n][0] / self.weights[n] for n in pre}
            p = argmin(loads, self.weights, key)
            if p == d:
                reason = "same_worker"
            else:
                delayed = 1 + min(self.load[n][3] for n in pre)
                if (
                    local_ok
                    and self.saturation is not None
                    and self.kv_cost(p, blocks, credit[p], delayed)
                    > self.saturation * self.kv_cost(d, blocks, credit[d], delayed)
                ):
                    reason = "saturated"
        assert pair.reason == reason
        assert pair.disaggregate == (reason == "remote")
        assert pair.decode.cached_blocks == overlap[d]
        assert (pair.decode.prompt_tokens, pair.decode.prompt_blocks) == (n_tokens, blocks)
        if reason == "remote":
            assert pair.prefill is not pair.decode
            assert (pair.prefill.worker, pair.prefill.half) == (p, "prefill")
            assert pair.prefill.cached_blocks == overlap[p]
            assert pair.decode.half == "decode"
            halves = [
                (pair.prefill, blocks - credit[p], blocks),
                (pair.decode, 0, blocks),
            ]
        else:
            assert pair.prefill is pair.decode and pair.decode.half == "whole"
            halves = [(pair.decode, blocks - credit[d], blocks)]
        if start:
            for half, prefill, decode in halves:
                self.r.begin(half)
                load = self.load[half.worker]
                load[0] += 1
                load[1] += prefill
                load[2] += decode
                load[3] += 1
                load[4] += prefill
                self.begun.append((half, prefill, decode, hashes))

    @precondition(lambda self: self.begun)
    @rule(i=st.integers(0, 50), prefilled=st.booleans())
    def finish(self, i, prefilled):
        half, prefill, decode, _ = self.begun.pop(i % len(self.begun))
        if half.worker in self.load:
            load = self.load[half.worker]
            load[4] -= prefill
            if prefilled:
                self.r.prefilled(half)
                load[1] -= prefill
                load[3] -= 1
                prefill = 0
            load[0] -= 1
            load[1] -= prefill
            load[2] -= decode
            load[3] -= 0 if prefilled else 1
        self.r.finish(half, now=1.0)

    @rule(i=st.integers(0, 6), role=st.sampled_from(ROLES))
    def set_role(self, i, role):
        w = sorted(self.weights)[i % len(self.weights)]
        self.r.set_role(w, role)
        self.role[w] = role

    @rule(i=st.integers(0, 6), ok=st.booleans())
    def set_healthy(self, i, ok):
        w = sorted(self.weights)[i % len(self.weights)]
        self.r.set_healthy(w, ok)
        (self.healthy.add if ok else self.healthy.discard)(w)

    @rule(role=st.sampled_from(ROLES))
    def add_worker(self, role):
        name = f"w{self.next}"
        self.next += 1
        self.weights[name] = 1.0
        self.role[name] = role
        self.healthy.add(name)
        self.held[name] = []
        self.load[name] = [0, 0, 0, 0, 0]
        self.r.add_worker(name, role=role)

    @precondition(lambda self: len(self.weights) > 1)
    @rule(i=st.integers(0, 6))
    def remove_worker(self, i):
        w = sorted(self.weights)[i % len(self.weights)]
        self.r.remove_worker(w)
        for d in (self.weights, self.role, self.held, self.load):
            del d[w]
        self.healthy.discard(w)

    @invariant()
    def loads_and_roles_agree(self):
        assert self.r.roles == self.role
        for n, want in self.load.items():
            got = self.r.load(n)
            keys = ("active", "prefill_blocks", "decode_blocks", "queued", "written_blocks")
            assert [got[k] for k in keys] == want


TestPdMachine = PdMachine.TestCase
TestPdMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- endpoint pools with roles ----------------------------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Each phase's part of an endpoint pool is the first `pool_size` healthy workers of that
    phase in the endpoint's rendezvous order, through joins, departures, role and health
    changes (weights mixed, so the order is weighted)."""

    @initialize(roles=st.lists(st.sampled_from(ROLES), min_size=6, max_size=30))
    def setup(self, roles):
        self.weights = {f"w{i}": float(1 + i % 3) for i in range(len(roles))}
        self.role = dict(zip(self.weights, roles, strict=True))
        self.healthy = set(self.weights)
        self.r = kvroute.Router(self.weights, roles=self.role, block_size=BS, capacity_blocks=32)
        self.pools: dict[str, int] = {}
        for ep, k in (("ep-a", 1), ("ep-b", 2), ("ep-c", 4)):
            most = max(sum(does(r, ph) for r in roles) for ph in ("prefill", "decode"))
            if k <= most:
                self.r.add_endpoint(ep, pool_size=k, reserved_blocks=2)
                self.pools[ep] = k
        self.next = len(roles)

    def pick(self, i: int) -> str:
        return sorted(self.weights)[i % len(self.weights)]

    @rule(role=st.sampled_from(ROLES), weight=st.sampled_from([1.0, 2.0]))
    def add(self, role, weight):
        name = f"w{self.next}"
        self.next += 1
        self.r.add_worker(name, weight, role=role)
        self.weights[name], self.role[name] = weight, role
        self.healthy.add(name)

    @precondition(lambda self: len(self.weights) > 2)
    @rule(i=st.integers(0, 60))
    def remove(self, i):
        w = self.pick(i)
        self.r.remove_worker(w)
        del self.weights[w], self.role[w]
        self.healthy.discard(w)

    @rule(i=st.integers(0, 60), role=st.sampled_from(ROLES))
    def set_role(self, i, role):
        w = self.pick(i)
        self.r.set_role(w, role)
        self.role[w] = role

    @rule(i=st.integers(0, 60), ok=st.booleans())
    def health(self, i, ok):
        w = self.pick(i)
        self.r.set_healthy(w, ok)
        (self.healthy.add if ok else self.healthy.discard)(w)

    @invariant()
    def pools_follow_the_order(self):
        rv = kvroute.Rendezvous(self.weights)
        for ep, k in self.pools.items():
            order = rv.preference(ep, len(self.weights))
            members = set()
            for phase in ("prefill", "decode"):
                want = [n for n in order if n in self.healthy and does(self.role[n], phase)][:k]
                got = self.r.endpoint_pool(ep, phase=phase)
                assert set(got) == set(want), (ep, phase)
                assert got == [n for n in self.weights if n in set(want)]
                members |= set(want)
            assert self.r.endpoint_pool(ep) == [n for n in self.weights if n in members]
        self.r._check_model()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---- kv_aware prefill, approx mode, the API surface ------------------------------------------


def test_kv_aware_prefill_follows_the_prefix_and_decode_spreads_kv():
    r = kvroute.Router(
        ["p0", "p1", "p2", "d0", "d1"],
        roles={"p0": "prefill", "p1": "prefill", "p2": "prefill", "d0": "decode", "d1": "decode"},
        block_size=BS,
        pd_threshold=0,
    )
    system = toks(1, 400)
    first = r.route_pd(np.concatenate([system, toks(2, 40)]), now=0.0)
    assert first.disaggregate and first.reason == "remote"
    home = first.prefill.worker
    decoders = []
    for i in range(8):
        pair = r.route_pd(np.concatenate([system, toks(10 + i, 40)]), now=1.0 + i)
        assert pair.prefill.worker == home and pair.prefill.cached_blocks == 100
        assert pair.prefill.reason == "prefix"
        # Approx mode: the decode worker received the prompt too (it caches what it gets).
        assert pair.decode.cached_blocks in (0, 100)
        r.begin(pair.decode)
        decoders.append(pair.decode.worker)
    assert set(decoders) == {"d0", "d1"}  # running requests' KV spreads the decodes
    r._check_model()


def test_conditional_threshold_counts_what_the_decode_worker_lacks():
    r = kvroute.Router(
        {"p0": 1.0, "d0": 1.0},
        roles={"p0": "prefill", "d0": "decode"},
        block_size=BS,
        pd_threshold=512,
    )
    assert r.config["pd_threshold"] == 512
    conversation = toks(3, 2000)
    turn1 = r.route_pd(conversation, now=0.0)
    assert turn1.disaggregate  # 2000 tokens, none on d0
    # The next turn appends 300 tokens: d0 holds the first 2000 (it received them).
    turn2 = r.route_pd(np.concatenate([conversation, toks(4, 300)]), now=1.0)
    assert (turn2.disaggregate, turn2.reason, turn2.decode.worker) == (False, "short", "d0")
    assert turn2.decode.half == "whole" and turn2.decode.cached_tokens == 2000
    r.begin(turn2.decode)
    assert r.load("d0")["prefill_blocks"] == turn2.decode.prompt_blocks - 500
    # 600 new tokens: more than the threshold.
    turn3 = r.route_pd(np.concatenate([conversation, toks(5, 600)]), now=2.0)
    assert turn3.disaggregate and turn3.prefill.cached_tokens == 2000


def test_route_only_uses_decoding_workers_and_errors_name_the_phase():
    r = kvroute.Router(["p0", "d0"], roles={"p0": "prefill", "d0": "decode"}, block_size=BS)
    for i in range(10):
        assert r.route(toks(i, 40), now=0.0).worker == "d0"
    r.set_healthy("d0", False)
    with pytest.raises(kvroute.NoWorkerError, match="2 workers, 1 healthy, 1 able to decode"):
        r.route(toks(1, 40), now=0.0)
    r.set_healthy("d0", True)
    with pytest.raises(kvroute.NoWorkerError, match="1 able to decode, 1 excluded"):
        r.route_pd(toks(1, 40), exclude=["d0"], now=0.0)
    r.add_endpoint("ep", pool_size=1)
    assert r.endpoint_pool("ep", phase="prefill") == ["p0"]
    assert r.endpoint_pool("ep", phase="decode") == ["d0"]
    assert r.endpoint_pool("ep") == ["p0", "d0"]
    pair = r.route_pd(toks(9, 4000), endpoint="ep", now=0.0)
    assert (pair.prefill.worker, pair.decode.worker) == ("p0", "d0")
    assert pair.prefill.endpoint == pair.decode.endpoint == "ep"
    assert "disaggregate=True" in repr(pair)


def test_bad_roles_and_pd_options_raise_and_change_nothing():
    r = kvroute.Router(["a", "b"], block_size=BS)
    cases = [
        (ValueError, lambda: r.set_role("a", "decoder")),
        (KeyError, lambda: r.set_role("zz", "decode")),
        (KeyError, lambda: r.role("zz")),
        (ValueError, lambda: r.add_worker("c", role="gpu")),
        (ValueError, lambda: r.endpoint_pool("x", phase="both")),
        (TypeError, lambda: r.route_pd(toks(1, 8), block_hashes=[1])),
        (KeyError, lambda: r.route_pd(toks(1, 8), endpoint="nope")),
        (ValueError, lambda: kvroute.Router(["a"], roles={"a": "x"})),
        (KeyError, lambda: kvroute.Router(["a"], roles={"b": "decode"})),
        (TypeError, lambda: kvroute.Router(["a"], roles=["decode"])),
        (ValueError, lambda: kvroute.Router(["a"], pd_saturation=-1.0)),
        (ValueError, lambda: kvroute.Router(["a"], pd_saturation=math.nan)),
        (ValueError, lambda: kvroute.Router(["a"], pd_threshold=-1)),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
    assert r.roles == {"a": "both", "b": "both"} and r.workers == ["a", "b"]
    assert kvroute.Router(["a"], pd_saturation=math.inf).config["pd_saturation"] == math.inf


def test_roles_and_tier_weights_take_any_mapping_and_name_the_bad_entry():
    """The stub types ``roles``/``tier_weights`` as Mapping: any mapping is taken (a dict was
    required); a bad value names its worker or tier."""
    roles = {"a": "prefill", "b": "decode"}
    for m in (types.MappingProxyType(roles), collections.UserDict(roles)):
        assert kvroute.Router(["a", "b"], roles=m).roles == roles
    tiers = collections.UserDict({"CPU": 0.5})
    assert kvroute.Router(["a"], tier_weights=tiers).config["tier_weights"] == {"CPU": 0.5}
    cases = [
        (TypeError, 'role of worker "a" must be a str, got int 1', {"roles": {"a": 1}}),
        (ValueError, 'worker "a": role must be', {"roles": {"a": "gpu"}}),
        (
            TypeError,
            'weight of tier "CPU" must be a number, got str',
            {"tier_weights": {"CPU": "x"}},
        ),
        (
            TypeError,
            'weight of tier "CPU" must be a number, got bool',
            {"tier_weights": {"CPU": True}},
        ),
        (TypeError, "roles must be a mapping of worker name to role", {"roles": ["a"]}),
    ]
    for exc, message, kw in cases:
        with pytest.raises(exc, match=re.escape(message)):
            kvroute.Router(["a"], **kw)


def test_a_fleet_without_roles_routes_pairs_on_single_workers():
    """All workers do both: route_pd either keeps the request whole or splits it between two
    ordinary workers; route() is unchanged."""
    r = kvroute.Router(["a", "b", "c"], block_size=BS, pd_threshold=16)
    twin = kvroute.Router(["a", "b", "c"], block_size=BS)
    for i in range(20):
        t = toks(i % 4, 40 + 8 * i)
        assert r.route(t, now=float(i)).worker == twin.route(t, now=float(i)).worker
    pair = r.route_pd(toks(0, 8), now=30.0)
    assert (pair.disaggregate, pair.reason) == (False, "short")
