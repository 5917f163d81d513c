"""The face all hashers share: get/get_many/preference/add/remove/nodes/len/in, bad input,
movement on membership changes, balance and thread safety (the stubs: test_stubs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import kvroute
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import run_threads

KINDS = {
    "ring-ketama": lambda nodes: kvroute.HashRing(nodes),
    "ring-xxh3": lambda nodes: kvroute.HashRing(nodes, hash="xxh3"),
    "maglev": lambda nodes: kvroute.Maglev(nodes),
    "rendezvous": lambda nodes: kvroute.Rendezvous(nodes),
    "jump": lambda nodes: kvroute.JumpHash(nodes),
}

keys_strategy = st.lists(
    st.one_of(st.text(max_size=30), st.binary(max_size=30), st.integers(0, 2**64 - 1)),
    max_size=80,
)


@pytest.fixture(params=sorted(KINDS))
def make(request):
    return KINDS[request.param]


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=25, deadline=None)
@given(nodes=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=30, unique=True))
def test_get_many_equals_get_and_preference_rules(kind, nodes):
    h = KINDS[kind](nodes)
    keys = ["a", b"b", 3, "endpoint-42", 2**64 - 1, ""]
    got = h.get_many(keys)
    assert got == [h.get(k) for k in keys]
    assert set(got) <= set(nodes)
    for key in keys:
        for n in (1, 2, len(nodes), len(nodes) + 5):
            order = h.preference(key, n)
            assert order[0] == h.get(key)
            assert len(order) == min(n, len(nodes))
            assert len(set(order)) == len(order)
            assert set(order) <= set(nodes)


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=25, deadline=None)
@given(
    nodes=st.lists(st.text(min_size=1, max_size=8), min_size=2, max_size=40, unique=True),
    removed=st.integers(0, 39),
    keys=keys_strategy,
)
def test_get_many_as_index_gives_positions_in_the_node_list(kind, nodes, removed, keys):
    h = KINDS[kind](nodes)
    h.remove(nodes[removed % len(nodes)])  # ids with a hole (JumpHash reuses freed buckets)
    keys = [*keys, *(f"session-{i}" for i in range(100))]  # more keys than nodes
    at, order = h.get_many(keys, as_index=True)
    assert order == h.nodes
    assert at.dtype == np.uint32
    assert at.shape == (len(keys),)
    assert [order[i] for i in at] == [h.get(k) for k in keys]
    ints = np.array([k for k in keys if isinstance(k, int)], dtype=np.uint64)
    at, order = h.get_many(ints, as_index=True)
    assert [order[i] for i in at] == [h.get(int(k)) for k in ints]


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=20, deadline=None)
@given(keys=keys_strategy)
def test_get_many_accepts_lists_tuples_iterables_and_arrays(kind, keys):
    h = KINDS[kind]([f"w{i}" for i in range(7)])
    expected = [h.get(k) for k in keys]
    assert h.get_many(keys) == expected
    assert h.get_many(tuple(keys)) == expected
    assert h.get_many(iter(keys)) == expected
    ints = [k for k in keys if isinstance(k, int)]
    as_int = [h.get(k) for k in ints]
    assert h.get_many(np.array(ints, dtype=np.uint64)) == as_int
    assert h.get_many(np.array(ints, dtype=np.uint64)[::2]) == as_int[::2]
    small = [k for k in ints if k < 2**31]
    assert h.get_many(np.array(small, dtype=np.int64)) == [h.get(k) for k in small]


def test_nodes_len_contains(make):
    h = make(["b", "a", "c"])
    assert h.nodes == ["b", "a", "c"]
    assert len(h) == 3
    assert "a" in h and "zz" not in h and 3 not in h and None not in h
    h.add("d")
    h.remove("a")
    assert h.nodes == ["b", "c", "d"]
    assert len(h) == 3


def snapshot(h) -> tuple:
    keys = [f"k{i}" for i in range(200)]
    return tuple(h.nodes), tuple(h.get_many(keys))


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda h: h.get(1.5), TypeError),
        (lambda h: h.get(None), TypeError),
        (lambda h: h.get(True), TypeError),
        (lambda h: h.get(["a"]), TypeError),
        (lambda h: h.get(-1), ValueError),
        (lambda h: h.get(2**64), ValueError),
        (lambda h: h.get_many(["a", 1.5]), TypeError),
        (lambda h: h.get_many([1, -1]), ValueError),
        (lambda h: h.get_many(np.array([1, -2], dtype=np.int64)), ValueError),
        (lambda h: h.get_many(np.zeros(3, dtype=np.float64)), TypeError),
        (lambda h: h.get_many(5), TypeError),
        # One key where a batch is wanted (a slip for get()): never iterated by character/byte.
        (lambda h: h.get_many("session-42"), TypeError),
        (lambda h: h.get_many(b"ab"), TypeError),
        (lambda h: h.get_many(bytearray(b"ab")), TypeError),
        (lambda h: h.get_many("ab", as_index=True), TypeError),
        (lambda h: h.preference("a", 0), ValueError),
        (lambda h: h.preference("a", -3), ValueError),
        (lambda h: h.preference("a", 1.0), TypeError),
        (lambda h: h.add("w1"), ValueError),
        (lambda h: h.add("new", 0), ValueError),
        (lambda h: h.add("new", -1), ValueError),
        (lambda h: h.add("new", float("nan")), ValueError),
        (lambda h: h.add("new", float("inf")), ValueError),
        (lambda h: h.add("new", "2"), TypeError),
        (lambda h: h.add("new", True), TypeError),
        (lambda h: h.add(7), TypeError),
        (lambda h: h.remove("nope"), KeyError),
        (lambda h: h.remove(7), TypeError),
    ],
)
def test_bad_input_raises_and_changes_nothing(make, call, exc):
    h = make([f"w{i}" for i in range(5)])
    before = snapshot(h)
    with pytest.raises(exc):
        call(h)
    assert snapshot(h) == before


def test_get_many_of_one_key_names_it(make):
    h = make(["a", "b"])
    with pytest.raises(TypeError, match="keys must be a sequence of keys, not one, got str 'k1'"):
        h.get_many("k1")
    with pytest.raises(TypeError, match="got bytearray bytearray"):
        h.get_many(bytearray(b"k1"))


def test_bad_constructor_input(make):
    with pytest.raises(ValueError, match="already present"):
        make(["a", "b", "a"])
    with pytest.raises(TypeError):
        make("abc")
    with pytest.raises(TypeError):
        make(["a", 3])
    with pytest.raises(TypeError):
        make(5)


def test_empty_hasher_cannot_route(make):
    h = make([])
    assert len(h) == 0 and h.nodes == []
    with pytest.raises(ValueError, match="no nodes"):
        h.get("a")
    with pytest.raises(ValueError, match="no nodes"):
        h.get_many(["a"])
    with pytest.raises(ValueError, match="no nodes"):
        h.preference("a", 1)
    h.add("only")
    assert h.get("a") == "only"
    h.remove("only")
    with pytest.raises(ValueError):
        h.get(1)


@pytest.mark.parametrize("kind", ["ring-ketama", "ring-xxh3", "rendezvous", "jump", "maglev"])
@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 40), data=st.data())
def test_membership_changes_move_only_the_changed_nodes_keys(kind, n, data):
    nodes = [f"worker-{i}" for i in range(n)]
    h = KINDS[kind](nodes)
    keys = [f"session-{i}" for i in range(4000)]
    before = h.get_many(keys)
    victim = data.draw(st.sampled_from(nodes))
    h.remove(victim)
    after = h.get_many(keys)
    stray = sum(b != a and b != victim for b, a in zip(before, after, strict=True))
    assert victim not in after
    moved = sum(b != a for b, a in zip(before, after, strict=True))
    # Maglev rebuilds its table, so it may move a few other keys (<= 1% in Envoy's tests and the
    # paper); the others move nothing but the removed node's keys.
    assert stray <= (0.01 * len(keys) if kind == "maglev" else 0)
    # About 1/n of the keys move (binomial noise, generous bound).
    assert moved <= len(keys) / n * 1.6 + 60
    h.add("newcomer")
    grown = h.get_many(keys)
    stray = sum(a != g and g != "newcomer" for a, g in zip(after, grown, strict=True))
    assert stray <= (0.01 * len(keys) if kind == "maglev" else 0)
    assert sum(a != g for a, g in zip(after, grown, strict=True)) <= len(keys) / n * 1.6 + 60


@pytest.mark.parametrize(
    ("kind", "bound"),
    [
        ("ring-ketama", 1.45),
        ("ring-xxh3", 1.45),
        ("maglev", 1.1),
        ("rendezvous", 1.1),
        ("jump", 1.1),
    ],
)
def test_balance(kind, bound):
    # 50 nodes, 2000 keys each on average. A ring's node owns the arcs before its 160 points, whose
    # total varies by ~8% (1/sqrt(160)): the largest of 50 is typically 1.2-1.35x the mean (1.34
    # for ketama with these names, as in uhashring). The others are within sampling noise (~1.07).
    nodes = [f"10.1.0.{i}:8000" for i in range(50)]
    h = KINDS[kind](nodes)
    counts = Counter(h.get_many([f"key-{i}" for i in range(100_000)]))
    assert set(counts) == set(nodes)
    assert max(counts.values()) / (100_000 / 50) < bound


def test_weights_via_mapping_and_sequences():
    nodes = {"a": 1, "b": 3}
    for h in (
        kvroute.HashRing(nodes, hash="xxh3"),
        kvroute.HashRing(nodes),
        kvroute.Maglev(nodes),
        kvroute.Maglev(["a", "b"], weights=[1, 3]),
        kvroute.Maglev(["a", "b"], weights={"b": 3}),
        kvroute.Rendezvous(nodes),
        kvroute.Rendezvous(["a", "b"], weights=[1.0, 3.0]),
    ):
        share = Counter(h.get_many(list(range(40_000))))["b"] / 40_000
        assert abs(share - 0.75) < 0.03, h


def test_concurrent_lookups_and_changes_are_safe(make):
    h = make([f"w{i}" for i in range(16)])
    keys = [f"k{i}" for i in range(5000)]

    def reader():
        for _ in range(30):
            out = h.get_many(keys)
            assert len(out) == len(keys)
            h.preference("k1", 3)

    def writer():
        for i in range(30):
            h.add(f"extra{i}")
            h.remove(f"extra{i}")

    run_threads((reader, ()), (reader, ()), (reader, ()), (writer, ()))
    assert h.nodes == [f"w{i}" for i in range(16)]


# Hashers big enough that their tables are allocations of their own (beyond glibc's default
# mmap threshold, 128 KiB): a lookup reading a freed one faults, or reads the fill byte
# MALLOC_PERTURB_ writes over freed memory, instead of the old answer left there.
BIG_KINDS = {
    **KINDS,
    "ring-ketama": lambda nodes: kvroute.HashRing(nodes, vnodes=4096),
    "ring-xxh3": lambda nodes: kvroute.HashRing(nodes, vnodes=4096, hash="xxh3"),
}


def check_one_version_whole(kind: str, rounds: int = 40) -> None:
    """Lookups read the hasher in place while another thread adds and removes a node, and tries
    changes that fail: each answer (a single get, a short batch read with the GIL held, a long one
    read without it) must be the whole answer of one version the writer published, never a mix,
    a half-made one or a freed one; a failed change leaves the answers, down to the very `str`
    objects returned, as they were."""
    make = BIG_KINDS[kind]
    nodes = [f"w{i}" for i in range(16)]
    h = make(nodes)
    versions = [make(nodes)] + [make([*nodes, f"extra{i}"]) for i in range(rounds)]
    short = [f"k{i}" for i in range(40)]
    long = [f"k{i}" for i in range(3000)]
    # Past one hold of the GIL (a ring's list is read in chunks, other threads running between):
    # still one version throughout.
    huge = [f"k{i}" for i in range(20_000)]
    batches_of = (short, long, huge)
    answers = {tuple(keys): {tuple(v.get_many(keys)) for v in versions} for keys in batches_of}
    per_key = {k: {v.get(k) for v in versions} for k in short}
    moved = {k for k, seen in per_key.items() if len(seen) > 1}
    assert moved, "no key moves between versions: the test could not see a mix"
    done = []

    def singles():  # the path that reads without a lock, back to back
        seen = 0
        while not done or seen < 3:
            seen += 1
            for k in short:
                assert h.get(k) in per_key[k], k

    def batches():
        seen = 0
        while not done or seen < 3:
            seen += 1
            for keys in batches_of:
                assert tuple(h.get_many(keys)) in answers[tuple(keys)]

    def writer():
        for i in range(rounds):
            h.add(f"extra{i}")
            with pytest.raises(ValueError):
                h.add("w0")
            h.remove(f"extra{i}")
            with pytest.raises(KeyError):
                h.remove(f"extra{i}")
        done.append(True)

    run_threads((singles, ()), (batches, ()), (writer, ()))
    assert h.get_many(long) == versions[0].get_many(long)
    named = h.get("k1")
    for bad in (lambda: h.add("w1"), lambda: h.remove("missing")):
        with pytest.raises((ValueError, KeyError)):
            bad()
        assert h.get("k1") is named
    # The last change stays: every path reads it.
    h.add("extra0")
    assert [h.get(k) for k in short] == h.get_many(short) == versions[1].get_many(short)
    assert h.get_many(long) == versions[1].get_many(long)


@pytest.mark.parametrize("kind", sorted(BIG_KINDS))
def test_lookups_during_changes_see_one_version_whole(kind):
    check_one_version_whole(kind)


def test_lookups_during_changes_never_read_a_freed_version():
    # The same in a fresh interpreter whose allocator unmaps every table it frees and fills
    # every other freed block with a byte no hasher writes.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import test_hashing_common as t\n"
        "for kind in sorted(t.BIG_KINDS): t.check_one_version_whole(kind, rounds=20)\n"
    )
    here = Path(__file__).resolve().parent
    env = {**os.environ, "MALLOC_PERTURB_": "165", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(here)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_a_batch_from_a_list_or_tuple_does_not_import_numpy():
    # Checking for a NumPy array imports NumPy (~45 ms): a process whose first batch is a list
    # must not pay that inside its first lookup.
    code = (
        "import sys, kvroute\n"
        "for make in (kvroute.HashRing, kvroute.Maglev, kvroute.Rendezvous, kvroute.JumpHash):\n"
        "    h = make(['a', 'b', 'c'])\n"
        "    assert h.get_many(['k1', b'k2', 3]) == h.get_many(('k1', b'k2', 3))\n"
        "    assert len(h.get_many(['k1'] * 100)) == 100\n"
        "kvroute.HashRing(['a'], hash='xxh3').get_many(['k'])\n"
        "assert 'numpy' not in sys.modules, 'imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


# -- hash_key (the stable key hash every hasher reads str/bytes keys through) --------------


def test_hash_key_is_xxh3_of_bytes():
    # XXH3-64 seed 0 reference values from the xxHash project's sanity tests: empty input.
    assert kvroute.hash_key(b"") == 0x2D06800538D394C2
    assert kvroute.hash_key("") == kvroute.hash_key(b"")
    assert kvroute.hash_key("ключ") == kvroute.hash_key("ключ".encode())
    assert kvroute.hash_key(7) == kvroute.hash_key((7).to_bytes(8, "little"))
    assert kvroute.hash_key(2**64 - 1) == kvroute.hash_key(b"\xff" * 8)


@pytest.mark.parametrize(
    ("key", "exc"), [(-1, ValueError), (2**64, ValueError), (1.0, TypeError), (None, TypeError)]
)
def test_hash_key_bad_input(key, exc):
    with pytest.raises(exc):
        kvroute.hash_key(key)


@given(st.binary(max_size=300))
def test_hash_key_matches_python_xxhash(data):
    assert kvroute.hash_key(data) == xxhash.xxh3_64_intdigest(data, seed=0)


def test_a_bad_key_in_a_batch_names_its_position(make):
    h = make(["a", "b"])
    for keys in (["x", "y", 1.5], ("x", "y", 1.5), iter(["x", "y", 1.5])):
        with pytest.raises(TypeError, match=r"^keys\[2\] must be str, bytes or int, got float 1.5"):
            h.get_many(keys)
    for keys in ([1, 2, -3], iter([1, 2, -3])):
        with pytest.raises(ValueError, match=r"^keys\[2\] = -3 is negative"):
            h.get_many(keys)
    with pytest.raises(TypeError, match=r"^key must be str, bytes or int, got float"):
        h.get(1.5)
