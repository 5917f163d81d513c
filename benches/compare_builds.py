"""Two or more builds of ``kvroute._core`` compared in one process, beside the ``uhashring`` peer.

Usage: ``python benches/compare_builds.py NAME=path/to/_core.so NAME=...`` (e.g. an abi3 build
and a version-specific one: ``maturin build --features pyo3/abi3-py310`` and without). Each
build's module is loaded side by side; every round calls ``HashRing.get_many`` on 100k str keys
and ``get`` 20,000 times with each build in turn, and the ``uhashring`` loop of bench_hashing.py
every third round, so that load on a shared machine falls on all alike. Prints the median (and
minimum) CPU time per key and the ratio to the peer of the same rounds. ``--shuffle`` shuffles
the keys first: their string objects then lie scattered in memory. Then ``jump_hash`` per call
(1,024 and 100,000 buckets) with each build and the C ``jump.hash`` in turn, 15 rounds.
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
import time

import jump
import uhashring

N_KEYS = 100_000
ROUNDS = 30
KEY = "endpoint-12345"


def load(path: str):
    spec = importlib.util.spec_from_file_location("kvroute._core", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_per(fn, n: int) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) / n


def repeat(get, n: int):
    """``n`` calls ``get(KEY)`` in a list comprehension, the same form for every build and the
    peer (a plain ``for`` loop costs ~5 ns more per call)."""

    def run() -> None:
        [get(KEY) for _ in range(n)]

    return run


def main(argv: list[str]) -> None:
    shuffle = "--shuffle" in argv
    builds = {name: load(path) for name, path in (a.split("=", 1) for a in argv if "=" in a)}
    keys = [f"session-{i * 7919}" for i in range(N_KEYS)]
    if shuffle:
        random.Random(1).shuffle(keys)
    for n_nodes in (64, 1024):
        fleet = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(n_nodes)]
        get_node = uhashring.HashRing(fleet, hash_fn="ketama").get_node
        rings = {name: m.HashRing(fleet) for name, m in builds.items()}
        expected = [get_node(k) for k in keys[:3000]]
        for name, ring in rings.items():
            assert ring.get_many(keys[:3000]) == expected, name
        many: dict[str, list[float]] = {name: [] for name in [*rings, "uhashring"]}
        one: dict[str, list[float]] = {name: [] for name in [*rings, "uhashring"]}
        for r in range(ROUNDS):
            for name, ring in rings.items():
                for _ in range(3):
                    many[name].append(cpu_per(lambda ring=ring: ring.get_many(keys), N_KEYS))
                one[name].append(cpu_per(repeat(ring.get, 20_000), 20_000))
            if r % 3 == 0:
                many["uhashring"].append(cpu_per(lambda g=get_node: [g(k) for k in keys], N_KEYS))
            one["uhashring"].append(cpu_per(repeat(get_node, 5000), 5000))
        peer_many = statistics.median(many["uhashring"])
        peer_one = statistics.median(one["uhashring"])
        print(
            f"{n_nodes} nodes{' (shuffled keys)' if shuffle else ''}: uhashring loop "
            f"{peer_many * 1e9:.0f} ns per key, get_node {peer_one * 1e9:.0f} ns"
        )
        for name in rings:
            m, s = statistics.median(many[name]), statistics.median(one[name])
            print(
                f"  {name:>10}: get_many {m * 1e9:6.1f} ns per key"
                f" (min {min(many[name]) * 1e9:6.1f}) {peer_many / m:6.1f}x"
                f" | get {s * 1e9:6.1f} ns {peer_one / s:5.1f}x"
            )
    jump_calls(builds)


def jump_calls(builds: dict) -> None:
    """``jump_hash(key, n)`` per call with each build and the C peer, interleaved."""
    key, calls = 0xDEADBEEF, 100_000
    for n in (1024, 100_000):
        per = {name: [] for name in [*builds, "jump.hash"]}
        for _ in range(15):
            for name, m in builds.items():
                per[name].append(
                    cpu_per(lambda f=m.jump_hash, n=n: [f(key, n) for _ in range(calls)], calls)
                )
            per["jump.hash"].append(
                cpu_per(lambda n=n: [jump.hash(key, n) for _ in range(calls)], calls)
            )
        peer = statistics.median(per["jump.hash"])
        print(f"jump_hash, {n:,} buckets: jump.hash (C) {peer * 1e9:.1f} ns per call")
        for name in builds:
            m = statistics.median(per[name])
            print(f"  {name:>10}: {m * 1e9:6.1f} ns {peer / m:5.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
