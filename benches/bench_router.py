"""Router.route on a 32,768-token prompt against Dynamo's compute_block_hash_for_seq alone.

Workload: 64 workers, a prefix index holding ~1e6 (worker, block) pairs (each worker holds 8
conversations of 2,048 blocks of 16 tokens sharing a system prompt), and a prompt of 32,768
NumPy int32 tokens that shares its first 1,024 blocks with what three workers hold. kvroute's
timed call is the whole decision — hashing the tokens, one index walk, scoring 64 workers,
picking — in events mode (the index is read only) and in approx mode (the prompt is also
recorded on the chosen worker's modelled cache). Dynamo's timed call only hashes the same tokens
(`compute_block_hash_for_seq(tokens, 16)`), the first step of its own routing. Also: route with
`block_hashes` given, and the begin + finish pair (of a 4-block decision, and of a 2,048-block one
in events mode, where begin records the prompt among the worker's in-flight blocks).

p50/p99 of single decisions are printed from perf_counter_ns timings (besides pytest-benchmark's
table): run pinned, e.g. `taskset -c 1 .venv/bin/python -m pytest benches/bench_router.py -s`.
"""

from __future__ import annotations

import time

import kvroute
import numpy as np
import pytest

dynamo_llm = pytest.importorskip("dynamo.llm")
compute_block_hash_for_seq = dynamo_llm.compute_block_hash_for_seq

N_TOKENS = 32_768
BLOCK = 16
WORKERS = [f"w{i:02d}" for i in range(64)]
CONVERSATIONS = 8  # per worker, 2,048 blocks each -> 64 * 8 * 2048 ~ 1.05e6 pairs
GROUP = f"route {N_TOKENS} int32 tokens, 64 workers, ~1e6 indexed pairs"


def _tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128_000, size=N_TOKENS, dtype=np.int32)


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    system = _tokens(1)[: N_TOKENS // 2]
    return np.concatenate([system, _tokens(2)[: N_TOKENS // 2]])


def _fill(router: kvroute.Router, prompt: np.ndarray) -> None:
    hasher = kvroute.BlockHasher(BLOCK)
    system = prompt[: N_TOKENS // 2]
    for i, w in enumerate(WORKERS):
        for c in range(CONVERSATIONS):
            if i < 3 and c == 0:
                tokens = np.concatenate([system, _tokens(1000 + i)[: N_TOKENS // 2]])
            else:
                tokens = _tokens(10_000 + i * CONVERSATIONS + c)
            if router.mode == "events":
                router.index.store(w, hasher.hash(tokens))
            else:
                router.route(tokens, exclude=[x for x in WORKERS if x != w], now=0.0)


@pytest.fixture(scope="module")
def events_router(prompt) -> kvroute.Router:
    r = kvroute.Router(WORKERS, index="events", block_size=BLOCK)
    _fill(r, prompt)
    return r


@pytest.fixture(scope="module")
def approx_router(prompt) -> kvroute.Router:
    r = kvroute.Router(WORKERS, block_size=BLOCK, capacity_blocks=CONVERSATIONS * 2048 + 4096)
    _fill(r, prompt)
    return r


def _pairs(r: kvroute.Router) -> int:
    return sum(r.index.num_blocks(w) for w in WORKERS)


def _percentiles(fn, *args, n: int = 300) -> tuple[float, float]:
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn(*args)
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    return times[n // 2] / 1e3, times[int(n * 0.99)] / 1e3


def _report(label: str, fn, *args) -> None:
    p50, p99 = _percentiles(fn, *args)
    print(f"\n{label}: p50 {p50:,.1f} us, p99 {p99:,.1f} us")


@pytest.mark.parametrize("mode", ["events", "approx"])
def test_route_tokens(benchmark, request, prompt, mode):
    r = request.getfixturevalue(f"{mode}_router")
    assert _pairs(r) >= 1_000_000 if mode == "events" else _pairs(r) >= 900_000
    benchmark.group = GROUP
    benchmark.extra_info.update(impl="kvroute", ops=1, mode=mode)
    d = benchmark(lambda: r.route(prompt, now=1.0))
    # Cross-check: the decision goes to a worker holding the shared system prompt (1,024 blocks)
    # — in approx mode, to the one the prompt was recorded on, which holds all of it.
    assert d.prompt_blocks == N_TOKENS // BLOCK
    assert d.cached_blocks >= 1024
    expected = kvroute.BlockHasher(BLOCK).hash(prompt)
    assert r.index.match(expected)[d.worker] == d.cached_blocks or mode == "approx"
    _report(f"kvroute route(tokens) {mode}", r.route, prompt)


def test_dynamo_hash_only(benchmark, prompt):
    benchmark.group = GROUP
    benchmark.extra_info.update(impl="dynamo compute_block_hash_for_seq", ops=1)
    out = benchmark(compute_block_hash_for_seq, prompt, BLOCK)
    assert len(out) == N_TOKENS // BLOCK
    _report("dynamo compute_block_hash_for_seq", compute_block_hash_for_seq, prompt, BLOCK)


def test_route_block_hashes(benchmark, events_router, prompt):
    hashes = kvroute.BlockHasher(BLOCK).hash(prompt)
    benchmark.group = "route 2048 given block hashes, 64 workers, ~1e6 indexed pairs"
    benchmark.extra_info.update(impl="kvroute", ops=1)
    d = benchmark(lambda: events_router.route(block_hashes=hashes, now=1.0))
    assert d.cached_blocks >= 1024
    _report("kvroute route(block_hashes)", lambda: events_router.route(block_hashes=hashes))


def _begin_finish(benchmark, router, hashes, group: str, rounds: int) -> float:
    """Times begin + finish of decisions for ``hashes`` (routed untimed); returns the p50 in us."""
    pending = []

    def one() -> None:
        pending.append(router.route(block_hashes=hashes, now=1.0))

    def pair() -> None:
        x = pending.pop()
        router.begin(x)
        router.finish(x, now=1.0)

    benchmark.group = group
    benchmark.extra_info.update(impl="kvroute", ops=1)
    benchmark.pedantic(pair, setup=one, rounds=rounds, iterations=1)
    times = []
    for _ in range(rounds):
        one()
        t0 = time.perf_counter_ns()
        pair()
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    p50, p99 = times[rounds // 2] / 1e3, times[rounds * 99 // 100] / 1e3
    print(f"\nkvroute {group}: p50 {p50:,.2f} us, p99 {p99:,.2f} us")
    assert not pending and all(router.load(w)["active"] == 0 for w in WORKERS)
    return p50


def test_begin_finish(benchmark, events_router):
    small = np.arange(1, 5, dtype=np.uint64)
    _begin_finish(
        benchmark, events_router, small, "begin + finish of one decision (64 workers)", 2000
    )


def test_begin_finish_long_prompt(benchmark, prompt):
    # A 2,048-block prompt's whole lifecycle after routing: in events mode begin records its
    # blocks in flight on the worker (and finish releases them), so a later request with the
    # same prefix is credited before the engine's events arrive.
    r = kvroute.Router(WORKERS, index="events", block_size=BLOCK)
    hashes = kvroute.BlockHasher(BLOCK).hash(prompt)
    group = "begin + finish of one 2,048-block decision (64 workers, events)"
    _begin_finish(benchmark, r, hashes, group, 300)
    assert len(r.index) == 0  # events mode: only the engines' events store blocks there
