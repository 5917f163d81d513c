"""Reading trace files: what every trace loader of :mod:`.traces` shares.

- Files are UTF-8, read with ``utf-8-sig``: a byte-order mark at the start (as some Windows tools
  write) is dropped, not taken for part of the first row. ``.gz`` files are read transparently.
- Checks of single values (integers, finite numbers, ``hash_ids`` lists) raise ``ValueError``
  naming where the value was (``where``: file and line, or JSON path) and the value.
"""

from __future__ import annotations

import gzip
import io
import math
import os
from pathlib import Path
from typing import Any, Union

__all__ = ["PathLike", "check_ids", "is_int", "is_number", "open_text", "plain_name"]

PathLike = Union[str, "os.PathLike[str]"]

_U64_LIMIT = 1 << 64


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
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def check_ids(ids: Any, where: str) -> None:
    """Raises ``ValueError`` unless ``ids`` is a list of integers in ``[0, 2^64)``."""
    if not isinstance(ids, list):
        raise ValueError(f"{where}: hash_ids must be a list of integers, got {ids!r:.80}")
    for k, h in enumerate(ids):
        if not is_int(h) or not 0 <= h < _U64_LIMIT:
            raise ValueError(f"{where}: hash_ids[{k}] must be an integer in [0, 2^64), got {h!r}")
