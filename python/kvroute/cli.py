"""The ``kvroute`` command line."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Sequence

from . import HashRing, JumpHash, Maglev, Rendezvous

HASHERS: dict[str, Callable[[list[str]], object]] = {
    "ring (ketama)": lambda fleet: HashRing(fleet),
    "ring (xxh3)": lambda fleet: HashRing(fleet, hash="xxh3"),
    "maglev": lambda fleet: Maglev(fleet),
    "rendezvous": lambda fleet: Rendezvous(fleet),
    "jump (memento)": lambda fleet: JumpHash(fleet),
}


def _moves(before: list[str], after: list[str]) -> tuple[int, Counter[tuple[str, str]]]:
    moved = Counter((b, a) for b, a in zip(before, after) if b != a)
    return sum(moved.values()), moved


def _describe(moved: Counter[tuple[str, str]], changed: str, leaving: bool, keys: int) -> str:
    """Where the moved keys went: from/to the changed worker, how evenly, and any strays."""
    if not moved:
        return "-"
    total = sum(moved.values())
    own = sum(c for (src, dst), c in moved.items() if (src if leaving else dst) == changed)
    peers = Counter()
    for (src, dst), c in moved.items():
        if (src if leaving else dst) == changed:
            peers[dst if leaving else src] += c
    text = (
        f"{'to' if leaving else 'from'} {len(peers)} workers, "
        f"the busiest {max(peers.values()) / own:.0%} (even: {1 / len(peers):.0%})"
        if peers
        else ""
    )
    if own < total:
        text += f"; plus {total - own} keys ({(total - own) / keys:.1%}) between other workers"
    return text


def _sticky(args: argparse.Namespace) -> int:
    """Show that endpoint IDs stick to workers, and how few move when the fleet changes."""
    fleet = [f"worker-{i}" for i in range(args.workers)]
    endpoints = [f"ep-{i:05d}" for i in range(args.endpoints)]
    leaver = fleet[args.workers // 3]
    joiner = f"worker-{args.workers}"
    n = len(fleet)
    print(f"Sticky routing of {len(endpoints):,} endpoint IDs over {n} workers.\n")

    shown = endpoints[: args.show]
    width = max(len(name) for name in HASHERS)
    print(f"{'':{width}}  " + "  ".join(f"{e:>9}" for e in shown))
    placements: dict[str, list[str]] = {}
    hashers = {}
    for name, make in HASHERS.items():
        h = make(fleet)
        hashers[name] = h
        placements[name] = h.get_many(endpoints)
        print(f"{name:{width}}  " + "  ".join(f"{p:>9}" for p in placements[name][: len(shown)]))

    key = endpoints[0]
    print(f"\nFailover order of {key} (preference): where it goes if its worker fails")
    for name, h in hashers.items():
        print(f"  {name:{width}}  " + " -> ".join(h.preference(key, 3)))

    print(f"\n{leaver} leaves ({n} -> {n - 1} workers). Ideal: only its keys, 1/{n} = {1 / n:.1%}")
    for name, h in hashers.items():
        h.remove(leaver)
        after = h.get_many(endpoints)
        count, moved = _moves(placements[name], after)
        print(
            f"  {name:{width}}  moved {count / len(endpoints):6.1%}  "
            f"{_describe(moved, leaver, leaving=True, keys=len(endpoints))}"
        )
        h.add(leaver)
        restored = h.get_many(endpoints)
        if restored != placements[name]:
            print(f"  {name:{width}}  (re-adding {leaver} did not restore every placement)")

    print(f"\n{joiner} joins ({n} -> {n + 1} workers). Ideal: 1/{n + 1} = {1 / (n + 1):.1%}, to it")
    for name, h in hashers.items():
        h.add(joiner)
        count, moved = _moves(placements[name], h.get_many(endpoints))
        print(
            f"  {name:{width}}  moved {count / len(endpoints):6.1%}  "
            f"{_describe(moved, joiner, leaving=False, keys=len(endpoints))}"
        )

    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sticky = sub.add_parser("sticky", help="show sticky routing of endpoint IDs over a fleet")
    sticky.add_argument("--workers", type=int, default=8)
    sticky.add_argument("--endpoints", type=int, default=20_000)
    sticky.add_argument("--show", type=int, default=5, help="endpoint placements to print")
    sticky.set_defaults(func=_sticky)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
