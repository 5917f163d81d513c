"""Rendezvous against a pure-Python model of its documented scores."""

from __future__ import annotations

import math
from collections import Counter

import kvroute
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

MASK = 2**64 - 1


def fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK
    return h ^ (h >> 33)


def model_order(weights: dict[str, float], key) -> list[str]:
    """The documented ranking: score w / -ln(u), u = ((h >> 11) + 0.5) / 2**53, ties by name."""
    k = kvroute.hash_key(key)

    def score(name: str) -> float:
        draw = fmix64(k ^ xxhash.xxh3_64_intdigest(name.encode())) >> 11
        u = (draw + 0.5) * (1.0 / 2**53)
        return weights[name] / -math.log(u)

    return sorted(weights, key=lambda n: (-score(n), n.encode()))


node_names = st.text(min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(node_names, st.floats(0.01, 100), min_size=1, max_size=12),
    st.lists(st.one_of(st.text(max_size=10), st.binary(max_size=10), st.integers(0, 2**64 - 1))),
)
def test_matches_the_documented_model(weights, keys):
    r = kvroute.Rendezvous(weights)
    for key in keys:
        order = model_order(weights, key)
        assert r.get(key) == order[0]
        assert r.preference(key, len(weights)) == order
    assert r.get_many(keys) == [model_order(weights, k)[0] for k in keys]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(node_names, min_size=1, max_size=12, unique=True),
    st.lists(st.text(max_size=10), max_size=30),
)
def test_equal_weights_rank_by_draw(nodes, keys):
    r = kvroute.Rendezvous(nodes, weights=[3] * len(nodes))
    for key in keys:
        assert r.preference(key, len(nodes)) == model_order(dict.fromkeys(nodes, 1.0), key)


def test_shares_follow_weights():
    weights = {"a": 1, "b": 2, "c": 5}
    r = kvroute.Rendezvous(weights)
    n = 80_000
    counts = Counter(r.get_many(list(range(n))))
    for node, w in weights.items():
        assert abs(counts[node] / n - w / 8) < 0.01, counts


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(node_names, st.sampled_from([0.5, 1.0, 3.0]), min_size=1, max_size=8),
    st.lists(st.tuples(node_names, st.sampled_from([None, 1.0, 3.0])), max_size=20),
    st.lists(st.text(max_size=8), min_size=1, max_size=20),
)
def test_add_and_remove_in_place_match_the_model(initial, ops, keys):
    """add/remove change the set in place; answers stay those of the documented model (and of a
    Rendezvous built from scratch), whether the weights are uniform before, after or never."""
    r = kvroute.Rendezvous(initial)
    weights = dict(initial)
    for name, weight in ops:
        if weight is None:
            if name in weights and len(weights) > 1:
                r.remove(name)
                del weights[name]
        elif name not in weights:
            r.add(name, weight)
            weights[name] = weight
    assert sorted(r.nodes) == sorted(weights)
    fresh = kvroute.Rendezvous(weights)
    for key in keys:
        order = model_order(weights, key)
        assert r.preference(key, len(weights)) == order == fresh.preference(key, len(weights))
    assert r.get_many(keys) == [model_order(weights, k)[0] for k in keys]
