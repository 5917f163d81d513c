"""Builders of KV-event payloads for tests and benchmarks.

The vLLM 0.33 payloads come byte-exact from the vector file. Payloads of other formats — vLLM
>= 0.24 maps in other key orders or with map16 headers, vLLM <= 0.23 tagged arrays, SGLang maps
with signed hashes and ``cache_salt`` — have no published vectors here: they are built from the spec
(tests/data/vectors/KV_EVENTS_SPEC.md) with the ``msgpack`` package, an encoder independent of
kvroute's Rust decoder.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgpack


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def map16(fields: Sequence[tuple[str, Any]]) -> bytes:
    """A map with a map16 header (``0xde nn nn``) whatever its size, as msgspec writes for
    vLLM 0.33 BlockStored; msgpack-python would use a fixmap for fewer than 16 keys."""
    out = bytearray(b"\xde" + struct.pack(">H", len(fields)))
    for key, value in fields:
        out += pack(key) + pack(value)
    return bytes(out)


def fixmap(fields: Sequence[tuple[str, Any]]) -> bytes:
    return pack(dict(fields))


def stored_fields(
    hashes: Sequence[int],
    parent: int | None,
    tokens: Sequence[int],
    block_size: int,
    *,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    extra_keys: Any = None,
    group_idx: int | None = None,
    **more: Any,
) -> list[tuple[str, Any]]:
    fields: list[tuple[str, Any]] = [
        ("type", "BlockStored"),
        ("block_hashes", list(hashes)),
        ("parent_block_hash", parent),
        ("token_ids", list(tokens)),
        ("block_size", block_size),
        ("lora_id", None),
        ("medium", medium),
        ("lora_name", lora_name),
    ]
    if extra_keys is not None:
        fields.append(("extra_keys", extra_keys))
    if group_idx is not None:
        fields.append(("group_idx", group_idx))
    fields.extend(more.items())
    return fields


def removed_fields(
    hashes: Sequence[int], *, medium: str | None = "GPU", group_idx: int | None = None
) -> list[tuple[str, Any]]:
    fields: list[tuple[str, Any]] = [
        ("type", "BlockRemoved"),
        ("block_hashes", list(hashes)),
        ("medium", medium),
    ]
    if group_idx is not None:
        fields.append(("group_idx", group_idx))
    return fields


CLEARED = [("type", "AllBlocksCleared")]


def batch(events: Sequence[bytes], *, ts: float = 1.0, dp_rank: int | None = 0) -> bytes:
    """``[ts, events, dp_rank]`` around already-encoded events."""
    out = bytearray(b"\x93" + b"\xcb" + struct.pack(">d", ts))
    n = len(events)
    out += bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
    for e in events:
        out += e
    out += pack(dp_rank)
    return bytes(out)


def legacy_stored(
    hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int, n_fields: int
) -> bytes:
    """vLLM <= 0.23 tagged array with the first ``n_fields`` declared fields (older releases had
    fewer trailing fields)."""
    fields = [
        list(hashes),
        parent,
        list(tokens),
        block_size,
        None,  # lora_id
        "GPU",  # medium
        None,  # lora_name
        None,  # extra_keys
        0,  # group_idx
        "full_attention",
        None,  # kv_cache_spec_sliding_window
    ]
    return pack(["BlockStored", *fields[:n_fields]])


def legacy_removed(hashes: Sequence[int], n_fields: int) -> bytes:
    return pack(["BlockRemoved", *[list(hashes), "GPU", 0][:n_fields]])


def sglang_stored(
    hashes: Sequence[int],
    parent: int | None,
    tokens: Sequence[int],
    page_size: int,
    *,
    medium: str = "GPU",
    cache_salt: str | None = None,
) -> bytes:
    """SGLang 0.5.23 BlockStored (signed int64 hashes: msgpack writes negatives as 0xd3)."""
    return pack(
        {
            "type": "BlockStored",
            "block_hashes": list(hashes),
            "parent_block_hash": parent,
            "token_ids": list(tokens),
            "block_size": page_size,
            "lora_id": None,
            "medium": medium,
            "cache_salt": cache_salt,
            "session_id": None,
            "lora_name": None,
        }
    )


def sglang_removed(hashes: Sequence[int], medium: str = "GPU") -> bytes:
    return pack({"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium})
