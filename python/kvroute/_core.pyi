"""Type stubs for the Rust extension module ``kvroute._core``."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__version__: str

Key = str | bytes | int
U64Array = npt.NDArray[np.uint64] | Sequence[int]

def hash_key(key: Key) -> int:
    """XXH3-64 (seed 0) of a str's UTF-8 bytes, bytes as given, or an int's 8 LE bytes."""

def jump_hash(key: int, num_buckets: int) -> int:
    """Lamping–Veach jump consistent hash of the 64-bit ``key`` into ``0..num_buckets``."""

def jump_hash_many(keys: U64Array, num_buckets: int) -> npt.NDArray[np.int64]:
    """``jump_hash`` of every key (NumPy uint64 array or sequence of ints), GIL released."""
