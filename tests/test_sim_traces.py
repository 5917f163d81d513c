"""Trace formats beyond the Mooncake / kv-cache-tester basics of test_sim_workloads.py: Qwen-Bailian
JSONL, block sizes checked against the data, kv-cache-tester global id scope, file encodings."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from kvroute.cli import main
from kvroute.sim import load_bailian, load_trace


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _chat(cid, parent, ts, n_in, ids, *, out=5, kind="text", turn=1):
    """A Qwen-Bailian row, fields in the order of the dataset's README."""
    return {
        "chat_id": cid,
        "parent_chat_id": parent,
        "timestamp": ts,
        "input_length": n_in,
        "output_length": out,
        "type": kind,
        "turn": turn,
        "hash_ids": ids,
    }


# -- Qwen-Bailian ---------------------------------------------------------------------------------
def _conversations(tmp_path: Path, name: str = "qwen_traceA_blksz_16.jsonl") -> Path:
    # Two conversations of three and one turns, and two turns whose parent (chat 90) began
    # before the trace; timestamps in seconds, out of order in the file; 16-token blocks, one id
    # per block including the final partial one.
    return _jsonl(
        tmp_path / name,
        [
            _chat(0, -1, 0.0, 40, [1, 2, 3]),
            _chat(5, -1, 0.25, 17, [7, 8], kind="search"),
            _chat(1, 0, 61.114, 70, [1, 2, 3, 4, 5]),
            _chat(3, 90, 2.5, 33, [9, 10, 11], turn=4),
            _chat(2, 1, 75.5, 96, [1, 2, 3, 4, 5, 6], kind="file", turn=3),
            _chat(4, 90, 3.0, 48, [9, 10, 12], turn=4),
        ],
    )


def test_bailian_rows_are_their_own_format_timed_in_seconds(tmp_path):
    w = load_trace(_conversations(tmp_path))
    assert w.meta["format"] == "bailian"
    assert w.block_size == 16
    # Seconds, as the dataset's README says (read as Mooncake's ms they would be 1000x denser).
    assert w.arrival.tolist() == [0.0, 0.25, 2.5, 3.0, 61.114, 75.5]
    assert w.input_tokens.tolist() == [40, 17, 33, 48, 70, 96]
    assert w.num_blocks.tolist() == [3, 2, 3, 3, 5, 6]
    # The conversation's turns extend one chain; the other conversations' ids are other blocks.
    h = [w.block_hashes(i).tolist() for i in range(len(w))]
    assert h[4][:3] == h[0] and h[5][:5] == h[4]
    assert h[3][:2] == h[2][:2] and h[3][2] != h[2][2]
    assert not set(h[1]) & set(h[0] + h[2])


def test_bailian_sessions_are_root_chats(tmp_path):
    w = load_trace(_conversations(tmp_path))
    # Arrival order: chats 0, 5, 3, 4, 1, 2. Chat 2's parent is 1, whose parent is 0 (a root);
    # 3 and 4 answer chat 90, not in the file: it stands for their conversation's root.
    assert w.session == ["chat-0", "chat-5", "chat-90", "chat-90", "chat-0", "chat-0"]


def test_bailian_block_size_from_the_file_name_or_the_caller(tmp_path):
    rows = [_chat(0, -1, 0.0, 20, [1, 2]), _chat(1, 0, 1.0, 40, [1, 2, 3])]
    plain = _jsonl(tmp_path / "bailian.jsonl", rows)
    assert load_trace(plain).block_size == 16  # the dataset's block size
    rows = [_chat(0, -1, 0.0, 64, [1, 2]), _chat(1, 0, 1.0, 90, [1, 2, 3])]  # fit 32..44
    named = _jsonl(tmp_path / "qwen_coder_blksz_32.jsonl", rows)
    assert load_trace(named).block_size == 32
    gz = tmp_path / "qwen_coder_blksz_32.jsonl.gz"
    gz.write_bytes(gzip.compress(named.read_bytes()))
    back = load_trace(gz)
    assert back.block_size == 32 and back.hashes.tolist() == load_trace(named).hashes.tolist()
    assert load_bailian(named, block_size=40).block_size == 40  # the caller's choice wins
    assert load_trace(named, block_size=40).block_size == 40


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({**_chat(7, -1, 1.0, 16, [1]), "chat_id": None}, "chat_id must be"),
        ({**_chat(7, -1, 1.0, 16, [1]), "parent_chat_id": -2}, "parent_chat_id must be"),
        ({k: v for k, v in _chat(7, -1, 1.0, 16, [1]).items() if k != "parent_chat_id"}, "missing"),
        (_chat(0, 3, 1.0, 16, [1]), r"chat_id 0 again, with parent_chat_id 3 \(.*:1: -1\)"),
        (_chat(7, -1, -1.0, 16, [1]), r"timestamp must be a finite number >= 0 \(s\)"),
        (_chat(7, -1, 1.0, 16, [1, 2]), "fills at most 1 blocks of 16"),
    ],
)
def test_bailian_bad_rows_name_file_and_line(tmp_path, row, match):
    path = _jsonl(tmp_path / "t.jsonl", [_chat(0, -1, 0.0, 16, [1]), "", row])
    with pytest.raises(ValueError, match=match) as e:
        load_trace(path)
    assert f"{path}:3:" in str(e.value)


def test_bailian_parent_cycle_is_refused(tmp_path):
    path = _jsonl(
        tmp_path / "t.jsonl",
        [_chat(0, -1, 0.0, 16, [1]), _chat(1, 2, 1.0, 16, [1]), _chat(2, 1, 2.0, 16, [1])],
    )
    with pytest.raises(ValueError, match="is its own ancestor"):
        load_trace(path)


def test_bailian_trace_through_the_cli(tmp_path, capsys):
    path = _conversations(tmp_path)
    out = tmp_path / "out.json"
    args = ["simulate", "--quiet", "--trace", str(path), "--policies", "kv_aware,hash"]
    assert main([*args, "--workers", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["policies"]["kv_aware"]["requests"] == 6
    # 6 requests, 304 prompt tokens, 75.5 s apart at most: not compressed into 75 ms.
    assert doc["policies"]["kv_aware"]["makespan_s"] > 75.5
