"""A router whose block size divides its engines' predicts exactly what each engine serves.

An engine caches, and so hits, whole blocks of its own size: of a prompt sharing 100 tokens with
a cached one, an engine of 64-token blocks serves 64 (vLLM and SGLang also always compute the
prompt's last token). A router of 16-token blocks (rehash mode) indexes each engine block as
several of its own, and must count each worker's match in whole blocks of *that worker's*
engine — so one router can follow a fleet mid-upgrade (vLLM 0.33's 16-token blocks beside
0.34's 64). The reference below is an engine's prefix cache at token level: the set of
whole-block prefixes of the prompts it stored, and a hit is the longest of them that the new
prompt starts with. It shares nothing with the router's block arithmetic. Events are built
from the spec (support/events_payloads.py) and applied through the router's own applier;
approx mode is told the sizes with ``set_engine_block_size``.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute import Router
from support import events_payloads as P


class Engine:
    """An engine's prefix cache: whole ``block``-token prefixes of the prompts it stored."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.ids: dict[tuple[int, ...], int] = {}  # cached prefix -> its engine block hash

    def store(self, prompt: list[int], next_id: list[int]) -> list[bytes]:
        """Caches the prompt's whole blocks; returns a BlockStored event for each new one."""
        events = []
        for end in range(self.block, len(prompt) + 1, self.block):
            prefix = tuple(prompt[:end])
            if prefix in self.ids:
                continue
            next_id[0] += 1
            self.ids[prefix] = next_id[0]
            parent = self.ids[prefix[: end - self.block]] if end > self.block else None
            block_tokens = prompt[end - self.block : end]
            events.append(P.map16(P.stored_fields([next_id[0]], parent, block_tokens, self.block)))
        return events

    def hit_tokens(self, prompt: list[int], last_token_computed: bool) -> int:
        """Tokens of ``prompt`` the engine serves from its cache."""
        limit = len(prompt) - 1 if last_token_computed else len(prompt)
        end = self.block
        while end <= limit and tuple(prompt[:end]) in self.ids:
            end += self.block
        return end - self.block


# Prompts share prefixes of every length, cut anywhere within a block: each is a cut of one of
# two long base sequences, then tokens of its own (so two prompts from one base share at least
# the shorter cut).
BASES = [[1000 + i for i in range(400)], [2000 + i for i in range(400)]]


@st.composite
def prompt(draw, router_block: int):
    """A prompt whose length is often a whole number of router (and so engine) blocks."""
    units = draw(st.integers(0, 24))
    length = units * router_block + draw(st.sampled_from([0, 0, 1, router_block - 1]))
    cut = draw(st.integers(0, length))
    base = draw(st.sampled_from(BASES))
    own = draw(st.integers(0, 10**6))
    return base[:cut] + [own * 1000 + i for i in range(length - cut)]


settings_kw = {"deadline": None}


@settings(max_examples=120, **settings_kw)
@given(
    data=st.data(),
    router_block=st.sampled_from([2, 4, 8]),
    multiples=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    profile=st.sampled_from(["native", "sglang"]),
)
def test_events_mode_predicts_each_engines_whole_block_hits(data, router_block, multiples, profile):
    names = [f"w{i}" for i in range(len(multiples))]
    router = Router(names, block_size=router_block, index="events", hash_profile=profile)
    applier = router.event_applier
    engines = {n: Engine(k * router_block) for n, k in zip(names, multiples, strict=True)}
    stored = data.draw(
        st.lists(st.tuples(st.sampled_from(names), prompt(router_block)), max_size=8)
    )
    next_id = [0]
    for name, p in stored:
        for event in engines[name].store(p, next_id):
            applier.apply(name, P.batch([event]))
    queries = data.draw(st.lists(prompt(router_block), max_size=6)) + [p for _, p in stored]
    for query in queries:
        for name, engine in engines.items():
            d = router.route(query, exclude=[n for n in names if n != name])
            want = engine.hit_tokens(query, last_token_computed=profile != "native")
            assert d.worker == name
            assert d.cached_blocks == want // router_block, (name, engine.block, query)


@settings(max_examples=80, **settings_kw)
@given(
    data=st.data(),
    router_block=st.sampled_from([2, 4, 8]),
    multiples=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    profile=st.sampled_from(["native", "sglang"]),
)
def test_approx_mode_predicts_whole_block_hits_once_told_the_sizes(
    data, router_block, multiples, profile
):
    """Approx mode models a routed prompt as cached where it went (capacity to spare, no TTL):
    each route's prediction is what the reference engine, storing the same prompts, serves."""
    names = [f"w{i}" for i in range(len(multiples))]
    router = Router(names, block_size=router_block, hash_profile=profile)
    engines = {n: Engine(k * router_block) for n, k in zip(names, multiples, strict=True)}
    for name, engine in engines.items():
        router.set_engine_block_size(name, engine.block)
        assert router.engine_block_size(name) == engine.block
    steps = data.draw(
        st.lists(st.tuples(st.sampled_from(names), prompt(router_block)), max_size=16)
    )
    next_id = [0]
    for name, p in steps:
        d = router.route(p, exclude=[n for n in names if n != name])
        want = engines[name].hit_tokens(p, last_token_computed=profile != "native")
        assert d.cached_blocks == want // router_block, (name, engines[name].block, p)
        engines[name].store(p, next_id)


def test_an_engine_block_size_is_checked_and_names_what_is_wrong():
    router = Router(["a"], block_size=16)
    assert router.engine_block_size("a") is None
    with pytest.raises(KeyError, match="nope"):
        router.set_engine_block_size("nope", 64)
    with pytest.raises(KeyError, match="nope"):
        router.engine_block_size("nope")
    with pytest.raises(ValueError, match=re.escape('"a" must be 1..=4294967295 tokens, got 0')):
        router.set_engine_block_size("a", 0)
    with pytest.raises(ValueError, match="tokens = -1 is negative"):
        router.set_engine_block_size("a", -1)
    with pytest.raises(TypeError, match="tokens must be an int"):
        router.set_engine_block_size("a", 64.0)
    assert router.engine_block_size("a") is None  # nothing changed
    router.set_engine_block_size("a", 64)
    assert router.engine_block_size("a") == 64
