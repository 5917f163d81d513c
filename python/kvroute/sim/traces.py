"""Trace loaders: Mooncake and Qwen-Bailian JSONL, kv-cache-tester JSON, detected by
:func:`load_trace`.

Formats (all carry block ids, never tokens):

- **Mooncake** (FAST'25 release, JSON Lines): one object per line with ``timestamp`` (ms since the
  trace start), ``input_length``, ``output_length`` (tokens) and ``hash_ids`` — one id per
  512-token block *including the final partial block*. ``block_size`` defaults to 512.
- **Qwen-Bailian** (JSON Lines, :func:`~.trace_jsonl.load_bailian`): Mooncake's four fields with
  ``timestamp`` in *seconds*, 16-token blocks (or the file name's ``blksz_<N>``), and ``chat_id``
  / ``parent_chat_id``: each request's session is its conversation's root chat.
- **kv-cache-tester** (one JSON document per conversation): top-level ``block_size`` (64) and
  ``requests[]`` with ``t`` (s since the conversation start), ``in``, ``out`` and ``hash_ids`` of
  *full* blocks only; entries with ``type == "subagent"`` nest their own ``requests`` whose ``t``
  counts from the sub-agent's own ``t``. Ids are local to the file, unless the document declares
  ``"hash_id_scope": "global"``: then they name the same blocks in every such file.

Guarantees:

- Ids become prefix-chained block hashes under a per-trace namespace
  (:func:`~kvroute.sim.workloads.chain_block_ids`): one file's chains never meet another file's
  (kv-cache-tester files of global id scope excepted: they share one namespace), and in
  kv-cache-tester files each model (the parent's, a sub-agent's) gets its own namespace, since
  different models never share KV blocks.
- A trace's block size is honoured (read from the file or its name, or given for Mooncake and
  Qwen-Bailian).
- Bad input raises ``ValueError`` naming the file and the line (JSONL) or JSON path (JSON) and
  the offending value; nothing is returned half-loaded. Rows out of time order are sorted (stably).
- A directory of kv-cache-tester files is many conversations merged by time; conversation ``k``
  (files in name order) starts at an offset drawn from a seeded arrival process (``starts``).
- ``.gz`` files are read transparently.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .trace_io import (
    MAX_SECONDS,
    READ_ERRORS,
    PathLike,
    check_count,
    check_ids,
    check_time,
    is_int,
    open_text,
    plain_name,
    read_error,
)
from .trace_jsonl import (
    BAILIAN_BLOCK_SIZE,
    MOONCAKE_BLOCK_SIZE,
    bailian_block_size,
    load_bailian,
    load_mooncake,
)
from .workloads import (
    Workload,
    chain_block_ids,
    gather_spans,
    namespace_seed,
    offsets_from_lengths,
)

__all__ = [
    "BAILIAN_BLOCK_SIZE",
    "MOONCAKE_BLOCK_SIZE",
    "bailian_block_size",
    "bundled_claude_code_dir",
    "bundled_mooncake_path",
    "claude_code_sessions",
    "conversation_starts",
    "export_losses",
    "load_bailian",
    "load_kv_cache_tester",
    "load_mooncake",
    "load_trace",
    "mooncake_conversation",
    "write_mooncake",
]


# ---------------------------------------------------------------------------------------------
# kv-cache-tester
# ---------------------------------------------------------------------------------------------
class _Flat:
    """Requests flattened out of one kv-cache-tester document."""

    def __init__(self) -> None:
        self.arrival: list[float] = []
        self.n_in: list[int] = []
        self.n_out: list[int] = []
        self.session: list[str] = []
        self.models: list[str] = []
        self.id_parts: list[list[int]] = []


def _walk_kv_cache_tester(
    reqs: Any, where: str, t0: float, session: str, block_size: int, out: _Flat, strict: bool
) -> None:
    if not isinstance(reqs, list):
        raise ValueError(f"{where}: 'requests' must be a list")
    for k, r in enumerate(reqs):
        here = f"{where}[{k}]"
        if not isinstance(r, dict):
            raise ValueError(f"{here}: expected a JSON object, got {type(r).__name__}")
        t = check_time(r.get("t"), "t", here, "s", 1.0)
        if t0 + t > MAX_SECONDS:
            raise ValueError(f"{here}: arrives at {t0 + t:.3g} s, after {MAX_SECONDS:.0e} s")
        if r.get("type") == "subagent":
            agent = r.get("agent_id", f"subagent{k}")
            _walk_kv_cache_tester(
                r.get("requests"),
                f"{here}.requests",
                t0 + float(t),
                f"{session}/{agent}",
                block_size,
                out,
                strict,
            )
            continue
        n_in, n_out, ids = r.get("in"), r.get("out"), r.get("hash_ids")
        check_count(n_in, "'in'", here, 1)
        check_count(n_out, "'out'", here, 0)
        check_ids(ids, here)
        full = n_in // block_size
        if len(ids) > -(-n_in // block_size) or (strict and len(ids) != full):
            raise ValueError(
                f"{here}: {len(ids)} hash_ids for {n_in} input tokens; expected "
                f"floor({n_in}/{block_size}) = {full} full blocks"
            )
        out.arrival.append(t0 + float(t))
        out.n_in.append(n_in)
        out.n_out.append(n_out)
        out.session.append(session)
        out.models.append(str(r.get("model", "")))
        out.id_parts.append(ids)


def _read_kv_cache_tester(path: Path) -> tuple[dict[str, Any], int]:
    try:
        with open_text(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except READ_ERRORS as e:
        raise read_error(path, e) from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or "requests" not in doc:
        raise ValueError(f"{path}: not a kv-cache-tester trace (no top-level 'requests')")
    block_size = doc.get("block_size")
    if not is_int(block_size) or block_size < 1:
        raise ValueError(f"{path}: block_size must be an integer >= 1, got {block_size!r}")
    scope = doc.get("hash_id_scope")
    if scope not in _ID_SCOPES:
        raise ValueError(
            f"{path}: hash_id_scope must be 'local' (ids meaningful within the file; also "
            f"'per_context' or absent) or 'global' (shared by every file), got {scope!r}"
        )
    return doc, block_size


#: ``hash_id_scope`` values: ``"global"`` ids mean the same blocks in every file declaring it;
#: the others (kv-cache-tester's ``trace_replay_tester.py`` defaults to ``"per_context"``) are
#: meaningful within the file only.
_ID_SCOPES = (None, "local", "per_context", "global")


def _id_namespace(doc: dict[str, Any], k: int, path: Path, model: str) -> str:
    """The namespace of ``model``'s ids in file ``k``: shared by every ``"global"`` file."""
    if doc.get("hash_id_scope") == "global":
        return f"kvct:global:{model}"
    return f"kvct:{k}:{plain_name(path)}:{model}"


def conversation_starts(
    count: int, starts: str | Sequence[float], *, mean_gap: float, seed: int
) -> np.ndarray:
    """Start offsets (s) for ``count`` merged conversations.

    ``starts`` is ``"poisson"`` (exponential gaps of mean ``mean_gap``, the first at 0),
    ``"uniform"`` (one every ``mean_gap`` seconds), ``"together"`` (all at 0), or explicit offsets.
    """
    if isinstance(starts, str):
        if starts == "together":
            return np.zeros(count)
        if not (mean_gap >= 0 and math.isfinite(mean_gap)):
            raise ValueError(f"mean_gap must be a finite number >= 0, got {mean_gap}")
        if starts == "uniform":
            return np.arange(count) * float(mean_gap)
        if starts == "poisson":
            gaps = np.random.default_rng(seed).exponential(mean_gap, size=count)
            gaps[0] = 0.0
            return np.cumsum(gaps)
        raise ValueError(
            f"starts must be 'poisson', 'uniform', 'together' or offsets, got {starts!r}"
        )
    offs = np.asarray(starts, dtype=np.float64)
    if offs.shape != (count,):
        raise ValueError(f"need {count} start offsets, got {offs.shape[0]}")
    if not np.all(np.isfinite(offs)) or np.any(offs < 0):
        raise ValueError("start offsets must be finite and >= 0")
    return offs


def load_kv_cache_tester(
    paths: PathLike | Sequence[PathLike],
    *,
    starts: str | Sequence[float] = "poisson",
    mean_gap: float = 60.0,
    seed: int = 0,
    strict: bool = True,
    name: str | None = None,
) -> Workload:
    """Load one or more kv-cache-tester traces (files, or a directory of ``*.json[.gz]``).

    Each file is one conversation (its sub-agents included, as sessions ``<id>/<agent_id>``);
    conversations start at :func:`conversation_starts` offsets and are merged by time. ``strict``
    demands ``len(hash_ids) == floor(in / block_size)`` as the format specifies.
    """
    files = _expand(paths)
    offs = conversation_starts(len(files), starts, mean_gap=mean_gap, seed=seed)
    block_size: int | None = None
    flat = _Flat()
    namespaces: list[str] = []
    for k, path in enumerate(files):
        doc, bs = _read_kv_cache_tester(path)
        if block_size is None:
            block_size = bs
        elif bs != block_size:
            raise ValueError(f"{path}: block_size {bs} differs from {block_size} of {files[0]}")
        conv = str(doc.get("id", path.stem))
        before = len(flat.arrival)
        _walk_kv_cache_tester(
            doc["requests"], f"{path}: requests", float(offs[k]), conv, bs, flat, strict
        )
        namespaces.extend(_id_namespace(doc, k, path, m) for m in flat.models[before:])
    if not flat.arrival or block_size is None:
        raise ValueError(f"{', '.join(map(str, files))}: no requests")
    lengths = np.fromiter((len(p) for p in flat.id_parts), dtype=np.int64, count=len(flat.id_parts))
    offsets = offsets_from_lengths(lengths)
    ids = np.fromiter(
        (h for p in flat.id_parts for h in p), dtype=np.uint64, count=int(offsets[-1])
    )
    # One namespace per (file, model): chain each group separately.
    hashes = np.empty_like(ids)
    groups: dict[str, list[int]] = {}
    for r, label in enumerate(namespaces):
        groups.setdefault(label, []).append(r)
    for label, rows in groups.items():
        rows_a = np.asarray(rows, dtype=np.int64)
        gather, sub_off = gather_spans(offsets[rows_a], lengths[rows_a])
        hashes[gather] = chain_block_ids(ids[gather], sub_off, namespace_seed(label))
    label = name or (files[0].name if len(files) == 1 else f"{len(files)} kv-cache-tester traces")
    return Workload(
        arrival=flat.arrival,
        input_tokens=flat.n_in,
        output_tokens=flat.n_out,
        hashes=hashes,
        offsets=offsets,
        block_size=block_size,
        session=flat.session,
        name=label,
        description=(
            f"kv-cache-tester agentic traces ({len(files)} conversation(s), {block_size}-token "
            f"blocks, starts={starts if isinstance(starts, str) else 'explicit'})"
        ),
        meta={"format": "kv-cache-tester", "source": [str(p) for p in files]},
    )


def _expand(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(
                q for q in p.iterdir() if q.is_file() and q.name.endswith((".json", ".json.gz"))
            )
            if not found:
                raise ValueError(f"{p}: directory holds no *.json trace files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"{p}: no such file or directory")
    if not files:
        raise ValueError("no trace files given")
    return files


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------
def _detect(path: Path) -> str:
    try:
        with open_text(path) as f:
            head = f.read(1 << 16)
    except READ_ERRORS as e:
        raise read_error(path, e) from None
    stripped = head.lstrip()
    if not stripped:
        raise ValueError(f"{path}: empty file")
    first_line = stripped.split("\n", 1)[0].strip()
    try:
        row = json.loads(first_line)
    except ValueError as e:
        row = None
        # A JSONL trace whose first row is broken (a kv-cache-tester document has "requests":
        # its own loader names the line).
        mooncake_keys = '"hash_ids"' in first_line or '"timestamp"' in first_line
        if first_line.startswith("{") and mooncake_keys and '"requests"' not in head:
            line = head[: len(head) - len(stripped)].count("\n") + 1
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            raise ValueError(
                f"{path}:{line}: not valid JSON ({msg}) in the first row of a Mooncake or "
                "Qwen-Bailian JSONL trace"
            ) from None
    if isinstance(row, dict) and "hash_ids" in row and "timestamp" in row:
        if "chat_id" in row and "parent_chat_id" in row:
            return "bailian"
        return "mooncake"
    if stripped.startswith("{") and '"requests"' in head:
        return "kv-cache-tester"
    raise ValueError(
        f"{path}: unknown trace format (expected Mooncake JSONL rows with 'timestamp' and "
        "'hash_ids' (Qwen-Bailian: also 'chat_id' and 'parent_chat_id'), or a kv-cache-tester "
        "JSON document with 'block_size' and 'requests')"
    )


def load_trace(path: PathLike, **options: Any) -> Workload:
    """Load a trace file or directory, detecting the format.

    A directory is a set of kv-cache-tester conversations. Keyword options go to the loader:
    :func:`load_mooncake` or :func:`load_bailian` (``block_size``, ``namespace``, ``name``) or
    :func:`load_kv_cache_tester` (``starts``, ``mean_gap``, ``seed``, ``strict``, ``name``).
    """
    p = Path(path)
    if p.is_dir():
        return load_kv_cache_tester(p, **options)
    if not p.is_file():
        raise ValueError(f"{p}: no such file or directory")
    fmt = _detect(p)
    if fmt == "mooncake":
        return load_mooncake(p, **options)
    if fmt == "bailian":
        return load_bailian(p, **options)
    return load_kv_cache_tester(p, **options)


# ---------------------------------------------------------------------------------------------
# Bundled data
# ---------------------------------------------------------------------------------------------
def bundled_mooncake_path() -> Path:
    """Path of the bundled Mooncake FAST'25 conversation trace (gzip; see ``sim/data/NOTICE``)."""
    return Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"


def mooncake_conversation() -> Workload:
    """The Mooncake FAST'25 conversation trace shipped with kvroute (``--scenario mooncake``):
    12,031 requests over 3,537 s, 512-token blocks."""
    w = load_mooncake(bundled_mooncake_path(), namespace="mooncake:conversation_trace.jsonl")
    w.name = "mooncake-conversation"
    w.description = (
        "Mooncake FAST'25 conversation trace (Moonshot AI / Kimi production, one hour sampled; "
        "kvcache-ai/Mooncake@3b5a5941, Apache-2.0), 512-token blocks"
    )
    return w


def bundled_claude_code_dir() -> Path:
    """Directory of the four bundled kv-cache-tester Claude Code traces (gzip; see its
    ``NOTICE``): the same files as ``kv-cache-tester/traces/trace_000{1,2,6,7}.json``."""
    return Path(__file__).resolve().parent / "data" / "claude_code"


def claude_code_sessions(*, seed: int = 0) -> Workload:
    """The four bundled Claude Code sessions (``--scenario claude-code``): 132 requests of ~88k
    prompt tokens in 64-token blocks, conversations starting at Poisson offsets (mean gap 60 s,
    ``seed``) — the same workload as ``load_trace`` on a directory holding the original files."""
    w = load_kv_cache_tester(bundled_claude_code_dir(), seed=seed)
    w.name = "claude-code"
    w.description = (
        "four Claude Code sessions recorded by kv-cache-tester "
        "(callanjfox/kv-cache-tester@94f6046, Apache-2.0), 64-token blocks"
    )
    return w


def export_losses(workload: Workload) -> str | None:
    """What :func:`write_mooncake` cannot keep of ``workload`` (its tenants and sessions: the
    format has neither), as a sentence, or None when it keeps everything."""
    tenants = sorted({t for t in workload.tenant if t is not None})
    sessions = {s for s in workload.session if s is not None}
    lost = []
    if tenants:
        mine = sum(t is not None for t in workload.tenant)
        lost.append(
            f"the tenant{'s' if len(tenants) > 1 else ''} {', '.join(map(repr, tenants))} "
            f"({mine:,} requests)"
        )
    if sessions:
        lost.append(f"{len(sessions):,} sessions")
    if not lost:
        return None
    return (
        f"Mooncake rows carry no tenant or session: the file drops {' and '.join(lost)}; "
        "replaying it routes every request as an anonymous public one (no endpoint study, no "
        "session keys)"
    )


def write_mooncake(workload: Workload, path: PathLike) -> None:
    """Write ``workload`` as a Mooncake-format JSONL trace (``.gz`` compresses).

    Block hashes become dense ids in order of first appearance (as in the released traces), so
    :func:`load_mooncake` gives back the same requests with the same sharing structure: equal ids
    exactly where the hashes were equal. Every row carries the workload's ``block_size`` (a key
    Mooncake's own rows lack; readers of the format ignore it), which :func:`load_mooncake` takes
    as the file's block size. Timestamps are written in ms (rounded to µs). Tenants and sessions
    are not part of the format and are lost.
    """
    _, first, inverse = np.unique(workload.hashes, return_index=True, return_inverse=True)
    rank = np.empty(first.shape[0], dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.shape[0])
    ids = rank[inverse.reshape(-1)].tolist()
    off = workload.offsets.tolist()
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i in range(len(workload)):
            row = {
                "timestamp": round(float(workload.arrival[i]) * 1000.0, 3),
                "input_length": int(workload.input_tokens[i]),
                "output_length": int(workload.output_tokens[i]),
                "hash_ids": ids[off[i] : off[i + 1]],
                "block_size": workload.block_size,
            }
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
