"""Trace files that are corrupt: every one is refused with a ``ValueError`` naming the file, the
line and the value (and ``kvroute simulate`` exits 2 with it, no traceback) — never a traceback
from deeper in the loader, and never a row of absurd size taken as a request."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from kvroute.cli import main
from kvroute.sim import load_trace

MAX_TOKENS = 10_000_000  # kvroute.sim.trace_io.MAX_TOKENS
SHORT_IDS = 4  # kvroute.sim.trace_jsonl.SHORT_IDS


def _row(n_in: int = 1100, ids: list[int] | None = None, ts: object = 0, out: object = 5) -> str:
    ids = ids if ids is not None else [1, 2, 3]  # ceil(1100 / 512) = 3 blocks
    return (
        f'{{"timestamp": {ts}, "input_length": {n_in}, "output_length": {out}, '
        f'"hash_ids": {json.dumps(ids)}}}\n'
    )


def _trace(path: Path, bad: str, *, at: int = 3, rows: int = 30) -> Path:
    lines = [_row(ids=[3 * r, 3 * r + 1, 3 * r + 2], ts=r) for r in range(rows)]
    lines[at - 1] = bad
    path.write_text("".join(lines))
    return path


def refused(path: Path, capsys) -> str:
    """The loader's message, checked to be the CLI's too (exit 2, no traceback)."""
    with pytest.raises(ValueError) as e:
        load_trace(path)
    assert main(["simulate", "--quiet", "--trace", str(path), "--policies", "random"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvroute simulate: {e.value}\n"
    return str(e.value)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_row(n_in=10**20), f"input_length must be an integer in [1, {MAX_TOKENS:,}] tokens, got "),
        (_row(out=10**20), f"output_length must be an integer in [0, {MAX_TOKENS:,}] tokens, got "),
        (_row(ts=10**400), "timestamp must be a finite number in [0, 1e+12] (ms), got 1000000"),
        (_row(ts="1e300"), "timestamp must be a finite number in [0, 1e+12] (ms), got 1e+300"),
        (_row(ts="1e400"), "timestamp must be a finite number in [0, 1e+12] (ms), got inf"),
        (_row(ts="1" * 5000), "not valid JSON (Exceeds the limit (4300 digits)"),
    ],
)
def test_values_beyond_any_real_trace_name_file_line_and_value(tmp_path, capsys, row, message):
    msg = refused(_trace(tmp_path / "t.jsonl", row), capsys)
    assert msg.startswith(f"{tmp_path / 't.jsonl'}:3: {message}")


def test_kv_cache_tester_time_beyond_any_real_trace(tmp_path, capsys):
    reqs = [{"t": 0.0, "type": "n", "in": 9, "out": 1, "hash_ids": [1, 2]}]
    reqs.append({"t": 10**300, "type": "n", "in": 9, "out": 1, "hash_ids": [1, 2]})
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"id": "c", "block_size": 4, "requests": reqs}))
    msg = refused(path, capsys)
    assert msg.startswith(f"{path}: requests[1]: t must be a finite number in [0, 1e+09] (s), got")


def test_a_row_far_short_of_its_blocks_is_refused(tmp_path, capsys):
    # 1,000,000 tokens are 1,954 blocks of 512: 5 ids is a corrupt row, not a short one.
    path = _trace(tmp_path / "t.jsonl", _row(n_in=1_000_000, ids=[0, 1, 2, 3, 4]), at=4)
    msg = refused(path, capsys)
    assert msg == (
        f"{path}:4: 5 hash_ids but input_length 1000000 fills 1954 blocks of 512 tokens (one id "
        "each, the final partial block included; 1953 full blocks): 1949 ids short, more than "
        f"the {SHORT_IDS} a short row may lack (a corrupt input_length?); is the block size "
        "right? no single block size fits every row (are some rows' hash_ids cut short?)"
    )
    # SHORT_IDS short: still one of the tolerated short rows.
    load_trace(_trace(tmp_path / "ok.jsonl", _row(n_in=512 * (SHORT_IDS + 1), ids=[7]), at=4))


def test_a_truncated_gz_names_file_and_line(tmp_path, capsys):
    data = gzip.compress(_trace(tmp_path / "t.jsonl", _row()).read_bytes())
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    msg = refused(path, capsys)
    assert msg.startswith(f"{path}:") and "the gzip stream is cut short (truncated file)" in msg


def test_not_gzip_and_not_utf8_name_the_file(tmp_path, capsys):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(_row().encode())
    assert refused(path, capsys).startswith(f"{path}: not a valid gzip file")
    path = tmp_path / "t.jsonl"
    path.write_bytes(_row().encode() + _row().encode() + b'{"timestamp": 0\xff}\n')
    assert refused(path, capsys) == (
        f"{path}:3: not UTF-8 text (invalid start byte: byte 0xff at column 16)"
    )


def test_a_broken_first_row_is_bad_json_not_an_unknown_format(tmp_path, capsys):
    path = _trace(tmp_path / "t.jsonl", '{"timestamp": 0, "input_length": 5\n', at=1)
    msg = refused(path, capsys)
    assert msg.startswith(f"{path}:1: not valid JSON (Expecting ',' delimiter)")
