"""BlockHasher against vLLM's published vectors and small independent reference models.

References: the vLLM 0.33.0 vector file (hashes, NONE_HASH and CBOR pre-images produced by running
vLLM's own modules); ``cbor2`` + ``hashlib`` for vLLM's ``sha256_cbor`` (the library vLLM itself
calls); ``xxhash`` for the native profile; ``hashlib`` for SGLang's page hash, written from
KV_EVENTS_SPEC.md section 4 (SGLang's own vector file is not available here).
"""

from __future__ import annotations

import ast
import enum
import hashlib
import json
import pickle
import re
import struct
from pathlib import Path

import cbor2
import kvroute
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import run_threads

VECTORS = Path(__file__).parent / "data" / "vectors"
VLLM = json.loads((VECTORS / "vllm_0.33.0_block_hash_and_kv_event_vectors.json").read_text())
RELEASES = json.loads((VECTORS / "vllm_block_hash_releases.json").read_text())["releases"]

# ----------------------------------------------------------------------------------------------
# Reference models (pure Python, written from the published definitions, not from kvroute's code)


def _field(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode()
    return b"\x01" + struct.pack("<Q", len(raw)) + raw


def native_root(salt=None, lora_name=None, lora_path=None) -> int:
    salt = salt or None
    lora = b"\x00" if lora_name is None else b"\x01" + _field(lora_name) + _field(lora_path or "")
    return xxhash.xxh3_64_intdigest(b"kvroute-native-v1" + _field(salt) + lora, seed=0)


def native_ref(tokens, block_size, parent=None, **opts) -> list[int]:
    prev = native_root(**opts) if parent is None else parent
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        prev = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=prev)
        out.append(prev)
    return out


def vllm_mm_keys(mm, start, end, cursor, tagged=True):
    """vLLM's walk over multimodal items sorted by offset, for the block ``start..end``."""
    keys = []
    while cursor < len(mm):
        ident, offset, length = mm[cursor]
        if end <= offset:
            break
        if start >= offset + length:
            cursor += 1
            continue
        keys.append(("mm", ident, offset - start) if tagged else (ident, offset - start))
        if end >= offset + length:
            cursor += 1
        else:
            break
    return keys, cursor


def _distinct(s):
    """A new str object equal to ``s`` (as a request's strings are; CPython still returns its
    singletons for the empty string and one Latin-1 character)."""
    return None if s is None else "".join(list(s))


def vllm_ref_digests(
    tokens,
    block_size,
    parent=None,
    *,
    salt=None,
    lora_name=None,
    lora_path=None,
    seed=None,
    mm=(),
    algo="sha256_cbor",
    tagged=True,
):
    """vLLM's block hash: ``H((parent, tuple(block), extra_keys))`` with ``H`` = SHA-256 of
    ``pickle.dumps(x, protocol=5)`` (``sha256``) or of canonical CBOR (``sha256_cbor``); extra keys
    tagged (vLLM >= 0.31) or bare (0.23-0.30)."""
    if algo == "sha256":

        def H(x):
            return hashlib.sha256(pickle.dumps(x, protocol=5)).digest()
    else:

        def H(x):
            return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    salt, lora_name, lora_path = _distinct(salt), _distinct(lora_name), _distinct(lora_path)
    mm = [(_distinct(i), o, n) for i, o, n in mm]
    none_hash = H(seed if seed is not None else "vllm-none-hash")
    prev, first, cursor, out = parent or none_hash, parent is None, 0, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        keys = []
        if lora_name is not None:
            path = lora_path if lora_path is not None else ""
            keys.append(("lora", lora_name, path) if tagged else lora_name)
        mm_keys, cursor = vllm_mm_keys(mm, start, start + block_size, cursor, tagged)
        keys += mm_keys
        if first and salt:
            keys.append(("cache_salt", salt) if tagged else salt)
        extra = tuple(keys) if keys else None
        block = tuple(tokens[start : start + block_size])
        prev = H((prev, block, extra))
        first = False
        out.append(prev)
    return out


def vllm_value(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & (2**64 - 1)


def sglang_ref_digests(tokens, page_size, parent=None, *, salt=None):
    prev = parent
    if prev is None and salt:
        prev = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest()
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        if any(t > 2**32 - 1 for t in page):
            h.update(b"\xff" + b"".join(t.to_bytes(8, "little") for t in page))
        else:
            h.update(b"".join(t.to_bytes(4, "little") for t in page))
        prev = h.digest()
        out.append(prev)
    return out


def sglang_value(digest: bytes) -> int:
    # SGLang publishes int.from_bytes(digest[:8], "big", signed=True); kvroute returns its bits.
    return int.from_bytes(digest[:8], "big", signed=True) & (2**64 - 1)


# ----------------------------------------------------------------------------------------------
# vLLM 0.33.0 vectors


def _case_options(case: dict) -> tuple[dict, list]:
    """Hasher options and mm items for a vector case, read from its hash-side extra keys."""
    opts: dict = {"seed": case["none_hash_seed"]}
    mm = []
    for raw in case["hash_side_extra_keys"]:
        for key in ast.literal_eval(raw) or ():
            if key[0] == "lora":
                opts["lora_name"], opts["lora_path"] = key[1], key[2]
            elif key[0] == "cache_salt":
                opts["salt"] = key[1]
    found = re.search(r"multimodal\(identifier=([^,]+),offset=(\d+),length=(\d+)\)", case["case"])
    if found:
        mm = [(found.group(1), int(found.group(2)), int(found.group(3)))]
    return opts, mm


@pytest.mark.parametrize("case", VLLM["hash_cases"], ids=lambda c: c["case"])
def test_vllm_033_vectors(case):
    opts, mm = _case_options(case)
    h = kvroute.BlockHasher(case["block_size"], profile="vllm", hash_algo=case["algo"], **opts)
    tokens = case["token_ids"]
    assert h.root.hex() == case["none_hash_hex"]
    assert h.hash(tokens, mm=mm).tolist() == case["block_hashes_external_u64"]
    assert [bytes(d).hex() for d in h.digests(tokens, mm=mm)] == case["block_hashes_hex"]
    # The reference model reproduces vLLM's exact pre-images, so it is a fair oracle below.
    digests = [bytes.fromhex(d) for d in case["block_hashes_hex"]]
    parents = [bytes.fromhex(case["none_hash_hex"]), *digests[:-1]]
    for i, (parent, preimage) in enumerate(zip(parents, case["hash_preimage_hex"], strict=True)):
        keys = ast.literal_eval(case["hash_side_extra_keys"][i])
        block = tuple(tokens[i * 16 : (i + 1) * 16])
        if case["algo"] == "sha256":
            assert pickle.dumps((parent, block, keys), protocol=5).hex() == preimage
        else:
            assert cbor2.dumps((parent, block, keys), canonical=True).hex() == preimage
    ref = vllm_ref_digests(tokens, case["block_size"], mm=mm, algo=case["algo"], **opts)
    assert [d.hex() for d in ref] == case["block_hashes_hex"]


RELEASE_CASES = [(r["vllm_version"], c) for r in RELEASES for c in r["cases"]]


@pytest.mark.parametrize(
    ("version", "case"),
    RELEASE_CASES,
    ids=[f"{v}-{c['algo']}-{c['seed']}-{c['salt']}-{bool(c['lora'])}" for v, c in RELEASE_CASES],
)
def test_vllm_release_vectors(version, case):
    """Each release's own hashing code (tests/data/vectors/vllm_block_hash_releases.json)."""
    name, path = case["lora"] or (None, None)
    h = kvroute.BlockHasher(
        case["block_size"],
        profile="vllm",
        hash_algo=case["algo"],
        vllm_version=version,
        seed=case["seed"],
        salt=case["salt"],
        lora_name=name,
        lora_path=path,
    )
    assert h.root.hex() == case["none_hash"]
    assert h.hash(case["tokens"]).tolist() == case["values"]
    assert [bytes(d).hex() for d in h.digests(case["tokens"])] == case["digests"]
    tagged = tuple(int(x) for x in version.split(".")[:2]) >= (0, 31)
    ref = vllm_ref_digests(
        case["tokens"],
        case["block_size"],
        salt=case["salt"],
        lora_name=name,
        lora_path=path,
        seed=case["seed"],
        algo=case["algo"],
        tagged=tagged,
    )
    assert [d.hex() for d in ref] == case["digests"]


def test_vllm_releases_before_029_need_the_engines_seed():
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        kvroute.BlockHasher(16, profile="vllm", vllm_version="0.28.1")
    h = kvroute.BlockHasher(16, profile="vllm", vllm_version="v0.26.0", seed="0")
    assert (h.vllm_version, h.hash_algo, h.seed) == ("0.26", "sha256_cbor", "0")
    assert kvroute.BlockHasher(16, profile="vllm").vllm_version == "0.33"
    with pytest.raises(ValueError, match=r"older than 0\.23"):
        kvroute.BlockHasher(16, profile="vllm", vllm_version="0.22.1", seed="0")
    with pytest.raises(ValueError, match="xxhash"):
        kvroute.BlockHasher(16, profile="vllm", hash_algo="xxhash")
    with pytest.raises(ValueError, match="only to profile 'vllm'"):
        kvroute.BlockHasher(16, hash_algo="sha256")


def test_vllm_vectors_continue_from_a_digest():
    case = VLLM["hash_cases"][0]
    h = kvroute.BlockHasher(16, profile="vllm")
    tokens = case["token_ids"]
    first, state = h.hash_with_state(tokens[:16])
    assert state.hex() == case["block_hashes_hex"][0]
    rest = h.hash(tokens[16:], parent=state)
    assert [*first.tolist(), *rest.tolist()] == case["block_hashes_external_u64"]


# ----------------------------------------------------------------------------------------------
# Models, chaining, tails, dtypes (Hypothesis)

u32 = st.integers(0, 2**32 - 1)
small_tokens = st.lists(st.integers(0, 300_000), max_size=60)
names = st.one_of(st.none(), st.text(max_size=8))


@st.composite
def mm_items(draw):
    offsets = sorted(draw(st.lists(st.integers(-20, 60), max_size=4)))
    return [(draw(st.text(max_size=4)), off, draw(st.integers(0, 30))) for off in offsets]


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(u32, max_size=60), bs=st.integers(1, 9), salt=names, lora=names)
def test_native_matches_xxhash_reference(tokens, bs, salt, lora):
    h = kvroute.BlockHasher(bs, salt=salt, lora_name=lora)
    assert h.hash(tokens).tolist() == native_ref(tokens, bs, salt=salt, lora_name=lora)
    assert h.root == native_root(salt=salt, lora_name=lora)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.one_of(u32, st.integers(0, 2**64 - 1)), max_size=40),
    bs=st.integers(1, 9),
    salt=names,
    lora=names,
    lora_path=names,
    seed=st.one_of(st.none(), st.sampled_from(["0", "vllm-none-hash", "42"])),
)
def test_vllm_matches_cbor2_reference(tokens, bs, salt, lora, lora_path, seed):
    lora_path = lora_path if lora is not None else None
    opts = {"salt": salt, "lora_name": lora, "lora_path": lora_path, "seed": seed}
    h = kvroute.BlockHasher(bs, profile="vllm", **opts)
    ref = vllm_ref_digests(tokens, bs, **opts)
    assert h.hash(tokens).tolist() == [vllm_value(d) for d in ref]
    assert [bytes(d) for d in h.digests(tokens)] == ref


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.one_of(u32, st.integers(0, 2**64 - 1)), max_size=40),
    bs=st.integers(1, 9),
    salt=names,
    lora=names,
    lora_path=names,
    seed=st.one_of(st.none(), st.sampled_from(["0", "vllm-none-hash", "42", "", "é"])),
    version=st.sampled_from(["0.29", "0.30.1", "0.31", "0.33.0"]),
    mm=mm_items(),
)
def test_vllm_sha256_matches_pickle_reference(tokens, bs, salt, lora, lora_path, seed, version, mm):
    """vLLM's default algorithm: SHA-256 of Python's own pickle (protocol 5) of the block key."""
    lora_path = lora_path if lora is not None else None
    opts = {"salt": salt, "lora_name": lora, "lora_path": lora_path, "seed": seed}
    h = kvroute.BlockHasher(bs, profile="vllm", hash_algo="sha256", vllm_version=version, **opts)
    tagged = version.startswith(("0.31", "0.33"))
    ref = vllm_ref_digests(tokens, bs, mm=mm, algo="sha256", tagged=tagged, **opts)
    assert h.hash(tokens, mm=mm).tolist() == [vllm_value(d) for d in ref]


def test_vllm_sha256_blocks_larger_than_a_pickle_frame():
    """A block whose pickle is split into several 64 KiB frames (and a >= 64 KiB salt, written
    outside any frame)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**31, 3 * 20_000, dtype=np.int64).tolist()
    for opts in ({}, {"salt": "s" * 70_000}, {"lora_name": "l" * 300, "lora_path": "p"}):
        h = kvroute.BlockHasher(20_000, profile="vllm", hash_algo="sha256", **opts)
        ref = vllm_ref_digests(tokens, 20_000, algo="sha256", **opts)
        assert [bytes(d) for d in h.digests(tokens)] == ref
    assert h.hash(tokens).tolist() == [vllm_value(d) for d in ref]
    assert [bytes(d) for d in h.digests(tokens)] == ref


@settings(max_examples=150, deadline=None)
@given(tokens=small_tokens, bs=st.integers(1, 12), mm=mm_items(), salt=names)
def test_vllm_multimodal_matches_reference_walk(tokens, bs, mm, salt):
    h = kvroute.BlockHasher(bs, profile="vllm", salt=salt)
    ref = vllm_ref_digests(tokens, bs, salt=salt, mm=mm)
    assert h.hash(tokens, mm=mm).tolist() == [vllm_value(d) for d in ref]


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.one_of(u32, u32, st.integers(0, 2**64 - 1)), max_size=40),
    bs=st.integers(1, 9),
    salt=names,
)
def test_sglang_matches_hashlib_reference(tokens, bs, salt):
    h = kvroute.BlockHasher(bs, profile="sglang", salt=salt)
    ref = sglang_ref_digests(tokens, bs, salt=salt)
    assert h.hash(tokens).tolist() == [sglang_value(d) for d in ref]
    assert [bytes(d) for d in h.digests(tokens)] == ref


PROFILES = ["native", "vllm", "sglang"]


@settings(max_examples=100, deadline=None)
@given(
    profile=st.sampled_from(PROFILES),
    bs=st.integers(1, 8),
    head_blocks=st.integers(0, 5),
    data=st.data(),
    salt=names,
)
def test_chaining_continues_exactly(profile, bs, head_blocks, data, salt):
    a = data.draw(
        st.lists(st.integers(0, 100_000), min_size=bs * head_blocks, max_size=bs * head_blocks)
    )
    b = data.draw(small_tokens)
    h = kvroute.BlockHasher(bs, profile=profile, salt=salt)
    head, state = h.hash_with_state(a)
    assert state is None if head_blocks == 0 else state is not None
    whole = h.hash(a + b).tolist()
    assert whole == head.tolist() + h.hash(b, parent=state).tolist()
    if head_blocks and profile == "native":
        # The native state is the last hash itself, as a Python int or a NumPy scalar.
        assert state == head[-1]
        assert h.hash(b, parent=head[-1]).tolist() == whole[head_blocks:]
    if head_blocks and profile != "native":
        digest_rows = h.digests(a)
        assert bytes(digest_rows[-1]) == state
        assert h.hash(b, parent=digest_rows[-1]).tolist() == whole[head_blocks:]


@settings(max_examples=100, deadline=None)
@given(profile=st.sampled_from(PROFILES), bs=st.integers(1, 10), tokens=small_tokens)
def test_partial_tail_is_dropped(profile, bs, tokens):
    h = kvroute.BlockHasher(bs, profile=profile)
    out = h.hash(tokens)
    assert out.dtype == np.uint64
    assert len(out) == len(tokens) // bs
    full = len(tokens) // bs * bs
    assert out.tolist() == h.hash(tokens[:full]).tolist()


DTYPES = [np.int32, np.uint32, np.int64, np.uint64]


@settings(max_examples=60, deadline=None)
@given(profile=st.sampled_from(PROFILES), bs=st.integers(1, 6), tokens=small_tokens)
def test_dtypes_and_layouts_agree(profile, bs, tokens):
    h = kvroute.BlockHasher(bs, profile=profile)
    expected = h.hash(tokens).tolist()
    for dtype in DTYPES:
        arr = np.asarray(tokens, dtype=dtype)
        assert h.hash(arr).tolist() == expected, dtype
        strided = np.repeat(arr, 2)[::2]  # a non-contiguous view holding the same values
        assert not strided.flags.c_contiguous or len(arr) <= 1
        assert h.hash(strided).tolist() == expected, dtype
    assert h.hash(tuple(tokens)).tolist() == expected


def test_long_inputs_release_the_gil_and_match_the_models():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 128_000, size=5000, dtype=np.int64)
    listed = tokens.tolist()
    assert kvroute.BlockHasher(16).hash(tokens).tolist() == native_ref(listed, 16)
    vllm = kvroute.BlockHasher(16, profile="vllm", salt="s", lora_name="a", lora_path="/a")
    ref = vllm_ref_digests(listed, 16, salt="s", lora_name="a", lora_path="/a")
    assert vllm.hash(tokens).tolist() == [vllm_value(d) for d in ref]
    sglang = kvroute.BlockHasher(16, profile="sglang", salt="s")
    ref = sglang_ref_digests(listed, 16, salt="s")
    assert sglang.hash(tokens).tolist() == [sglang_value(d) for d in ref]


def test_threads_share_one_hasher():
    h = kvroute.BlockHasher(16, profile="vllm")
    tokens = np.arange(40_000, dtype=np.uint32)
    expected = h.hash(tokens)
    results = [None] * 4

    def work(i):
        results[i] = h.hash(tokens)

    run_threads(*((work, (i,)) for i in range(4)))
    for r in results:
        np.testing.assert_array_equal(r, expected)


# ----------------------------------------------------------------------------------------------
# Namespaces


def test_salt_and_lora_separate_chains():
    tokens = list(range(64))
    for profile in PROFILES:
        plain = kvroute.BlockHasher(16, profile=profile).hash(tokens)
        a = kvroute.BlockHasher(16, profile=profile, salt="a").hash(tokens)
        b = kvroute.BlockHasher(16, profile=profile, salt="b").hash(tokens)
        again = kvroute.BlockHasher(16, profile=profile, salt="a").hash(tokens)
        assert not set(plain.tolist()) & set(a.tolist())
        assert not set(a.tolist()) & set(b.tolist())
        assert a.tolist() == again.tolist()
        empty = kvroute.BlockHasher(16, profile=profile, salt="").hash(tokens)
        assert empty.tolist() == plain.tolist()  # an empty salt is no salt, as in vLLM/SGLang
    for profile in ["native", "vllm"]:
        plain = kvroute.BlockHasher(16, profile=profile).hash(tokens)
        lora = kvroute.BlockHasher(16, profile=profile, lora_name="x").hash(tokens)
        assert not set(plain.tolist()) & set(lora.tolist())


def test_properties_and_repr():
    h = kvroute.BlockHasher(32, profile="vllm", salt="t", lora_name="n")
    assert (h.block_size, h.profile, h.salt, h.lora_name, h.lora_path, h.seed) == (
        32,
        "vllm",
        "t",
        "n",
        "",
        "vllm-none-hash",
    )
    assert repr(h) == (
        "BlockHasher(block_size=32, profile='vllm', salt='t', lora_name='n', lora_path='', "
        "seed='vllm-none-hash', hash_algo='sha256_cbor', vllm_version='0.33')"
    )
    d = kvroute.BlockHasher()
    assert (d.block_size, d.profile, d.seed, d.salt) == (16, "native", None, None)
    assert kvroute.BlockHasher(profile="sglang").root is None
    assert (
        kvroute.BlockHasher(profile="sglang", salt="x").root
        == hashlib.sha256(b"sglang-cache-salt-v1\0x").digest()
    )


# ----------------------------------------------------------------------------------------------
# Errors: clear exceptions, nothing changed


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": -1}, ValueError, "block_size"),
        ({"block_size": "16"}, TypeError, "block_size"),
        ({"block_size": True}, TypeError, "block_size"),
        ({"profile": "xxhash"}, ValueError, "xxhash"),
        ({"profile": 1}, TypeError, "profile"),
        ({"salt": b"x"}, TypeError, "salt"),
        ({"lora_name": 3}, TypeError, "lora_name"),
        ({"lora_path": "/p"}, ValueError, "lora_path"),
        ({"seed": "0"}, ValueError, "seed"),
        ({"profile": "vllm", "seed": 0}, TypeError, "seed"),
        ({"profile": "sglang", "lora_name": "x"}, ValueError, "lora_name"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvroute.BlockHasher(**kwargs)


@pytest.mark.parametrize("profile", PROFILES)
def test_bad_tokens_raise_and_change_nothing(profile):
    h = kvroute.BlockHasher(4, profile=profile)
    good = list(range(1, 9))
    before = h.hash(good).tolist()
    with pytest.raises(ValueError, match=r"tokens\[5\] = -3 is negative"):
        h.hash([1, 2, 3, 4, 5, -3, 7, 8])
    arr = np.array([1, 2, 3, 4, 5, 6, -9], dtype=np.int32)
    with pytest.raises(ValueError, match=r"tokens\[6\] = -9 is negative"):
        h.hash(arr)  # the offending token is in the dropped tail: still refused
    assert arr.tolist() == [1, 2, 3, 4, 5, 6, -9]
    with pytest.raises(ValueError, match=r"tokens\[0\]"):
        h.hash([2**64])
    for bad in [np.zeros(8, dtype=np.float64), np.zeros((2, 4), dtype=np.int64), "abcd", 5]:
        with pytest.raises(TypeError):
            h.hash(bad)
    with pytest.raises(TypeError, match=r"tokens\[1\]"):
        h.hash([1, "2", 3, 4])
    with pytest.raises(TypeError, match=r"tokens\[0\]"):
        h.hash([True, 2, 3, 4])
    with pytest.raises(TypeError):
        h.hash(np.zeros(8, dtype=np.int16))
    # Text and bytes iterate as ints but are no token lists: refused whole, naming the value.
    for bad in ["abcdefgh", b"abcdefgh", bytearray(b"abcdefgh")]:
        with pytest.raises(
            TypeError,
            match=re.escape(f"tokens must be a sequence of ints, got {type(bad).__name__} {bad!r}"),
        ):
            h.hash(bad)
    assert h.hash(good).tolist() == before


def test_int_subclasses_and_sequences_take_the_careful_path():
    class Tok(enum.IntEnum):
        A = 7

    h = kvroute.BlockHasher(2)
    assert h.hash([Tok.A, 3]).tolist() == native_ref([7, 3], 2)
    assert h.hash((7, 3)).tolist() == h.hash(iter([7, 3])).tolist() == native_ref([7, 3], 2)
    with pytest.raises(ValueError, match=r"tokens\[1\] = -1 is negative"):
        h.hash((7, -1))
    with pytest.raises(ValueError, match=r"tokens\[1\] = 18446744073709551616 is outside"):
        kvroute.BlockHasher(2, profile="vllm").hash([1, 2**64])


def test_native_refuses_tokens_wider_than_32_bits():
    big = [1, 2, 2**32, 4]
    with pytest.raises(ValueError, match=r"tokens\[2\] = 4294967296 does not fit in 32 bits"):
        kvroute.BlockHasher(4).hash(big)
    with pytest.raises(ValueError, match=r"tokens\[2\]"):
        kvroute.BlockHasher(4).hash(np.array(big, dtype=np.uint64))
    assert len(kvroute.BlockHasher(4, profile="vllm").hash(big)) == 1


def test_bad_parents_raise_clearly():
    native = kvroute.BlockHasher(4)
    vllm = kvroute.BlockHasher(4, profile="vllm")
    sglang = kvroute.BlockHasher(4, profile="sglang")
    tokens = [1, 2, 3, 4]
    with pytest.raises(TypeError, match="32-byte SHA-256 digest"):
        vllm.hash(tokens, parent=123)
    with pytest.raises(TypeError, match="32-byte SHA-256 digest"):
        sglang.hash(tokens, parent=-5)  # a published (signed) SGLang value is not a chain state
    with pytest.raises(TypeError, match="64-bit hash"):
        native.hash(tokens, parent=b"\x00" * 32)
    with pytest.raises(ValueError, match="32 bytes, got 8"):
        vllm.hash(tokens, parent=b"\x00" * 8)
    with pytest.raises(ValueError, match="parent"):
        native.hash(tokens, parent=2**64)
    for bad in [True, 1.5, "ab", object()]:
        with pytest.raises(TypeError, match="parent"):
            native.hash(tokens, parent=bad)
    # Accepted forms of the same state.
    state = bytes(range(32))
    expected = vllm.hash(tokens, parent=state).tolist()
    assert vllm.hash(tokens, parent=bytearray(state)).tolist() == expected
    assert vllm.hash(tokens, parent=np.frombuffer(state, dtype=np.uint8)).tolist() == expected
    assert native.hash(tokens, parent=np.uint64(7)).tolist() == native_ref(tokens, 4, parent=7)
    # A negative int64 is read as its two's-complement bits.
    assert native.hash(tokens, parent=-1).tolist() == native_ref(tokens, 4, parent=2**64 - 1)


def test_bad_mm_items():
    vllm = kvroute.BlockHasher(4, profile="vllm")
    tokens = list(range(8))
    with pytest.raises(ValueError, match="sorted"):
        vllm.hash(tokens, mm=[("a", 5, 1), ("b", 1, 1)])
    with pytest.raises(ValueError, match="only to profile 'vllm'"):
        kvroute.BlockHasher(4).hash(tokens, mm=[("a", 0, 1)])
    for bad in [[("a", 0)], [("a", "0", 1)], [(1, 0, 1)], "abc", [["a", 0, 1]]]:
        with pytest.raises(TypeError, match="mm"):
            vllm.hash(tokens, mm=bad)
    with pytest.raises(ValueError, match="length"):
        vllm.hash(tokens, mm=[("a", 0, -1)])
    assert vllm.hash(tokens, mm=[]).tolist() == vllm.hash(tokens).tolist()


def test_digests_only_for_digest_profiles():
    with pytest.raises(ValueError, match="native"):
        kvroute.BlockHasher(4).digests([1, 2, 3, 4])
    rows = kvroute.BlockHasher(4, profile="sglang").digests([1, 2, 3])
    assert rows.shape == (0, 32) and rows.dtype == np.uint8


def test_lora_path_without_lora_name_names_the_path():
    """The message shows the path given, not a Rust ``Some(...)``."""
    with pytest.raises(ValueError, match=r"^lora_path \"p\" was given without lora_name$"):
        kvroute.BlockHasher(16, lora_path="p")
