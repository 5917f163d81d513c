"""What the KV-event subscriber (``kvroute.events``) tells an operator about an engine whose
stores the router cannot use as they are: block hashes that are not the router's (direct mode)
and block sizes the router gathers, splits or must skip. Each check reads the applier's counters
for one worker and logs once per engine run; the subscriber remembers that it did.
"""

from __future__ import annotations

import logging
from typing import Any

from ._core import KvEventApplier

__all__ = ["check_block_size", "check_hashes"]

log = logging.getLogger("kvroute.events")


def check_hashes(applier: Any, worker: str) -> bool:
    """Direct mode: logs an engine whose block hashes are not the router's, counted by the
    applier on root stores (``foreign_hashes``). Whether it logged (then not again this run)."""
    foreign = applier.stats(worker)["foreign_hashes"]
    if not foreign:
        return False
    log.error(
        "worker %s: the engine's block hashes are not the router's (%d root stores so far; "
        "direct mode, hash_profile %r): nothing it stores can match a request. Hash as the "
        "engine does (vLLM: its --prefix-caching-hash-algo, sha256 by default, and "
        "PYTHONHASHSEED; SGLang: hash_profile 'sglang'), or use mode 'rehash', which needs "
        "no common hash.",
        worker,
        foreign,
        applier.hash_profile,
    )
    return True


def check_block_size(applier: Any, worker: str, router_counts_engine_blocks: bool) -> bool:
    """Once the worker's engine has stored a block, logs a block size the router cannot use
    (error), gathers into its own larger blocks (info: SGLang's pages) or indexes at its own
    finer size (info for a router, which counts the worker's matches in whole engine blocks:
    ``router_counts_engine_blocks``; a warning for an index read directly, which does not).
    Whether the check is done (False: no store seen yet)."""
    if not isinstance(applier, KvEventApplier):
        return True  # an event sink (the relay's outbox): no sizes to compare
    engine = applier.stats(worker)["engine_block_size"]
    if not engine:
        return False
    router, mode = applier.block_size, applier.mode
    if engine == router:
        return True
    if engine < router and mode == "rehash" and not router % engine:
        # Pages (e.g. SGLang's default of 1 token) gathered into router blocks.
        log.info(
            "worker %s: the engine's KV blocks (pages) are %d tokens and the router's %d: "
            "each router block is indexed once the engine holds all %d of its pages "
            "(block_size %d would credit up to %d more tokens per request, with %d times "
            "more blocks to index).",
            worker,
            engine,
            router,
            router // engine,
            engine,
            router - engine,
            router // engine,
        )
    elif engine < router:
        # Fewer tokens than a router block, and not gathered (direct mode, or not a divisor
        # of the router's block): skipped as partial blocks.
        log.error(
            "worker %s: the engine's KV blocks (pages) are %d tokens, fewer than the router's "
            "%d, so every store of this engine is skipped (stats: skipped_partial) and it is "
            "never credited with a cached prefix. Set the router's block_size to %d, or start "
            "the engine with blocks of %d tokens (vLLM: --block-size, SGLang: --page-size).",
            worker,
            engine,
            router,
            engine,
            router,
        )
    elif mode == "direct" or engine % router:
        need = "equal" if mode == "direct" else "a multiple of the router's"
        log.error(
            "worker %s: the engine's KV blocks are %d tokens and the router's %d: %s mode "
            "needs the engine's block size %s, so every store of this engine is skipped "
            "(stats: skipped_block_size) and it is never credited with a cached prefix. Set "
            "the router's block_size to %d, or start the engine with --block-size %d "
            "(vLLM >= 0.34 defaults to 64 on GPU).",
            worker,
            engine,
            router,
            mode,
            need,
            engine,
            router,
        )
    elif router_counts_engine_blocks:
        log.info(
            "worker %s: the engine's KV blocks are %d tokens and the router's %d: each is "
            "indexed as %d router blocks, and the router counts this worker's matches in "
            "whole %d-token blocks (block_size %d would index %d times fewer blocks).",
            worker,
            engine,
            router,
            engine // router,
            engine,
            engine,
            engine // router,
        )
    else:
        log.warning(
            "worker %s: the engine's KV blocks are %d tokens and the router's %d: its stores "
            "are indexed as %d-token blocks, so a match read from this index counts up to %d "
            "tokens more than the engine's whole blocks hold (a Router fed by its "
            "event_applier counts whole engine blocks). Set block_size to %d for exact "
            "matches.",
            worker,
            engine,
            router,
            router,
            engine - router,
            engine,
        )
    return True
