"""`make mutants`: mutation testing of the core and of the Python modules users rely on.

Rust — cargo-mutants on ``rust/src/{hashing,blocks,index,cache,router,events}``, each mutant
tested by ``cargo test --no-default-features`` (the core's own tests: a Rust mutant only Python
tests catch is a missing Rust test). Python — mutmut on ``events.py``, the gateway's auth,
forwarding and failover (``gateway/auth.py``, ``gateway/upstream.py``, the forwarding functions
of ``gateway/app.py``, ``server/health.py``) and ``sim/engine.py``, each group with the test
files that exercise it.

A full run takes hours on a 2-core machine, so the default is what a change needs: only the
mutants in lines changed since ``--diff`` (default ``main``; Python: the changed files). Name
modules to run them whole (``--only hashing,py-events``); ``--shard K/N`` runs every N-th mutant
of each Rust module from the K-th (round-robin): shard 1/N is an unbiased sample, and shards 1..N
together are the whole set. Every run is niced, one job at a time by default (``--jobs``), and
writes under ``target/mutants/<module>/``; the score table goes to ``target/mutants/summary.md``.

Score per module: caught ÷ (caught + missed − accepted equivalents); timeouts count as caught,
unviable mutants (that do not build) as nothing. Accepted equivalent mutants — ones no test can
observe — are listed with the reason in ``docs/mutants.md``; a surviving mutant not listed there
is a missing test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "target" / "mutants"
EQUIVALENTS = ROOT / "docs" / "mutants.md"

RUST = ["hashing", "blocks", "index", "cache", "router", "events"]

# name -> (files mutated, test files run, mutants run: mutmut name globs, empty = all). mutmut
# runs, for each mutant, only the listed tests that call the mutated function.
PYTHON: dict[str, tuple[list[str], list[str], list[str]]] = {
    "py-events": (
        ["python/kvroute/events.py"],
        ["tests/test_events_replay.py", "tests/test_events_subscriber.py"],
        [],
    ),
    "py-gateway-auth": (
        ["python/kvroute/gateway/auth.py"],
        # The reference model (seconds) and the end-to-end keys test; test_gateway.py would run
        # its ~40 server tests for every mutant of a function every request calls.
        [
            "tests/test_gateway_access.py",
            "tests/test_gateway_auth.py",
            "tests/test_gateway_config.py",
        ],
        [],
    ),
    # Failover: which workers are in (ejection, readmission, suspicion probes), against the
    # reference model of tests/test_server_health.py.
    "py-server-health": (
        ["python/kvroute/server/health.py"],
        ["tests/test_server_health.py"],
        [],
    ),
    # Forwarding: one attempt's load accounting (begin / prefilled / observe / finish exactly
    # once, the in-flight bound).
    "py-gateway-upstream": (
        ["python/kvroute/gateway/upstream.py"],
        [
            "tests/test_gateway_flight.py",  # the reference model: seconds
            "tests/test_gateway_faults.py",
            "tests/test_gateway_usage.py",
            "tests/test_gateway_limits.py",
        ],
        [],
    ),
    # Forwarding and failover in the gateway: the choice among untried workers, retries, the
    # give-up answer, and charging failures to workers. Only these functions: the rest of app.py
    # (request parsing, admin routes) runs in every request of ~40 server tests per mutant.
    "py-gateway-failover": (
        ["python/kvroute/gateway/app.py"],
        ["tests/test_gateway_faults.py", "tests/test_gateway_limits.py", "tests/test_gateway.py"],
        [
            f"kvroute.gateway.app.xǁGatewayǁ{f}__mutmut_*"
            for f in ("_choose", "_failed", "_settle", "_forward", "_give_up", "_attempt")
        ],
    ),
    "py-sim-engine": (
        ["python/kvroute/sim/engine.py"],
        ["tests/test_sim_engine.py", "tests/test_sim_policies.py", "tests/test_sim_oracles.py"],
        [],
    ),
}


@dataclass
class Score:
    module: str
    caught: int = 0
    missed: list[str] = field(default_factory=list)
    timeout: int = 0
    unviable: int = 0
    equivalent: list[str] = field(default_factory=list)

    @property
    def killed(self) -> int:
        return self.caught + self.timeout

    @property
    def judged(self) -> int:
        return self.killed + len(self.missed)

    def row(self) -> str:
        score = f"{100 * self.killed / self.judged:.1f}%" if self.judged else "-"
        return (
            f"| {self.module} | {self.judged + len(self.equivalent) + self.unviable} | "
            f"{self.caught} | {self.timeout} | {len(self.missed)} | {len(self.equivalent)} | "
            f"{self.unviable} | {score} |"
        )


def accepted() -> dict[str, set[str]]:
    """``{module: {mutant id}}`` from the table rows of docs/mutants.md."""
    out: dict[str, set[str]] = {}
    if not EQUIVALENTS.exists():
        return out
    for line in EQUIVALENTS.read_text().splitlines():
        m = re.match(r"^\|\s*([\w/-]+)\s*\|\s*`([^`]+)`\s*\|", line)
        if m and m.group(1) != "module":  # a | inside a table cell is written \|
            out.setdefault(m.group(1), set()).add(m.group(2).replace("\\|", "|").strip())
    return out


# What one Rust mutant costs: an incremental rebuild of the crate in Cargo.toml's `mutants`
# profile (opt-level 1: the tests run ~7x faster than at 0) and only the lib's unit tests (the
# crate has no integration tests and no doctests; `--lib` skips building the cdylib/rlib and
# running rustdoc for nothing). Tests that exceed a minute count as a timeout (caught): a loaded
# machine can slow the ~5 s suite a lot, so the timeout is not scaled down from the baseline.
RUST_COST = [
    "--profile",
    "mutants",
    "--cargo-test-arg=--lib",
    "--minimum-test-timeout",
    "60",
    "--timeout-multiplier",
    "3",
]


def rust_id(line: str) -> str:
    """``file: description`` of a cargo-mutants line, without its line and column (they move)."""
    return re.sub(r"^([^:]+):\d+:\d+:\s*", r"\1: ", line.strip())


def niced(cmd: list[str]) -> list[str]:
    return ["nice", "-n", "10", *cmd]


def git(*args: str) -> str:
    """The output of ``git ARGS`` in the repository (raises if git fails)."""
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def changed_files(diff: str) -> list[str]:
    """Files changed since ``diff`` (committed or not)."""
    out = git("diff", "--name-only", f"{diff}...HEAD").split()
    dirty = git("diff", "--name-only", "HEAD").split()
    return sorted(set(out) | set(dirty))


def run_rust(module: str, args: argparse.Namespace, equivalents: set[str]) -> Score:
    out = OUT / f"rust-{module}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        "cargo",
        "mutants",
        "--no-default-features",
        "--file",
        f"rust/src/{module}/**/*.rs",
        "--exclude",
        "**/tests*.rs",
        "--jobs",
        str(args.jobs),
        "--output",
        str(out),
        *RUST_COST,
        "--no-shuffle",
    ]
    if args.shard:
        # round-robin: shard K/N is every N-th mutant from the K-th, an unbiased sample of the
        # module (cargo-mutants' default, "slice", would be one consecutive run of files).
        cmd += ["--shard", args.shard, "--sharding", "round-robin"]
    if args.diff:
        patch = out / "changes.diff"
        diff = git("diff", f"{args.diff}...HEAD", "--", f"rust/src/{module}")
        if not diff.strip():
            print(f"{module}: no change since {args.diff}")
            return Score(f"rust/{module}")
        patch.write_text(diff)
        cmd += ["--in-diff", str(patch)]
    print("+", " ".join(cmd), flush=True)
    # One build directory for every module's run: the dependencies are built once, not once per
    # cargo-mutants invocation (each builds in a fresh copy of the tree).
    env = dict(os.environ, CARGO_TARGET_DIR=str(OUT / "build"))
    subprocess.run(niced(cmd), cwd=ROOT, env=env, check=False)
    return rust_score(module, out / "mutants.out", equivalents)


def rust_score(module: str, results: Path, equivalents: set[str]) -> Score:
    score = Score(f"rust/{module}")

    def lines(name: str) -> list[str]:
        path = results / name
        return [x for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    score.caught = len(lines("caught.txt"))
    score.timeout = len(lines("timeout.txt"))
    score.unviable = len(lines("unviable.txt"))
    for line in lines("missed.txt"):
        ident = rust_id(line)
        (score.equivalent if ident in equivalents else score.missed).append(ident)
    return score


def run_python(group: str, args: argparse.Namespace, equivalents: set[str]) -> Score:
    files, tests, names = PYTHON[group]
    work = OUT / group
    if work.exists() and args.fresh:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    # mutmut names mutants after modules under ./, src/ or source/: the package dir is src/.
    for name, target in (("src", "python"), ("tests", "tests")):
        link = work / name
        if not link.exists():
            link.symlink_to(ROOT / target)
    mutated = [f.replace("python/", "src/", 1) for f in files]
    lines = [
        "[tool.mutmut]",
        'source_paths = ["src"]',
        f"only_mutate = {json.dumps(mutated)}",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q"]',
        "use_git_change_detection = false",
    ]
    pyproject = (ROOT / "pyproject.toml").read_text()  # the project's pytest settings
    (work / "pyproject.toml").write_text(pyproject + "\n" + "\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs), *names]
    print(f"+ (cd {work.relative_to(ROOT)}) " + " ".join(cmd[1:]), flush=True)
    subprocess.run(niced(cmd), cwd=work, env=env, check=False)
    results = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    (work / "results.txt").write_text(results)
    return python_score(group, results, equivalents)


def python_score(group: str, results: str, equivalents: set[str]) -> Score:
    score = Score(group)
    for line in results.splitlines():
        m = re.match(r"^\s*(\S+):\s*(\w[\w ]*)$", line)
        if not m:
            continue
        name, status = m.group(1), m.group(2).strip()
        if status == "killed":
            score.caught += 1
        elif status == "timeout":
            score.timeout += 1
        elif status in ("survived", "no tests"):
            (score.equivalent if name in equivalents else score.missed).append(f"{name} ({status})")
        elif status in ("suspicious", "segfault"):
            score.timeout += 1
        elif status != "not checked":  # not run (yet): not counted at all
            score.unviable += 1  # "skipped", "caught by type check": not judged
    return score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated modules run whole: " + ",".join(RUST + list(PYTHON)),
    )
    parser.add_argument(
        "--diff",
        default="main",
        help="only mutants in what changed since this git ref (default main; '' = whole)",
    )
    parser.add_argument("--shard", default="", help="K/N: one shard of each Rust module")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="forget earlier mutmut results")
    args = parser.parse_args(argv)
    chosen = [m for m in args.only.split(",") if m] or RUST + list(PYTHON)
    unknown = sorted(set(chosen) - set(RUST) - set(PYTHON))
    if unknown:
        parser.error(f"unknown modules {unknown}")
    if args.only:
        args.diff = ""
    changed = changed_files(args.diff) if args.diff else None
    equivalents = accepted()
    scores = []
    for module in chosen:
        if module in RUST:
            if changed is not None and not any(
                f.startswith(f"rust/src/{module}/") for f in changed
            ):
                continue
            scores.append(run_rust(module, args, equivalents.get(f"rust/{module}", set())))
        else:
            if changed is not None and not set(PYTHON[module][0]) & set(changed):
                continue
            scores.append(run_python(module, args, equivalents.get(module, set())))
    header = (
        "| module | mutants | caught | timeout | missed | equivalent | unviable | score |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    table = "\n".join([header, *(s.row() for s in scores)])
    missed = "\n".join(f"- {s.module}: {m}" for s in scores for m in s.missed)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.md").write_text(table + "\n\nMissed:\n" + (missed or "none") + "\n")
    print(table)
    if missed:
        print("\nMissed (a test is missing, or an equivalent for docs/mutants.md):")
        print(textwrap.indent(missed, "  "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
