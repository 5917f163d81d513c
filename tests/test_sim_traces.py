"""Trace formats beyond the Mooncake / kv-cache-tester basics of test_sim_workloads.py: Qwen-Bailian
JSONL, block sizes checked against the data, kv-cache-tester global id scope, file encodings."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest
from kvroute.cli import main
from kvroute.sim import infinite_cache, load_bailian, load_mooncake, load_trace
from kvroute.sim.trace_jsonl import block_size_range


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
        (_chat(7, -1, -1.0, 16, [1]), r"timestamp must be a finite number in \[0, 1e\+09\] \(s\)"),
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


# -- block sizes checked against the data ---------------------------------------------------------
def _mooncake(n_in: int, ids: list[int], ts: float = 0.0) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": 1, "hash_ids": ids}


def _ids(count: int, first: int) -> list[int]:
    return list(range(first, first + count))


# One id per 1024-token block, the final partial block included: only 1024 fits every row.
ROWS_1024 = [(3000, 3), (1500, 2), (5000, 5), (700, 1), (4097, 5), (2048, 2)]


def test_mooncake_rows_of_another_block_size_are_refused(tmp_path):
    path = _jsonl(
        tmp_path / "t.jsonl",
        [_mooncake(n, _ids(k, 10 * r), ts=r) for r, (n, k) in enumerate(ROWS_1024)],
    )
    # Read as 512-token blocks every row would have half its ids: its prompt's second half never
    # cached, silently, before.
    with pytest.raises(ValueError) as e:
        load_trace(path)
    assert str(e.value) == (
        f"{path}:1: 3 hash_ids but input_length 3000 fills 6 blocks of 512 tokens (one id each, "
        "the final partial block included; 5 full blocks); is the block size right? every row "
        "fits block size 1024: pass it with --block-size (block_size=)"
    )
    assert load_trace(path, block_size=1024).num_blocks.tolist() == [3, 2, 5, 1, 5, 2]
    with pytest.raises(ValueError, match="3000 fills at most 2 blocks of 2048"):
        load_trace(path, block_size=2048)
    # Through the CLI: the same message, exit status 2; --block-size 1024 runs.
    assert main(["simulate", "--quiet", "--trace", str(path), "--policies", "random"]) == 2
    out = tmp_path / "o.json"
    args = ["--block-size", "1024", "--policies", "random", "--json", str(out)]
    assert main(["simulate", "--quiet", "--trace", str(path), *args]) == 0


def test_full_block_traces_load_and_cut_short_rows_are_refused(tmp_path):
    # floor(input_length / 100) ids on every row (full blocks only, as kv-cache-tester and
    # kvroute's own exports write them): loads, its tails uncached.
    rows = [_mooncake(250, [1, 2]), _mooncake(199, [1]), _mooncake(300, [1, 2, 3])]
    w = load_mooncake(_jsonl(tmp_path / "full.jsonl", rows), block_size=100)
    assert w.num_blocks.tolist() == [2, 1, 3]
    with pytest.raises(ValueError, match=r"fits block size 100 \(full blocks only\): pass"):
        load_mooncake(tmp_path / "full.jsonl")
    # A row whose ids stop short of both conventions: refused, whatever the block size.
    rows.append(_mooncake(1000, [1, 2, 3], ts=1))
    path = _jsonl(tmp_path / "cut.jsonl", rows)
    with pytest.raises(ValueError, match=r"t.jsonl:4: .*no single block size fits every row"):
        load_mooncake(path, block_size=100)


def test_a_few_short_rows_load_with_a_warning(tmp_path, caplog):
    """A real trace's odd row (ids cut short) does not refuse the trace: up to SHORT_ROWS of the
    rows may have fewer ids than blocks, logged; a wrong block size fits few rows and is still
    refused, as is a row with more ids than blocks."""
    rows = [_mooncake(1100, _ids(3, 10 * r), ts=r) for r in range(40)]  # ceil(1100 / 512) = 3
    rows[7] = _mooncake(1100, _ids(1, 999), ts=7)  # 1 id for 3 blocks: cut short
    path = _jsonl(tmp_path / "t.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="kvroute.sim"):
        w = load_trace(path)
    assert w.num_blocks.tolist() == [3] * 7 + [1] + [3] * 32
    (record,) = [r for r in caplog.records if r.name == "kvroute.sim"]
    assert record.getMessage() == (
        f"{path}: 1 of 40 rows have fewer hash_ids than their 512-token blocks (the first: line "
        "8, 1 ids for 1100 tokens): their prompts' tails count as never cached"
    )
    rows[9] = _mooncake(1100, _ids(2, 888), ts=9)  # 2 of 40 = 5%: still tolerated
    load_trace(_jsonl(tmp_path / "t2.jsonl", rows))
    rows[11] = _mooncake(1100, _ids(2, 777), ts=11)  # 3 of 40: refused
    with pytest.raises(ValueError, match=r"t3.jsonl:8: 1 hash_ids but input_length 1100"):
        load_trace(_jsonl(tmp_path / "t3.jsonl", rows))
    rows[9:12] = rows[8:9] * 3
    rows[20] = _mooncake(1100, _ids(4, 555), ts=20)  # more ids than blocks: refused
    with pytest.raises(ValueError, match=r"t4.jsonl:21: 4 hash_ids .* fills at most 3 blocks"):
        load_trace(_jsonl(tmp_path / "t4.jsonl", rows))


@pytest.mark.parametrize(
    ("rows", "full", "expected"),
    [
        (ROWS_1024, False, (1024, 1024)),
        ([(1100, 3), (600, 2), (512, 1)], False, (512, 549)),
        ([(5, 1)], False, (5, None)),  # one block of any size >= 5
        ([(5, 0)], False, (1, 0)),  # no id: no block size puts a partial block in none
        ([(250, 2), (199, 1), (300, 3)], True, (100, 100)),
        ([(5, 0)], True, (6, None)),
    ],
)
def test_block_size_range_against_brute_force(rows, full, expected):
    n, k = zip(*rows, strict=True)
    assert block_size_range(n, k, full_blocks_only=full) == expected
    lo, hi = expected
    for bs in range(1, 3000):
        blocks = [(x // bs) if full else -(-x // bs) for x in n]
        fits = blocks == list(k)
        assert fits == (lo <= bs and (hi is None or bs <= hi)), bs


# -- kv-cache-tester hash_id_scope ----------------------------------------------------------------
def _kvct(path: Path, conv: str, scope: str | None, ids: list[int], model: str = "m") -> Path:
    reqs = [
        {
            "t": 10.0 * i,
            "type": "n",
            "model": model,
            "in": 4 * len(ids) + 1,
            "out": 1,
            "hash_ids": ids,
        }
        for i in range(2)
    ]
    doc = {"id": conv, "models": [model], "block_size": 4, "requests": reqs}
    if scope is not None:
        doc["hash_id_scope"] = scope
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("scope", [None, "local", "per_context"])
def test_kv_cache_tester_local_ids_stay_in_their_file(tmp_path, scope):
    _kvct(tmp_path / "a.json", "a", scope, [1, 2, 3])
    _kvct(tmp_path / "b.json", "b", scope, [1, 2, 3])
    w = load_trace(tmp_path, starts="uniform", mean_gap=100.0)
    assert w.session == ["a", "a", "b", "b"]
    assert not set(w.block_hashes(0).tolist()) & set(w.block_hashes(2).tolist())
    assert infinite_cache(w).cached_blocks.tolist() == [0, 3, 0, 3]  # each file's repeat only


def test_kv_cache_tester_global_ids_are_shared_across_files(tmp_path):
    # The doc (trace_replay_tester.md): with hash_id_scope "global", equal ids in different
    # files are the same blocks (sub-agents sharing tool definitions get matching ids).
    _kvct(tmp_path / "a.json", "a", "global", [1, 2, 3])
    _kvct(tmp_path / "b.json", "b", "global", [1, 2, 7])
    _kvct(tmp_path / "c.json", "c", "global", [1, 2, 3], model="other")
    _kvct(tmp_path / "d.json", "d", "local", [1, 2, 3])
    w = load_trace(tmp_path, starts="uniform", mean_gap=100.0)
    assert w.session == ["a", "a", "b", "b", "c", "c", "d", "d"]
    h = [w.block_hashes(i).tolist() for i in range(len(w))]
    assert h[2][:2] == h[0][:2] and h[2][2] != h[0][2]  # b continues a's [1, 2], then differs
    assert not set(h[4]) & set(h[0])  # another model: never the same blocks
    assert not set(h[6]) & set(h[0])  # a local file keeps its own namespace
    # b's first request finds a's [1, 2]; c and d only their own repeats.
    assert infinite_cache(w).cached_blocks.tolist() == [0, 3, 2, 3, 0, 3, 0, 3]


def test_kv_cache_tester_unknown_id_scope_is_refused(tmp_path):
    path = _kvct(tmp_path / "a.json", "a", "shared", [1])
    with pytest.raises(ValueError, match=r"a.json: hash_id_scope must be .* got 'shared'"):
        load_trace(path)


# -- encodings, CLI conflicts, exports ------------------------------------------------------------
BOM = "\ufeff"


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    rows = [_mooncake(600, [1, 2]), _mooncake(512, [1], ts=5)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    plain = tmp_path / "plain.jsonl"
    plain.write_text(text)
    ref = load_trace(plain, namespace="x").hashes.tolist()
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes((BOM + text).encode("utf-8"))
    assert load_trace(bom, namespace="x").hashes.tolist() == ref
    gz = tmp_path / "bom.jsonl.gz"
    gz.write_bytes(gzip.compress((BOM + text).encode("utf-8")))
    assert load_trace(gz, namespace="x").hashes.tolist() == ref
    bailian = tmp_path / "b.jsonl"
    bailian.write_bytes((BOM + json.dumps(_chat(0, -1, 0.0, 16, [1])) + "\n").encode("utf-8"))
    assert load_trace(bailian).meta["format"] == "bailian"
    conv = tmp_path / "conv.json"
    doc = {
        "id": "c",
        "block_size": 4,
        "requests": [{"t": 0, "in": 9, "out": 1, "hash_ids": [1, 2]}],
    }
    conv.write_bytes((BOM + json.dumps(doc)).encode("utf-8"))
    assert load_trace(conv).num_blocks.tolist() == [2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "T", "--duration", "30"], "--duration applies to the synthetic scenarios"),
        (["--scenario", "mooncake", "--duration", "30"], "not to --scenario mooncake"),
        (["--scenario", "claude-code", "--duration", "30"], "not to --scenario claude-code"),
        (["--scenario", "mooncake", "--block-size", "64"], "(recorded in 512-token blocks)"),
        (["--scenario", "claude-code", "--block-size", "16"], "(recorded in 64-token blocks)"),
        (["--scenario", "mooncake", "--block-size", "64", "--pd", "1:1"], "--block-size applies"),
    ],
)
def test_options_that_do_not_apply_are_refused(tmp_path, capsys, args, message):
    trace = _jsonl(tmp_path / "t.jsonl", [_mooncake(600, [1, 2])])
    args = [str(trace) if a == "T" else a for a in args]
    if "--pd" not in args:
        args += ["--policies", "random"]
    assert main(["simulate", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute simulate: ") and message in err


def test_an_export_carries_its_block_size(tmp_path, capsys):
    # A 64-token synthetic workload (full blocks only) exported, then replayed with no
    # --block-size: the same requests, blocks and sharing.
    path = tmp_path / "rag.jsonl"
    first = tmp_path / "first.json"
    args = ["simulate", "--quiet", "--policies", "random,round_robin", "--workers", "2"]
    rag = ["--scenario", "rag", "--duration", "10", "--block-size", "64"]
    assert main([*args, *rag, "--export-trace", str(path), "--json", str(first)]) == 0
    assert {json.loads(line)["block_size"] for line in path.read_text().splitlines()} == {64}
    again = tmp_path / "again.json"
    assert main([*args, "--trace", str(path), "--json", str(again)]) == 0
    a, b = json.loads(first.read_text()), json.loads(again.read_text())
    assert a["oracles"] == b["oracles"]
    assert (
        a["policies"]["round_robin"]["cached_tokens"]
        == b["policies"]["round_robin"]["cached_tokens"]
    )
    w = load_mooncake(path)
    assert w.block_size == 64 and w.num_blocks.sum() == a["oracles"]["infinite"]["block_refs"]
    # Rows that disagree on their block size are refused.
    rows = path.read_text().splitlines()
    rows[1] = rows[1].replace('"block_size":64', '"block_size":32')
    bad = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"bad.jsonl:2: block_size .*\(earlier rows: 64\), got 32"):
        load_mooncake(bad)
