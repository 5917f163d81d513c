"""What one ``HashRing.get`` call is made of, beside calls that do less, in one process.

Usage: ``python benches/ring_get_floor.py [NAME=path/to/_core.so ...]`` (default: the installed
``kvroute._core``). Times, as CPU time per call of a plain ``for`` loop (the median of 7 loops of
200,000 calls; the peer 20,000): the empty loop, ``dict.get`` (a C method of one argument), the
hasher's ``len`` (PyO3's slot and the read lock), ``get`` on an XXH3 ring (the call, the key, the
lock, the lookup, the cached name) and on a ketama ring (the same plus one scalar MD5), and
``uhashring``'s ``get_node``, with the ratio of each ``get`` to it. The difference between the two
rings' ``get`` is the MD5 of the key (with its padding).
"""

from __future__ import annotations

import statistics
import sys
import time

import uhashring
from compare_builds import KEY, load

N_CALLS = 200_000
LOOPS = 7


def per_call(fn, arg, n: int) -> float:
    """Median CPU time per call of ``LOOPS`` loops of ``n`` calls ``fn(arg)`` (no call: ``fn``
    None)."""

    def run() -> float:
        start = time.process_time()
        if fn is None:
            for _ in range(n):
                pass
        else:
            for _ in range(n):
                fn(arg)
        return (time.process_time() - start) / n

    return statistics.median(run() for _ in range(LOOPS))


def main(argv: list[str]) -> None:
    paths = [a.split("=", 1) for a in argv if "=" in a]
    if paths:
        builds = {name: load(path) for name, path in paths}
    else:
        import kvroute

        builds = {"installed": kvroute}
    fleet = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(64)]
    peer = uhashring.HashRing(fleet, hash_fn="ketama").get_node
    print(f"64 nodes, key {KEY!r}, CPU time per call (median of {LOOPS} loops)")
    rows = [("empty loop", per_call(None, None, N_CALLS))]
    rows.append(("dict.get", per_call({KEY: 1}.get, KEY, N_CALLS)))
    for name, module in builds.items():
        ketama, xxh3 = module.HashRing(fleet), module.HashRing(fleet, hash="xxh3")
        assert ketama.get(KEY) == peer(KEY)
        rows.append((f"{name} len", per_call(len, ketama, N_CALLS)))
        rows.append((f"{name} get xxh3", per_call(xxh3.get, KEY, N_CALLS)))
        rows.append((f"{name} get ketama", per_call(ketama.get, KEY, N_CALLS)))
    slow = per_call(peer, KEY, N_CALLS // 10)
    rows.append(("uhashring get_node", slow))
    for label, t in rows:
        ratio = f"  {slow / t:5.1f}x get_node" if " get " in label else ""
        print(f"  {label:<22} {t * 1e9:7.1f} ns{ratio}")


if __name__ == "__main__":
    main(sys.argv[1:])
