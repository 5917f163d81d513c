"""kvroute: keep prompt (KV/prefix) caches hot across a fleet of LLM workers.

The hot paths live in the Rust extension ``kvroute._core``; this package re-exports its public
names and adds the pure-Python parts (command line, simulator, event subscriber, gateway).
"""

from __future__ import annotations

from typing import Any

from ._core import (
    BlockCache,
    BlockHasher,
    Decision,
    HashRing,
    JumpHash,
    KvEventApplier,
    Maglev,
    NoWorkerError,
    PdDecision,
    PrefixIndex,
    ReadOnlyError,
    Rendezvous,
    Router,
    __version__,
    decode_kv_events,
    hash_key,
    jump_hash,
    jump_hash_many,
)

__all__ = [
    "BlockCache",
    "BlockHasher",
    "Decision",
    "HashRing",
    "JumpHash",
    "KvEventApplier",
    "KvEventSubscriber",
    "Maglev",
    "NoWorkerError",
    "PdDecision",
    "PrefixIndex",
    "ReadOnlyError",
    "Rendezvous",
    "Router",
    "__version__",
    "decode_kv_events",
    "hash_key",
    "jump_hash",
    "jump_hash_many",
]


def __getattr__(name: str) -> Any:
    # The ZMQ subscriber needs the optional pyzmq (the `events` extra): imported on first use.
    if name == "KvEventSubscriber":
        from .events import KvEventSubscriber

        return KvEventSubscriber
    raise AttributeError(f"module 'kvroute' has no attribute {name!r}")
