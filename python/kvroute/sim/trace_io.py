"""Reading trace files: what every trace loader of :mod:`.traces` shares.

- Files are UTF-8, read with ``utf-8-sig``: a byte-order mark at the start (as some Windows tools
  write) is dropped, not taken for part of the first row. ``.gz`` files are read transparently.
- Checks of single values (integers, finite numbers, ``hash_ids`` lists) raise ``ValueError``
  naming where the value was (``where``: file and line, or JSON path) and the value.
- Token counts are at most :data:`MAX_TOKENS` and timestamps at most :data:`MAX_SECONDS`: a value
  beyond them is a corrupt row, not a request (no model's context is that long; no trace that old).
- A file that is not UTF-8, or a ``.gz`` that is not gzip or is cut short, raises ``ValueError``
  naming the file and the line of the bad byte (or where the .gz stops) — :func:`read_error`.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import zlib
from pathlib import Path
from typing import Any, Union

__all__ = [
    "MAX_SECONDS",
    "MAX_TOKENS",
    "PathLike",
    "check_count",
    "check_ids",
    "check_time",
    "is_int",
    "is_number",
    "open_text",
    "plain_name",
    "read_error",
    "shown",
]

PathLike = Union[str, "os.PathLike[str]"]

_U64_LIMIT = 1 << 64
#: The most tokens a trace row's prompt or output may have (longer: a corrupt row).
MAX_TOKENS = 10_000_000
#: The latest arrival a trace may have, in seconds from its start (about 31.7 years).
MAX_SECONDS = 1e9
#: What a file can fail with while it is read (besides bad JSON).
READ_ERRORS = (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error)


def open_text(path: Path) -> io.TextIOBase:
    """``path`` opened for reading text (gunzipped when it ends in ``.gz``; a BOM is dropped)."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def plain_name(path: Path) -> str:
    """The file name without a ``.gz`` suffix: a compressed copy loads with the same hashes."""
    return path.name[:-3] if path.name.endswith(".gz") else path.name


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer beyond the float range
        return False


def shown(x: Any) -> str:
    """``repr(x)``, cut to 60 characters (and an integer too long to print named as one)."""
    try:
        text = repr(x)
    except ValueError:  # more digits than Python converts
        return "an integer of more than 4300 digits"
    return text if len(text) <= 60 else text[:57] + "..."


def check_count(x: Any, field: str, where: str, low: int) -> int:
    """``x`` if it is an integer token count in ``[low, MAX_TOKENS]``, else ``ValueError``."""
    if not is_int(x) or not low <= x <= MAX_TOKENS:
        raise ValueError(
            f"{where}: {field} must be an integer in [{low}, {MAX_TOKENS:,}] tokens, got {shown(x)}"
        )
    return x


def check_time(x: Any, field: str, where: str, unit: str, seconds: float) -> float:
    """``x`` as a float if it is a number of ``unit`` (``seconds`` each) in
    ``[0, MAX_SECONDS]`` seconds, else ``ValueError``."""
    if not is_number(x) or not 0 <= x * seconds <= MAX_SECONDS:
        raise ValueError(
            f"{where}: {field} must be a finite number in [0, {MAX_SECONDS / seconds:.0e}] "
            f"({unit}), got {shown(x)}"
        )
    return float(x)


def read_error(path: Path, e: BaseException) -> ValueError:
    """The ``ValueError`` for a file that could not be read (one of :data:`READ_ERRORS`), naming
    the file and, found by reading it again as bytes, the line of the bad byte or where a
    ``.gz`` stops."""
    if isinstance(e, (gzip.BadGzipFile, zlib.error)):
        return ValueError(f"{path}: not a valid gzip file ({e})")
    opener: Any = gzip.open if path.suffix == ".gz" else open
    line = 0
    try:
        with opener(path, "rb") as f:
            for line, raw in enumerate(f, start=1):  # noqa: B007 (read after the loop)
                raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return ValueError(
            f"{path}:{line}: not UTF-8 text ({bad.reason}: byte 0x{bad.object[bad.start]:02x} "
            f"at column {bad.start + 1})"
        )
    except (EOFError, gzip.BadGzipFile, zlib.error):
        return ValueError(
            f"{path}:{line + 1}: the gzip stream is cut short (truncated file) after {line} lines"
        )
    return ValueError(f"{path}: cannot be read ({type(e).__name__}: {e})")


def check_ids(ids: Any, where: str) -> None:
    """Raises ``ValueError`` unless ``ids`` is a list of integers in ``[0, 2^64)``."""
    if not isinstance(ids, list):
        raise ValueError(f"{where}: hash_ids must be a list of integers, got {ids!r:.80}")
    for k, h in enumerate(ids):
        if not is_int(h) or not 0 <= h < _U64_LIMIT:
            raise ValueError(
                f"{where}: hash_ids[{k}] must be an integer in [0, 2^64), got {shown(h)}"
            )
