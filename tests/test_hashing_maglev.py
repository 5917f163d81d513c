"""Maglev against Envoy's maglev_lb_test.cc tables, and its documented lookup rules."""

from __future__ import annotations

import kvroute
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st


def envoy_case(vectors: dict, name: str) -> dict:
    return next(c for c in vectors["envoy"]["cases"] if c["name"] == name)


@pytest.mark.parametrize("name", ["Basic", "BasicWithHostName", "Weighted"])
def test_envoy_tables(maglev_vectors, name):
    case = envoy_case(maglev_vectors, name)
    hosts = case["hosts_in_order"]
    weights = case.get("weights", [1] * len(hosts))
    # Give the hosts out of order: Envoy sorts them by name before filling.
    t = kvroute.Maglev(list(reversed(hosts)), weights=list(reversed(weights)), table_size=case["M"])
    assert t.table == [hosts[i] for i in case["expected_table_host_index"]]
    if "min_entries_per_host" in case:
        counts = [t.table.count(h) for h in hosts]
        assert min(counts) == case["min_entries_per_host"]
        assert max(counts) == case["max_entries_per_host"]


def test_envoy_locality_weighted_tables(maglev_vectors):
    # Envoy normalises host weights within localities; these two cases reduce to plain weights:
    # same locality weights -> hosts 90 and 91 at 1/2 each; locality weights A=8, C=2, B=0 ->
    # host 90 at 0.8, host 91 at 0.2, host 92 (zone B) dropped.
    hosts = ["127.0.0.1:90", "127.0.0.1:91"]
    same = envoy_case(maglev_vectors, "LocalityWeightedSameLocalityWeights")
    t = kvroute.Maglev(hosts, weights=[0.5, 0.5], table_size=17)
    assert t.table == [hosts[i] for i in same["expected_table_host_index"]]
    different = envoy_case(maglev_vectors, "LocalityWeightedDifferentLocalityWeights")
    t = kvroute.Maglev({"127.0.0.1:90": 0.8, "127.0.0.1:91": 0.2}, table_size=17)
    assert t.table == [hosts[i] for i in different["expected_table_host_index"]]


def test_envoy_retry_attempts_are_the_preference_order(maglev_vectors):
    case = envoy_case(maglev_vectors, "BasicWithRetryHostPredicate")
    hosts = envoy_case(maglev_vectors, "Basic")["hosts_in_order"]
    t = kvroute.Maglev(hosts, table_size=case["M"])
    expected = [hosts[lookup["expected_host_index"]] for lookup in case["lookups"]]
    assert t.preference(10, 3) == expected
    assert t.get(10) == expected[0]


def test_offsets_and_skips_are_envoys(maglev_vectors):
    case = envoy_case(maglev_vectors, "Basic")
    for host, (offset, skip) in case["derived_offset_skip"].items():
        assert xxhash.xxh64_intdigest(host.encode(), seed=0) % 7 == offset
        assert xxhash.xxh64_intdigest(host.encode(), seed=1) % 6 + 1 == skip


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=20, unique=True),
    st.lists(st.integers(0, 2**64 - 1), max_size=50),
    st.lists(st.binary(max_size=20), max_size=20),
)
def test_lookup_is_table_of_key_mod_m(nodes, ints, blobs):
    t = kvroute.Maglev(nodes, table_size=251)
    table = t.table
    assert len(table) == 251 and set(table) <= set(nodes)
    for k in ints:
        assert t.get(k) == table[k % 251]
    for b in blobs:
        assert t.get(b) == table[kvroute.hash_key(b) % 251]
    assert t.get_many(np.array(ints, dtype=np.uint64)) == [table[k % 251] for k in ints]


def test_every_node_gets_a_fair_share_of_slots():
    nodes = [f"10.0.0.{i}:8000" for i in range(100)]
    t = kvroute.Maglev(nodes)
    counts = [t.table.count(n) for n in nodes]
    mean = 65537 / 100
    # Maglev's fill gives every backend floor or ceil of M/n, up to the last partial round.
    assert max(counts) - min(counts) <= 1
    assert abs(max(counts) - mean) < 1


def test_weighted_shares():
    t = kvroute.Maglev({"a": 1, "b": 3})
    share = t.table.count("b") / t.table_size
    assert abs(share - 0.75) < 0.001


def test_table_size_must_be_prime():
    for m in (0, 1, 4, 65536, 2**27):
        with pytest.raises(ValueError, match="prime"):
            kvroute.Maglev(["a"], table_size=m)
    assert kvroute.Maglev(["a", "b"], table_size=2).table_size == 2
    with pytest.raises(ValueError, match="not both"):
        kvroute.Maglev({"a": 1}, weights={"a": 2})
    with pytest.raises(ValueError, match="2 weights given for 1 nodes"):
        kvroute.Maglev(["a"], weights=[1, 2])
    with pytest.raises(KeyError, match="zz"):
        kvroute.Maglev(["a"], weights={"zz": 2})
