"""`make mutants`: mutation testing of the core and of the Python modules users rely on.

Rust — cargo-mutants on ``rust/src/{hashing,blocks,index,cache,router,events}``, each mutant
tested by ``cargo test --no-default-features`` (the core's own tests: a Rust mutant only Python
tests catch is a missing Rust test). Python — mutmut on ``events.py``, the gateway's auth,
forwarding and failover (``gateway/auth.py``, ``gateway/upstream.py``, the forwarding functions
of ``gateway/app.py``, the prefill/decode handoff of ``gateway/pd.py``, ``server/health.py``,
the upstream client's pool in ``gateway/client.py`` and the first-event failure detection of
``gateway/stream.py``), the Responses API (``gateway/responses.py``, ``responses_api.py``,
``cluster/responses.py``) and ``sim/engine.py``, each group with the test files that exercise it.

A full run takes hours on a 2-core machine, so the default is what a change needs: only the
mutants in lines changed since ``--diff`` (default ``main``; Python: in the functions changed).
Name modules to run them whole (``--only hashing,py-events``), or only their changes with ``--diff``
too (``--only hashing --diff a0e9e96^``). ``--shard K/N`` runs every N-th mutant of each Rust
module from the K-th, ``--sample K/N`` the same for each Python group (round-robin, 0 <= K < N,
as cargo-mutants counts: mutant ``i`` is in ``i % N``): one is an unbiased sample, and 0..N-1
together are the whole set. Every run is niced, one job at a time by default (``--jobs``), and
writes under ``target/mutants/<module>/``; the score table goes to ``target/mutants/summary.md``
(a sample's score counts the sample's mutants only).

Every Python group's tests run under a wall-clock limit of ``TEST_TIMEOUT_S`` (300 s) a test —
its setup, call and teardown — through pytest-timeout (the ``mutants`` extra), passed in
mutmut's ``pytest_add_cli_args``, so the stats run, the clean run and every mutant run under
it: a mutant that hangs without using CPU (a request never given its head) fails its test then
and counts as caught — mutmut reports it ``killed`` (pytest's exit code 1) — as a cargo-mutants
timeout does for Rust. mutmut's own limits are CPU time, which such a hang never uses, and a
wall clock of 15× the summed durations of every test calling the mutated function, 11–21 min
for ``py-gateway-client``'s connection callbacks. A work directory made before the limit re-runs
every mutant once (mutmut forgets its results when ``pytest_add_cli_args`` changes).

Score per module: caught ÷ (caught + missed − accepted equivalents); timeouts count as caught,
unviable mutants (that do not build) as nothing. Accepted equivalent mutants — ones no test can
observe — are listed with the reason in ``docs/mutants.md``; a surviving mutant not listed there
is a missing test.
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import fnmatch
import importlib.util
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
        # _events_membership.py: the subscriber's workers joining and leaving while it runs;
        # _events_diagnostics.py: what it logs about hashes and block sizes it cannot use.
        [
            "python/kvroute/events.py",
            "python/kvroute/_events_membership.py",
            "python/kvroute/_events_diagnostics.py",
        ],
        [
            "tests/test_events_replay.py",
            "tests/test_events_subscriber.py",
            "tests/test_events_block_size.py",  # the engine's block size checked
            "tests/test_events_lifecycle.py",  # stop's timeout, a start failing part-way
            "tests/test_events_replay_socket.py",  # a replay DEALER ZMQ cannot make
            "tests/test_events_membership.py",  # add_worker / remove_worker, running or not
            "tests/test_epp_pool_events.py",  # an EPP pool's changes through a live engine
        ],
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
            "tests/test_gateway_nonstreamed.py",  # a predicted prefill through a real gateway
        ],
        [],
    ),
    # Forwarding and failover in the gateway: the choice among untried workers, retries, the
    # give-up answer, charging failures to workers, and one flight's send (``_send_to``, which a
    # pair's decode half passes its client usage through). Only these functions: the rest of app.py
    # (request parsing, admin routes) runs in every request of ~40 server tests per mutant.
    "py-gateway-failover": (
        ["python/kvroute/gateway/app.py"],
        [
            "tests/test_gateway_failover.py",  # every failure path: answer, log, counters
            "tests/test_gateway_faults.py",
            "tests/test_gateway_limits.py",
            "tests/test_gateway.py",
            "tests/test_gateway_usage.py",  # _attempt's cache usage fields on a whole reply
            "tests/test_gateway_nonstreamed.py",  # _attempt: a whole reply's predicted prefill
            "tests/test_gateway_pd_client.py",  # _attempt: a pair's usage shown to its client
        ],
        [
            f"kvroute.gateway.app.xǁGatewayǁ{f}__mutmut_*"
            for f in (
                "_choose",
                "_failed",
                "_settle",
                "_forward",
                "_give_up",
                "_attempt",
                "_send_to",
            )
        ],
    ),
    # Prefill/decode pairs: routing a pair among untried workers, sending each half (the vLLM
    # prefill-then-decode handoff, SGLang's bootstrap fields) and charging a failed half.
    "py-gateway-pd": (
        ["python/kvroute/gateway/pd.py"],
        [
            "tests/test_gateway_pd.py",
            "tests/test_gateway_pd_failover.py",
            "tests/test_gateway_pd_client.py",  # the client's usage; a client leaving mid-pair
        ],
        [
            *(
                f"kvroute.gateway.pd.xǁPdForwarderǁ{f}__mutmut_*"
                for f in (
                    "_choose",
                    "_send",
                    "_mark",
                    "_body",
                    "_refused",
                    "_read_prefill",
                    "_vllm",
                    "_sglang",
                    "_drain_prefill",
                )
            ),
            *(
                f"kvroute.gateway.pd.x_{f}__mutmut_*"
                for f in ("bootstrap_host", "_json_object", "_last_usage", "_cancel")
            ),
            # the usage a pair's client is shown: the decode's, with the prefill's cached tokens
            *(f"kvroute.gateway.pd.xǁPrefillUsageǁ{f}__mutmut_*" for f in ("__init__", "__call__")),
        ],
    ),
    # The upstream client's connection pool — which connection a request goes out on (reuse,
    # the resend on a fresh one when a reused one is lost unanswered), its timeouts and how a
    # failure is classified — and how a stream's first events tell a failure (an engine's
    # error event, an empty stream) from an answer. Only these functions: the rest of client.py
    # (parsing, body reading) runs in every request of every server test.
    "py-gateway-client": (
        ["python/kvroute/gateway/client.py", "python/kvroute/gateway/stream.py"],
        [
            "tests/test_gateway_client.py",  # the pool against real servers, by hand
            "tests/test_gateway_client_pool.py",  # timers in the test's loop; every failure whole
            "tests/test_gateway_client_flow.py",  # bytes on the wire, 1xx, a connection's life
            "tests/test_gateway_stream_failure.py",  # first_failure against a reference
            "tests/test_gateway_failover.py",  # every failure kind: answer, log, counters
            "tests/test_gateway_faults.py",
        ],
        [
            *(
                f"kvroute.gateway.client.xǁ_Connectionǁ{f}__mutmut_*"
                for f in (
                    "data_received",
                    "connection_lost",
                    "on_headers_complete",
                    "on_message_complete",
                    "_arm",
                    "_write_check",
                    "_read_expired",
                    "_fail",
                    "usable",
                    "close",
                )
            ),
            *(f"kvroute.gateway.client.xǁResponseǁ{f}__mutmut_*" for f in ("_failed", "close")),
            *(
                f"kvroute.gateway.client.xǁPoolǁ{f}__mutmut_*"
                for f in ("_release", "_lost", "_open", "_idle", "_acquire", "request", "_send")
            ),
            *(
                f"kvroute.gateway.stream.x_{f}__mutmut_*"
                for f in ("first_events", "first_failure", "failed_answer", "forwarded_headers")
            ),
        ],
    ),
    # Rate limits: the buckets against their reference model, and shared by replicas (the
    # two-replica reference, the wire format, real NATS).
    "py-limits": (
        [
            "python/kvroute/gateway/limits.py",
            "python/kvroute/cluster/limits.py",
            "python/kvroute/cluster/share.py",
        ],
        ["tests/test_gateway_limits.py", "tests/test_cluster_limits.py"],
        [],
    ),
    # The Responses API: the prompt vLLM renders (two oracles' vectors), follow-ups pinned to
    # the worker holding their response, the by-id routes, and the owners shared by replicas.
    "py-responses": (
        [
            "python/kvroute/gateway/responses.py",
            "python/kvroute/gateway/responses_api.py",
            "python/kvroute/cluster/responses.py",
        ],
        [
            "tests/test_gateway_responses.py",
            "tests/test_gateway_responses_edges.py",
            "tests/test_cluster_responses.py",
        ],
        [],
    ),
    # Keeping endpoints warm: what is learnt against its reference, the passes against the
    # upstream doubles' prefix caches.
    "py-warm": (
        [
            "python/kvroute/gateway/warm.py",
            "python/kvroute/server/warm.py",
            "python/kvroute/sim/warm.py",
        ],
        ["tests/test_gateway_warm.py", "tests/test_sim_warm.py"],
        [],
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


def changed_lines(patch: str) -> set[int]:
    """The new file's line numbers a unified diff (``-U0``) adds or changes; a deletion counts
    the lines on both sides of it."""
    lines: set[int] = set()
    for m in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", patch, re.M):
        start, count = int(m.group(1)), int(m.group(2) or 1)
        lines |= set(range(start, start + count)) if count else {start, start + 1}
    return lines


def functions_at(source: str, module: str, lines: set[int]) -> list[str]:
    """mutmut's name globs (``module.x_f__mutmut_*``, ``module.xǁClassǁm__mutmut_*``) of the
    top-level functions and methods (decorators included) that hold any of ``lines``: mutmut
    mutates only those, a nested function as part of its enclosing one."""
    out = []
    for node in ast.parse(source).body:
        found = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node, f"x_{node.name}"))
        elif isinstance(node, ast.ClassDef):
            found += [
                (f, f"xǁ{node.name}ǁ{f.name}")
                for f in node.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
        for f, name in found:
            first = min([f.lineno, *(d.lineno for d in f.decorator_list)])
            if lines & set(range(first, (f.end_lineno or f.lineno) + 1)):
                out.append(f"{module}.{name}__mutmut_*")
    return out


def changed_functions(files: list[str], diff: str) -> list[str]:
    """mutmut name globs of the functions of ``files`` changed since ``diff`` (committed or
    not)."""
    base = git("merge-base", diff, "HEAD").strip()
    out = []
    for f in files:
        path = ROOT / f
        if not path.exists():
            continue
        lines = changed_lines(git("diff", "-U0", base, "--", f))
        module = f.removeprefix("python/").removesuffix(".py").replace("/", ".")
        out += functions_at(path.read_text(), module, lines)
    return out


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


# The wall-clock limit on each test of a Python group (setup, call and teardown), in seconds.
# Measured at 53ccf8f on this 2-core machine at load 11-18, every group's stats and clean runs
# under it: the slowest test is the prefill/decode load test (`test_load_loses_and_duplicates_
# nothing`, 34 s in mutmut's stats run, 29 s clean); every other group's slowest is 4-9 s. ~9x
# that, so that a busier machine (a nice-19 run beside other sessions' builds) does not fail a
# test, while a mutant that hangs ends in 5 minutes. pytest-timeout's "thread" method: a timer
# thread dumps the stacks and ends the whole test process with exit code 1 (mutmut: killed),
# whatever the hung test is blocked in; "signal" raises in the main thread, which a hang in a C
# call, or a teardown that hangs again after it, would outlast.
TEST_TIMEOUT_S = 300


def pytest_args(timeout_s: int = TEST_TIMEOUT_S) -> list[str]:
    """mutmut's ``pytest_add_cli_args`` for a Python group: every run (the stats, the clean
    tests, each mutant) stops at its first failure, and a test that runs ``timeout_s`` seconds
    ends the process (pytest-timeout) and fails the run."""
    return [
        "-p",
        "no:cacheprovider",
        "-x",
        "-q",
        f"--timeout={timeout_s}",
        "--timeout-method=thread",
    ]


def mutmut_config(files: list[str], tests: list[str]) -> str:
    """The ``[tool.mutmut]`` table of a group's work directory: ``files`` mutated (paths under
    python/), ``tests`` run."""
    mutated = [f.replace("python/", "src/", 1) for f in files]
    lines = [
        "[tool.mutmut]",
        'source_paths = ["src"]',
        'also_copy = ["examples"]',
        f"only_mutate = {json.dumps(mutated)}",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        f"pytest_add_cli_args = {json.dumps(pytest_args())}",
        "use_git_change_detection = false",
    ]
    return "\n".join(lines) + "\n"


def require_pytest_timeout() -> None:
    """Refuses to run a Python group without pytest-timeout: mutmut would stop at its first
    pytest run (``--timeout`` unknown) with a message that does not say why."""
    if importlib.util.find_spec("pytest_timeout") is None:
        raise SystemExit(
            "tests/mutants/run.py: pytest-timeout is not installed (the `mutants` extra: "
            "`make mutants`, or `pip install -e '.[mutants]'`)"
        )


# Writes the mutants (mutants/ in the work directory, as `mutmut run` does first) without running
# any test, so that a sample can be drawn from their names. mutmut has no command for it: these
# are the first steps of mutmut 3's `run` (pyproject.toml pins mutmut < 4).
GENERATE = """
import os
from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
from mutmut.mutation.trampoline import set_mutant_under_test

set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir()
copy_also_copy_files()
setup_source_paths()
create_mutants(1)
"""


def mutmut_results(work: Path, env: dict[str, str]) -> str:
    """``mutmut results --all true``: one ``name: status`` line per mutant, in mutmut's order."""
    cmd = [sys.executable, "-m", "mutmut", "results", "--all", "true"]
    return subprocess.run(
        cmd, cwd=work, env=env, capture_output=True, text=True, check=False
    ).stdout


def statuses(results: str) -> dict[str, str]:
    """``{mutant: status}`` from ``mutmut results`` output (insertion order kept)."""
    out = {}
    for line in results.splitlines():
        m = re.match(r"^\s*(\S+):\s*(\w[\w ]*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def refresh_extensions(package: Path, copy: Path) -> None:
    """Replaces mutmut's copies (in ``copy``) of the package's native extensions that differ from
    the built ones. mutmut copies each file of src/ into mutants/ once and refreshes only the
    Python ones: an extension rebuilt since (``make build`` after a Rust change) would stay stale
    there, and every test reaching a changed binding would fail in the stats run."""
    for ext in package.glob("_core*.so"):
        stale = copy / ext.name
        if stale.exists() and not filecmp.cmp(ext, stale, shallow=False):
            shutil.copy2(ext, stale)


def run_python(
    group: str,
    args: argparse.Namespace,
    equivalents: set[str],
    functions: list[str] | None = None,
) -> Score:
    """Runs one group's mutants: all of them, or of ``functions`` (name globs) only, or sample
    ``args.sample`` of either."""
    require_pytest_timeout()
    files, tests, names = PYTHON[group]
    work = OUT / group
    if work.exists() and args.fresh:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    # mutmut names mutants after modules under ./, src/ or source/: the package dir is src/.
    # examples/: tests run the README's examples (mutmut copies tests/, and examples/ as asked).
    for name, target in (("src", "python"), ("tests", "tests"), ("examples", "examples")):
        link = work / name
        if not link.exists():
            link.symlink_to(ROOT / target)
    refresh_extensions(ROOT / "python" / "kvroute", work / "mutants" / "src" / "kvroute")
    pyproject = (ROOT / "pyproject.toml").read_text()  # the project's pytest settings
    (work / "pyproject.toml").write_text(pyproject + "\n" + mutmut_config(files, tests))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    chosen = None
    if args.sample or functions is not None:
        subprocess.run(niced([sys.executable, "-c", GENERATE]), cwd=work, env=env, check=True)
        known = statuses(mutmut_results(work, env))
        pool = [
            n
            for n in known
            if (not names or any(fnmatch.fnmatchcase(n, g) for g in names))
            and (functions is None or any(fnmatch.fnmatchcase(n, g) for g in functions))
        ]
        picked = sample(pool, args.sample) if args.sample else pool
        chosen = set(picked)
        # mutmut re-runs every mutant named on its command line: name only those without a
        # result yet (mutmut forgets the results of a function whose code changed; an
        # interrupted run resumes). "*" + name matches that name only (no name ends with
        # another) and, being a pattern, spares mutmut's look-up of the tests calling it by
        # exact name, which fails for a function no test calls.
        todo = [n for n in picked if known[n] == "not checked"]
        names = ["*" + n for n in todo]
        print(
            f"{group}: {len(chosen)} of {len(known)} mutants "
            f"({'sample ' + args.sample if args.sample else 'all'} of "
            f"{'the changed functions' if functions is not None else 'the group'}), "
            f"{len(todo)} not run yet",
            flush=True,
        )
    if chosen is None or names:
        cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs), *names]
        print(f"+ (cd {work.relative_to(ROOT)}) " + " ".join(cmd[1:]), flush=True)
        subprocess.run(niced(cmd), cwd=work, env=env, check=False)
    results = mutmut_results(work, env)
    (work / "results.txt").write_text(results)
    return python_score(group, results, equivalents, chosen)


def python_score(
    group: str, results: str, equivalents: set[str], only: set[str] | None = None
) -> Score:
    """The score of the mutants in ``results`` (of ``only``, a sample, if given)."""
    score = Score(group)
    for name, status in statuses(results).items():
        if only is not None and name not in only:
            continue
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


def parse_sample(spec: str) -> tuple[int, int]:
    """``K/N`` as (K, N), 0 <= K < N: sample K of N holds every N-th mutant from the K-th
    (mutant ``i`` is in sample ``i % N``), as cargo-mutants' ``--shard K/N --sharding
    round-robin`` (also 0-based); samples 0..N-1 are the whole set."""
    m = re.fullmatch(r"(\d+)/(\d+)", spec)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"sample {spec!r}: want K/N with 0 <= K < N")
    return int(m.group(1)), int(m.group(2))


def sample(names: list[str], spec: str) -> list[str]:
    """The mutants of ``names`` (in mutmut's order: by file, then as generated) in sample
    ``spec`` (``K/N``, see ``parse_sample``)."""
    k, n = parse_sample(spec)
    return names[k::n]


def plan(args: argparse.Namespace) -> tuple[list[str], str]:
    """The modules to run and the git ref whose changes restrict them ('' = whole modules).

    ``--only`` names the modules; without it every module. ``--diff`` as given (so ``--only
    hashing --diff a0e9e96^`` runs one module's mutants in the lines that commit changed);
    without ``--diff``, modules named by ``--only`` run whole and the default (all modules) only
    what changed since ``main``."""
    chosen = [m for m in args.only.split(",") if m] or RUST + list(PYTHON)
    unknown = sorted(set(chosen) - set(RUST) - set(PYTHON))
    if unknown:
        raise ValueError(f"unknown modules {unknown}")
    diff = args.diff if args.diff is not None else ("" if args.only else "main")
    return chosen, diff


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``modules`` (the modules to run) and ``diff`` resolved by ``plan``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated modules (run whole unless --diff is given): "
        + ",".join(RUST + list(PYTHON)),
    )
    parser.add_argument(
        "--diff",
        default=None,
        help="only mutants in what changed since this git ref (default: main, or '' = whole "
        "modules when --only is given)",
    )
    parser.add_argument(
        "--shard", default="", help="K/N (0 <= K < N): every N-th mutant of each Rust module"
    )
    parser.add_argument(
        "--sample",
        default="",
        help="K/N (0 <= K < N): every N-th mutant of each Python group, from the K-th",
    )
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="forget earlier mutmut results")
    args = parser.parse_args(argv)
    try:
        args.modules, args.diff = plan(args)
        for spec in (args.shard, args.sample):
            if spec:
                parse_sample(spec)
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    changed = changed_files(args.diff) if args.diff else None
    equivalents = accepted()
    scores = []
    for module in args.modules:
        if module in RUST:
            if changed is not None and not any(
                f.startswith(f"rust/src/{module}/") for f in changed
            ):
                continue
            scores.append(run_rust(module, args, equivalents.get(f"rust/{module}", set())))
        else:
            functions = None
            if changed is not None:
                functions = changed_functions(PYTHON[module][0], args.diff)
                if not functions:
                    continue
            scores.append(run_python(module, args, equivalents.get(module, set()), functions))
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
