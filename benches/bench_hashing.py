"""HashRing against uhashring (same process): ketama vs ketama, xxh3 vs uhashring's default ring.

Bars (issue #2): ``get`` per call >= 10x ``uhashring.get_node``; ``get_many`` on 100k str keys
>= 100x a loop of it, at 64 and 1024 nodes (and, apart, ``get_many(keys, as_index=True)``, which
returns positions in the node list instead of a list of str). Answers are cross-checked against
uhashring for the ketama ring (the xxh3 ring places keys differently by design, so only its speed
is compared).
"""

from __future__ import annotations

import kvroute
import pytest

uhashring = pytest.importorskip("uhashring")

N_KEYS = 100_000
KEY = "endpoint-12345"


@pytest.fixture(scope="module")
def keys() -> list[str]:
    return [f"session-{i * 7919}" for i in range(N_KEYS)]


def fleet(n: int) -> list[str]:
    return [f"10.0.{i // 256}.{i % 256}:8000" for i in range(n)]


# (group label, kvroute hash, uhashring hash_fn)
FLAVOURS = [("ketama", "ketama", "ketama"), ("xxh3 vs uhashring default", "xxh3", None)]


@pytest.mark.parametrize("nodes", [64, 1024])
@pytest.mark.parametrize(("label", "ours", "theirs"), FLAVOURS)
def test_get_kvroute(benchmark, per_call, nodes, label, ours, theirs):
    benchmark.group = f"HashRing.get {label}, {nodes} nodes"
    benchmark.extra_info["impl"] = "kvroute"
    ring = kvroute.HashRing(fleet(nodes), hash=ours)
    got = per_call(ring.get, KEY)
    if ours == "ketama":
        assert got == uhashring.HashRing(fleet(nodes), hash_fn="ketama").get_node(KEY)


@pytest.mark.parametrize("nodes", [64, 1024])
@pytest.mark.parametrize(("label", "ours", "theirs"), FLAVOURS)
def test_get_uhashring(benchmark, per_call, nodes, label, ours, theirs):
    benchmark.group = f"HashRing.get {label}, {nodes} nodes"
    benchmark.extra_info["impl"] = "uhashring"
    ring = uhashring.HashRing(fleet(nodes), hash_fn=theirs)
    per_call(ring.get_node, KEY)


@pytest.mark.parametrize("nodes", [64, 1024])
@pytest.mark.parametrize(("label", "ours", "theirs"), FLAVOURS)
def test_get_many_kvroute(benchmark, keys, nodes, label, ours, theirs):
    benchmark.group = f"HashRing.get_many 100k str keys, {label}, {nodes} nodes"
    benchmark.extra_info.update(impl="kvroute", ops=N_KEYS)
    ring = kvroute.HashRing(fleet(nodes), hash=ours)
    got = benchmark(ring.get_many, keys)
    if ours == "ketama":
        peer = uhashring.HashRing(fleet(nodes), hash_fn="ketama")
        assert got[:2000] == [peer.get_node(k) for k in keys[:2000]]


@pytest.mark.parametrize("nodes", [64, 1024])
def test_get_many_as_index_kvroute(benchmark, keys, nodes):
    # The zero-object path (positions into the node list), beside the same peer loop.
    benchmark.group = f"HashRing.get_many(as_index=True) 100k str keys, ketama, {nodes} nodes"
    benchmark.extra_info.update(impl="kvroute", ops=N_KEYS)
    ring = kvroute.HashRing(fleet(nodes))
    at, order = benchmark(ring.get_many, keys, as_index=True)
    assert [order[i] for i in at[:2000]] == ring.get_many(keys[:2000])


@pytest.mark.parametrize("nodes", [64, 1024])
def test_get_many_as_index_uhashring_loop(benchmark, keys, nodes):
    benchmark.group = f"HashRing.get_many(as_index=True) 100k str keys, ketama, {nodes} nodes"
    benchmark.extra_info.update(impl="uhashring get_node loop", ops=N_KEYS)
    get_node = uhashring.HashRing(fleet(nodes), hash_fn="ketama").get_node
    benchmark.pedantic(lambda: [get_node(k) for k in keys], rounds=5, iterations=1)


@pytest.mark.parametrize("nodes", [64, 1024])
@pytest.mark.parametrize(("label", "ours", "theirs"), FLAVOURS)
def test_get_many_uhashring_loop(benchmark, keys, nodes, label, ours, theirs):
    benchmark.group = f"HashRing.get_many 100k str keys, {label}, {nodes} nodes"
    benchmark.extra_info.update(impl="uhashring get_node loop", ops=N_KEYS)
    get_node = uhashring.HashRing(fleet(nodes), hash_fn=theirs).get_node
    benchmark.pedantic(lambda: [get_node(k) for k in keys], rounds=5, iterations=1)
