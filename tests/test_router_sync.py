"""Router replicas sharing their model and load (``updates=True``, ``take_updates`` /
``apply_updates``, ``dump_model`` / ``load_model``, ``set_load``), held against a single router
that sees all the traffic — the reference every replica set should reproduce."""

from __future__ import annotations

import random

import kvroute
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.sync import ReplicaSync

WORKERS = ["w0", "w1", "w2", "w3"]


def replica(**kw) -> kvroute.Router:
    return kvroute.Router(WORKERS, block_size=4, capacity_blocks=10_000, updates=True, **kw)


def prompts(seed: int, n: int) -> list[np.ndarray]:
    """Prompts of a few families (shared system parts) with their own tails."""
    rng = random.Random(seed)
    systems = [np.arange(k * 1000, k * 1000 + 48, dtype=np.uint32) for k in range(5)]
    out = []
    for i in range(n):
        tail = np.arange(100_000 + 100 * i, 100_000 + 100 * i + 4 * rng.randint(1, 6))
        out.append(np.concatenate([systems[rng.randrange(5)], tail.astype(np.uint32)]))
    return out


def held(router: kvroute.Router, probes: list[np.ndarray]) -> list[dict[str, int]]:
    """What the model says each worker holds of each probe (the index's answer)."""
    hasher = kvroute.BlockHasher(4)
    return [router.index.match(hasher.hash(p)) for p in probes]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    order=st.randoms(use_true_random=False),
    duplicates=st.integers(0, 5),
    swaps=st.integers(0, 8),
)
def test_any_delivery_order_converges(seed, order, duplicates, swaps):
    """Two replicas route disjoint traffic; a third receives both publishers' batches
    interleaved in any way, each publisher's own out of order (swaps) and some twice, after
    its first: it applies each once, in its publisher's order, and ends up holding exactly the
    union of what the two placed (no eviction at this size), with no load left over."""
    a, b, c = replica(), replica(), replica()
    streams: dict[str, list[tuple[int, bytes]]] = {"a": [], "b": []}
    ps = prompts(seed, 30)
    for i, p in enumerate(ps):
        name, r = ("a", a) if i % 2 == 0 else ("b", b)
        d = r.route(tokens=p, now=float(i))
        r.begin(d)
        r.finish(d, now=float(i))
        streams[name].append((len(streams[name]) + 1, r.take_updates()))
    for seq in streams.values():
        for _ in range(swaps):  # reorder within a publisher, its first batch first
            i, j = order.randrange(1, len(seq)), order.randrange(1, len(seq))
            seq[i], seq[j] = seq[j], seq[i]
    delivered: list[tuple[str, int, bytes]] = []
    cursor = {"a": 0, "b": 0}
    while any(cursor[n] < len(streams[n]) for n in streams):
        n = order.choice([n for n in streams if cursor[n] < len(streams[n])])
        delivered.append((n, *streams[n][cursor[n]]))
        cursor[n] += 1
    for _ in range(duplicates):
        at = order.randrange(len(delivered))
        delivered.insert(order.randrange(at + 1, len(delivered) + 1), delivered[at])
    sync = ReplicaSync(c, ClusterConfig(name="c"))  # only `apply` is used: no NATS here
    for n, k, batch in delivered:
        sync.apply({"Kvroute-Replica": n, "Kvroute-Seq": str(k)}, batch)
    union = [
        {w: max(x.get(w, 0), y.get(w, 0)) for w in {*x, *y}}
        for x, y in zip(held(a, ps), held(b, ps), strict=True)
    ]
    assert held(c, ps) == union
    assert sync.skipped.get("duplicate") == duplicates
    assert sync.skipped.get("unanchored") == 0
    for w in WORKERS:
        assert set(c.load(w)["others"].values()) == {0}


def test_a_gone_header_ends_the_wait_for_the_batches_it_names():
    """``Kvroute-Gone: k`` on batch n: the publisher dropped its batches up to k unpublished. The
    numbers up to k that have not come never will: what is held below k is applied in order, then
    n, and one gap is counted; a header that is not a number (or names nothing missing) changes
    nothing."""
    a, c = replica(), replica()
    ps = [np.arange(k * 1000, k * 1000 + 40, dtype=np.uint32) for k in range(11)]  # disjoint
    batches = {}
    for i, p in enumerate(ps, start=1):
        d = a.route(tokens=p, now=float(i))
        a.begin(d)
        a.finish(d, now=float(i))
        batches[i] = a.take_updates()
    sync = ReplicaSync(c, ClusterConfig(name="c"))
    pub = "a"

    def send(n: int, **more: str) -> None:
        sync.apply({"Kvroute-Replica": pub, "Kvroute-Seq": str(n), **more}, batches[n])

    send(1)
    send(3, **{"Kvroute-Gone": "x"})  # 2 missing: held
    assert sorted(sync._seen[pub].held) == [3]
    send(5, **{"Kvroute-Gone": "4"})  # 2 and 4 gone for good: 3 then 5 applied
    assert sync._seen[pub].upto == 5 and not sync._seen[pub].held
    assert sync.skipped.get("gap") == 1
    send(6, **{"Kvroute-Gone": "4"})  # nothing missing any more: applied, no new gap
    send(8, **{"Kvroute-Gone": "2"})  # 7 missing, not named gone: held
    assert sync._seen[pub].upto == 6 and sorted(sync._seen[pub].held) == [8]
    assert sync.skipped.get("gap") == 1
    # A publisher that names a batch it did publish (8, held) or the batch itself as gone:
    # what was held is applied all the same, and the batch carrying the header too.
    send(9, **{"Kvroute-Gone": "8"})
    send(10, **{"Kvroute-Gone": "10"})
    assert sync._seen[pub].upto == 10 and not sync._seen[pub].held
    assert sync.skipped.get("gap") == 2
    applied = [1, 3, 5, 6, 8, 9, 10]
    assert [bool(x) for x in held(c, ps)] == [i in applied for i in range(1, 12)]


def test_replicas_with_updates_route_as_one_router():
    """Requests spread round robin over three replicas that exchange every batch at once are
    routed exactly as by one router that sees them all (same workers, same cached blocks)."""
    reps = [replica() for _ in range(3)]
    one = kvroute.Router(WORKERS, block_size=4, capacity_blocks=10_000)
    inflight = []
    for i, p in enumerate(prompts(7, 120)):
        r = reps[i % 3]
        d = r.route(tokens=p, now=float(i))
        r.begin(d)
        e = one.route(tokens=p, now=float(i))
        one.begin(e)
        assert (d.worker, d.cached_blocks) == (e.worker, e.cached_blocks), i
        inflight.append((r, d, e))
        if len(inflight) > 5:  # requests overlap: the load matters
            r0, d0, e0 = inflight.pop(0)
            r0.finish(d0, now=float(i))
            one.finish(e0, now=float(i))
        batch = r.take_updates()
        for other in reps:
            if other is not r:
                other.apply_updates(batch, now=float(i))
        for r0, _, _ in inflight:
            batch = r0.take_updates()
            for other in reps:
                if other is not r0:
                    other.apply_updates(batch, now=float(i))


def test_snapshots_and_bad_input():
    a = replica()
    for i, p in enumerate(prompts(3, 40)):
        a.route(tokens=p, now=float(i))
    image = a.dump_model()
    b = replica()
    b.load_model(image)
    assert b.dump_model() == image
    b._check_model()
    before = b.dump_model()
    with pytest.raises(ValueError, match="checksum"):
        b.load_model(image[:-1] + bytes([image[-1] ^ 1]))
    with pytest.raises(ValueError, match="update batch"):
        b.apply_updates(b"KVRU\x01\x09")
    with pytest.raises(TypeError, match="bytes"):
        b.apply_updates("text")
    assert b.dump_model() == before
    with pytest.raises(ValueError, match="approx"):
        kvroute.Router(WORKERS, index="events").dump_model()
    # Batches of at most max_bytes, cut between updates.
    for i, p in enumerate(prompts(4, 10)):
        a.begin(a.route(tokens=p, now=100.0 + i))
    parts = list(iter(lambda: a.take_updates(max_bytes=64), b""))
    assert len(parts) > 10
    c = replica()
    for part in parts:
        c.apply_updates(part)
    assert sum(c.load(w)["others"]["active"] for w in WORKERS) == 10


def test_set_load_is_a_baseline_for_the_routers_own_requests():
    r = kvroute.Router(WORKERS, policy="least_loaded")
    d = r.route(tokens=np.arange(64, dtype=np.uint32))
    r.begin(d)
    r.set_load(d.worker, active=3, queued=2, prefill_blocks=10, decode_blocks=7)
    assert r.load(d.worker)["others"] == {
        "active": 2,
        "queued": 1,
        "prefill_blocks": 6,
        "decode_blocks": 3,
        "written_blocks": 0,  # no engine figure: only other replicas' announcements
    }
    r.finish(d)
    assert r.load(d.worker)["active"] == 0
    assert r.load(d.worker)["others"]["active"] == 2
    with pytest.raises(KeyError):
        r.set_load("nope", active=1)
    with pytest.raises((ValueError, OverflowError)):
        r.set_load(d.worker, active=-1)


def test_batches_hashed_under_other_settings_are_skipped_and_named(caplog):
    """A block hash means something only under the settings that made it: a batch from a
    replica of another block size, hash profile, seed or salt is skipped (``hashing_mismatch``),
    changing nothing, and both settings are named (the seed and salt as a digest only), logged
    once per publisher; one of the same settings is applied, and one without the header (an
    older replica) too."""
    from kvroute.cluster.sync import hashing_of

    a = replica()
    p = np.arange(1000, 1040, dtype=np.uint32)
    d = a.route(tokens=p, now=1.0)
    a.begin(d)
    a.finish(d, now=1.0)
    batch = a.take_updates()
    mine = hashing_of(a)
    assert mine == hashing_of(replica()) and "block_size=4 profile=native" in mine
    others = {
        "block size": kvroute.Router(WORKERS, block_size=8, updates=True),
        "profile": replica(hash_profile="vllm"),
        "seed": replica(hash_profile="vllm", hash_seed="s3cret-seed"),
        "salt": replica(salt="s3cret-salt"),
    }
    vllm = hashing_of(replica(hash_profile="vllm"))
    assert hashing_of(others["seed"]) != vllm  # the seed alone tells them apart
    for what, c in others.items():
        theirs = hashing_of(c)
        assert theirs != mine, what
        assert "s3cret" not in theirs, what
        sync = ReplicaSync(c, ClusterConfig(name="c"))
        with caplog.at_level("ERROR", logger="kvroute.cluster"):
            caplog.clear()
            for n in (1, 2):
                sync.apply(
                    {"Kvroute-Replica": "a", "Kvroute-Seq": str(n), "Kvroute-Hashing": mine},
                    batch,
                )
        assert sync.skipped.get("hashing_mismatch") == 2, what
        assert c.index.match(kvroute.BlockHasher(4).hash(p)) == {}, what
        assert sync.last_error == (
            f"batch a/2 hashed with {mine}; this replica hashes with {theirs}"
        )
        assert [r.getMessage() for r in caplog.records] == [
            f"cluster: batch a/1 hashed with {mine}; this replica hashes with {theirs}: "
            "not applied (another hash space)"
        ], what
        assert sync.describe()["hashing"] == theirs
    for headers in ({"Kvroute-Hashing": mine}, {}):
        c = replica()
        sync = ReplicaSync(c, ClusterConfig(name="c"))
        sync.apply({"Kvroute-Replica": "a", "Kvroute-Seq": "1", **headers}, batch)
        assert held(c, [p]) == held(a, [p]) and held(c, [p]) != [{}]
        assert sync.skipped.get("hashing_mismatch") == 0 and sync.last_error == ""
