"""The suite's own rules: a skip whose reason is not allow-listed fails the run (tests/conftest.py).

Run on a scratch suite in a child pytest with this suite's conftest.py: a module skipped by
``importorskip``, a test calling ``pytest.skip`` and a ``skipif`` marker each fail it; an
allow-listed reason, an xfail and ``KVROUTE_ALLOW_SKIPS=1`` do not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

SCRATCH = {
    "test_missing.py": (
        "import pytest\npytest.importorskip('kvroute_no_such_module')\ndef test_never(): pass\n"
    ),
    "test_cases.py": (
        "import pytest\n"
        "def test_skips_inside(): pytest.skip('an optional thing is missing')\n"
        "@pytest.mark.skipif(True, reason='no engine here')\n"
        "def test_skipif(): pass\n"
        "@pytest.mark.skipif(True, reason='subprocess signals')\n"
        "def test_allowed(): pass\n"
        "@pytest.mark.xfail(reason='known', strict=True)\n"
        "def test_xfail(): assert False\n"
        "def test_ok(): pass\n"
    ),
}


def run(tmp_path: Path, *args: str, allow: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVROUTE_ALLOW_SKIPS"}
    if allow:
        env["KVROUTE_ALLOW_SKIPS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def scratch_suite(tmp_path: Path) -> None:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "data" / "vectors").mkdir(parents=True)
    for name, text in SCRATCH.items():
        (tmp_path / name).write_text(text)


def test_unexpected_skips_fail_the_run(tmp_path):
    scratch_suite(tmp_path)
    cases = run(tmp_path, "test_cases.py")
    out = cases.stdout
    assert cases.returncode == 1, out
    assert "FAILED test_cases.py::test_skips_inside - unexpected skip: an optional" in out
    assert "ERROR test_cases.py::test_skipif - unexpected skip: no engine here" in out
    assert "SKIPPED [1] test_cases.py" in out and ": subprocess signals" in out
    assert "XFAIL test_cases.py::test_xfail" in out and "PASSED test_cases.py::test_ok" in out
    missing = run(tmp_path, "test_missing.py")
    assert missing.returncode != 0
    assert "unexpected skip: could not import 'kvroute_no_such_module'" in missing.stdout


def test_skips_can_be_allowed_explicitly(tmp_path):
    scratch_suite(tmp_path)
    result = run(tmp_path, allow=True)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 4 skipped, 1 xfailed" in result.stdout


def make_mutants():
    """tests/mutants/run.py, imported."""
    sys.path.insert(0, str(Path(__file__).parent / "mutants"))
    try:
        import run as mutants
    finally:
        sys.path.pop(0)
    return mutants


def test_make_mutants_refreshes_a_rebuilt_extension(tmp_path):
    """mutmut never refreshes its copy of a non-Python file: run.py replaces a stale copy of the
    native extension, and leaves an up-to-date one and a missing one alone."""
    mutants = make_mutants()
    built, copy = tmp_path / "built", tmp_path / "copy"
    built.mkdir()
    copy.mkdir()
    (built / "_core.abi3.so").write_bytes(b"rebuilt")
    (copy / "_core.abi3.so").write_bytes(b"stale!!")  # same size: compared by content
    (built / "_core.other.so").write_bytes(b"x")
    mutants.refresh_extensions(built, copy)
    assert (copy / "_core.abi3.so").read_bytes() == b"rebuilt"
    assert not (copy / "_core.other.so").exists()  # mutmut has not copied it (yet)


def test_make_mutants_scores_and_equivalents():
    """tests/mutants/run.py: the accepted equivalents are read from docs/mutants.md (a ``\\|``
    in a cell is a ``|``), and a listed mutant is neither missed nor in the score."""
    mutants = make_mutants()
    accepted = mutants.accepted()
    ketama = "rust/src/hashing/ketama.rs:155:13: replace && with || in md5_word0_lanes"
    assert mutants.rust_id(ketama) in accepted["rust/hashing"]
    first = "kvroute.events.xǁKvEventSubscriberǁ_on_monitor__mutmut_1"
    assert first in accepted["py-events"]
    results = "\n".join(
        [
            f"    {first}: survived",
            "    kvroute.events.x_a__mutmut_1: survived",
            "    kvroute.events.x_a__mutmut_2: killed",
            "    kvroute.events.x_a__mutmut_3: timeout",
            "    kvroute.events.x_a__mutmut_4: not checked",
        ]
    )
    score = mutants.python_score("py-events", results, accepted["py-events"])
    assert (score.caught, score.timeout, score.unviable) == (1, 1, 0)  # not checked: not run
    assert score.missed == ["kvroute.events.x_a__mutmut_1 (survived)"]
    assert score.equivalent == [f"{first} (survived)"]
    assert score.row() == "| py-events | 4 | 1 | 1 | 1 | 1 | 0 | 66.7% |"


def test_make_mutants_only_keeps_diff():
    """``--only`` with ``--diff`` runs that module's changes (it used to run it whole); ``--only``
    alone runs modules whole, no option the changes since main in every module."""
    args = make_mutants().arguments
    one = args(["--only", "hashing", "--diff", "a0e9e96^"])
    assert (one.modules, one.diff) == (["hashing"], "a0e9e96^")
    whole = args(["--only", "hashing,py-gateway-pd"])
    assert (whole.modules, whole.diff) == (["hashing", "py-gateway-pd"], "")
    default = args([])
    assert default.diff == "main" and "py-gateway-pd" in default.modules
    assert args(["--diff", ""]).diff == ""


def test_make_mutants_sample_is_round_robin():
    """``--sample K/N`` takes every N-th Python mutant from the K-th (0-based, as cargo-mutants'
    round-robin shards): samples 0..N-1 are disjoint and together every mutant; a sample's score
    counts its own mutants only."""
    mutants = make_mutants()
    names = [f"m.x_f__mutmut_{i}" for i in range(1, 11)]
    assert mutants.sample(names, "0/3") == [names[0], names[3], names[6], names[9]]
    parts = [mutants.sample(names, f"{k}/3") for k in range(3)]
    assert sorted(n for part in parts for n in part) == sorted(names)
    for bad in ("3/3", "1/0", "-1/3", "1", "a/b"):
        with pytest.raises(ValueError, match="want K/N"):
            mutants.parse_sample(bad)
    results = "\n".join(
        f"    {n}: {'survived' if i % 2 else 'killed'}" for i, n in enumerate(names)
    )
    score = mutants.python_score("g", results, set(), set(parts[1]))
    assert (score.caught, score.missed) == (1, [f"{names[1]} (survived)", f"{names[7]} (survived)"])


def test_make_mutants_python_diff_is_the_changed_functions():
    """With a diff, a Python group runs the mutants of the top-level functions and methods
    holding a changed line (mutmut's name globs), not the whole file."""
    mutants = make_mutants()
    source = (
        "import x\n"  # 1
        "def f():\n"  # 2
        "    def inner(): pass\n"  # 3
        "    return 1\n"  # 4
        "class C:\n"  # 5
        "    @staticmethod\n"  # 6
        "    def m():\n"  # 7
        "        pass\n"  # 8
        "    async def n(self):\n"  # 9
        "        pass\n"  # 10
    )
    at = mutants.functions_at
    assert at(source, "p.q", {1}) == []
    assert at(source, "p.q", {3}) == ["p.q.x_f__mutmut_*"]
    assert at(source, "p.q", {6, 10}) == ["p.q.xǁCǁm__mutmut_*", "p.q.xǁCǁn__mutmut_*"]
    patch = "@@ -3 +3 @@\n-a\n+b\n@@ -8,2 +9,0 @@\n-c\n-d\n@@ -20,0 +21,2 @@\n+e\n+f\n"
    assert mutants.changed_lines(patch) == {3, 9, 10, 21, 22}


def test_make_mutants_python_groups_run_under_a_wall_clock_limit():
    """Every Python group's mutmut config passes pytest-timeout's limit through
    ``pytest_add_cli_args`` (so the stats, the clean run and every mutant run under it), with the
    group's files and tests."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    mutants = make_mutants()
    files, tests, _ = mutants.PYTHON["py-gateway-client"]
    config = tomllib.loads(mutants.mutmut_config(files, tests))["tool"]["mutmut"]
    assert config["pytest_add_cli_args"] == [
        "-p",
        "no:cacheprovider",
        "-x",
        "-q",
        f"--timeout={mutants.TEST_TIMEOUT_S}",
        "--timeout-method=thread",
    ]
    assert config["only_mutate"] == [
        "src/kvroute/gateway/client.py",
        "src/kvroute/gateway/stream.py",
    ]
    assert config["pytest_add_cli_args_test_selection"] == tests


HUNG = {  # where: (the scratch test file, the function its stack dump shows hung)
    # A request that never gets its head: a future nobody resolves, on a running loop.
    "call": (
        "import asyncio\n"
        "def test_before():\n"
        "    pass\n"
        "def test_hangs():\n"
        "    async def main():\n"
        "        await asyncio.get_running_loop().create_future()\n"
        "    asyncio.run(main())\n"
        "def test_after():\n"
        "    pass\n",
        "test_hangs",
    ),
    # A clean-up that waits forever (a stop joining a thread that never ends).
    "teardown": (
        "import threading\n"
        "import pytest\n"
        "@pytest.fixture\n"
        "def stuck():\n"
        "    yield\n"
        "    threading.Event().wait()\n"
        "def test_hangs(stuck):\n"
        "    pass\n"
        "def test_after():\n"
        "    pass\n",
        "stuck",
    ),
}


@pytest.mark.parametrize("where", sorted(HUNG))
def test_make_mutants_limit_ends_a_hung_test_as_a_failure(tmp_path, where):
    """run.py's pytest arguments end a test hung without using CPU — in its body or its
    teardown — by themselves: pytest-timeout dumps the stacks and ends the process with exit
    code 1, which mutmut counts as a killed mutant (its exit code 1: ``killed``), and no later
    test runs. (A 1 s limit here in place of ``TEST_TIMEOUT_S``.)"""
    mutants = make_mutants()
    source, hung = HUNG[where]
    (tmp_path / "test_hung.py").write_text(source)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the scratch dir is the rootdir
    cmd = [sys.executable, "-m", "pytest", *mutants.pytest_args(timeout_s=1), "-v", "test_hung.py"]
    # The guard only: without the limit the child would wait forever.
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "+ Timeout +" in out and f"in {hung}" in out, out  # the hung test's stack
    assert "test_hung.py::test_after" not in out
