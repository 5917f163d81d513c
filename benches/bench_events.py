"""KV events: decode + apply from raw payload bytes, against Dynamo's RadixTree.apply_event.

Workload (same events for both sides): 4 workers, each with a KV cache of a fixed number of
blocks. Each request is one engine batch holding one BlockStored for the request's newly full
blocks (16..128 blocks of 16 tokens, a 32k vocabulary), half of them continuing an earlier
conversation on the same worker (parent = its last block); once the worker's cache is full the
batch also evicts as many blocks, tail first from the least recently used conversations, one
BlockRemoved per block as vLLM sends them. Two scenarios: "filling" (2,000 requests from empty,
24,576-block caches: mostly stores, evictions in the last third) and "steady" (16,384-block
caches filled by 1,000 requests outside the timed region, then 2,000 timed requests whose
stores and removals balance). Engine hashes are arbitrary u64 (the engine's own algorithm;
rehash mode does not read them except to chain and remove).

- kvroute: ``KvEventApplier.apply(worker, payload)`` on the msgpack payload bytes (vLLM 0.33 map
  encoding built with ``msgpack``), rehash mode (native XXH3 own hashes recomputed from the
  tokens) and direct mode. Timed: decode + rehash + index updates, one Python call per batch.
- Dynamo: ``RadixTree.apply_event(worker, json)`` per event, the JSON pre-encoded outside the
  timed region, with ``tokens_hash`` (Dynamo's own per-block hash, what its router computes from
  the event's tokens) also precomputed outside it — so Dynamo's hashing is not timed, ours is.

``ops`` = blocks stored + blocks removed. Answers are cross-checked: for a sample of live
conversations, kvroute's ``match`` on its own hashes equals Dynamo's ``find_matches`` scores.
Run: ``taskset -c 1 .venv/bin/python -m pytest benches/bench_events.py``.
"""

from __future__ import annotations

import json
import struct

import msgpack
import numpy as np
import pytest
from dynamo_peer import dynamo_answer
from kvroute import BlockHasher, KvEventApplier, PrefixIndex

dynamo_llm = pytest.importorskip("dynamo.llm")

N_WORKERS = 4
BLOCK = 16
VOCAB = 32_000
# name: (requests, requests applied before timing, KV cache capacity per worker in blocks)
SCENARIOS = {
    "filling": (2_000, 0, 24_576),  # caches fill up; the last third of requests evict
    "steady": (3_000, 1_000, 16_384),  # caches full: every store evicts as many blocks
}


def _map16(fields: dict) -> bytes:
    out = bytearray(b"\xde" + struct.pack(">H", len(fields)))
    for k, v in fields.items():
        out += msgpack.packb(k) + msgpack.packb(v)
    return bytes(out)


def make_workload(n_requests: int, capacity: int, seed: int = 0):
    """Batches ``(worker, [event dicts])`` and the conversations ``[worker, engine hashes,
    tokens, alive]`` still (partly) cached at the end."""
    rng = np.random.default_rng(seed)
    next_hash = iter(np.unique(rng.integers(1, 2**63, size=n_requests * 130)).tolist())
    conversations: list[list] = []  # least recently used first
    held = [0] * N_WORKERS
    batches = []
    for r in range(n_requests):
        worker = r % N_WORKERS
        mine = [c for c in conversations if c[0] == worker and c[3]]
        n = int(rng.integers(16, 129))
        tokens = rng.integers(0, VOCAB, size=n * BLOCK).tolist()
        hashes = [next(next_hash) for _ in range(n)]
        if mine and rng.random() < 0.5:
            conv = mine[int(rng.integers(len(mine)))]
            parent = conv[1][-1]
            conv[1].extend(hashes)
            conv[2].extend(tokens)
            conversations.remove(conv)
        else:
            parent = None
            conv = [worker, list(hashes), list(tokens), True]
        conversations.append(conv)  # most recently used
        held[worker] += n
        events = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": tokens,
                "block_size": BLOCK,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ]
        # A full cache evicts the least recently used conversations, tail block first, one
        # BlockRemoved per block as vLLM sends them.
        while held[worker] > capacity:
            victim = next(c for c in conversations if c[0] == worker and c is not conv)
            h = victim[1].pop()
            del victim[2][-BLOCK:]
            victim[3] = False  # its tail is gone: never continued again
            held[worker] -= 1
            events.append(
                {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
            )
            if not victim[1]:
                conversations.remove(victim)
        batches.append((worker, events))
    return batches, conversations


def encode_msgpack(batches):
    out = []
    for r, (worker, events) in enumerate(batches):
        body = b"".join(_map16(e) for e in events)
        payload = (
            b"\x93\xcb" + struct.pack(">d", 1.7e9 + r) + b"\xdc" + struct.pack(">H", len(events))
        )
        out.append((f"w{worker}", payload + body + b"\x00"))
    return out


def encode_dynamo(batches):
    compute = dynamo_llm.compute_block_hash_for_seq
    out, n = [], 0
    for worker, events in batches:
        for e in events:
            if e["type"] == "BlockStored":
                local = compute(e["token_ids"], BLOCK)
                blocks = [
                    {"block_hash": h, "tokens_hash": t}
                    for h, t in zip(e["block_hashes"], local, strict=True)
                ]
                data = {"stored": {"parent_hash": e["parent_block_hash"], "blocks": blocks}}
            else:
                data = {"removed": {"block_hashes": e["block_hashes"]}}
            out.append((worker, json.dumps({"event_id": n, "data": data}).encode()))
            n += 1
    return out


def count_blocks(batches) -> int:
    return sum(len(e["block_hashes"]) for _, events in batches for e in events)


@pytest.fixture(scope="module", params=list(SCENARIOS))
def workload(request):
    n_requests, warmup, capacity = SCENARIOS[request.param]
    batches, conversations = make_workload(n_requests, capacity)
    sample = [c for c in conversations if len(c[2]) >= BLOCK][::7][:100]
    payloads, dynamo = encode_msgpack(batches), encode_dynamo(batches)
    split = sum(len(events) for _, events in batches[:warmup])  # Dynamo takes single events
    timed = batches[warmup:]
    removed = [e for _, ev in timed for e in ev if e["type"] == "BlockRemoved"]
    return {
        "name": request.param,
        "warmup": payloads[:warmup],
        "payloads": payloads[warmup:],
        "dynamo_warmup": dynamo[:split],
        "dynamo": dynamo[split:],
        "blocks": count_blocks(timed),
        "removed": sum(len(e["block_hashes"]) for e in removed),
        "sample": sample,
    }


def group(workload, mode: str) -> str:
    return (
        f"kv events decode+apply, {workload['name']}: {workload['blocks']:,} blocks "
        f"({workload['removed']:,} removed), per block: kvroute {mode} vs dynamo"
    )


def apply_all(applier, payloads):
    apply = applier.apply
    for worker, payload in payloads:
        apply(worker, payload)
    return applier


@pytest.mark.parametrize("mode", ["rehash", "direct"])
def test_kvroute(benchmark, workload, mode):
    benchmark.group = group(workload, mode)
    benchmark.extra_info.update(impl="kvroute", ops=workload["blocks"], mode=mode)
    payloads = workload["payloads"]

    def fresh():
        applier = KvEventApplier(PrefixIndex(), mode=mode, block_size=BLOCK)
        return (apply_all(applier, workload["warmup"]), payloads), {}

    applier = benchmark.pedantic(apply_all, setup=fresh, rounds=5)
    stats = applier.stats()
    assert sum(s["malformed"] for s in stats.values()) == 0
    skipped = ("skipped_unknown_parent", "skipped_unsupported", "index_rejected")
    assert all(s[k] == 0 for s in stats.values() for k in skipped)
    # Cross-check against Dynamo on live conversations.
    tree = dynamo_llm.RadixTree()
    for worker, event in workload["dynamo_warmup"] + workload["dynamo"]:
        tree.apply_event(worker, event)
    hasher = BlockHasher(BLOCK)
    for worker, hashes, tokens, _alive in workload["sample"]:
        query = hashes if mode == "direct" else hasher.hash(tokens)
        local = dynamo_llm.compute_block_hash_for_seq(tokens, BLOCK)
        want = dynamo_answer(tree.find_matches(local).scores)
        assert applier.index.match(query) == want
        assert want[f"w{worker}"] == len(tokens) // BLOCK


@pytest.mark.parametrize("mode", ["rehash", "direct"])
def test_dynamo(benchmark, workload, mode):
    benchmark.group = group(workload, mode)
    benchmark.extra_info.update(impl="dynamo RadixTree.apply_event", ops=workload["blocks"])
    encoded = workload["dynamo"]

    def run(tree):
        apply = tree.apply_event
        for worker, event in encoded:
            apply(worker, event)
        return tree

    def fresh():
        tree = dynamo_llm.RadixTree()
        for worker, event in workload["dynamo_warmup"]:
            tree.apply_event(worker, event)
        return (tree,), {}

    benchmark.pedantic(run, setup=fresh, rounds=3)
