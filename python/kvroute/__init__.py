"""kvroute: keep prompt (KV/prefix) caches hot across a fleet of LLM workers.

The hot paths live in the Rust extension ``kvroute._core``; this package re-exports its public
names and adds the pure-Python parts (command line, simulator, event subscriber, gateway).
"""

from ._core import (
    BlockCache,
    BlockHasher,
    HashRing,
    JumpHash,
    Maglev,
    PrefixIndex,
    Rendezvous,
    __version__,
    hash_key,
    jump_hash,
    jump_hash_many,
)

__all__ = [
    "BlockCache",
    "BlockHasher",
    "HashRing",
    "JumpHash",
    "Maglev",
    "PrefixIndex",
    "Rendezvous",
    "__version__",
    "hash_key",
    "jump_hash",
    "jump_hash_many",
]
