"""PrefixIndex against Dynamo's RadixTree (ai-dynamo-runtime, Rust), same process, same workload.

Workload: 16 or 64 workers; conversations of 16..2048 blocks (log-uniform) that start with one
of eight shared system prompts and grow in 1-4 turns (each turn a store continuing from the
previous block); a quarter of the conversations are also held, in part, by a second worker.
Indexes hold 1e5 and 1e6 (worker, block) pairs (16 workers), and 1e6 pairs over 64 workers, where
the system prompts end up held by most workers: a query's answer names ~57 workers (~14 with 16).
Queries of 64, 512 and 2048 blocks are a stored conversation followed by new blocks (a new turn),
plus some with an unknown system prompt.

- store: blocks/s of building the index from the events (Dynamo's JSON is encoded beforehand);
- match, "lists": the case a gateway has — block hashes in a Python list for both, and both
  answers as ``{worker: blocks}`` (Dynamo's ``.scores``, keyed ``(worker_id, dp_rank)``, turned
  into that dict, as a caller must): the harder case for kvroute, whose NumPy input is free;
- match, "NumPy": kvroute given a uint64 array, Dynamo a list (its only input), timed with and
  without reading `.scores`;
- memory: RSS growth of building each index in a fresh process (`--memory` runs only that):
  ``taskset -c 1 .venv/bin/python -m pytest benches/bench_index.py`` or
  ``.venv/bin/python benches/bench_index.py --memory``.
Answers are cross-checked between kvroute and Dynamo for every query.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dynamo_peer import dynamo_answer

N_WORKERS = 16
SIZES = {"1e5": 100_000, "1e6": 1_000_000}
# (label, pairs, workers) of the in-process benchmarks.
SETUPS = {
    "1e5": (100_000, 16),
    "1e6": (1_000_000, 16),
    "1e6 x 64 workers": (1_000_000, 64),
}
QUERY_LENGTHS = (64, 512, 2048)
N_QUERIES = 200


def make_workload(target_pairs: int, seed: int = 0, n_workers: int = N_WORKERS):
    """Store events ``(worker, parent or None, uint64 blocks)`` and the stored conversations."""
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(1, 2**64, size=n, dtype=np.uint64) for n in (8, 16, 32, 64, 96, 128, 192, 256)
    ]
    held_system = [[0] * len(systems) for _ in range(n_workers)]
    events, conversations = [], []
    pairs = 0

    def store_prefix(worker: int, k: int, conv: np.ndarray, sys_len: int, cuts: list[int]) -> int:
        new = 0
        parent = None
        for start, end in zip([0, *cuts[:-1]], cuts, strict=True):
            blocks = conv[start:end]
            events.append((worker, parent, blocks))
            parent = int(blocks[-1])
            new += len(blocks)
        already = min(held_system[worker][k], sys_len, cuts[-1])
        held_system[worker][k] = max(held_system[worker][k], min(sys_len, cuts[-1]))
        return new - already

    while pairs < target_pairs:
        length = int(np.exp(rng.uniform(np.log(16), np.log(2048))))
        k = int(rng.integers(len(systems)))
        sys_len = min(len(systems[k]), length // 2)
        conv = np.concatenate(
            [systems[k][:sys_len], rng.integers(1, 2**64, size=length - sys_len, dtype=np.uint64)]
        )
        turns = int(rng.integers(1, 5))
        inner = sorted(set(rng.integers(sys_len + 1, length, size=turns - 1).tolist()))
        cuts = [*[c for c in inner if c < length], length]
        worker = int(rng.integers(n_workers))
        pairs += store_prefix(worker, k, conv, sys_len, cuts)
        if rng.random() < 0.25:
            other = (worker + 1 + int(rng.integers(n_workers - 1))) % n_workers
            part = cuts[: int(rng.integers(1, len(cuts) + 1))]
            pairs += store_prefix(other, k, conv, sys_len, part)
        conversations.append(conv)
    return events, conversations


def make_queries(conversations, length: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + length)
    out = []
    for i in range(N_QUERIES):
        if i % 10 == 9:
            out.append(rng.integers(1, 2**64, size=length, dtype=np.uint64))
            continue
        conv = conversations[int(rng.integers(len(conversations)))]
        tail = max(0, length - len(conv))
        extra = rng.integers(1, 2**64, size=tail, dtype=np.uint64)
        out.append(np.concatenate([conv[:length], extra]))
    return out


def dynamo_events(events) -> list[tuple[int, bytes]]:
    encoded = []
    for n, (worker, parent, blocks) in enumerate(events):
        data = {
            "parent_hash": parent,
            "blocks": [{"block_hash": h, "tokens_hash": h} for h in blocks.tolist()],
        }
        encoded.append((worker, json.dumps({"event_id": n, "data": {"stored": data}}).encode()))
    return encoded


def build_kvroute(events):
    import kvroute

    idx = kvroute.PrefixIndex()
    names = [f"w{i}" for i in range(1 + max(w for w, _, _ in events))]
    for worker, parent, blocks in events:
        idx.store(names[worker], blocks, parent)
    return idx


def build_dynamo(encoded):
    from dynamo.llm import RadixTree

    tree = RadixTree()
    for worker, event in encoded:
        tree.apply_event(worker, event)
    return tree


# ---- in-process benchmarks ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(SETUPS), ids=list(SETUPS))
def setup(request):
    pytest.importorskip("dynamo.llm")
    pairs, n_workers = SETUPS[request.param]
    events, conversations = make_workload(pairs, n_workers=n_workers)
    encoded = dynamo_events(events)
    idx = build_kvroute(events)
    tree = build_dynamo(encoded)
    queries = {n: make_queries(conversations, n) for n in QUERY_LENGTHS}
    lists = {n: [q.tolist() for q in qs] for n, qs in queries.items()}
    for n in QUERY_LENGTHS:
        for q, ql in zip(queries[n], lists[n], strict=True):
            assert idx.match(q) == dynamo_answer(tree.find_matches(ql).scores)
    pairs = sum(idx.num_blocks(w) for w in idx.workers)
    blocks = sum(len(b) for _, _, b in events)
    return {
        "size": request.param,
        "names": [f"w{i}" for i in range(n_workers)],
        "events": events,
        "encoded": encoded,
        "idx": idx,
        "tree": tree,
        "queries": queries,
        "lists": lists,
        "pairs": pairs,
        "blocks": blocks,
    }


def test_store_kvroute(benchmark, setup):
    import kvroute

    benchmark.group = f"index store {setup['size']} pairs (per block)"
    benchmark.extra_info.update(impl="kvroute", ops=setup["blocks"], pairs=setup["pairs"])
    names = setup["names"]
    events = setup["events"]

    def run(idx):
        for worker, parent, blocks in events:
            idx.store(names[worker], blocks, parent)
        return idx

    idx = benchmark.pedantic(run, setup=lambda: ((kvroute.PrefixIndex(),), {}), rounds=3)
    assert idx.dump() == setup["idx"].dump()


def test_store_dynamo(benchmark, setup):
    from dynamo.llm import RadixTree

    benchmark.group = f"index store {setup['size']} pairs (per block)"
    benchmark.extra_info.update(impl="dynamo RadixTree.apply_event", ops=setup["blocks"])
    encoded = setup["encoded"]

    def run(tree):
        for worker, event in encoded:
            tree.apply_event(worker, event)
        return tree

    tree = benchmark.pedantic(run, setup=lambda: ((RadixTree(),), {}), rounds=3)
    q = setup["lists"][64][0]
    assert dynamo_answer(tree.find_matches(q).scores) == setup["idx"].match(q)


#: kvroute's query form per match group: Python lists, or uint64 arrays (``setup`` key).
KVROUTE_QUERIES = {"lists": "lists", "NumPy": "queries"}
#: Dynamo's match peers (it takes lists only): label -> (group form, the timed work on a batch).
DYNAMO_MATCHES = {
    "dynamo find_matches -> {worker: blocks}": (
        "lists",
        lambda find, qs: [dynamo_answer(find(q).scores) for q in qs],
    ),
    "dynamo find_matches + .scores": ("NumPy", lambda find, qs: [find(q).scores for q in qs]),
    "dynamo find_matches only": ("NumPy", lambda find, qs: [find(q) for q in qs]),
}


def match_group(setup: dict, length: int, form: str) -> str:
    return f"index match {length}-block query, {setup['size']} pairs ({form})"


@pytest.mark.parametrize("form", list(KVROUTE_QUERIES))
@pytest.mark.parametrize("length", QUERY_LENGTHS)
def test_match_kvroute(benchmark, setup, length, form):
    benchmark.group = match_group(setup, length, form)
    benchmark.extra_info.update(impl="kvroute", ops=N_QUERIES)
    match = setup["idx"].match
    queries = setup[KVROUTE_QUERIES[form]][length]
    out = benchmark(lambda: [match(q) for q in queries])
    tree = setup["tree"]
    assert out == [dynamo_answer(tree.find_matches(q).scores) for q in setup["lists"][length]]


@pytest.mark.parametrize("impl", list(DYNAMO_MATCHES))
@pytest.mark.parametrize("length", QUERY_LENGTHS)
def test_match_dynamo(benchmark, setup, length, impl):
    form, work = DYNAMO_MATCHES[impl]
    benchmark.group = match_group(setup, length, form)
    benchmark.extra_info.update(impl=impl, ops=N_QUERIES)
    find = setup["tree"].find_matches
    queries = setup["lists"][length]
    benchmark(lambda: work(find, queries))


# ---- memory: RSS growth of one build in a fresh process ------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_child(impl: str, pairs: int) -> dict:
    events, _ = make_workload(pairs)
    if impl == "dynamo":
        from dynamo.llm import RadixTree  # import before the baseline

        data = dynamo_events(events)
        RadixTree()
    else:
        import kvroute

        data = events
        kvroute.PrefixIndex()
    gc.collect()
    before = _rss_bytes()
    built = build_dynamo(data) if impl == "dynamo" else build_kvroute(data)
    gc.collect()
    after = _rss_bytes()
    out = {"impl": impl, "rss_growth": after - before}
    if impl == "kvroute":
        out["memory_bytes"] = built.memory_bytes()
        out["pairs"] = sum(built.num_blocks(w) for w in built.workers)
        out["distinct_blocks"] = len(built)
        out["nodes"] = built.num_nodes()
    return out


def measure_memory() -> list[dict]:
    rows = []
    for size, pairs in SIZES.items():
        got = {}
        for impl in ("kvroute", "dynamo"):
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--memory-child", impl, str(pairs)],
                capture_output=True,
                text=True,
                check=True,
            )
            got[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
        n = got["kvroute"]["pairs"]
        rows.append(
            {
                "size": size,
                "pairs": n,
                "distinct_blocks": got["kvroute"]["distinct_blocks"],
                "nodes": got["kvroute"]["nodes"],
                "kvroute_bytes_per_pair": got["kvroute"]["rss_growth"] / n,
                "kvroute_memory_bytes_per_pair": got["kvroute"]["memory_bytes"] / n,
                "dynamo_bytes_per_pair": got["dynamo"]["rss_growth"] / n,
            }
        )
    return rows


def format_memory(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        ratio = r["kvroute_bytes_per_pair"] / r["dynamo_bytes_per_pair"]
        lines.append(
            f"index memory {r['size']} ({r['pairs']:,} pairs, {r['distinct_blocks']:,} blocks, "
            f"{r['nodes']:,} nodes): kvroute {r['kvroute_bytes_per_pair']:.1f} B/pair RSS "
            f"(memory_bytes {r['kvroute_memory_bytes_per_pair']:.1f}), dynamo "
            f"{r['dynamo_bytes_per_pair']:.1f} B/pair RSS -> kvroute/dynamo = {ratio:.3f}"
        )
    return "\n".join(lines)


def test_memory_per_pair(capsys):
    pytest.importorskip("dynamo.llm")
    rows = measure_memory()
    with capsys.disabled():
        print("\n" + format_memory(rows))
    for r in rows:
        # memory_bytes() is an account of the heap; RSS growth must not dwarf it.
        assert r["kvroute_memory_bytes_per_pair"] > 0.5 * r["kvroute_bytes_per_pair"]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--memory-child":
        print(json.dumps(_memory_child(sys.argv[2], int(sys.argv[3]))))
    elif sys.argv[1:] == ["--memory"]:
        print(format_memory(measure_memory()))
    else:
        sys.exit("usage: bench_index.py --memory")
