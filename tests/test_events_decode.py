"""KV-event decoding and applying, without sockets.

References: the vLLM 0.33 vector file (payload bytes produced by vLLM's own msgspec structs, and
their decoded form); payloads of the other formats built from the wire spec with the ``msgpack``
package (an independent encoder, see ``events_payloads``); ``kvroute.BlockHasher`` for the own
hashes a rehashing router must store; a pure-Python model of which engine blocks a worker holds
(Hypothesis state machine). Fuzzed payloads must either decode or raise ValueError, and a refused
payload must leave the index byte-for-byte unchanged (``PrefixIndex.dump``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import kvroute
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvroute import BlockHasher, KvEventApplier, PrefixIndex, decode_kv_events
from support import events_payloads as P

VECTORS = Path(__file__).parent / "data" / "vectors"
VLLM = json.loads((VECTORS / "vllm_0.33.0_block_hash_and_kv_event_vectors.json").read_text())
CASES = {c["name"]: c for c in VLLM["event_cases"]}
HASHES = {c["case"]: c for c in VLLM["hash_cases"]}
PLAIN = HASHES["plain/sha256_cbor/seed=vllm-none-hash"]


def payload(name: str) -> bytes:
    return bytes.fromhex(CASES[name]["payload_hex"])


def own(tokens, block_size=16, **opts) -> list[int]:
    return [int(h) for h in BlockHasher(block_size, **opts).hash(tokens)]


# ---- decoder against the vLLM 0.33 vectors ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_decoder_matches_vllm_vectors(name):
    case = CASES[name]
    frames = [bytes.fromhex(f) for f in case["zmq_frames_hex"]]
    assert frames[0] == case["topic"].encode()
    assert int.from_bytes(frames[1], "big") == case["seq"]
    assert frames[2] == payload(name)
    ts, events, rank = decode_kv_events(frames[2])
    want_ts, want_events, want_rank = case["payload_decoded"]
    assert (ts, rank) == (want_ts, want_rank)
    assert len(events) == len(want_events)
    for got, want in zip(events, want_events, strict=True):
        for key, value in want.items():
            if key == "extra_keys":
                assert msgpack.unpackb(got["extra_keys"]) == value
            elif key == "kv_cache_spec_kind":
                continue  # skipped by the decoder (not needed to place blocks)
            else:
                assert got[key] == value, key


def test_salt_and_lora_extra_keys_are_classified():
    (event,) = decode_kv_events(payload("batch_salted_store"))[1]
    assert (event["extra_salt"], event["extra_unsupported"]) == ("tenant-a", False)
    (event,) = decode_kv_events(payload("batch_lora_store"))[1]
    assert (event["extra_salt"], event["extra_unsupported"]) == (None, False)
    mm = [[["img-3f2a", 4]], [["img-3f2a", -12]], None]
    blob = P.batch([P.fixmap(P.stored_fields([1, 2, 3], None, range(48), 16, extra_keys=mm))])
    (event,) = decode_kv_events(blob)[1]
    assert event["extra_unsupported"] is True


# ---- decoder against msgpack-built payloads of the other formats ------------------------------


def test_map_key_order_and_map16_and_unknown_keys_do_not_matter():
    fields = P.stored_fields(
        [7, 8], 6, range(32), 16, medium="CPU", group_idx=2, locality="LOCAL", session_id="s"
    )
    fields.append(("some_future_field", {"nested": [1, [2, {"x": b"y"}]]}))
    reference = decode_kv_events(P.batch([P.fixmap(fields)]))
    for encoded in (P.map16(fields), P.map16(fields[::-1]), P.fixmap(fields[::-1])):
        assert decode_kv_events(P.batch([encoded])) == reference
    (event,) = reference[1]
    assert event["block_hashes"] == [7, 8]
    assert (event["parent_block_hash"], event["medium"], event["group_idx"]) == (6, "CPU", 2)


@pytest.mark.parametrize("n_fields", range(4, 12))
def test_legacy_tagged_arrays_are_decoded_by_length(n_fields):
    tokens = list(range(1000, 1032))
    blob = P.batch(
        [
            P.legacy_stored([1, 2], None, tokens, 16, n_fields),
            P.legacy_removed([2], min(n_fields, 3)),
            P.pack(["AllBlocksCleared"]),
        ]
    )
    _, events, _ = decode_kv_events(blob)
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0]["block_hashes"] == [1, 2]
    assert events[0]["token_ids"] == tokens
    assert events[0]["block_size"] == 16
    assert events[1]["block_hashes"] == [2]


def test_sglang_signed_hashes_and_digests():
    blob = P.batch([P.sglang_stored([-1, -(2**63), 2**63 - 1], -5, range(3), 1, cache_salt="t")])
    (event,) = decode_kv_events(blob)[1]
    assert event["block_hashes"] == [2**64 - 1, 2**63, 2**63 - 1]
    assert event["parent_block_hash"] == 2**64 - 5
    assert event["cache_salt"] == "t"
    digest = bytes.fromhex(PLAIN["block_hashes_hex"][0])
    blob = P.batch([P.pack({"type": "BlockRemoved", "block_hashes": [digest], "medium": None})])
    (event,) = decode_kv_events(blob)[1]
    assert event["block_hashes"] == [PLAIN["block_hashes_external_u64"][0]]


# Token ids in runs of one msgpack width each (fixint, uint8, uint16, uint32, uint64, negative),
# as vocabularies of different sizes make them: the decoder reads eight uint16 ids at a time.
_RUNS = [
    (0, 127),
    (128, 255),
    (256, 65_535),
    (65_536, 2**32 - 1),
    (2**32, 2**64 - 1),
    (-(2**63), -1),
]
_token_runs = st.lists(
    st.sampled_from(_RUNS).flatmap(lambda r: st.lists(st.integers(*r), min_size=1, max_size=20)),
    max_size=6,
).map(lambda runs: [t for run in runs for t in run])


@settings(max_examples=300, deadline=None)
@given(_token_runs, st.integers(0, 40))
def test_token_ids_of_every_width_decode_exactly(tokens, cut):
    blob = P.batch([P.map16(P.stored_fields([1], None, tokens, max(len(tokens), 1)))])
    (event,) = decode_kv_events(blob)[1]
    fit = all(0 <= t < 2**32 for t in tokens)
    assert event["tokens_fit_u32"] == fit
    assert event["token_ids"] == [t if 0 <= t < 2**32 else 0 for t in tokens]
    # Cut anywhere inside the token array: refused. A reserved marker in it: refused, unless it
    # lands inside a multi-byte id (then only that id's value changes).
    start = blob.index(b"token_ids") + len(b"token_ids")
    size = len(msgpack.packb(tokens))
    for at in range(start + 1, start + size):
        with pytest.raises(ValueError):
            decode_kv_events(blob[:at])
    if tokens:
        body = sum(len(msgpack.packb(t)) for t in tokens)  # after the array header
        bad = bytearray(blob)
        bad[start + size - 1 - cut % body] = 0xC1
        try:
            (ev,) = decode_kv_events(bytes(bad))[1]
        except ValueError as e:
            assert "not an integer" in str(e)
        else:
            assert len(ev["token_ids"]) == len(tokens)


@pytest.mark.parametrize(
    "blob, what",
    [
        (b"", "ends"),
        (P.pack([1.0]), "fewer than 2"),
        (P.pack({"ts": 1}), "not an array"),
        (P.pack([1.0, [{"block_hashes": [1]}], 0]), 'no "type"'),
        (P.pack([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]), "token_ids"),
        (P.pack([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}], 0]), "not a hash"),
        (P.pack([1.0, [{"type": "BlockRemoved", "block_hashes": [b""]}], 0]), "0-byte digest"),
        (P.pack([1.0, [["BlockStored", [1], None, [1]]], 0]), "fewer than 5"),
        (P.pack([1.0, [{"type": 3}], 0]), "not a string"),
        (P.pack([1.0, [], 0]) + b"\x00", "trailing"),
        (b"\x93\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff", "claims"),
    ],
)
def test_malformed_payloads_name_the_problem(blob, what):
    with pytest.raises(ValueError, match=what):
        decode_kv_events(blob)


def test_repeated_keys_are_refused():
    fields = [*P.removed_fields([1]), ("block_hashes", [2])]
    with pytest.raises(ValueError, match="repeated"):
        decode_kv_events(P.batch([P.map16(fields)]))


# ---- applying: rehash against BlockHasher, direct against the engine's hashes ------------------


def test_direct_mode_with_the_vllm_profile_stores_the_engines_hashes():
    index = PrefixIndex()
    applier = KvEventApplier(index, mode="direct", hash_profile="vllm")
    tokens = PLAIN["token_ids"]
    ours = own(tokens, profile="vllm")
    assert ours == PLAIN["block_hashes_external_u64"]  # the router reproduces the engine
    assert applier.apply("w", payload("batch_stored_stored")) == 2
    assert index.match(ours) == {"w": 3}
    applier.apply("w", payload("batch_removed"))
    assert index.match(ours) == {"w": 2}
    applier.apply("w", payload("batch_cleared"))
    assert index.match(ours) == {}
    applier.apply("w", payload("batch_salted_store"))
    assert index.match(own(tokens, profile="vllm", salt="tenant-a")) == {"w": 3}


@pytest.mark.parametrize(
    "hashing, foreign",
    [
        ({"hash_profile": "vllm"}, 0),  # vLLM 0.33's own: sha256_cbor, as published
        ({"hash_profile": "vllm", "hash_algo": "sha256_cbor"}, 0),
        ({"hash_profile": "vllm", "hash_algo": "sha256"}, 1),  # pickle: another hash
        ({"hash_profile": "vllm", "seed": "7"}, 1),  # another first-block seed
        ({"hash_profile": "vllm", "vllm_version": "0.30"}, 0),  # same plain hash; salt differs
        ({"hash_profile": "native"}, 1),
        ({"hash_profile": "sglang"}, 1),
    ],
)
def test_direct_mode_counts_root_stores_hashed_otherwise(hashing, foreign):
    """The published 0.33 stores (a root of 2 blocks, its child; a salted root, a LoRA root):
    only the plain root's first block is compared with the router's own hash of its tokens — a
    child has no first block to hash alone, a salted or LoRA root hashes in its namespace."""
    applier = KvEventApplier(PrefixIndex(), mode="direct", **hashing)
    for name in ("batch_stored_stored", "batch_salted_store", "batch_lora_store"):
        applier.apply("w", payload(name))
    assert applier.stats("w")["foreign_hashes"] == foreign
    assert applier.stats("w")["blocks_stored"] == 9  # stored as they are, either way
    applier.clear("w")  # a counter: a reset keeps it
    assert applier.stats("w")["foreign_hashes"] == foreign


def test_rehash_mode_stores_the_routers_own_hashes():
    index = PrefixIndex()
    applier = KvEventApplier(index)  # rehash, native, 16
    tokens = PLAIN["token_ids"]
    applier.apply("w", payload("batch_stored_stored"))
    assert index.match(own(tokens)) == {"w": 3}
    assert index.num_blocks("w") == 3
    applier.apply("w", payload("batch_removed"))
    assert index.match(own(tokens)) == {"w": 2}
    applier.apply("w", payload("batch_cleared"))
    assert index.num_blocks("w") == 0
    # Salted and LoRA chains land in their own namespaces, as BlockHasher(salt=/lora_name=) has.
    applier.apply("w", payload("batch_salted_store"))
    assert index.match(own(tokens, salt="tenant-a")) == {"w": 3}
    assert index.match(own(tokens)) == {}
    applier.apply("w", payload("batch_lora_store"))
    assert index.match(own(tokens, lora_name="sql-lora")) == {"w": 3}
    stats = applier.stats("w")
    assert (stats["batches"], stats["blocks_stored"], stats["skipped_unsupported"]) == (5, 9, 0)


@pytest.mark.parametrize("profile", ["native", "vllm", "sglang"])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_rehash_with_engine_blocks_k_times_the_routers(profile, factor):
    router = 8
    engine = router * factor
    tokens = [(i * 7919) % 50_000 for i in range(engine * 6)]
    index = PrefixIndex()
    applier = KvEventApplier(index, block_size=router, hash_profile=profile)
    # Engine hashes are arbitrary (another algorithm, another seed): rehash must not care.
    e = [hash(("engine", i)) & (2**64 - 1) for i in range(6)]
    first = P.stored_fields(e[:2], None, tokens[: 2 * engine], engine)
    second = P.stored_fields(e[2:], e[1], tokens[2 * engine :], engine)
    applier.apply("w", P.batch([P.map16(first), P.map16(second)]))
    ours = own(tokens, router, profile=profile)
    assert index.match(ours) == {"w": len(ours)}
    applier.apply("w", P.batch([P.map16(P.removed_fields([e[3]]))]))
    assert index.match(ours) == {"w": 3 * factor}


def test_skips_are_counted_and_change_nothing():
    index = PrefixIndex()
    applier = KvEventApplier(index)
    tokens = list(range(64))
    events = [
        P.fixmap(P.stored_fields([1], 999, tokens[:16], 16)),  # unknown parent
        P.fixmap(P.stored_fields([2], None, tokens[:5], 5)),  # partial window
        P.fixmap(P.stored_fields([3], None, tokens[:7], 16)),  # SGLang short last page
        P.fixmap(P.stored_fields([4], None, tokens[:24], 24)),  # 24 is not a multiple of 16
        P.fixmap(P.stored_fields([5], None, tokens[:16], 16, group_idx=1)),  # other group
        P.fixmap(P.stored_fields([6], None, tokens[:16], 16, lookahead_token_ids=[[3]])),
        P.fixmap(P.stored_fields([7], None, [2**40, *tokens[:15]], 16)),  # id beyond 32 bits
        P.pack({"type": "BlockPinned", "block_hashes": [1]}),
    ]
    applier.apply("w", P.batch(events))
    s = applier.stats("w")
    assert len(index) == 0
    assert (s["skipped_unknown_parent"], s["skipped_partial"], s["skipped_block_size"]) == (1, 2, 1)
    assert (s["skipped_other_group"], s["skipped_unsupported"], s["skipped_unknown_type"]) == (
        1,
        2,
        1,
    )


def test_other_media_are_separate_tiers():
    index = PrefixIndex()
    applier = KvEventApplier(index)
    tokens = list(range(48))
    events = [
        P.fixmap(P.stored_fields([1, 2], None, tokens[:32], 16, medium="CPU")),
        P.sglang_stored([-3], None, tokens[:16], 16, medium="DISK"),
        P.fixmap(P.stored_fields([1], None, tokens[:16], 16, medium=None)),
    ]
    applier.apply("w", P.batch(events))
    assert applier.tiers == ["CPU", "DISK"]
    ours = own(tokens)
    assert index.match(ours) == {"w": 1}
    assert applier.tier_index("CPU").match(ours) == {"w": 2}
    assert applier.tier_index("DISK").match(ours) == {"w": 1}
    assert applier.tier_index("STORAGE") is None
    applier.apply("w", P.batch([P.fixmap(P.removed_fields([2], medium="CPU"))]))
    assert applier.tier_index("CPU").match(ours) == {"w": 1}
    assert index.match(ours) == {"w": 1}
    applier.apply("w", P.batch([P.fixmap(P.CLEARED)]))
    assert applier.tier_index("CPU").match(ours) == {}
    assert index.match(ours) == {}


def test_sglang_payloads_rehash_into_the_sglang_profile():
    tokens = list(range(100, 164))
    index = PrefixIndex()
    applier = KvEventApplier(index, block_size=16, hash_profile="sglang")
    engine = own(tokens, profile="sglang")  # SGLang publishes these (as signed int64)
    signed = [h - 2**64 if h >= 2**63 else h for h in engine]
    events = [P.sglang_stored([signed[0]], None, tokens[:16], 16, cache_salt=None)]
    for i in range(1, 4):
        events.append(P.sglang_stored([signed[i]], signed[i - 1], tokens[16 * i : 16 * i + 16], 16))
    applier.apply("w", P.batch(events))
    assert index.match(engine) == {"w": 4}
    direct = PrefixIndex()
    d = KvEventApplier(direct, mode="direct", hash_profile="sglang")
    d.apply("w", P.batch(events))
    assert direct.match(engine) == {"w": 4}
    assert d.stats("w")["foreign_hashes"] == 0  # the root page hashes as the profile does
    vllm = KvEventApplier(PrefixIndex(), mode="direct", hash_profile="vllm")
    vllm.apply("w", P.batch(events))
    assert vllm.stats("w")["foreign_hashes"] == 1
    # A salted SGLang chain rehashes into the salted namespace.
    salted = PrefixIndex()
    KvEventApplier(salted, hash_profile="sglang").apply(
        "w", P.batch([P.sglang_stored([-1], None, tokens[:16], 16, cache_salt="t")])
    )
    assert salted.match(own(tokens[:16], profile="sglang", salt="t")) == {"w": 1}


def test_bad_arguments():
    index = PrefixIndex()
    with pytest.raises(ValueError, match="mode"):
        KvEventApplier(index, mode="guess")
    with pytest.raises(ValueError, match="profile"):
        KvEventApplier(index, hash_profile="xxhash")
    with pytest.raises(ValueError, match="block_size"):
        KvEventApplier(index, block_size=0)
    applier = KvEventApplier(index)
    with pytest.raises(TypeError, match="payload"):
        applier.apply("w", "not bytes")
    with pytest.raises(TypeError, match="worker"):
        applier.apply(1, b"")
    with pytest.raises(KeyError):
        applier.stats("nobody")


# ---- fuzzing: no crash, no change on error ---------------------------------------------------

VALID = [payload(n) for n in sorted(CASES)]


def _mutations():
    def mutate(blob_and_edits):
        blob, edits = blob_and_edits
        data = bytearray(blob)
        for pos, value, cut in edits:
            if cut and len(data) > 1:
                del data[pos % len(data)]
            elif data:
                data[pos % len(data)] = value
        return bytes(data)

    edit = st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.booleans())
    edits = st.lists(edit, max_size=4)
    return st.tuples(st.sampled_from(VALID), edits).map(mutate)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=300), _mutations()))
def test_fuzzed_payloads_decode_or_raise_and_never_change_the_index_on_error(blob):
    index = PrefixIndex()
    applier = KvEventApplier(index, mode="direct", hash_profile="vllm")
    applier.apply("w", payload("batch_stored_stored"))
    before = index.dump()
    try:
        decode_kv_events(blob)
        decoded = True
    except ValueError:
        decoded = False
    try:
        applier.apply("w", blob)
        applied = True
    except ValueError:
        applied = False
        assert index.dump() == before
    assert decoded == applied
    index._check_invariants()


FIELDS = [
    *("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"),
    *("lora_name", "extra_keys", "group_idx", "lookahead_token_ids", "other"),
]
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=40),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(FIELDS),
            _value,
        ),
        max_size=3,
    )
)
def test_structured_garbage_never_crashes(events):
    blob = P.pack([1.0, events, None])
    try:
        decode_kv_events(blob)
    except ValueError:
        pass


# ---- model-based: rehash and direct mode against a reference of held engine blocks -------------

BS = 4
VOCAB = 6


def engine_hash(path: tuple[int, ...]) -> int:
    """An engine's own hash of a block, a function of its whole token path (like a real engine,
    but deliberately unlike any kvroute profile)."""
    return int.from_bytes(hashlib.blake2b(repr(path).encode(), digest_size=8).digest(), "big")


class EventModel(RuleBasedStateMachine):
    """Reference: the set of engine blocks the worker holds, with the index's rules — a store
    needs its parent held; a removal drops the block and every block after it."""

    @initialize()
    def setup(self):
        self.rehash = PrefixIndex()
        self.direct = PrefixIndex()
        self.appliers = [
            KvEventApplier(self.rehash, block_size=BS),
            KvEventApplier(self.direct, mode="direct", block_size=BS, hash_profile="native"),
        ]
        self.held: dict[int, tuple[int, ...]] = {}  # engine hash -> token path
        self.paths: dict[int, tuple[int, ...]] = {}  # every engine block ever published

    def send(self, events):
        blob = P.batch(events)
        for applier in self.appliers:
            applier.apply("w", blob)

    @rule(
        data=st.data(),
        n=st.integers(1, 3),
        tokens=st.lists(st.integers(0, VOCAB), min_size=3 * BS, max_size=3 * BS),
    )
    def store(self, data, n, tokens):
        known = sorted(self.paths)
        parent = data.draw(st.sampled_from([None, *known]))
        prefix = () if parent is None else self.paths[parent]
        hashes, path = [], prefix
        for i in range(n):
            path = path + tuple(tokens[i * BS : (i + 1) * BS])
            h = engine_hash(path)
            hashes.append(h)
            self.paths[h] = path
        self.send([P.map16(P.stored_fields(hashes, parent, tokens[: n * BS], BS))])
        if parent is None or parent in self.held:
            path = prefix
            for i, h in enumerate(hashes):
                path = path + tuple(tokens[i * BS : (i + 1) * BS])
                self.held[h] = path

    @precondition(lambda self: self.paths)
    @rule(data=st.data())
    def remove(self, data):
        victims = data.draw(st.lists(st.sampled_from(sorted(self.paths)), min_size=1, max_size=3))
        self.send([P.fixmap(P.removed_fields(victims))])
        for v in victims:
            if v in self.held:
                dead = self.held[v]
                self.held = {h: p for h, p in self.held.items() if p[: len(dead)] != dead}

    @precondition(lambda self: self.paths)
    @rule(data=st.data(), then_store=st.booleans())
    def evict_block_by_block(self, data, then_store):
        """vLLM's eviction: one BlockRemoved per block, a chain's tail last block first (the
        applier gathers them into one index call), maybe followed by a store in the same batch."""
        h = data.draw(st.sampled_from(sorted(self.paths)))
        path = self.paths[h]
        chain = [engine_hash(path[: (i + 1) * BS]) for i in range(len(path) // BS)]
        victims = chain[data.draw(st.integers(0, len(chain) - 1)) :][::-1]
        events = [P.map16(P.removed_fields([v])) for v in victims]
        for v in victims:
            if v in self.held:
                dead = self.held[v]
                self.held = {k: p for k, p in self.held.items() if p[: len(dead)] != dead}
        if then_store:
            known = sorted(self.paths)
            parent = data.draw(st.sampled_from([None, *known]))
            tokens = data.draw(st.lists(st.integers(0, VOCAB), min_size=BS, max_size=BS))
            prefix = () if parent is None else self.paths[parent]
            stored = engine_hash(prefix + tuple(tokens))
            self.paths[stored] = prefix + tuple(tokens)
            events.append(P.map16(P.stored_fields([stored], parent, tokens, BS)))
            if parent is None or parent in self.held:
                self.held[stored] = prefix + tuple(tokens)
        self.send(events)

    @rule()
    def clear(self):
        self.send([P.fixmap(P.CLEARED)])
        self.held.clear()

    @invariant()
    def indexes_agree_with_the_model(self):
        if not hasattr(self, "held"):
            return
        for h, path in self.paths.items():
            depth = len(path) // BS
            want = depth if h in self.held else None
            ours = own(list(path), BS)
            got = self.rehash.match(ours).get("w")
            chain = [engine_hash(path[: (i + 1) * BS]) for i in range(depth)]
            got_direct = self.direct.match(chain).get("w")
            if want is None:
                assert got is None or got < depth
                assert got_direct is None or got_direct < depth
            else:
                assert got == depth
                assert got_direct == depth
        n = len(self.held)
        assert self.rehash.num_blocks("w") == n if "w" in self.rehash.workers else n == 0
        assert self.direct.num_blocks("w") == n if "w" in self.direct.workers else n == 0


TestEventModel = EventModel.TestCase
TestEventModel.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_exports():
    assert kvroute.KvEventApplier is KvEventApplier
    assert kvroute.decode_kv_events is decode_kv_events
