"""Up-front checks of ``kvroute simulate``'s options (called by :mod:`kvroute.cli` before any
workload is built or simulated).

Every check raises ``ValueError`` naming the option and the value it was given; the command
prints it as ``kvroute simulate: ...`` and exits with status 2. Output files (``--json``,
``--plot``, ``--decisions``, ``--export-trace``) are checked before the run: their directory must
exist and be writable, and a plot's suffix must be a format matplotlib writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["SEED_LIMIT", "check_output", "check_outputs", "check_plot", "check_seed"]

#: Seeds are unsigned 64-bit integers (the router's and the workloads' generators).
SEED_LIMIT = 1 << 64


def check_seed(seed: int, option: str = "--seed") -> int:
    """``seed`` if ``0 <= seed < 2**64``, else ``ValueError`` naming ``option``."""
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{option} must be in [0, 2**64), got {seed}")
    return seed


def check_output(path: str, option: str) -> None:
    """``ValueError`` naming ``option`` unless ``path`` can be written: not a directory, in an
    existing, writable directory."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {path}: is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{option} {path}: not writable")


def check_plot(path: str, option: str = "--plot") -> None:
    """:func:`check_output`, and ``path``'s suffix must be a format matplotlib writes
    (``ImportError`` naming the ``sim`` extra when matplotlib is not installed)."""
    check_output(path, option)
    from .report import pyplot

    plt: Any = pyplot()
    formats = sorted(plt.figure().canvas.get_supported_filetypes())
    plt.close("all")
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        raise ValueError(
            f"{option} {path}: {'suffix .' + suffix if suffix else 'no suffix'} is not an image "
            f"format matplotlib writes ({', '.join(formats)})"
        )


def check_outputs(args: Any) -> None:
    """The checks every mode of ``kvroute simulate`` shares: ``--seed`` and the output files."""
    check_seed(args.seed)
    for option in ("--json", "--decisions", "--export-trace"):
        path = getattr(args, option[2:].replace("-", "_"))
        if path:
            check_output(path, option)
    if args.plot:
        check_plot(args.plot)
