"""Jump hash and hash_key against published vectors and independent references."""

from __future__ import annotations

import zlib

import kvroute
import numpy as np
import pytest
from helpers import paper_jump
from hypothesis import given
from hypothesis import strategies as st


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
    xxhash = pytest.importorskip("xxhash")
    assert kvroute.hash_key(data) == xxhash.xxh3_64_intdigest(data, seed=0)


def test_jump_hash_arguments_bind_like_a_def():
    assert kvroute.jump_hash(key=0xDEADBEEF, num_buckets=19) == 16
    assert kvroute.jump_hash(0xDEADBEEF, num_buckets=19) == 16
    with pytest.raises(TypeError, match="missing"):
        kvroute.jump_hash(1)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        kvroute.jump_hash(1, 2, 3)
    with pytest.raises(TypeError, match="multiple values"):
        kvroute.jump_hash(1, 2, key=3)
    with pytest.raises(TypeError, match="unexpected keyword"):
        kvroute.jump_hash(1, buckets=3)
