"""Integers at the Python boundary: NumPy integer scalars (and any object with ``__index__``) are
taken by value wherever an int is, in lists of block hashes, tokens and ring keys and alone;
``bool`` (Python's or NumPy's) and floats are refused with ``TypeError`` naming the argument.

The reference is the same call with ``int(x)`` for every element: the answers must be equal.
"""

from __future__ import annotations

import kvroute
import numpy as np
import pytest

BS = 4


class Index:
    """An integer type of the caller's own (``operator.index`` takes it)."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def hashes() -> np.ndarray:
    """Eight block hashes; some have the top bit set (>= 2**63), some not."""
    h = kvroute.BlockHasher(BS).hash(np.arange(BS * 8, dtype=np.int32))
    top = [bool(int(x) >> 63) for x in h]
    assert any(top) and not all(top)
    return h


def scalars(values, kind):
    return [kind(int(v)) for v in values]


KINDS = [np.uint64, Index]


@pytest.mark.parametrize("kind", KINDS)
def test_block_hash_scalars_equal_their_ints(kind):
    h = hashes()
    ints, objs = [int(x) for x in h], scalars(h, kind)
    a, b = kvroute.PrefixIndex(), kvroute.PrefixIndex()
    a.store("w", ints[:4])
    b.store("w", objs[:4])
    a.store("w", ints[4:], parent=ints[3])
    b.store("w", objs[4:], parent=objs[3])
    assert a.dump() == b.dump()
    assert b.match(objs) == a.match(ints) == {"w": 8}
    assert all(o in b for o in objs)
    ca, cb = kvroute.BlockCache(16), kvroute.BlockCache(16)
    (na, _), (nb, _) = ca.insert(ints, now=0.0), cb.insert(objs, now=0.0)
    assert na == nb == 8
    assert cb.peek(objs) == cb.peek(ints) == 8 and all(o in cb for o in objs)
    ra, rb = kvroute.Router(["a", "b"]), kvroute.Router(["a", "b"])
    da, db = ra.route(block_hashes=ints, now=0.0), rb.route(block_hashes=objs, now=0.0)
    assert (db.worker, db.prompt_blocks) == (da.worker, da.prompt_blocks) == (da.worker, 8)


def test_negative_int64_scalars_are_reinterpreted_as_ints_are():
    """SGLang publishes signed hashes: np.int64 scalars take their two's-complement bits."""
    signed = [-5, 7, -(2**63)]
    a, b = kvroute.PrefixIndex(), kvroute.PrefixIndex()
    a.store("w", signed)
    b.store("w", [np.int64(v) for v in signed])
    assert a.dump() == b.dump()
    assert b.match([v % 2**64 for v in signed]) == {"w": 3}


@pytest.mark.parametrize("kind", [np.int64, np.uint32, np.uint64, np.int16, Index])
def test_token_scalars_equal_their_ints(kind):
    tokens = list(range(1000, 1000 + BS * 3))
    hasher = kvroute.BlockHasher(BS)
    expected = hasher.hash(tokens)
    assert list(hasher.hash([kind(t) for t in tokens])) == list(expected)


@pytest.mark.parametrize("kind", KINDS)
def test_ring_key_scalars_equal_their_ints(kind):
    keys = [int(x) for x in hashes()] + [0, 1, 2**64 - 1]
    for h in (
        kvroute.HashRing(["a", "b", "c"]),
        kvroute.Maglev(["a", "b", "c"]),
        kvroute.Rendezvous(["a", "b", "c"]),
        kvroute.JumpHash(["a", "b", "c"]),
    ):
        expected = h.get_many(keys)
        objs = [kind(k) for k in keys]
        assert h.get_many(objs) == expected
        assert h.get_many(tuple(objs)) == expected
        assert [h.get(o) for o in objs] == expected
        assert h.preference(objs[0], 2) == h.preference(keys[0], 2)
    assert kvroute.jump_hash(kind(2**64 - 1), 7) == kvroute.jump_hash(2**64 - 1, 7)


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda: kvroute.PrefixIndex().store("w", [1, np.True_]), TypeError, r"block_hashes\[1\]"),
        (lambda: kvroute.PrefixIndex().store("w", [1, True]), TypeError, r"block_hashes\[1\]"),
        (lambda: kvroute.PrefixIndex().match([np.float64(1.0)]), TypeError, r"block_hashes\[0\]"),
        (lambda: kvroute.PrefixIndex().store("w", [1], parent=np.True_), TypeError, "parent"),
        (lambda: kvroute.BlockHasher(BS).hash([1, 2, np.True_, 4]), TypeError, r"tokens\[2\]"),
        (lambda: kvroute.BlockHasher(BS).hash([1, 2, np.int64(-1), 4]), ValueError, r"tokens\[2\]"),
        (lambda: kvroute.HashRing(["a"]).get(np.True_), TypeError, "key"),
        (lambda: kvroute.HashRing(["a"]).get_many([1, np.float32(2)]), TypeError, "key"),
        (lambda: kvroute.HashRing(["a"]).get(np.int64(-1)), ValueError, "key"),
        (lambda: kvroute.PrefixIndex().store("w", [Index(2**64)]), ValueError, r"-2\*\*63"),
    ],
)
def test_bools_floats_and_out_of_range_scalars_are_refused(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def applier(**kw):
    return kvroute.KvEventApplier(kvroute.PrefixIndex(), **kw)


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        # KvEventApplier's ints go through the module's conversions, as everywhere else.
        (lambda: applier(block_size=-1), ValueError, "block_size = -1 is negative"),
        (lambda: applier(block_size=2**64), ValueError, r"block_size = 18446744073709551616 is"),
        (lambda: applier(block_size=True), TypeError, "block_size must be an int, got bool"),
        (lambda: applier(group_idx=2**63), ValueError, "group_idx = 9223372036854775808 is"),
        (lambda: applier(group_idx=True), TypeError, "group_idx must be an int, got bool"),
        # The value given, never a saturated one.
        (lambda: kvroute.jump_hash(1, 2**70), ValueError, f"num_buckets .* got {2**70}$"),
        (lambda: kvroute.jump_hash(1, -(2**70)), ValueError, f"num_buckets .* got {-(2**70)}$"),
        (lambda: kvroute.jump_hash_many([1], 2**64), ValueError, f"got {2**64}$"),
        (lambda: kvroute.HashRing(["a"], vnodes=2**64), ValueError, f"vnodes .* got {2**64}$"),
        (lambda: kvroute.HashRing(["a"], vnodes=-(2**64)), ValueError, f"got {-(2**64)}$"),
        (lambda: kvroute.Maglev(["a"], table_size=2**64), ValueError, f"prime .* got {2**64}$"),
        (lambda: kvroute.Maglev(["a"], table_size=-(2**64)), ValueError, f"got {-(2**64)}$"),
        (lambda: kvroute.HashRing(["a"]).preference("k", -(2**64)), ValueError, "n must be >= 1"),
    ],
)
def test_int_arguments_name_themselves_and_the_value_given(call, exc, message):
    with pytest.raises(exc, match=message) as e:
        call()
    if exc is ValueError and "must be" in str(e.value):
        assert "9223372036854775807" not in str(e.value)


def test_int_arguments_take_numpy_scalars():
    a = applier(block_size=np.int64(8), group_idx=np.uint8(1))
    assert (a.block_size, a.group_idx) == (8, 1)
    assert kvroute.jump_hash(5, np.int32(9)) == kvroute.jump_hash(5, 9)
    ring = kvroute.HashRing(["a", "b", "c"], vnodes=np.uint16(40))
    assert ring.preference("k", np.int64(2)) == kvroute.HashRing(
        ["a", "b", "c"], vnodes=40
    ).preference("k", 2)
    # A count beyond every node asks for all of them, however large.
    assert sorted(ring.preference("k", 2**70)) == ["a", "b", "c"]
