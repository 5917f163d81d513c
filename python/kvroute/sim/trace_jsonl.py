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
(:func:`~kvroute.sim.workloads.chain_block_ids`). The block size is checked against the data
(:func:`check_block_size`): one id per block on every row, the final partial block included
(``len(hash_ids) == ceil(input_length / block_size)``, as in every row of both published Mooncake
traces), or full blocks only on every row (``floor``: kv-cache-tester's convention, and kvroute's
exports of such workloads). Up to :data:`SHORT_ROWS` of the rows may have up to
:data:`SHORT_IDS` fewer ids than that (a real trace's odd rows: a prompt whose ids were cut short;
their tails count as never cached): they are logged as a warning, naming the first. A row with
more ids than blocks, a row more than :data:`SHORT_IDS` ids short, or more short rows, is
refused, naming the row (and the block sizes that fit every row). Token counts above
:data:`~.trace_io.MAX_TOKENS` and timestamps after :data:`~.trace_io.MAX_SECONDS` are refused.
Bad rows raise ``ValueError`` naming the file, the line and the value; nothing is returned
half-loaded.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .trace_io import (
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
from .workloads import Workload, chain_block_ids, namespace_seed, offsets_from_lengths

log = logging.getLogger("kvroute.sim")

#: The largest share of a trace's rows that may have fewer ids than blocks (module docs).
SHORT_ROWS = 0.05
#: The most ids such a short row may lack (more: a corrupt row, refused).
SHORT_IDS = 4

__all__ = [
    "BAILIAN_BLOCK_SIZE",
    "MOONCAKE_BLOCK_SIZE",
    "SHORT_IDS",
    "SHORT_ROWS",
    "bailian_block_size",
    "block_size_range",
    "check_block_size",
    "load_bailian",
    "load_mooncake",
]

MOONCAKE_BLOCK_SIZE = 512
BAILIAN_BLOCK_SIZE = 16
_BLKSZ = re.compile(r"blksz_(\d+)")
_SECONDS = {"ms": 1e-3, "s": 1.0}


class _Columns:
    """The columns read from one JSONL trace, in file order."""

    def __init__(self) -> None:
        self.arrival: list[float] = []
        self.n_in: list[int] = []
        self.n_out: list[int] = []
        self.ids: list[int] = []
        self.lengths: list[int] = []
        self.lines: list[int] = []

    def add(self, line: int, t: float, n_in: int, n_out: int, ids: list[int]) -> None:
        self.lines.append(line)
        self.arrival.append(t)
        self.n_in.append(n_in)
        self.n_out.append(n_out)
        self.ids.extend(ids)
        self.lengths.append(len(ids))

    def check(self, path: Path, block_size: Any) -> None:
        """Raises ``ValueError`` unless ``block_size`` fits the rows (:func:`check_block_size`)."""
        if not is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        check_block_size(path, self.n_in, self.lengths, self.lines, block_size)

    def hashes(self, label: str) -> tuple[np.ndarray, np.ndarray]:
        offsets = offsets_from_lengths(self.lengths)
        ids = np.array(self.ids, dtype=np.uint64)
        return chain_block_ids(ids, offsets, namespace_seed(label)), offsets


def _rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """``(line, where, row)`` for every non-blank line: ``where`` is ``path:line``."""
    try:
        with open_text(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except ValueError as e:  # JSONDecodeError, or an integer of > 4300 digits
                    msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                    raise ValueError(f"{where}: not valid JSON ({msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
                yield lineno, where, row
    except READ_ERRORS as e:
        raise read_error(path, e) from None


def _request(row: dict[str, Any], where: str, unit: str) -> tuple[float, int, int, list[int]]:
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
    t = check_time(ts, "timestamp", where, unit, _SECONDS[unit])
    check_count(n_in, "input_length", where, 1)
    check_count(n_out, "output_length", where, 0)
    check_ids(ids, where)
    return t, n_in, n_out, ids


def _read(
    path: Path, unit: str, extra: Callable[[dict[str, Any], str], None] | None = None
) -> _Columns:
    cols = _Columns()
    for line, where, row in _rows(path):
        t, i, o, h = _request(row, where, unit)
        if extra is not None:
            extra(row, where)
        cols.add(line, t, i, o, h)
    if not cols.arrival:
        raise ValueError(f"{path}: no requests")
    return cols


def block_size_range(
    input_tokens: Sequence[int], num_ids: Sequence[int], *, full_blocks_only: bool = False
) -> tuple[int, int | None]:
    """``(lo, hi)``: the block sizes ``bs`` with ``len(hash_ids) == ceil(input_length / bs)`` on
    every row (``floor`` with ``full_blocks_only``); ``hi`` is None for no upper bound, and the
    range is empty when ``lo > hi``."""
    n = np.asarray(input_tokens, dtype=np.int64)
    k = np.asarray(num_ids, dtype=np.int64)
    if full_blocks_only:  # k*bs <= n < (k+1)*bs
        lo = int(np.max(n // (k + 1) + 1))
        some = k >= 1
        hi = int(np.min(n[some] // k[some])) if some.any() else None
    else:  # (k-1)*bs < n <= k*bs
        if np.any(k == 0):
            return 1, 0
        lo = int(np.max(-(-n // k)))
        some = k >= 2
        hi = int(np.min((n[some] - 1) // (k[some] - 1))) if some.any() else None
    return lo, hi


def _describe(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"block sizes >= {lo}"
    return f"block size {lo}" if lo == hi else f"block sizes {lo}..{hi}"


def check_block_size(
    path: Path, input_tokens: list[int], num_ids: list[int], lines: list[int], block_size: int
) -> None:
    """Raises ``ValueError`` unless every row has one id per ``block_size``-token block: the final
    partial block included (``ceil``, as Mooncake and Qwen-Bailian traces are written) or full
    blocks only (``floor``, as kv-cache-tester traces and synthetic workloads are), the same on
    every row — but for at most :data:`SHORT_ROWS` of the rows with fewer ids (logged). The
    message names the first row that does not fit and the block sizes that fit every row."""
    n = np.asarray(input_tokens, dtype=np.int64)
    k = np.asarray(num_ids, dtype=np.int64)
    ceil = -(-n // block_size)
    floor = n // block_size
    fits_ceil, fits_floor = k == ceil, k == floor
    if fits_ceil.all() or fits_floor.all():
        return
    # The convention most rows follow; the others may be short (fewer ids), a few of them.
    fits = fits_ceil if fits_ceil.sum() >= fits_floor.sum() else fits_floor
    short = ~fits & (k < ceil)
    far = short & (ceil - k > SHORT_IDS)
    if not (k > ceil).any() and not far.any() and short.sum() <= SHORT_ROWS * len(k):
        r = int(np.argmax(short))
        log.warning(
            "%s: %d of %d rows have fewer hash_ids than their %d-token blocks (the first: line "
            "%d, %d ids for %d tokens): their prompts' tails count as never cached",
            path,
            int(short.sum()),
            len(k),
            block_size,
            lines[r],
            k[r],
            n[r],
        )
        return
    misfit = ~(fits_ceil | fits_floor)
    if (k > ceil).any():  # more ids than blocks: named first, as no tolerance covers it
        misfit = k > ceil
    r = int(np.argmax(misfit)) if misfit.any() else int(np.argmin(fits_ceil))
    if k[r] > ceil[r]:
        what = f"fills at most {ceil[r]} blocks of {block_size} tokens"
    else:
        what = (
            f"fills {ceil[r]} blocks of {block_size} tokens (one id each, the final partial "
            f"block included; {floor[r]} full blocks)"
        )
        if ceil[r] - k[r] > SHORT_IDS:
            what += (
                f": {ceil[r] - k[r]} ids short, more than the {SHORT_IDS} a short row may lack "
                "(a corrupt input_length?)"
            )
    lo, hi = block_size_range(n, k)
    if hi is None or lo <= hi:
        fit = f"every row fits {_describe(lo, hi)}: pass it with --block-size (block_size=)"
    else:
        lo, hi = block_size_range(n, k, full_blocks_only=True)
        if hi is None or lo <= hi:
            fit = (
                f"every row fits {_describe(lo, hi)} (full blocks only): pass it with "
                "--block-size (block_size=)"
            )
        else:
            fit = "no single block size fits every row (are some rows' hash_ids cut short?)"
    raise ValueError(
        f"{path}:{lines[r]}: {k[r]} hash_ids but input_length {n[r]} {what}; is the block size "
        f"right? {fit}"
    )


# ---------------------------------------------------------------------------------------------
# Mooncake
# ---------------------------------------------------------------------------------------------
def load_mooncake(
    path: PathLike,
    *,
    block_size: int | None = None,
    namespace: str | None = None,
    name: str | None = None,
) -> Workload:
    """Load a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``). Every row must have ``ceil(input_length / block_size)`` ids (the final partial
    block included), or every row ``floor(...)`` (full blocks only: the tail is never cached), as
    :func:`check_block_size` checks: a wrong block size is refused, naming the ones that fit.
    ``block_size`` defaults to the rows' own ``block_size`` (which :func:`~.traces.write_mooncake`
    writes; the same on every row), else 512."""
    path = Path(path)
    declared: list[int] = []

    def own_block_size(row: dict[str, Any], where: str) -> None:
        if "block_size" not in row:
            return
        bs = row["block_size"]
        if not is_int(bs) or bs < 1 or (declared and bs != declared[0]):
            first = f" (earlier rows: {declared[0]})" if declared else ""
            raise ValueError(f"{where}: block_size must be an integer >= 1{first}, got {bs!r}")
        if not declared:
            declared.append(bs)

    cols = _read(path, "ms", own_block_size)
    if block_size is None:
        block_size = declared[0] if declared else MOONCAKE_BLOCK_SIZE
    cols.check(path, block_size)
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

    cols = _read(path, "s", chat)
    cols.check(path, bs)
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
