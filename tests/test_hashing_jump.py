"""Jump consistent hashing. ``jump_hash`` / ``jump_hash_many`` against published vectors, the
paper's loop and the C ``jump`` package; ``JumpHash`` (named nodes, MementoHash removals) against a
pure-Python model of MementoHash driven by a Hypothesis state machine, plus the properties the
paper proves (minimal disruption, balance)."""

from __future__ import annotations

import zlib
from collections import Counter

import jump
import kvroute
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.helpers import paper_jump

# -- jump_hash, jump_hash_many ------------------------------------------------------------------


def test_reference_table(jump_vectors):
    for row in jump_vectors["table_by_bucket_count"]:
        got = [
            kvroute.jump_hash(row["key"], n)
            for n in range(1, len(row["expected_for_buckets_1_to_n"]) + 1)
        ]
        assert got == row["expected_for_buckets_1_to_n"], row["key_hex"]


def test_guava_and_lithammer_vectors(jump_vectors):
    golden = jump_vectors["guava_golden100"]
    assert [kvroute.jump_hash(k, golden["buckets"]) for k in range(20)] == golden["expected"]
    for case in jump_vectors["guava_compat"] + jump_vectors["lithammer"]:
        assert kvroute.jump_hash(case["key"], case["buckets"]) == case["expected"], case


def test_string_key_vectors_through_an_external_hasher(jump_vectors):
    # jump applied to CRC32 of a string key (lithammer/go-jump-consistent-hash HashString).
    for case in jump_vectors["string_keys_lithammer_go"]["vectors"]:
        if case["hasher"] == "CRC32":
            key = zlib.crc32(case["key"].encode())
            assert kvroute.jump_hash(key, case["buckets"]) == case["expected"]


@given(st.integers(0, 2**64 - 1), st.integers(1, 10_000))
def test_matches_paper_loop(key, n):
    assert kvroute.jump_hash(key, n) == paper_jump(key, n)


@given(st.lists(st.integers(0, 2**64 - 1), max_size=200), st.integers(1, 5000))
def test_many_equals_single(keys, n):
    arr = np.array(keys, dtype=np.uint64)
    out = kvroute.jump_hash_many(arr, n)
    assert out.dtype == np.int64
    assert out.tolist() == [kvroute.jump_hash(k, n) for k in keys]
    assert kvroute.jump_hash_many(keys, n).tolist() == out.tolist()


def test_many_accepts_strided_and_other_int_dtypes():
    base = np.arange(100, dtype=np.uint64)
    assert kvroute.jump_hash_many(base[::3], 7).tolist() == [
        kvroute.jump_hash(int(k), 7) for k in base[::3]
    ]
    assert kvroute.jump_hash_many(np.arange(50, dtype=np.int32), 7).tolist() == [
        kvroute.jump_hash(k, 7) for k in range(50)
    ]


@pytest.mark.parametrize("n", [0, -1, 2**31])
def test_bad_bucket_counts(n):
    with pytest.raises(ValueError, match="num_buckets"):
        kvroute.jump_hash(1, n)
    with pytest.raises(ValueError, match="num_buckets"):
        kvroute.jump_hash_many(np.arange(3, dtype=np.uint64), n)


@pytest.mark.parametrize(
    ("key", "exc"),
    [(-1, ValueError), (2**64, ValueError), (1.5, TypeError), ("7", TypeError), (True, TypeError)],
)
def test_bad_jump_keys(key, exc):
    with pytest.raises(exc):
        kvroute.jump_hash(key, 3)


def test_bad_key_arrays():
    with pytest.raises(ValueError, match=r"keys\[1\]"):
        kvroute.jump_hash_many(np.array([1, -2], dtype=np.int64), 3)
    with pytest.raises(ValueError, match=r"keys\[0\]"):
        kvroute.jump_hash_many([-5], 3)
    with pytest.raises(TypeError):
        kvroute.jump_hash_many(np.zeros((2, 2), dtype=np.uint64), 3)
    with pytest.raises(TypeError):
        kvroute.jump_hash_many(np.zeros(3, dtype=np.float64), 3)
    with pytest.raises(TypeError):
        kvroute.jump_hash_many("abc", 3)


def test_jump_hash_arguments_bind_like_a_def():
    assert kvroute.jump_hash(key=0xDEADBEEF, num_buckets=19) == 16
    assert kvroute.jump_hash(0xDEADBEEF, num_buckets=19) == 16
    with pytest.raises(TypeError, match="missing"):
        kvroute.jump_hash(1)
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        kvroute.jump_hash(1, 2, 3)
    with pytest.raises(TypeError, match="multiple values"):
        kvroute.jump_hash(1, 2, key=3)
    with pytest.raises(TypeError, match="unexpected keyword"):
        kvroute.jump_hash(1, buckets=3)


# -- JumpHash ------------------------------------------------------------------------------------


class MementoModel:
    """MementoHash as described in the paper (arXiv:2306.09783), on named buckets."""

    def __init__(self, nodes: list[str]):
        self.bucket = {name: i for i, name in enumerate(nodes)}
        self.node_at: list[str | None] = list(nodes)
        self.replaced: dict[int, tuple[int, int]] = {}  # bucket -> (working size after, previous)
        self.last_removed = len(nodes)

    def lookup(self, k: int) -> str | None:
        b = paper_jump(k, len(self.node_at))
        while b in self.replaced:
            w = self.replaced[b][0]
            h = xxhash.xxh3_64_intdigest(k.to_bytes(8, "little"), seed=b) % w
            while h in self.replaced and self.replaced[h][0] >= w:
                h = self.replaced[h][0]
            b = h
        return self.node_at[b]

    def remove(self, name: str) -> None:
        b = self.bucket.pop(name)
        if not self.replaced and b == len(self.node_at) - 1:
            self.node_at.pop()
            self.last_removed = len(self.node_at)
        else:
            self.replaced[b] = (len(self.bucket), self.last_removed)
            self.node_at[b] = None
            self.last_removed = b

    def add(self, name: str) -> None:
        if not self.replaced:
            self.bucket[name] = len(self.node_at)
            self.node_at.append(name)
            self.last_removed = len(self.node_at)
        else:
            b = self.last_removed
            self.last_removed = self.replaced.pop(b)[1]
            self.node_at[b] = name
            self.bucket[name] = b


KEYS = [(i * 0x9E3779B97F4A7C15 + 12345) % 2**64 for i in range(3000)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=100), st.integers(1, 300))
def test_without_removals_it_is_jump_hash(keys, n):
    nodes = [f"w{i}" for i in range(n)]
    h = kvroute.JumpHash(nodes)
    assert [h.get(k) for k in keys] == [nodes[paper_jump(k, n)] for k in keys]
    assert h.get_many(keys) == [nodes[kvroute.jump_hash(k, n)] for k in keys]


def test_matches_the_c_jump_package():
    nodes = [f"w{i}" for i in range(37)]
    h = kvroute.JumpHash(nodes)
    assert h.get_many(KEYS) == [nodes[jump.hash(k, 37)] for k in KEYS]


def test_str_keys_go_through_hash_key():
    nodes = [f"w{i}" for i in range(10)]
    h = kvroute.JumpHash(nodes)
    for key in ["a", "endpoint-7", b"\x00\x01"]:
        assert h.get(key) == nodes[kvroute.jump_hash(kvroute.hash_key(key), 10)]


class JumpHashMachine(RuleBasedStateMachine):
    """Random removals and additions, checked against the model and the paper's guarantees."""

    def __init__(self):
        super().__init__()
        self.next_name = 8
        names = [f"n{i}" for i in range(self.next_name)]
        self.hasher = kvroute.JumpHash(names)
        self.model = MementoModel(names)
        self.placement = self.hasher.get_many(KEYS)

    @precondition(lambda self: len(self.hasher) > 1)
    @rule(data=st.data())
    def remove(self, data):
        victim = data.draw(st.sampled_from(sorted(self.hasher.nodes)))
        # The failover order predicts where each of the victim's keys goes.
        predicted = {
            k: self.hasher.preference(k, 2)[1]
            for k, node in zip(KEYS, self.placement, strict=True)
            if node == victim
        }
        self.hasher.remove(victim)
        self.model.remove(victim)
        after = self.hasher.get_many(KEYS)
        for k, before, now in zip(KEYS, self.placement, after, strict=True):
            if before == victim:
                assert now == predicted[k]
            else:
                assert now == before, "only the removed node's keys may move"
        self.placement = after

    @rule()
    def add(self):
        name = f"n{self.next_name}"
        self.next_name += 1
        self.hasher.add(name)
        self.model.add(name)
        after = self.hasher.get_many(KEYS)
        for before, now in zip(self.placement, after, strict=True):
            assert now in (before, name), "keys may only move to the added node"
        self.placement = after

    @invariant()
    def agrees_with_the_model(self):
        assert self.placement == [self.model.lookup(k) for k in KEYS]
        assert sorted(self.hasher.nodes) == sorted(self.model.bucket)

    @invariant()
    def preference_is_distinct_and_starts_with_get(self):
        n = len(self.hasher)
        for k in KEYS[:20]:
            order = self.hasher.preference(k, n)
            assert order[0] == self.hasher.get(k)
            assert sorted(order) == sorted(self.hasher.nodes)


TestJumpHashMachine = JumpHashMachine.TestCase
TestJumpHashMachine.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)


def test_balance_after_removing_arbitrary_nodes():
    nodes = [f"n{i}" for i in range(60)]
    h = kvroute.JumpHash(nodes)
    for name in nodes[5:45:2]:  # 20 holes in the middle of the bucket array
        h.remove(name)
    keys = [f"key-{i}" for i in range(200_000)]
    counts = Counter(h.get_many(keys))
    mean = len(keys) / len(h)
    assert set(counts) == set(h.nodes)
    # 5000 keys per node: sampling noise is ~1.4%; a node inheriting a neighbour's keys would
    # sit at 2x.
    assert max(counts.values()) / mean < 1.08
    assert min(counts.values()) / mean > 0.92


def test_removed_nodes_keys_spread_over_all_others():
    nodes = [f"n{i}" for i in range(20)]
    h = kvroute.JumpHash(nodes)
    keys = [f"key-{i}" for i in range(60_000)]
    before = h.get_many(keys)
    h.remove("n3")
    after = h.get_many(keys)
    moved_to = Counter(a for b, a in zip(before, after, strict=True) if b != a)
    assert set(moved_to) == set(nodes) - {"n3"}
    share = sum(moved_to.values()) / len(moved_to)
    assert max(moved_to.values()) < 1.4 * share


def test_unweighted_only():
    h = kvroute.JumpHash(["a"])
    with pytest.raises(ValueError, match="unweighted"):
        h.add("b", 2)
    h.add("b", 1)
    with pytest.raises(ValueError, match="unweighted"):
        kvroute.JumpHash({"a": 1, "b": 3})
    assert h.nodes == ["a", "b"]
