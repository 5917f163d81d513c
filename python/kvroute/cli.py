"""The ``kvroute`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import hash_key, jump_hash


def _sticky(args: argparse.Namespace) -> int:
    """Show that endpoint IDs stick to workers, and how few move when the fleet changes."""
    workers = [f"worker-{i}" for i in range(args.workers)]
    endpoints = [f"ep-{i:04d}" for i in range(args.endpoints)]

    def place(fleet: list[str]) -> dict[str, str]:
        return {e: fleet[jump_hash(hash_key(e), len(fleet))] for e in endpoints}

    before = place(workers)
    for e in endpoints[: args.show]:
        print(f"{e} -> {before[e]}")
    grown = place([*workers, f"worker-{args.workers}"])
    moved = sum(before[e] != grown[e] for e in endpoints)
    print(
        f"jump: a worker joins {args.workers}->{args.workers + 1}: "
        f"{moved}/{len(endpoints)} keys move ({moved / len(endpoints):.1%}, "
        f"ideal {1 / (args.workers + 1):.1%})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sticky = sub.add_parser("sticky", help="show sticky routing of endpoint IDs over a fleet")
    sticky.add_argument("--workers", type=int, default=8)
    sticky.add_argument("--endpoints", type=int, default=10_000)
    sticky.add_argument("--show", type=int, default=5, help="endpoint placements to print")
    sticky.set_defaults(func=_sticky)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
