"""An engine whose KV block size the router cannot use is named in the log, once per engine run.

vLLM >= 0.34 stores 64-token blocks on GPU by default (16 before), so a router left at 16 tokens
meets engines it cannot follow: in direct mode every store is skipped, in rehash mode they are
indexed at the router's finer size (a router counts whole engine blocks, an index read directly
does not). Real ZMQ sockets on 127.0.0.1 (support/events_engine.py);
payloads built from the spec (support/events_payloads.py).
"""

from __future__ import annotations

import logging

import pytest
from kvroute import PrefixIndex, Router
from kvroute.events import KvEventSubscriber
from support import events_payloads as P
from support.events_engine import own
from support.helpers import wait_for


def store(hashes: list[int], tokens: list[int], block_size: int) -> bytes:
    return P.batch([P.map16(P.stored_fields(hashes, None, tokens, block_size))])


def records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvroute.events"]


def published(sub: KvEventSubscriber, seq: int) -> dict:
    wait_for(lambda: sub.stats()["w"]["last_seq"] == seq, f"seq {seq}")
    return sub.stats()["w"]


def test_direct_mode_names_an_engine_block_size_it_skips(engines, caplog):
    caplog.set_level(logging.WARNING, logger="kvroute.events")
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = list(range(128))
    sub = KvEventSubscriber(index, {"w": engine.endpoint}, mode="direct", hash_profile="vllm")
    with sub:
        engine.wait_subscriber()
        engine.publish(store([11], tokens[:64], 64))
        engine.publish(store([12], tokens[64:], 64))
        s = published(sub, 1)
        assert (s["skipped_block_size"], s["blocks_stored"], s["engine_block_size"]) == (2, 0, 64)
        assert index.match([11]) == {}
        (first,) = records(caplog)  # once, not per store
        assert first.levelno == logging.ERROR
        assert first.getMessage() == (
            "worker w: the engine's KV blocks are 64 tokens and the router's 16: direct mode "
            "needs the engine's block size equal, so every store of this engine is skipped "
            "(stats: skipped_block_size) and it is never credited with a cached prefix. Set the "
            "router's block_size to 64, or start the engine with --block-size 16 (vLLM >= 0.34 "
            "defaults to 64 on GPU)."
        )
        # A restarted engine (numbering from 0 again: the worker is reset) is checked afresh.
        engine.restart()
        engine.publish(store([13], tokens[:64], 64))
        wait_for(lambda: sub.stats()["w"]["restarts"] == 1, "the restart")
        wait_for(lambda: len(records(caplog)) == 2, "the second engine run's check")
        assert sub.stats()["w"]["errors"] == 0


def test_rehash_mode_names_a_size_that_is_not_a_multiple(engines, caplog):
    caplog.set_level(logging.WARNING, logger="kvroute.events")
    engine = engines(replay=False)
    sub = KvEventSubscriber(PrefixIndex(), {"w": engine.endpoint}, block_size=32)
    with sub:
        engine.wait_subscriber()
        engine.publish(store([21], list(range(48)), 48))
        s = published(sub, 0)
    assert (s["skipped_block_size"], s["engine_block_size"]) == (1, 48)
    (record,) = records(caplog)
    assert record.levelno == logging.ERROR
    assert (
        "blocks are 48 tokens and the router's 32: rehash mode needs the engine's block size a "
        "multiple of the router's" in record.getMessage()
    )


def test_rehash_mode_warns_that_a_multiple_is_indexed_at_the_router_size(engines, caplog):
    caplog.set_level(logging.INFO, logger="kvroute.events")
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = list(range(64))
    with KvEventSubscriber(index, {"w": engine.endpoint}) as sub:
        engine.wait_subscriber()
        engine.publish(store([31], tokens, 64))
        s = published(sub, 0)
        engine.publish(store([32], list(range(100, 164)), 64))
        s = published(sub, 1)
    assert (s["skipped_block_size"], s["blocks_stored"], s["engine_block_size"]) == (0, 2, 64)
    assert index.match(own(tokens)) == {"w": 4}  # indexed as four 16-token blocks
    (record,) = records(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "worker w: the engine's KV blocks are 64 tokens and the router's 16: its stores are "
        "indexed as 16-token blocks, so a match read from this index counts up to 48 tokens more "
        "than the engine's whole blocks hold (a Router fed by its event_applier counts whole "
        "engine blocks). Set block_size to 64 for exact matches."
    )


def test_a_router_counts_a_multiple_in_whole_engine_blocks(engines, caplog):
    """The same engine feeding a router: an info line, and the router's prediction for a prompt
    sharing 100 tokens with the stored 128 is the engine's one whole 64-token block."""
    caplog.set_level(logging.INFO, logger="kvroute.events")
    engine = engines(replay=False)
    router = Router(["w", "x"], index="events")
    tokens = list(range(128))
    with KvEventSubscriber(router, {"w": engine.endpoint}) as sub:
        engine.wait_subscriber()
        engine.publish(store([51, 52], tokens, 64))
        published(sub, 0)
    assert router.engine_block_size("w") == 64
    assert router.engine_block_size("x") is None
    d = router.route(tokens[:100] + [7] * 28, exclude=["x"])
    assert (d.worker, d.cached_blocks) == ("w", 4)
    (record,) = records(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "worker w: the engine's KV blocks are 64 tokens and the router's 16: each is indexed as "
        "4 router blocks, and the router counts this worker's matches in whole 64-token blocks "
        "(block_size 64 would index 4 times fewer blocks)."
    )


@pytest.mark.parametrize("mode", ["rehash", "direct"])
def test_equal_sizes_log_nothing(engines, caplog, mode):
    caplog.set_level(logging.DEBUG, logger="kvroute.events")
    engine = engines(replay=False)
    profile = "vllm" if mode == "direct" else None
    sub = KvEventSubscriber(PrefixIndex(), {"w": engine.endpoint}, mode=mode, hash_profile=profile)
    with sub:
        engine.wait_subscriber()
        # Direct mode: the engine's own hash of the block (else it would be named as foreign).
        hashes = own(list(range(16)), profile="vllm") if mode == "direct" else [41]
        engine.publish(store(hashes, list(range(16)), 16))
        s = published(sub, 0)
    assert (s["skipped_block_size"], s["blocks_stored"], s["engine_block_size"]) == (0, 1, 16)
    assert s["foreign_hashes"] == 0
    assert records(caplog) == []


def test_engine_pages_smaller_than_the_routers_blocks_are_named_in_direct_mode(engines, caplog):
    """Direct mode keys the index by the engine's hashes, so pages shorter than a router block
    (SGLang's default page is 1 token) cannot be gathered: skipped as partial, and the log says
    so, with SGLang's flag."""
    caplog.set_level(logging.WARNING, logger="kvroute.events")
    engine = engines(replay=False)
    sub = KvEventSubscriber(
        PrefixIndex(), {"w": engine.endpoint}, mode="direct", hash_profile="sglang"
    )
    with sub:
        engine.wait_subscriber()
        engine.publish(P.batch([P.map16(P.stored_fields([31], None, [7], 1))]))
        s = published(sub, 0)
    assert (s["skipped_partial"], s["skipped_block_size"], s["engine_block_size"]) == (1, 0, 1)
    (record,) = records(caplog)
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "worker w: the engine's KV blocks (pages) are 1 tokens, fewer than the router's 16, so "
        "every store of this engine is skipped (stats: skipped_partial) and it is never credited "
        "with a cached prefix. Set the router's block_size to 1, or start the engine with blocks "
        "of 16 tokens (vLLM: --block-size, SGLang: --page-size)."
    )


@pytest.mark.parametrize("page", [1, 4])
def test_sglang_pages_are_gathered_into_router_blocks_in_rehash_mode(engines, caplog, page):
    """SGLang's events as its radix cache sends them — one ``BlockStored`` per page, each
    chained on the page before, ``block_size`` the page's length — for 40 tokens: the router
    indexes its own two 16-token blocks, and only once every page of each is held."""
    caplog.set_level(logging.INFO, logger="kvroute.events")
    engine = engines(replay=False)
    index = PrefixIndex()
    tokens = [(7 * t) % 101 for t in range(40)]
    pages = own(tokens, page, profile="sglang")  # SGLang's page hashes (signed int64)

    def stores(first: int, last: int) -> bytes:
        return P.batch(
            [
                P.map16(
                    P.stored_fields(
                        [pages[i]],
                        pages[i - 1] if i else None,
                        tokens[i * page : (i + 1) * page],
                        page,
                    )
                )
                for i in range(first, last)
            ]
        )

    sub = KvEventSubscriber(index, {"w": engine.endpoint}, hash_profile="sglang")
    routers = own(tokens, 16, profile="sglang")
    with sub:
        engine.wait_subscriber()
        engine.publish(stores(0, 24 // page))  # 24 tokens: one router block and a half
        s = published(sub, 0)
        assert (s["blocks_stored"], s["skipped_partial"], s["engine_block_size"]) == (
            24 // page,
            0,
            page,
        )
        assert index.match(routers) == {"w": 1}
        engine.publish(stores(24 // page, 40 // page))
        published(sub, 1)
        assert index.match(routers) == {"w": 2}
        # Evicted leaf first, as SGLang's radix cache does: the second block goes with its
        # last page, the first stays.
        engine.publish(P.batch([P.map16(P.removed_fields(pages[::-1][: 16 // page]))]))
        published(sub, 2)
        assert index.match(routers) == {"w": 1}
    (record,) = records(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        f"worker w: the engine's KV blocks (pages) are {page} tokens and the router's 16: each "
        f"router block is indexed once the engine holds all {16 // page} of its pages "
        f"(block_size {page} would credit up to {16 - page} more tokens per request, with "
        f"{16 // page} times more blocks to index)."
    )


def direct_vllm(engines, caplog):
    """An engine without replay and a direct-mode subscriber to it hashing as vLLM; the
    subscriber's warnings captured."""
    caplog.set_level(logging.WARNING, logger="kvroute.events")
    engine = engines(replay=False)
    sub = KvEventSubscriber(
        PrefixIndex(), {"w": engine.endpoint}, mode="direct", hash_profile="vllm"
    )
    return engine, sub


def test_direct_mode_names_an_engine_hashing_otherwise(engines, caplog):
    """Roots stored under hashes that are not the router's hash of their tokens (an engine on
    another --prefix-caching-hash-algo or seed) can never match: logged once per engine run."""
    engine, sub = direct_vllm(engines, caplog)
    tokens = list(range(64))
    with sub:
        engine.wait_subscriber()
        engine.publish(store([41], tokens[:16], 16))
        engine.publish(store([42], tokens[16:32], 16))
        s = published(sub, 1)
        assert (s["foreign_hashes"], s["blocks_stored"]) == (2, 2)
        (record,) = records(caplog)
        assert record.levelno == logging.ERROR
        assert record.getMessage() == (
            "worker w: the engine's block hashes are not the router's (1 root stores so far; "
            "direct mode, hash_profile 'vllm'): nothing it stores can match a request. Hash as "
            "the engine does (vLLM: its --prefix-caching-hash-algo, sha256 by default, and "
            "PYTHONHASHSEED; SGLang: hash_profile 'sglang'), or use mode 'rehash', which needs no "
            "common hash."
        )
        # The engine's own hashes (vLLM 0.33's sha256_cbor of the same tokens) are not counted.
        engine.publish(store(own(tokens[32:48], profile="vllm"), tokens[32:48], 16))
        assert published(sub, 2)["foreign_hashes"] == 2
        engine.restart()  # numbering from 0 again: the worker is reset and checked afresh
        engine.publish(store([43], tokens[48:], 16))
        wait_for(lambda: len(records(caplog)) == 2, "the second engine run's check")
        assert sub.stats()["w"]["errors"] == 0


def test_direct_mode_names_an_engine_whose_foreign_roots_come_later(engines, caplog):
    """The check runs on every batch until it finds a foreign root: an engine whose first stores
    are hashed as the router's (nothing to say yet) and a later root is not, is still named."""
    engine, sub = direct_vllm(engines, caplog)
    tokens = list(range(48))
    with sub:
        engine.wait_subscriber()
        engine.publish(store(own(tokens[:16], profile="vllm"), tokens[:16], 16))
        assert published(sub, 0)["foreign_hashes"] == 0
        assert not records(caplog)
        engine.publish(store([77], tokens[16:32], 16))
        assert published(sub, 1)["foreign_hashes"] == 1
        (record,) = records(caplog)
        assert record.levelno == logging.ERROR
        assert record.getMessage().startswith(
            "worker w: the engine's block hashes are not the router's (1 root stores so far;"
        )
