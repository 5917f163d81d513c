"""JSON Lines trace loaders: Mooncake and Qwen-Bailian (one request per line, block ids only).

- **Mooncake** (FAST'25 release): ``timestamp`` (ms since the trace start), ``input_length``,
  ``output_length`` (tokens) and ``hash_ids`` — one id per 512-token block *including the final
  partial block*. ``block_size`` defaults to 512.
- **Qwen-Bailian** (alibaba-edu/qwen-bailian-usagetraces-anon, Apache-2.0): the same four fields
  with ``timestamp`` in **seconds** since the trace start, ``hash_ids`` of 16-token blocks, plus
  ``chat_id`` and ``parent_chat_id`` (-1 for a conversation's first request), ``type`` and
  ``turn``. ``block_size`` defaults to the ``blksz_<N>`` of the file name (``qwen_traceA_blksz_16
  .jsonl``), else 16. Each request's session is its conversation: the root reached by following
  ``parent_chat_id`` up to -1; a parent not in the file (the conversation began before the trace)
  stands for the root. ``type`` and ``turn`` are not read (requests carry no such field).

Ids are turned into prefix-chained hashes under one namespace per file
(:func:`~kvroute.sim.workloads.chain_block_ids`). Bad rows raise ``ValueError`` naming the file,
the line and the value; nothing is returned half-loaded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .trace_io import PathLike, check_ids, is_int, is_number, open_text, plain_name
from .workloads import Workload, chain_block_ids, namespace_seed, offsets_from_lengths

__all__ = [
    "BAILIAN_BLOCK_SIZE",
    "MOONCAKE_BLOCK_SIZE",
    "bailian_block_size",
    "load_bailian",
    "load_mooncake",
]

MOONCAKE_BLOCK_SIZE = 512
BAILIAN_BLOCK_SIZE = 16
_BLKSZ = re.compile(r"blksz_(\d+)")


class _Columns:
    """The columns read from one JSONL trace, in file order."""

    def __init__(self) -> None:
        self.arrival: list[float] = []
        self.n_in: list[int] = []
        self.n_out: list[int] = []
        self.ids: list[int] = []
        self.lengths: list[int] = []

    def add(self, t: float, n_in: int, n_out: int, ids: list[int]) -> None:
        self.arrival.append(t)
        self.n_in.append(n_in)
        self.n_out.append(n_out)
        self.ids.extend(ids)
        self.lengths.append(len(ids))

    def hashes(self, label: str) -> tuple[np.ndarray, np.ndarray]:
        offsets = offsets_from_lengths(self.lengths)
        ids = np.array(self.ids, dtype=np.uint64)
        return chain_block_ids(ids, offsets, namespace_seed(label)), offsets


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every non-blank line: ``where`` is ``path:line``."""
    with open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _request(
    row: dict[str, Any], where: str, block_size: int, unit: str
) -> tuple[float, int, int, list[int]]:
    """The four request fields of a row (``timestamp`` as given, in ``unit``)."""
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in row:
            raise ValueError(f"{where}: missing field {key!r}")
    ts, n_in, n_out, ids = (
        row["timestamp"],
        row["input_length"],
        row["output_length"],
        row["hash_ids"],
    )
    if not is_number(ts) or ts < 0:
        raise ValueError(f"{where}: timestamp must be a finite number >= 0 ({unit}), got {ts!r}")
    if not is_int(n_in) or n_in < 1:
        raise ValueError(f"{where}: input_length must be an integer >= 1, got {n_in!r}")
    if not is_int(n_out) or n_out < 0:
        raise ValueError(f"{where}: output_length must be an integer >= 0, got {n_out!r}")
    check_ids(ids, where)
    most = -(-n_in // block_size)
    if len(ids) > most:
        raise ValueError(
            f"{where}: {len(ids)} hash_ids but input_length {n_in} fills at most {most} blocks "
            f"of {block_size} tokens (is the block size right?)"
        )
    return float(ts), n_in, n_out, ids


def _read(
    path: Path,
    block_size: int,
    unit: str,
    extra: Callable[[dict[str, Any], str], None] | None = None,
) -> _Columns:
    if not is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    cols = _Columns()
    for where, row in _rows(path):
        t, i, o, h = _request(row, where, block_size, unit)
        if extra is not None:
            extra(row, where)
        cols.add(t, i, o, h)
    if not cols.arrival:
        raise ValueError(f"{path}: no requests")
    return cols


# ---------------------------------------------------------------------------------------------
# Mooncake
# ---------------------------------------------------------------------------------------------
def load_mooncake(
    path: PathLike,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    namespace: str | None = None,
    name: str | None = None,
) -> Workload:
    """Load a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``). ``len(hash_ids)`` may not exceed ``ceil(input_length / block_size)``; fewer ids
    leave the prompt's tail without blocks (never cached)."""
    path = Path(path)
    cols = _read(path, block_size, "ms")
    label = namespace if namespace is not None else f"mooncake:{plain_name(path)}"
    hashes, offsets = cols.hashes(label)
    return Workload(
        arrival=[t / 1000.0 for t in cols.arrival],
        input_tokens=cols.n_in,
        output_tokens=cols.n_out,
        hashes=hashes,
        offsets=offsets,
        block_size=block_size,
        name=name or path.name,
        description=f"Mooncake-format trace {path.name} ({block_size}-token blocks)",
        meta={"format": "mooncake", "source": str(path)},
    )


# ---------------------------------------------------------------------------------------------
# Qwen-Bailian
# ---------------------------------------------------------------------------------------------
def bailian_block_size(path: PathLike) -> int:
    """The block size a Qwen-Bailian file name declares (``..._blksz_<N>...``), else 16."""
    m = _BLKSZ.search(plain_name(Path(path)))
    if m is None:
        return BAILIAN_BLOCK_SIZE
    size = int(m.group(1))
    if size < 1:
        raise ValueError(f"{path}: the file name declares block size {size} (blksz_), not >= 1")
    return size


def _session_roots(parent: dict[int, int], where: dict[int, str]) -> dict[int, int]:
    """``{chat_id: root}``: the root is the chat reached by following parents up to -1, or the
    first parent not in the file."""
    root: dict[int, int] = {}
    for start in parent:
        chain: list[int] = []
        on_chain: set[int] = set()
        c = start
        while c not in root:
            p = parent[c]
            if p == -1 or p not in parent:
                root[c] = c if p == -1 else p
                break
            if c in on_chain:
                raise ValueError(f"{where[c]}: chat_id {c} is its own ancestor (parent_chat_id)")
            chain.append(c)
            on_chain.add(c)
            c = p
        r = root[c]
        for x in chain:
            root[x] = r
    return root


def load_bailian(
    path: PathLike,
    *,
    block_size: int | None = None,
    namespace: str | None = None,
    name: str | None = None,
) -> Workload:
    """Load a Qwen-Bailian JSONL trace (``timestamp`` s, ``chat_id``, ``parent_chat_id``,
    ``input_length``, ``output_length``, ``hash_ids``); ``block_size`` defaults to
    :func:`bailian_block_size` of the file name. Sessions are conversations (module docs)."""
    path = Path(path)
    bs = bailian_block_size(path) if block_size is None else block_size
    chats: list[int] = []
    parent: dict[int, int] = {}
    first_seen: dict[int, str] = {}

    def chat(row: dict[str, Any], where: str) -> None:
        for key in ("chat_id", "parent_chat_id"):
            if key not in row:
                raise ValueError(f"{where}: missing field {key!r}")
        cid, pid = row["chat_id"], row["parent_chat_id"]
        if not is_int(cid) or cid < 0:
            raise ValueError(f"{where}: chat_id must be an integer >= 0, got {cid!r}")
        if not is_int(pid) or pid < -1:
            raise ValueError(f"{where}: parent_chat_id must be an integer >= -1, got {pid!r}")
        if parent.setdefault(cid, pid) != pid:
            raise ValueError(
                f"{where}: chat_id {cid} again, with parent_chat_id {pid} "
                f"({first_seen[cid]}: {parent[cid]})"
            )
        first_seen.setdefault(cid, where)
        chats.append(cid)

    cols = _read(path, bs, "s", chat)
    root = _session_roots(parent, first_seen)
    session = [f"chat-{root[c]}" for c in chats]
    label = namespace if namespace is not None else f"bailian:{plain_name(path)}"
    hashes, offsets = cols.hashes(label)
    return Workload(
        arrival=cols.arrival,
        input_tokens=cols.n_in,
        output_tokens=cols.n_out,
        hashes=hashes,
        offsets=offsets,
        block_size=bs,
        session=session,
        name=name or path.name,
        description=(
            f"Qwen-Bailian trace {path.name} ({bs}-token blocks, "
            f"{len(set(session)):,} conversations)"
        ),
        meta={"format": "bailian", "source": str(path)},
    )
