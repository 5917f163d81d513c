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
    if args.seed is not None:
        check_seed(args.seed)
    for option in ("--json", "--decisions", "--export-trace"):
        path = getattr(args, option[2:].replace("-", "_"))
        if path:
            check_output(path, option)
    if args.plot:
        check_plot(args.plot)


#: The dedicated endpoint's options (the endpoint scenario's tenant study only).
ENDPOINT_OPTIONS = ("--pool-size", "--priority", "--reserved-blocks", "--warm-interval")


def given(args: Any, *options: str) -> list[str]:
    """Those of ``options`` given on the command line (every optional one defaults to None)."""
    out = []
    for option in options:
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None and value is not False:
            out.append(option)
    return out


def _refuse(options: list[str], why: str) -> None:
    if options:
        raise ValueError(f"{', '.join(options)} {'does' if len(options) == 1 else 'do'} not {why}")


def check_modes(args: Any) -> None:
    """Refuses an option that does not apply to the mode ``args`` choose (``--pd``, ``--sweep``,
    ``--replicas`` or one run; a workload with a tenant or not), and counts below 1."""
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if args.policies is not None and not args.policies.strip(" ,"):
        raise ValueError(f"--policies lists no policy, got {args.policies!r}")
    if args.pool_size is not None and args.pool_size < 1:
        raise ValueError(f"--pool-size must be >= 1, got {args.pool_size}")
    if args.replica_scrape is not None and not 0 < args.replica_scrape < float("inf"):
        raise ValueError(
            f"--replica-scrape must be a finite number of seconds > 0, got {args.replica_scrape:g}"
        )
    if args.non_streamed is not None and not 0 <= args.non_streamed <= 1:
        raise ValueError(f"--non-streamed must be a share from 0 to 1, got {args.non_streamed:g}")
    if args.pd is not None or args.replicas is not None:
        _refuse(
            given(args, "--non-streamed"),
            "apply to --pd or --replicas (their requests are simulated as streamed)",
        )
    if args.pd is None:
        _refuse(given(args, "--pd-thresholds"), "apply without --pd")
    if args.replicas is None:
        _refuse(given(args, "--replica-sync", "--replica-scrape"), "apply without --replicas")
    if args.pd is not None:
        return  # cli._pd refuses what does not apply to it
    tenant = args.trace is None and args.scenario == "endpoint"
    if args.replicas is not None:
        _refuse(
            given(
                args,
                "--sweep",
                "--decisions",
                "--plot",
                "--explain",
                "--index",
                "--seeds",
                "--pressure",
                *ENDPOINT_OPTIONS,
            ),
            "apply to --replicas (one table of replica counts x sync settings, approx mode)",
        )
    if args.sweep is not None:
        _refuse(
            given(args, *ENDPOINT_OPTIONS),
            "apply to --sweep (it compares the policies; the tenant study is not shown)",
        )
    if not tenant:
        _refuse(
            given(args, *ENDPOINT_OPTIONS),
            "apply without a tenant: the dedicated endpoint is the endpoint scenario's (not "
            + ("--trace's" if args.trace is not None else f"--scenario {args.scenario}'s")
            + ")",
        )
