"""HashRing against libketama's published vectors and uhashring (an independent implementation)."""

from __future__ import annotations

import bisect
import hashlib
import inspect
import random
import threading
import time
from collections import Counter

import kvroute
import numpy as np
import pytest
import uhashring
import xxhash
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.helpers import run_threads


def ketama_hashi(key: str | bytes) -> int:
    """libketama's ketama_hashi: the first 4 MD5 digest bytes, little-endian."""
    data = key.encode() if isinstance(key, str) else key
    return int.from_bytes(hashlib.md5(data).digest()[:4], "little")


def first_point_at_or_after(positions: list[int], h: int) -> int:
    i = bisect.bisect_left(positions, h)
    return positions[i if i < len(positions) else 0]


def test_libketama_two_servers(ketama_vectors):
    case = ketama_vectors["libketama_two_servers"]
    ring = kvroute.HashRing(dict(case["servers"]))
    positions = [p for p, _ in ring.points]
    assert len(positions) == case["num_points"]
    assert ketama_hashi("test") == case["hashi"]["test"]
    expected = case["get_server"]["test"]
    assert first_point_at_or_after(positions, ketama_hashi("test")) == expected["point"]
    assert ring.get("test") == expected["server"]


def test_libketama_million_key_golden_output(ketama_vectors):
    """ketama_test's output for keys "0".."999999" (hash, chosen point, server), byte for byte."""
    case = ketama_vectors["libketama_ketama_servers_file"]
    ring = kvroute.HashRing(dict(case["servers"]))
    positions = [p for p, _ in ring.points]
    assert len(positions) == case["num_points_observed_with_uhashring"]
    keys = [str(i) for i in range(1_000_000)]
    servers = ring.get_many(keys)
    lines = ["\n"]
    for key, server in zip(keys, servers, strict=True):
        h = ketama_hashi(key)
        lines.append(f"{h} {first_point_at_or_after(positions, h)} {server}\n")
    assert lines[1 : 1 + len(case["first_lines_of_that_output"])] == [
        line + "\n" for line in case["first_lines_of_that_output"]
    ]
    assert hashlib.md5("".join(lines).encode()).hexdigest() == case["golden_output_md5"]


def test_go_ketama_counts(ketama_vectors):
    case = ketama_vectors["go_ketama_basic_compat"]
    ring = kvroute.HashRing([f"server{i}" for i in range(1, 11)])
    counts = Counter(ring.get_many([f"foo{i}" for i in range(100_000)]))
    assert counts == case["expected_counts"]


def test_raw_byte_keys_hashing_to_zero(ketama_vectors):
    # go-ketama's regression keys are raw bytes whose ketama hash is exactly 0. go-ketama (Perl's
    # binary search with its underflow quirk) answers the LAST point's server, r01; libketama's
    # ketama_get_server and uhashring answer the first point >= 0, whose owner is r02 here.
    # kvroute follows libketama.
    case = ketama_vectors["go_ketama_segfault_regression"]
    ring = kvroute.HashRing(dict(case["servers"]))
    peer = uhashring.HashRing(dict(case["servers"]), hash_fn="ketama")
    first, last = ring.points[0][1], ring.points[-1][1]
    assert (first, last) == ("r02", "r01")
    for key_hex, go_ketama_server in case["keys_hex_bytes"].items():
        key = bytes.fromhex(key_hex)
        assert ketama_hashi(key) == 0
        assert go_ketama_server == last
        assert ring.get(key) == first
    # uhashring hashes str(key) for bytes, so apply its lookup rule (bisect) to hash 0 directly.
    runtime = peer.runtime
    assert runtime._ring[runtime._keys[bisect.bisect(runtime._keys, 0)]] == first


def divergence_is_documented(ring: kvroute.HashRing, key: str) -> bool:
    """The two cases where libketama (and kvroute) and uhashring differ, by design."""
    points = ring.points
    positions = [p for p, _ in points]
    h = ketama_hashi(key)
    if h in positions:  # exact hit: libketama takes that point, uhashring the next one
        return True
    owners = {n for p, n in points if p == first_point_at_or_after(positions, h)}
    return len(owners) > 1  # a point owned by two nodes


names = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.dictionaries(names, st.integers(1, 1000), min_size=1, max_size=24),
    keys=st.lists(st.one_of(st.text(max_size=40), st.integers(0, 2**64 - 1)), max_size=60),
    vnodes=st.sampled_from([4, 40, 160, 200]),
)
def test_parity_with_uhashring_ketama(nodes, keys, vnodes):
    ours = kvroute.HashRing(nodes, vnodes=vnodes)
    peer = uhashring.HashRing(dict(nodes), hash_fn="ketama", vnodes=vnodes // 4)
    assert sorted(ours.points) == sorted(peer.get_points()) or any(
        c > 1 for c in Counter(p for p, _ in ours.points).values()
    )
    assert [p for p, _ in ours.points] == sorted(peer.runtime._keys)
    got = ours.get_many(keys)
    for key, node in zip(keys, got, strict=True):
        assert node == ours.get(key)
        expected = peer.get_node(key)
        assert node == expected or divergence_is_documented(ours, str(key)), key


def boundary_keys() -> list[str]:
    """Keys whose UTF-8 length straddles one MD5 block's payload (55/56 bytes) and one block
    (64), ASCII and with 2-, 3- and 4-byte characters, in one batch larger than the MD5 lanes."""
    keys = []
    for n in range(48, 72):
        keys.append("k" * n)
        keys.append("é" + "x" * (n - 2))  # 2-byte character first
        keys.append("x" * (n - 3) + "€")  # 3-byte character last
        keys.append("𝄞" + "y" * (n - 4))  # 4-byte character
    return keys


@pytest.mark.parametrize("hash", ["ketama", "xxh3"])
@pytest.mark.parametrize("nodes", [3, 64, 1100])
def test_get_many_equals_get_on_small_and_large_rings(hash, nodes):
    # Rings whose tables fit in cache are looked up plainly, larger ones with prefetching.
    ring = kvroute.HashRing([f"10.0.{i // 256}.{i % 256}:8000" for i in range(nodes)], hash=hash)
    keys = [f"session-{i * 7919}" for i in range(3000)]
    assert ring.get_many(keys) == [ring.get(k) for k in keys]


def test_get_many_equals_get_for_every_key_length():
    # Each length class of the batch's short-key copy (1-3, 4-7, 8-15, 16-31, 32-64 bytes, and
    # longer), twice over so that later keys land after earlier ones in the buffer: keys from an
    # iterator are copied; a list's are read in place.
    ring = kvroute.HashRing([f"node-{i}" for i in range(16)])
    keys = ["".join(chr(48 + (i * 7 + j) % 75) for j in range(n)) for i, n in enumerate(range(141))]
    keys = keys + keys[::-1]
    expected = [ring.get(k) for k in keys]
    assert ring.get_many(iter(keys)) == expected
    assert ring.get_many(keys) == expected


@settings(max_examples=30, deadline=None)
@given(keys=st.lists(st.text(max_size=70), min_size=1, max_size=150))
def test_get_many_matches_uhashring_on_any_text(keys):
    # Batches longer than the MD5 lanes, with short and long (up to 280-byte) keys mixed.
    nodes = {f"node-{i}": 1 + i % 3 for i in range(12)}
    ours = kvroute.HashRing(nodes)
    peer = uhashring.HashRing(dict(nodes), hash_fn="ketama")
    keys = keys + boundary_keys()
    got = ours.get_many(keys)
    for key, node in zip(keys, got, strict=True):
        assert node == ours.get(key)  # the scalar MD5 path
        assert node == peer.get_node(key) or divergence_is_documented(ours, key), key


@settings(max_examples=40, deadline=None)
@given(
    nodes=st.lists(names, min_size=1, max_size=16, unique=True),
    keys=st.lists(st.text(max_size=20), min_size=1, max_size=20),
)
def test_preference_matches_uhashring_walk(nodes, keys):
    ours = kvroute.HashRing(nodes)
    positions = [p for p, _ in ours.points]
    assume(len(set(positions)) == len(positions))  # no point owned twice anywhere on the walk
    peer = uhashring.HashRing(list(nodes), hash_fn="ketama")
    for key in keys:
        assume(not divergence_is_documented(ours, key))
        assert ours.preference(key, len(nodes)) == list(peer.iterate_nodes(key))


def test_exact_hit_follows_libketama_not_uhashring():
    # "<node>-<i>" is the text libketama hashes for node's i-th digest, so such a key's 32-bit hash
    # is exactly one of that node's points. libketama (first point >= hash) answers the node;
    # uhashring (first point > hash) answers the owner of the next point. Keys whose next point
    # has another owner tell the two rules apart.
    nodes = ["a", "b", "c", "d"]
    ring = kvroute.HashRing(nodes)
    peer = uhashring.HashRing(nodes, hash_fn="ketama")
    points = ring.points
    position = {p: i for i, (p, _) in enumerate(points)}
    telling = []
    for node in nodes:
        for i in range(40):
            key = f"{node}-{i}"
            at = position[ketama_hashi(key)]
            assert points[at][1] == node
            following = points[(at + 1) % len(points)][1]
            if following != node:
                telling.append((key, node, following))
    assert len(telling) > 50
    for key, node, following in telling:
        assert ring.get(key) == node, key
        assert peer.get_node(key) == following, key


def test_weighted_point_counts_follow_the_exact_integer_formula():
    # Weights 1, 18, 21 over 3 servers: the third server's exact share is 40*3*21/40 = 63 digests.
    # libketama's float32 pct (0.52499998) gives floorf(62.999997) = 62; uhashring's integer
    # formula gives 63, and so does kvroute (documented in HashRing's docstring).
    weights = {"s1": 1, "s2": 18, "s3": 21}
    pct = np.float32(np.float32(21) / np.float32(40))
    assert int(np.floor(np.float32(float(pct) * 40.0 * 3.0))) == 62
    ring = kvroute.HashRing(weights)
    counts = Counter(n for _, n in ring.points)
    assert counts == {"s1": 12, "s2": 216, "s3": 252}
    assert counts == uhashring.HashRing(weights, hash_fn="ketama").distribution


def test_integer_keys_hash_as_their_decimal_text():
    ring = kvroute.HashRing([f"n{i}" for i in range(10)])
    for k in [0, 7, 12345, 2**64 - 1]:
        assert ring.get(k) == ring.get(str(k))


def test_xxh3_ring_points_are_documented():
    ring = kvroute.HashRing({"a": 1, "b": 2.5}, vnodes=8, hash="xxh3")
    expected = sorted(
        [(xxhash.xxh3_64_intdigest(b"a", seed=j), "a") for j in range(8)]
        + [(xxhash.xxh3_64_intdigest(b"b", seed=j), "b") for j in range(20)]
    )
    assert ring.points == expected
    positions = [p for p, _ in expected]
    for key in ["x", "y", "zz", b"\x00", 5]:
        h = kvroute.hash_key(key)
        assert ring.get(key) == dict(expected)[first_point_at_or_after(positions, h)]


def test_ring_options_and_errors():
    ring = kvroute.HashRing(["a", "b"], vnodes=40, hash="xxh3")
    assert (ring.vnodes, ring.hash) == (40, "xxh3")
    assert "vnodes=40" in repr(ring)
    with pytest.raises(ValueError, match="multiple of 4"):
        kvroute.HashRing(["a"], vnodes=10)
    with pytest.raises(ValueError, match="whole numbers"):
        kvroute.HashRing({"a": 1.5})
    with pytest.raises(ValueError, match="hash must be"):
        kvroute.HashRing(["a"], hash="md5")
    for bad in (0, -1, 2**40):
        with pytest.raises(ValueError, match="vnodes"):
            kvroute.HashRing(["a"], vnodes=bad)
    with pytest.raises(TypeError):
        kvroute.HashRing(["a"], vnodes=1.5)
    with pytest.raises(ValueError, match="too large"):
        kvroute.HashRing({"a": 10**6}, hash="xxh3")
    ketama = kvroute.HashRing(["a"])
    with pytest.raises(ValueError, match="whole numbers"):
        ketama.add("b", 0.5)
    assert ketama.nodes == ["a"]


def test_ketama_node_without_points_comes_last_in_preference():
    # Digests: 40 * 2 * 1000 // 1001 = 79 for "big", 40 * 2 * 1 // 1001 = 0 for "tiny". "tiny" owns
    # no point (as in uhashring and libketama), so it never receives a key, but it is still a node
    # and closes every preference list.
    ring = kvroute.HashRing({"big": 1000, "tiny": 1})
    assert {n for _, n in ring.points} == {"big"}
    assert set(ring.get_many([str(i) for i in range(1000)])) == {"big"}
    assert ring.preference("k", 5) == ["big", "tiny"]
    assert "tiny" in ring and len(ring) == 2
    peer = uhashring.HashRing({"big": 1000, "tiny": 1}, hash_fn="ketama")
    assert peer.distribution == Counter(n for _, n in ring.points) == {"big": 4 * 79}


# -- get_many on lists and tuples: keys hashed where they lie, the GIL released between chunks ----

CHUNK = 8192  # keys hashed per hold of the GIL (rust/src/py/in_place.rs GIL_CHUNK)


class Text(str):
    """A str subclass: hashed as its UTF-8, like any str, read through the stable API."""


@settings(max_examples=30, deadline=None)
@given(keys=st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=100))
def test_get_many_reads_cached_utf8_as_uhashring_hashes_it(keys):
    # A non-ASCII str holds no UTF-8 until something asks for it; get() caches it in the string
    # (PyUnicode_AsUTF8AndSize), which the next get_many then reads in place.
    nodes = {f"node-{i}": 1 + i % 3 for i in range(12)}
    ours = kvroute.HashRing(nodes)
    peer = uhashring.HashRing(dict(nodes), hash_fn="ketama")
    keys = [*keys, *boundary_keys()]
    fresh = [k.encode().decode() for k in keys]  # equal strings, no cached UTF-8
    first = ours.get_many(fresh)
    for key in keys:
        ours.get(key)
    cached = ours.get_many(keys)
    subclassed = ours.get_many([Text(k) for k in keys])
    assert cached == first == subclassed == ours.get_many(tuple(keys))
    for key, node in zip(keys, cached, strict=True):
        assert node == peer.get_node(key) or divergence_is_documented(ours, key), key


@pytest.mark.parametrize("hash", ["ketama", "xxh3"])
def test_get_many_on_lists_longer_than_the_gil_chunks(hash):
    nodes = [f"10.0.0.{i}:8000" for i in range(40)]
    ring = kvroute.HashRing(nodes, hash=hash)
    keys: list[str | bytes | int] = []
    for i in range(3 * CHUNK + 17):
        keys.append(("sess-{}", "séance-{}", "𝄞{}", "{0}" * 20)[i % 4].format(i))
    keys[CHUNK - 1] = b"bytes at the end of a chunk"
    keys[CHUNK] = 2**64 - 1
    keys[2 * CHUNK] = Text("a subclass at the start of one")
    got = ring.get_many(keys)
    assert got == [ring.get(k) for k in keys]
    assert ring.get_many(tuple(keys)) == got
    if hash == "ketama":
        peer = uhashring.HashRing(nodes, hash_fn="ketama")
        for key, node in zip(keys, got, strict=True):
            if not isinstance(key, bytes):  # uhashring hashes str(b"...") (see the class docs)
                assert node == peer.get_node(key) or divergence_is_documented(ring, str(key))


@pytest.mark.parametrize("hash", ["ketama", "xxh3"])
def test_get_many_on_a_list_another_thread_changes(hash):
    # Between chunks other threads run: each position is read as it is when reached, to the
    # list's length then, as [get(k) for k in keys] reads it.
    ring = kvroute.HashRing([f"w{i}" for i in range(32)], hash=hash)
    n = 4 * CHUNK
    a = [f"a-{i}" for i in range(n)]
    b = [f"b-é{i}" for i in range(n)]
    either = [{ring.get(x), ring.get(y)} for x, y in zip(a, b, strict=True)]
    keys = list(a)
    done = threading.Event()

    def mutate():
        rng = random.Random(7)
        while not done.is_set():
            for _ in range(200):
                i = rng.randrange(n)
                keys[i] = b[i] if keys[i] is a[i] else a[i]
            cut = rng.randrange(n // 4, n)
            # Copies that only the list holds: freed when cut off, so a read past the list's
            # length would find freed objects.
            tail = [(b[i] if rng.random() < 0.5 else a[i]).encode().decode() for i in range(cut, n)]
            del keys[cut:]  # shrinks the list's array ...
            time.sleep(0)  # ... lets the reader run on the short list ...
            keys.extend(tail)  # ... and grows it back

    def read():
        try:
            for _ in range(15):
                got = ring.get_many(keys)
                assert n // 4 <= len(got) <= n
                for i, node in enumerate(got):
                    assert node in either[i], i
        finally:
            done.set()

    run_threads((mutate, ()), (read, ()))


def test_get_arguments_bind_like_a_def():
    # `HashRing.get` is a direct method (rust/src/py/direct_call.rs): one positional key is looked
    # up there; every other call must bind as the PyO3 method `def get(self, key)` does.
    ring = kvroute.HashRing(["a", "b", "c"])
    want = uhashring.HashRing(["a", "b", "c"], hash_fn="ketama").get_node("k-1")
    assert ring.get("k-1") == ring.get(key="k-1") == kvroute.HashRing.get(ring, "k-1") == want
    assert kvroute.HashRing.get(ring, key="k-1") == want
    assert list(inspect.signature(kvroute.HashRing.get).parameters) == ["self", "key"]
    assert "The node ``key`` maps to." in kvroute.HashRing.get.__doc__
    with pytest.raises(TypeError, match="missing"):
        ring.get()
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        ring.get("k-1", "k-2")
    with pytest.raises(TypeError, match="multiple values"):
        ring.get("k-1", key="k-2")
    with pytest.raises(TypeError, match="unexpected keyword"):
        ring.get(name="k-1")
    with pytest.raises(TypeError):
        kvroute.HashRing.get(kvroute.Maglev(["a"]), "k-1")
    with pytest.raises(TypeError, match="key must be str, bytes or int"):
        ring.get(1.5)
    with pytest.raises(ValueError):
        kvroute.HashRing([]).get("k-1")
