"""What one key of ``HashRing.get_many`` (100k str keys) costs, beside batches that do less.

Usage: ``python benches/ring_many_floor.py [NODES]`` (default 64). CPU time per key, the median
of ``ROUNDS`` rounds, every workload once per round in turn (load on a shared machine falls on
all alike), the ``uhashring`` loop every third round:

- ``"".join(keys)``: reads every key's object and characters once and copies them — the memory
  traffic any batch over these keys pays, whatever it does with them;
- an XXH3 ring's ``get_many(as_index=True)``: the same key reading, a cheap hash, the lookup, and
  an array out (no ``str`` per key);
- the XXH3 ring's ``get_many``: plus the result list of names;
- the ketama ring's ``get_many(as_index=True)`` and ``get_many``: plus the MD5 of each key.

So ketama − XXH3 is the MD5 (in the CPU's widest vectors), ``get_many`` − ``as_index`` the list,
and the XXH3 array − the join the lookup and the hashing loop's own work. The last line is the
per-key budget that ``R``× the peer leaves (``R`` = 100).
"""

from __future__ import annotations

import statistics
import sys
import time

import kvroute
import uhashring

N_KEYS = 100_000
ROUNDS = 31
TARGET = 100


def cpu_per_key(fn) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) / N_KEYS


def main(argv: list[str]) -> None:
    n_nodes = int(argv[0]) if argv else 64
    keys = [f"session-{i * 7919}" for i in range(N_KEYS)]
    fleet = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(n_nodes)]
    get_node = uhashring.HashRing(fleet, hash_fn="ketama").get_node
    ketama = kvroute.HashRing(fleet)
    xxh3 = kvroute.HashRing(fleet, hash="xxh3")
    assert ketama.get_many(keys[:3000]) == [get_node(k) for k in keys[:3000]]
    work = {
        '"".join(keys)': lambda: "".join(keys),
        "xxh3 get_many(as_index=True)": lambda: xxh3.get_many(keys, as_index=True),
        "xxh3 get_many": lambda: xxh3.get_many(keys),
        "ketama get_many(as_index=True)": lambda: ketama.get_many(keys, as_index=True),
        "ketama get_many": lambda: ketama.get_many(keys),
    }
    times: dict[str, list[float]] = {name: [] for name in [*work, "uhashring loop"]}
    for r in range(ROUNDS):
        for name, fn in work.items():
            times[name].append(cpu_per_key(fn))
        if r % 3 == 0:
            times["uhashring loop"].append(cpu_per_key(lambda: [get_node(k) for k in keys]))
    peer = statistics.median(times["uhashring loop"])
    print(f"{n_nodes} nodes, {N_KEYS:,} str keys, CPU time per key (median of {ROUNDS} rounds):")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:>32}: {m * 1e9:7.1f} ns (min {min(ts) * 1e9:7.1f})  {peer / m:6.1f}x")
    print(f"  {TARGET}x the peer leaves {peer / TARGET * 1e9:.1f} ns per key")


if __name__ == "__main__":
    main(sys.argv[1:])
