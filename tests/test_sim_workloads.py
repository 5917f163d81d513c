"""Workload records and trace loaders: real files, small fixtures, malformed input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvroute.sim import (
    Workload,
    WorkloadBuilder,
    chain_block_ids,
    load_kv_cache_tester,
    load_mooncake,
    load_trace,
)
from kvroute.sim.workloads import mix64, namespace_seed

DATA = Path(__file__).parent / "data"
KVCT = DATA / "traces"
MASK = (1 << 64) - 1


# -- reference model of the chained hash: plain Python integers --------------------------------
def _mix_ref(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _chain_ref(ids: list[int], ns: int) -> list[int]:
    prev, out = _mix_ref(ns ^ 0x9E3779B97F4A7C15), []
    for i in ids:
        prev = _mix_ref(prev ^ _mix_ref((_mix_ref(i) + ns) & MASK))
        out.append(prev)
    return out


def test_mix64_matches_splitmix64_reference_values():
    # SplitMix64 outputs for seed 0 (state advanced by the golden gamma), a published sequence.
    gamma = 0x9E3779B97F4A7C15
    states = np.array([(gamma * k) & MASK for k in range(1, 4)], dtype=np.uint64)
    assert mix64(states).tolist() == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]


@given(
    st.lists(st.lists(st.integers(0, MASK), max_size=12), max_size=8),
    st.integers(0, MASK),
)
def test_chain_block_ids_matches_reference(requests, ns):
    ids = np.array([i for r in requests for i in r], dtype=np.uint64)
    offsets = np.cumsum([0, *(len(r) for r in requests)])
    got = chain_block_ids(ids, offsets, ns)
    want = [h for r in requests for h in _chain_ref(r, ns)]
    assert got.tolist() == want


def test_chain_equal_iff_equal_prefix():
    ids = [[1, 2, 3], [1, 2, 4], [9, 2, 3], [1, 2, 3, 5]]
    offsets = np.cumsum([0, *(len(r) for r in ids)])
    h = chain_block_ids(np.array([i for r in ids for i in r], dtype=np.uint64), offsets, 7)
    a, b, c, d = (h[offsets[k] : offsets[k + 1]] for k in range(4))
    assert a[:2].tolist() == b[:2].tolist() and a[2] != b[2]
    assert not set(c.tolist()) & set(a.tolist())  # same ids after a different root: no sharing
    assert d[:3].tolist() == a.tolist()
    other = chain_block_ids(np.array([i for r in ids for i in r], dtype=np.uint64), offsets, 8)
    assert not set(other.tolist()) & set(h.tolist())  # another namespace never collides


# -- Workload ---------------------------------------------------------------------------------
def _tiny(arrivals=(2.0, 0.0, 1.0, 1.0)) -> Workload:
    b = WorkloadBuilder(block_size=4)
    for k, t in enumerate(arrivals):
        b.add(t, np.arange(k + 1, dtype=np.uint64) + 100 * k, 4 * k + 3, k, tenant=f"t{k}")
    return b.build(name="tiny")


def test_workload_sorts_stably_by_arrival_and_keeps_columns_together():
    w = _tiny()
    assert w.arrival.tolist() == [0.0, 1.0, 1.0, 2.0]
    assert w.tenant == ["t1", "t2", "t3", "t0"]
    assert [r.id for r in w] == [0, 1, 2, 3]
    r = w[1]
    assert r.block_hashes.tolist() == [200, 201, 202]
    assert (r.input_tokens, r.output_tokens, r.block_size) == (11, 2, 4)
    assert w[-1].block_hashes.tolist() == [0]
    assert w.num_blocks.tolist() == [2, 3, 4, 1]
    assert not w.hashes.flags.writeable
    assert np.shares_memory(w.block_hashes(2), w.hashes)


def test_cached_tokens_counts_a_partial_tail_at_most_to_the_prompt_length():
    w = _tiny()
    r = w[2]  # 4 blocks of 4 tokens, 15 input tokens (last block partial)
    assert [r.cached_tokens(k) for k in range(5)] == [0, 4, 8, 12, 15]
    assert w.cached_tokens([2, 3, 4, 1]).tolist() == [7, 11, 15, 3]


def test_head_time_scale_merge_and_summary():
    w = _tiny()
    assert len(w.head(2)) == 2 and w.head(2).hashes.tolist() == [100, 101, 200, 201, 202]
    assert w.time_scaled(0.5).arrival.tolist() == [0.0, 0.5, 0.5, 1.0]
    m = Workload.merge([w, w.time_scaled(2.0)])
    assert len(m) == 8 and m.hashes.shape[0] == 2 * w.hashes.shape[0]
    assert np.all(np.diff(m.arrival) >= 0)
    s = w.summary()
    assert s["requests"] == 4 and s["block_refs"] == 10 and s["prompt_tokens"] == 3 + 7 + 11 + 15
    with pytest.raises(ValueError, match="block sizes"):
        Workload.merge([w, WorkloadBuilder(8).build(name="x")])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "block_size"),
        ({"input_tokens": [0]}, "input_tokens must be >= 1"),
        ({"output_tokens": [-1]}, "output_tokens"),
        ({"arrival": [float("nan")]}, "finite"),
        ({"offsets": [0, 3]}, "offsets must run"),
        ({"tenant": ["a", "b"]}, "one entry per request"),
    ],
)
def test_workload_rejects_bad_columns(kwargs, match):
    base = {
        "arrival": [0.0],
        "input_tokens": [5],
        "output_tokens": [1],
        "hashes": np.array([1, 2], dtype=np.uint64),
        "offsets": [0, 2],
        "block_size": 4,
    }
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Workload(**base)


# -- Mooncake (the `mooncake` fixture: conftest.py) ----------------------------------------------
def test_bundled_mooncake_matches_published_statistics(mooncake):
    # Figures from the Mooncake FAST'25 README and shared/data/SOURCES.md.
    assert len(mooncake) == 12_031
    assert mooncake.block_size == 512
    assert mooncake.hashes.shape[0] == 288_500
    assert np.unique(mooncake.hashes).shape[0] == 182_790  # distinct hash_ids, chained 1:1
    assert round(mooncake.input_tokens.mean()) == 12_035
    assert round(float(mooncake.output_tokens.mean()), 1) == 342.6
    assert mooncake.arrival[0] == 0.0 and mooncake.duration == pytest.approx(3537.0, abs=1.0)
    # One id per 512-token block, the final partial block included.
    assert np.array_equal(mooncake.num_blocks, -(-mooncake.input_tokens // 512))


def test_bundled_mooncake_is_the_original_file(mooncake):
    raw = gzip.decompress(Path(mooncake.meta["source"]).read_bytes())
    import hashlib

    assert hashlib.sha256(raw).hexdigest().startswith("b8cbb061a85206d7")
    first = json.loads(raw.split(b"\n", 1)[0])
    assert first == {
        "timestamp": 0,
        "input_length": 6758,
        "output_length": 500,
        "hash_ids": list(range(14)),
    }
    assert mooncake[0].input_tokens == 6758 and mooncake[0].num_blocks == 14


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mooncake_loader_on_a_fixture(tmp_path):
    rows = [
        {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [0, 3]},
        {"timestamp": 1500, "input_length": 512, "output_length": 1, "hash_ids": [0]},
    ]
    w = load_trace(_write_jsonl(tmp_path / "t.jsonl", rows))
    assert w.arrival.tolist() == [0.0, 1.5, 1.5]
    assert w.input_tokens.tolist() == [600, 1100, 512]
    assert w.meta["format"] == "mooncake"
    h = [w.block_hashes(i).tolist() for i in range(3)]
    assert h[0][0] == h[1][0] == h[2][0]
    assert h[0][1] != h[1][1]
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "t.jsonl").read_bytes()))
    assert load_trace(gz).hashes.tolist() == w.hashes.tolist()  # .gz: same namespace
    # Namespaces: the same ids in another file never share hashes unless asked to.
    other = load_mooncake(tmp_path / "t.jsonl", namespace="elsewhere")
    assert not set(other.hashes.tolist()) & set(w.hashes.tolist())
    # A different block size that fits the rows is honoured; one that does not is refused.
    assert load_mooncake(tmp_path / "t.jsonl", block_size=540).block_size == 540
    with pytest.raises(ValueError, match=r"fills at most 2 blocks of 1024.*sizes 512\.\.549"):
        load_mooncake(tmp_path / "t.jsonl", block_size=1024)
    with pytest.raises(ValueError, match=r"fills 5 blocks of 256.*sizes 512\.\.549"):
        load_mooncake(tmp_path / "t.jsonl", block_size=256)


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1}, "missing field 'hash_ids'"),
        ({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}, "timestamp"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "input_length"),
        ({"timestamp": 0, "input_length": True, "output_length": 1, "hash_ids": []}, "input_len"),
        ({"timestamp": 0, "input_length": 5, "output_length": -2, "hash_ids": [1]}, "output_len"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}, "list"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}, r"\[0\]"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1.5]}, "integer"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [2**64]}, "2\\^64"),
        (
            {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]},
            "at most 2",
        ),
    ],
)
def test_mooncake_loader_names_file_and_line_of_a_bad_row(tmp_path, row, match):
    good = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, "", row])
    with pytest.raises(ValueError, match=match) as e:
        load_mooncake(path)
    assert f"{path}:3:" in str(e.value)


def test_empty_and_unknown_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty file"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "x.json").write_text('{"foo": 1}')
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path / "x.json")
    with pytest.raises(ValueError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.json trace files"):
        load_trace(tmp_path / "d")


# -- kv-cache-tester ----------------------------------------------------------------------------
def _raw_requests(path: Path) -> list[dict]:
    return json.loads(path.read_text())["requests"]


@pytest.mark.parametrize(("name", "count"), [("trace_0002.json", 33), ("trace_0007.json", 12)])
def test_kv_cache_tester_real_files(name, count):
    path = KVCT / name
    w = load_trace(path)
    raw = _raw_requests(path)
    assert len(w) == count == len(raw)
    assert w.block_size == 64
    assert w.input_tokens.tolist() == [r["in"] for r in raw]
    assert w.output_tokens.tolist() == [r["out"] for r in raw]
    assert w.arrival.tolist() == [float(r["t"]) for r in raw]  # one file: starts at 0
    # Full 64-token blocks only.
    assert np.array_equal(w.num_blocks, w.input_tokens // 64)
    assert set(w.session) == {path.stem}
    # Chained hashes share exactly where the file's ids share a prefix.
    common = 0
    for x, y in zip(raw[-2]["hash_ids"], raw[-1]["hash_ids"], strict=False):
        if x != y:
            break
        common += 1
    ha, hb = w.block_hashes(len(w) - 2), w.block_hashes(len(w) - 1)
    shared = int(np.argmin(np.append(ha[: len(hb)] == hb[: len(ha)], False)))
    assert shared == common


def test_kv_cache_tester_directory_merges_conversations_in_separate_namespaces(tmp_path):
    for name in ("trace_0002.json", "trace_0007.json"):
        (tmp_path / name).write_bytes((KVCT / name).read_bytes())
    w = load_trace(tmp_path, starts="uniform", mean_gap=100.0)
    assert len(w) == 33 + 12
    assert np.all(np.diff(w.arrival) >= 0)
    by_session = {
        s: w.hashes[np.repeat(np.array(w.session) == s, w.num_blocks)] for s in set(w.session)
    }
    a, b = by_session["trace_0002"], by_session["trace_0007"]
    assert not set(a.tolist()) & set(b.tolist())  # both files use ids 1, 2, 3, ... locally
    first_0007 = min(
        t for t, s in zip(w.arrival.tolist(), w.session, strict=True) if s == "trace_0007"
    )
    assert first_0007 == 100.0
    p1 = load_trace(tmp_path, starts="poisson", mean_gap=30.0, seed=1)
    p2 = load_trace(tmp_path, starts="poisson", mean_gap=30.0, seed=1)
    p3 = load_trace(tmp_path, starts="poisson", mean_gap=30.0, seed=2)
    assert p1.arrival.tolist() == p2.arrival.tolist() != p3.arrival.tolist()
    explicit = load_kv_cache_tester(tmp_path, starts=[5.0, 0.0])
    assert explicit.arrival.min() == 0.0 and explicit.session[0] == "trace_0007"
    with pytest.raises(ValueError, match="need 2 start offsets"):
        load_kv_cache_tester(tmp_path, starts=[1.0])
    with pytest.raises(ValueError, match="starts must be"):
        load_kv_cache_tester(tmp_path, starts="sometimes")


def _kvct_doc(requests: list, block_size: int = 4) -> dict:
    return {"id": "conv", "block_size": block_size, "hash_id_scope": "local", "requests": requests}


def test_kv_cache_tester_subagents_are_sessions_timed_from_their_spawn(tmp_path):
    doc = _kvct_doc(
        [
            {"t": 0.0, "type": "n", "model": "big", "in": 9, "out": 2, "hash_ids": [1, 2]},
            {
                "t": 10.0,
                "type": "subagent",
                "agent_id": "agent_001",
                "requests": [
                    {"t": 0.0, "model": "small", "in": 8, "out": 1, "hash_ids": [1, 2]},
                    {"t": 3.5, "model": "small", "in": 12, "out": 1, "hash_ids": [1, 2, 5]},
                ],
            },
            {"t": 20.0, "type": "n", "model": "big", "in": 13, "out": 2, "hash_ids": [1, 2, 3]},
        ]
    )
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(doc))
    w = load_trace(path)
    assert w.arrival.tolist() == [0.0, 10.0, 13.5, 20.0]
    assert w.session == ["conv", "conv/agent_001", "conv/agent_001", "conv"]
    h = [w.block_hashes(i).tolist() for i in range(4)]
    assert h[3][:2] == h[0]  # the parent continues its own chain
    assert h[2][:2] == h[1]  # the sub-agent continues its own chain
    assert not set(h[1]) & set(h[0])  # another model: the same local ids are other blocks


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"t": -1.0, "in": 8, "out": 1, "hash_ids": [1, 2]}, "t must be"),
        ({"t": 0.0, "in": 0, "out": 1, "hash_ids": []}, "'in' must be"),
        ({"t": 0.0, "in": 8, "out": None, "hash_ids": [1, 2]}, "'out' must be"),
        ({"t": 0.0, "in": 9, "out": 1, "hash_ids": [1, 2, 3]}, "floor\\(9/4\\) = 2"),
        ({"t": 0.0, "in": 9, "out": 1, "hash_ids": [1]}, "floor\\(9/4\\) = 2"),
        ({"t": 0.0, "in": 9, "out": 1, "hash_ids": ["a", "b"]}, "hash_ids\\[0\\]"),
        ({"t": 1.0, "type": "subagent", "requests": {"x": 1}}, "'requests' must be a list"),
    ],
)
def test_kv_cache_tester_bad_entries_name_the_file_and_json_path(tmp_path, bad, match):
    good = {"t": 0.0, "in": 8, "out": 1, "hash_ids": [1, 2]}
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(_kvct_doc([good, bad])))
    with pytest.raises(ValueError, match=match) as e:
        load_trace(path)
    assert f"{path}: requests[1]" in str(e.value)


def test_kv_cache_tester_bad_documents(tmp_path):
    path = tmp_path / "conv.json"
    path.write_text(json.dumps({"block_size": 0, "requests": []}))
    with pytest.raises(ValueError, match="block_size must be"):
        load_kv_cache_tester(path)
    path.write_text('{"block_size": 64, "requests": [}')
    with pytest.raises(ValueError, match=f"{path}:1: not valid JSON"):
        load_kv_cache_tester(path)
    path.write_text(json.dumps(_kvct_doc([])))
    with pytest.raises(ValueError, match="no requests"):
        load_kv_cache_tester(path)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_kvct_doc([{"t": 0, "in": 8, "out": 1, "hash_ids": [1]}], 8)))
    path.write_text(json.dumps(_kvct_doc([{"t": 0, "in": 8, "out": 1, "hash_ids": [1, 2]}], 4)))
    with pytest.raises(ValueError, match="block_size 8 differs"):
        load_kv_cache_tester([path, other])


def test_namespace_seed_is_pinned():
    # BLAKE2b-64 of the label, little-endian: pinned so that bundled-trace hashes never drift.
    assert namespace_seed("mooncake:conversation_trace.jsonl") == 0xDB0576A6C6EF7A9B


def test_bundled_claude_code_sessions_are_the_original_files():
    from kvroute.sim.traces import bundled_claude_code_dir, claude_code_sessions

    for name in ("trace_0002.json", "trace_0007.json"):
        packed = gzip.decompress((bundled_claude_code_dir() / f"{name}.gz").read_bytes())
        assert packed == (Path(__file__).parent / "data" / "traces" / name).read_bytes()
    w = claude_code_sessions()
    assert len(w) == 132 and w.block_size == 64
    assert sorted({s.split("/")[0] for s in w.session}) == [
        "trace_0001",
        "trace_0002",
        "trace_0006",
        "trace_0007",
    ]
