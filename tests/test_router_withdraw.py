"""Router.withdraw: a decision whose request never ran is taken back, exactly and at most once.

Two references: a withdrawal right after its route must leave the router exactly as a twin that
never saw the request (every later prediction equal); and for withdrawals interleaved with other
routes, a pure-Python model of the documented rule (a block the route added leaves unless
something touched it since) predicts every decision's cached blocks and the final model.
"""

from __future__ import annotations

import kvroute
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BS = 4
WORKERS = ["a", "b", "c"]

#: Prompts built from a few shared segments, so routes share prefixes of various lengths.
SEGMENTS = [[s * 1000 + i for i in range(BS * n)] for s, n in ((1, 3), (2, 2), (3, 1), (4, 2))]
prompt_st = st.lists(st.integers(0, len(SEGMENTS) - 1), min_size=1, max_size=3).map(
    lambda ix: [t for i in ix for t in SEGMENTS[i]]
)


def router() -> kvroute.Router:
    return kvroute.Router(WORKERS, block_size=BS, index="approx", capacity_blocks=4096)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(prompt_st, st.sampled_from(["withdraw", "begin", "run"])), max_size=25))
def test_a_withdrawal_right_after_the_route_is_as_if_it_never_happened(ops):
    r, twin = router(), router()
    now = 0.0
    for tokens, what in ops:
        now += 1.0
        d = r.route(tokens=tokens, now=now)
        if what == "withdraw":
            assert r.withdraw(d) is True
            assert d.stage == "withdrawn"
            continue
        t = twin.route(tokens=tokens, now=now)
        assert (d.worker, d.cached_blocks) == (t.worker, t.cached_blocks)
        for router_, decision in ((r, d), (twin, t)):
            router_.begin(decision)
            if what == "run":
                router_.finish(decision, now=now)
    for name in WORKERS:
        assert r.load(name) == twin.load(name)
        assert r.index.num_blocks(name) == twin.index.num_blocks(name)
    for tokens in (s for s in SEGMENTS):
        probe = kvroute.BlockHasher(BS).hash(tokens)
        assert r.index.match(probe) == twin.index.match(probe)


class Reference:
    """Per worker, each modelled block's last touch (a global counter); a block is a prompt prefix
    of whole blocks. Routes are pinned to a worker, so only the model is compared."""

    def __init__(self) -> None:
        self.tick = 0
        self.touched: dict[str, dict[tuple[int, ...], int]] = {w: {} for w in WORKERS}

    @staticmethod
    def blocks(tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[: BS * (j + 1)]) for j in range(len(tokens) // BS)]

    def held(self, worker: str, tokens: list[int]) -> int:
        n = 0
        for b in self.blocks(tokens):
            if b not in self.touched[worker]:
                break
            n += 1
        return n

    def record(self, worker: str, tokens: list[int]) -> int:
        for b in self.blocks(tokens):
            self.tick += 1
            self.touched[worker][b] = self.tick
        return self.tick

    def withdraw(self, worker: str, tokens: list[int], cached: int, mark: int) -> None:
        cache = self.touched[worker]
        new = self.blocks(tokens)[cached:]
        for j, b in enumerate(new):
            if b in cache and cache[b] <= mark:
                for gone in new[j:]:
                    cache.pop(gone, None)
                return


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("route"), st.sampled_from(WORKERS), prompt_st),
            st.tuples(st.just("withdraw"), st.integers(0, 30)),
            st.tuples(st.just("begin"), st.integers(0, 30)),
            st.tuples(st.just("finish"), st.integers(0, 30)),
        ),
        max_size=40,
    )
)
def test_interleaved_withdrawals_follow_the_reference(ops):
    r, ref = router(), Reference()
    pending: list[tuple[kvroute.Decision, list[int], int]] = []
    for op in ops:
        if op[0] == "route":
            _, worker, tokens = op
            d = r.route(tokens=tokens, exclude=[w for w in WORKERS if w != worker])
            assert d.cached_blocks == ref.held(worker, tokens)
            pending.append((d, tokens, ref.record(worker, tokens)))
            continue
        if not pending:
            continue
        d, tokens, mark = pending[op[1] % len(pending)]
        stage = d.stage
        if op[0] == "withdraw":
            if stage in ("routed", "active"):
                assert r.withdraw(d) is True
                ref.withdraw(d.worker, tokens, d.cached_blocks, mark)
            elif stage == "withdrawn":
                assert r.withdraw(d) is False
            else:
                with pytest.raises(ValueError, match="it ran"):
                    r.withdraw(d)
        elif op[0] == "begin" and stage == "routed":
            r.begin(d)
        elif op[0] == "finish" and stage == "active":
            r.finish(d)
            ref.record(d.worker, tokens)
    active = {w: 0 for w in WORKERS}
    for d, _, _ in pending:
        active[d.worker] += d.stage == "active"
    for w in WORKERS:
        assert r.load(w)["active"] == active[w]
        assert r.index.num_blocks(w) == len(ref.touched[w])
        for b in ref.touched[w]:
            assert r.index.match(kvroute.BlockHasher(BS).hash(list(b))).get(w) == len(b) // BS


def test_withdraw_refuses_what_ran_and_changes_nothing():
    r = router()
    d = r.route(tokens=SEGMENTS[0])
    r.begin(d)
    r.prefilled(d)
    with pytest.raises(ValueError, match="prefilled"):
        r.withdraw(d)
    assert d.stage == "active"
    assert r.load(d.worker)["active"] == 1
    r.finish(d)
    with pytest.raises(ValueError, match="finished"):
        r.withdraw(d)
    other = router().route(tokens=SEGMENTS[1])
    with pytest.raises(ValueError, match="another router"):
        r.withdraw(other)
    shed = r.route(tokens=SEGMENTS[2])
    assert r.withdraw(shed) is True
    for late in (r.begin, r.finish):
        with pytest.raises(ValueError, match="withdrawn"):
            late(shed)
    with pytest.raises(ValueError, match="withdrawn"):
        r.observe(shed, 0)
