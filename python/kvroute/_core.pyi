"""Type stubs for the Rust extension module ``kvroute._core``."""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, final, overload, type_check_only

import numpy as np
import numpy.typing as npt

__all__ = [
    "BlockCache",
    "BlockHasher",
    "Decision",
    "HashRing",
    "JumpHash",
    "KvEventApplier",
    "Maglev",
    "NoWorkerError",
    "PdDecision",
    "PrefixIndex",
    "ReadOnlyError",
    "Rendezvous",
    "Router",
    "__version__",
    "decode_kv_events",
    "hash_key",
    "jump_hash",
    "jump_hash_many",
]

__version__: str

_Key = str | bytes | int
_U64Array = npt.NDArray[np.uint64] | Sequence[int]
_Nodes = Iterable[str] | Mapping[str, float]
_Weights = Sequence[float] | Mapping[str, float]
_Keys = Iterable[_Key] | npt.NDArray[np.integer]
_Role = Literal["prefill", "decode", "both"]

def hash_key(key: _Key) -> int:
    """XXH3-64 (seed 0) of a str's UTF-8 bytes, bytes as given, or an int's 8 LE bytes."""

def jump_hash(key: int, num_buckets: int) -> int:
    """Lamping–Veach jump consistent hash of the 64-bit ``key`` into ``0..num_buckets``."""

def jump_hash_many(keys: _U64Array, num_buckets: int) -> npt.NDArray[np.int64]:
    """``jump_hash`` of every key (NumPy uint64 array or sequence of ints), GIL released."""

_TokenArray = (
    npt.NDArray[np.uint32]
    | npt.NDArray[np.int32]
    | npt.NDArray[np.uint64]
    | npt.NDArray[np.int64]
    | Sequence[int]
)
# A chain state accepted as ``parent``: a native block hash, or a vllm/sglang 32-byte digest.
_Parent = int | bytes | bytearray | npt.NDArray[np.uint8] | None
# Multimodal items of a vLLM request: (identifier, offset relative to tokens[0], length).
_MmItems = Sequence[tuple[str, int, int]]

@final
class BlockHasher:
    """Chained hashes of FULL token blocks, bit-exact with an engine's prefix-cache keys.

    ``hash(tokens)`` returns ``len(tokens) // block_size`` uint64 values; a partial tail is dropped.
    Profiles: ``"native"`` (XXH3-64 chain over little-endian u32 tokens), ``"vllm"`` (vLLM's block
    hash: ``hash_algo`` ``"sha256_cbor"`` (default) or ``"sha256"`` (vLLM's own default), for the
    extra-key format of ``vllm_version`` >= 0.23, default the newest), ``"sglang"`` (SGLang 0.5.23
    page hash; its signed int64 as the same bits).
    """

    def __new__(
        cls,
        block_size: int = 16,
        *,
        profile: Literal["native", "vllm", "sglang"] = "native",
        salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        seed: str | None = None,
        hash_algo: Literal["sha256", "sha256_cbor"] | None = None,
        vllm_version: str | None = None,
    ) -> BlockHasher: ...
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def profile(self) -> Literal["native", "vllm", "sglang"]:
        """The hash profile."""
    @property
    def salt(self) -> str | None:
        """The cache salt (an empty salt is stored as ``None``)."""
    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter name."""
    @property
    def lora_path(self) -> str | None:
        """The LoRA adapter path (``""`` when a LoRA was given without one)."""
    @property
    def seed(self) -> str | None:
        """vLLM's NONE_HASH seed string (``None`` for other profiles)."""
    @property
    def hash_algo(self) -> Literal["sha256", "sha256_cbor"] | None:
        """vLLM's ``--prefix-caching-hash-algo`` reproduced (``None`` for other profiles)."""
    @property
    def vllm_version(self) -> str | None:
        """The vLLM release (``"major.minor"``) whose extra-key format is reproduced."""
    @property
    def root(self) -> int | bytes | None:
        """Native root hash, vLLM NONE_HASH (32 bytes), or SGLang salt seed (``None`` unsalted).

        As ``parent`` it hashes like ``parent=None``, except that a vLLM cache salt only applies
        with ``parent=None`` (it is an extra key of the sequence's first block).
        """
    def hash(
        self, tokens: _TokenArray, parent: _Parent = None, *, mm: _MmItems | None = None
    ) -> npt.NDArray[np.uint64]:
        """Chained hashes of the full blocks of ``tokens``, continuing from ``parent``."""
    def hash_with_state(
        self, tokens: _TokenArray, parent: _Parent = None, *, mm: _MmItems | None = None
    ) -> tuple[npt.NDArray[np.uint64], int | bytes | None]:
        """``(hash(tokens, parent), state)``; pass ``state`` as the next call's ``parent``."""
    def digests(
        self, tokens: _TokenArray, parent: _Parent = None, *, mm: _MmItems | None = None
    ) -> npt.NDArray[np.uint8]:
        """``(n_blocks, 32)`` SHA-256 digests of the full blocks (vllm/sglang only)."""

_BlockHash = int | np.integer
_BlockHashes = npt.NDArray[np.uint64] | npt.NDArray[np.int64] | Sequence[int]

@final
class PrefixIndex:
    """Which worker holds which chained KV blocks (radix tree with path compression).

    A worker's blocks are prefix-closed. ``store`` needs the worker to hold ``parent``
    (``KeyError``); a block already stored after a different parent, or repeated, raises
    ``ValueError``; both leave the index unchanged. ``remove`` drops each listed block and every
    block after it that the worker holds. ``len()`` counts distinct blocks. Negative hashes
    (int64) are taken as their two's-complement bits. The index a router owns in approx mode
    (``router.index``) is read-only: writes raise ``ReadOnlyError`` saying why.
    """

    def __new__(cls, *, max_bytes: int | None = None) -> PrefixIndex: ...
    def store(
        self, worker: str, block_hashes: _BlockHashes, parent: _BlockHash | None = None
    ) -> None:
        """Worker now holds the chain ``block_hashes``, continuing from block ``parent``."""

    def remove(self, worker: str, block_hashes: _BlockHashes) -> int:
        """Worker dropped these blocks and the blocks after each; returns how many it dropped."""

    def clear(self, worker: str) -> int:
        """Worker dropped all its blocks (it stays known); returns how many."""

    def remove_worker(self, worker: str) -> int:
        """Forgets the worker and its blocks; returns how many blocks it held."""

    def match(self, block_hashes: _BlockHashes) -> dict[str, int]:
        """Per worker, how many leading blocks of the query it holds (0 omitted)."""

    @property
    def workers(self) -> list[str]:
        """Known workers, sorted."""

    @property
    def max_bytes(self) -> int | None:
        """The memory budget, or None."""

    @property
    def read_only(self) -> bool:
        """Whether writes raise ``ReadOnlyError`` (the router's approx-mode index)."""

    def num_blocks(self, worker: str) -> int:
        """Blocks held by ``worker`` (``KeyError`` if unknown)."""

    def __len__(self) -> int:
        """Distinct blocks held by at least one worker."""

    def __contains__(self, block_hash: _BlockHash, /) -> bool: ...
    def memory_bytes(self) -> int:
        """Heap bytes of the whole structure (what ``max_bytes`` bounds)."""

    def num_nodes(self) -> int:
        """Radix-tree nodes; a function of the stored state (nodes merge back)."""

    def dump(self) -> bytes:
        """Versioned, checksummed binary image of the index."""

    @staticmethod
    def load(data: bytes | bytearray | memoryview, *, max_bytes: int | None = None) -> PrefixIndex:
        """Index rebuilt from ``dump()`` output (``ValueError`` for a bad image)."""

    def _check_invariants(self) -> None: ...

@type_check_only
class _ConsistentHasher:
    """The face every hasher class shares (a typing aid: no such class exists at run time)."""

    def get(self, key: _Key) -> str:
        """The node ``key`` maps to (ValueError when there is no node)."""
    @overload
    def get_many(
        self, keys: _Keys, *, as_index: Literal[True]
    ) -> tuple[npt.NDArray[np.uint32], list[str]]:
        """``(positions, nodes)``: each key's node as a position in ``nodes`` (the node list as of
        the lookup), no per-key Python object."""
    @overload
    def get_many(self, keys: _Keys, *, as_index: Literal[False] = False) -> list[str]:
        """``[get(k) for k in keys]``, computed in Rust with the GIL released."""
    def preference(self, key: _Key, n: int) -> list[str]:
        """``n`` distinct nodes in the hasher's fallback order for ``key``, ``get(key)`` first."""
    def add(self, node: str, weight: float = 1) -> None: ...
    def remove(self, node: str) -> None: ...
    @property
    def nodes(self) -> list[str]:
        """Node names, in the order they were added."""
    def __len__(self) -> int: ...
    def __contains__(self, node: object, /) -> bool: ...

@final
class HashRing(_ConsistentHasher):
    """Consistent-hash ring: ``hash="ketama"`` (libketama/uhashring placement) or ``"xxh3"``."""

    def __new__(cls, nodes: _Nodes, *, vnodes: int = 160, hash: str = "ketama") -> HashRing: ...
    @property
    def vnodes(self) -> int: ...
    @property
    def hash(self) -> str: ...
    @property
    def points(self) -> list[tuple[int, str]]: ...

@final
class Maglev(_ConsistentHasher):
    """Maglev hashing with Envoy's table construction; ``table_size`` must be prime."""

    def __new__(
        cls, nodes: _Nodes, *, weights: _Weights | None = None, table_size: int = 65537
    ) -> Maglev: ...
    @property
    def table(self) -> list[str]: ...
    @property
    def table_size(self) -> int: ...

@final
class Rendezvous(_ConsistentHasher):
    """Weighted highest-random-weight hashing (logarithmic method)."""

    def __new__(cls, nodes: _Nodes, *, weights: _Weights | None = None) -> Rendezvous: ...

@final
class JumpHash(_ConsistentHasher):
    """Jump consistent hash over named nodes (MementoHash): any node can be removed."""

    def __new__(cls, nodes: Iterable[str]) -> JumpHash: ...

@final
class BlockCache:
    """LRU cache model of a worker's KV memory: leaf-first eviction, pins, leases, partitions.

    Eviction takes the least recently used unpinned leaf (a block with no cached child) that the
    inserting partition may evict; a partition's blocks up to its reservation are evicted only by
    inserts into that partition, and unused reservations are lent and taken back. A cached block
    inserted again into a declared partition moves to it. Calls that take ``now`` first release
    the leases that ended at or before it; ``now`` defaults to ``time.monotonic()`` (pass it on
    every call, or on none). Invalid input raises and changes nothing.
    """

    def __new__(
        cls, capacity: int, *, reserved: dict[str, int] | None = None, track_idle: bool = False
    ) -> BlockCache: ...
    def insert(
        self,
        block_hashes: _U64Array,
        *,
        partition: str | None = None,
        parent: int | None = None,
        now: float | None = None,
    ) -> tuple[int, npt.NDArray[np.uint64]]:
        """Insert a chain; returns (leading blocks now cached, evicted hashes in eviction order)."""

    def match(self, block_hashes: _U64Array, /) -> int:
        """Leading blocks cached; refreshes them."""

    def peek(self, block_hashes: _U64Array, /) -> int:
        """Leading blocks cached, without refreshing them."""

    def pin(
        self, block_hashes: _U64Array, *, ttl: float | None = None, now: float | None = None
    ) -> None:
        """One reference per listed block, or (with ``ttl``) a lease until ``now + ttl``."""

    def unpin(self, block_hashes: _U64Array, *, now: float | None = None) -> None:
        """Remove one reference per listed block; raises and changes nothing if one is unpinned."""

    def expire(self, *, now: float | None = None) -> int:
        """Release the leases ended at or before ``now``; returns how many."""

    def usage(self, partition: str | None = None) -> int:
        """Blocks that belong to ``partition`` (None: the shared pool)."""

    def expire_idle(
        self, max_idle: float, *, now: float | None = None
    ) -> tuple[npt.NDArray[np.uint64], float | None]:
        """Drop the evictable blocks idle for more than ``max_idle`` seconds at ``now`` (needs
        ``track_idle=True``), leaves first, least recently used first within each partition.
        Returns (dropped hashes in that order, last touch of the least recently used evictable
        block left or None): nothing expires before that time plus ``max_idle``, unless an
        eviction or a pin release intervenes."""

    def last_touch(self, block_hash: int) -> float | None:
        """The cache's clock (largest ``now`` passed so far) at the block's last touch, or None
        without ``track_idle``; KeyError if not cached."""

    def add_partition(self, name: str, reserved: int) -> None:
        """Declare partition ``name`` reserving ``reserved`` blocks (0: none); the reservations
        must fit in the capacity. ValueError if already declared."""

    def set_reserved(self, name: str, blocks: int) -> None:
        """Change a declared partition's reservation; lowering it evicts nothing (the blocks
        above it become borrowers). KeyError if undeclared, ValueError past the capacity."""

    def remove(self, block_hashes: _U64Array, /) -> npt.NDArray[np.uint64]:
        """Take the listed cached blocks out, in order (uncached ones ignored); each must be
        unpinned, without a lease, with no cached child left (list descendants first), else
        ValueError and nothing changes. Not a touch. Returns the removed hashes."""

    def pins(self, block_hash: int) -> int:
        """References held by ``pin`` (leases not counted); KeyError if not cached."""

    def lease_end(self, block_hash: int) -> float | None:
        """End time of the block's lease, or None; KeyError if not cached."""

    @property
    def capacity(self) -> int: ...
    @property
    def reserved(self) -> dict[str, int]: ...
    @property
    def track_idle(self) -> bool: ...
    def __len__(self) -> int: ...
    def __contains__(self, block_hash: object, /) -> bool: ...

@final
class KvEventApplier:
    """Applies engine KV-event payloads (vLLM / SGLang msgpack), per worker, to a PrefixIndex.

    ``mode="rehash"`` recomputes the router's own block hashes from each event's tokens with
    ``BlockHasher(block_size, profile=hash_profile, seed=seed, hash_algo=…, vllm_version=…)``
    chained from the parent's state
    (engine-hash -> own-hash map per worker); ``mode="direct"`` stores the engine's hashes as they
    are. Non-GPU media go to one index per tier (``tier_index``). Only KV-cache group
    ``group_idx`` is followed. A malformed payload raises ``ValueError`` and changes nothing;
    events that cannot be placed exactly are skipped and counted (``stats``). An index that is
    ``read_only`` (another object owns it: an approx-mode router's) raises ``ReadOnlyError``.
    """

    def __new__(
        cls,
        index: PrefixIndex,
        *,
        mode: Literal["rehash", "direct"] = "rehash",
        block_size: int = 16,
        hash_profile: Literal["native", "vllm", "sglang"] = "native",
        seed: str | None = None,
        group_idx: int = 0,
        hash_algo: Literal["sha256", "sha256_cbor"] | None = None,
        vllm_version: str | None = None,
    ) -> KvEventApplier: ...
    def apply(self, worker: str, payload: bytes | bytearray | memoryview) -> int:
        """Decodes and applies one batch; returns its number of events (GIL released)."""

    def clear(self, worker: str) -> None:
        """Forgets every block of ``worker`` in every tier; counted as a reset."""

    def remove_worker(self, worker: str) -> bool:
        """Clears ``worker``, drops it from the tier indexes and forgets its counters."""

    @overload
    def stats(self, worker: str) -> dict[str, int]: ...
    @overload
    def stats(self, worker: None = None) -> dict[str, dict[str, int]]: ...
    @property
    def workers(self) -> list[str]:
        """Workers that sent at least one payload, sorted."""

    @property
    def index(self) -> PrefixIndex:
        """The main (GPU) index."""

    def tier_index(self, medium: str) -> PrefixIndex | None:
        """The index of tier ``medium`` ("GPU" gives ``index``); None if never seen."""

    @property
    def tiers(self) -> list[str]:
        """Non-GPU tiers seen so far, in order of appearance."""

    @property
    def mode(self) -> Literal["rehash", "direct"]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def hash_profile(self) -> Literal["native", "vllm", "sglang"]: ...
    @property
    def group_idx(self) -> int: ...

def decode_kv_events(
    payload: bytes | bytearray | memoryview,
) -> tuple[float, list[dict[str, Any]], int | None]:
    """``(ts, events, data_parallel_rank)`` of one payload, each event a dict of the fields the
    decoder reads (``ValueError`` for a malformed payload). For inspection and tests."""

class ReadOnlyError(RuntimeError):
    """A write to an object another one owns and writes: ``router.index`` in approx mode (the
    router's model of each worker's cache). The message names the owner and the alternative."""

class NoWorkerError(ValueError):
    """No worker can take the request: none is healthy, in the endpoint's pool and not excluded.

    Raised by ``Router.route`` only (a ``ValueError``): a gateway answers it with 503 and retries
    later, while any other ``ValueError`` is a bad argument."""

@final
class Decision:
    """A routing decision: the worker, why, and how much of the prompt it is expected to hold.

    Pass it to the router's ``begin``, ``prefilled``, ``finish`` and ``observe``.
    """

    @property
    def worker(self) -> str: ...
    @property
    def cached_blocks(self) -> int:
        """Leading prompt blocks the worker holds, per the router's index."""

    @property
    def inflight_blocks(self) -> int:
        """Events mode: leading prompt blocks held by the requests in flight on the worker when
        routed (0 in approx mode)."""

    @property
    def cached_tokens(self) -> int:
        """``cached_blocks * block_size``."""

    @property
    def prompt_blocks(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def scores(self) -> dict[str, float]:
        """Per worker, the value the policy compared (kv_aware: its cost; lower wins)."""

    @property
    def policy(self) -> str: ...
    @property
    def reason(self) -> str:
        """Why: prefix / load (kv_aware), hash / hash_bounded, or the policy name."""

    @property
    def endpoint(self) -> str | None: ...
    @property
    def priority(self) -> int:
        """The scheduling priority to ask the engine for: the endpoint's, 0 without one."""

    @property
    def id(self) -> int: ...
    @property
    def stage(self) -> Literal["routed", "active", "finished", "withdrawn"]: ...
    @property
    def half(self) -> Literal["whole", "prefill", "decode"]:
        """The part of the request: ``whole``, or a half of a ``route_pd`` pair."""

@final
class PdDecision:
    """A prefill/decode pair from ``Router.route_pd``.

    ``prefill`` and ``decode`` are ``Decision``s, the same object when ``disaggregate`` is False
    (the whole request runs on the decode worker). Begin, finish and observe each half with the
    router (once when they are the same object).
    """

    @property
    def prefill(self) -> Decision: ...
    @property
    def decode(self) -> Decision: ...
    @property
    def disaggregate(self) -> bool:
        """True when the prefill runs on another worker than the decode."""

    @property
    def reason(self) -> Literal["remote", "short", "saturated", "same_worker", "no_prefill"]:
        """Why the pair is, or is not, disaggregated."""

@final
class Router:
    """Which worker gets a request, why, and how much of the prompt is cached there.

    ``index="approx"`` models each worker's cache from where requests were routed (a
    ``BlockCache`` of ``capacity_blocks``, blocks idle over ``ttl`` seconds gone); ``observe``
    corrects it. ``index="events"``: ``router.index`` is fed by ``router.event_applier`` (engine
    KV events); stale workers' overlap credit decays (``mark_stale``). Policies: ``random``,
    ``round_robin``, ``least_loaded``, ``power_of_two``, ``hash``, ``kv_aware``. ``now`` defaults
    to ``time.monotonic()``. Unknown names raise ``KeyError``, bad values ``ValueError``, no
    worker to route to ``NoWorkerError``; errors change nothing.

    The defaults below are the core's (``Router.config`` shows them; tests check the two agree):
    a keyword left out, or passed as None, takes the core's default.
    """

    def __new__(
        cls,
        workers: Iterable[str] | Mapping[str, float],
        *,
        policy: Literal[
            "random", "round_robin", "least_loaded", "power_of_two", "hash", "kv_aware"
        ] = "kv_aware",
        block_size: int = 16,
        hash_profile: Literal["native", "vllm", "sglang"] = "native",
        index: Literal["approx", "events"] = "approx",
        capacity_blocks: int = 32768,
        ttl: float | None = None,
        queue_weight: float = 1.0,
        decode_weight: float = 0.05,
        load_bound: float = 1.25,
        seed: int = 0,
        stale_half_life: float = 5.0,
        tier_weights: Mapping[str, float] = {"CPU": 0.5, "CPU_PINNED": 0.5},
        salt: str | None = None,
        hash_seed: str | None = None,
        event_mode: Literal["rehash", "direct"] = "rehash",
        hash_algo: Literal["sha256", "sha256_cbor"] | None = None,
        vllm_version: str | None = None,
        updates: bool = False,
        roles: Mapping[str, _Role] | None = None,
        pd_threshold: int = 2048,
        pd_saturation: float | None = None,
        pd_local_prefill: bool = True,
    ) -> Router: ...
    def route(
        self,
        tokens: _TokenArray | None = None,
        *,
        block_hashes: _U64Array | None = None,
        key: _Key | None = None,
        endpoint: str | None = None,
        exclude: Iterable[str] | None = None,
        now: float | None = None,
    ) -> Decision:
        """Route one request: at most one of ``tokens`` and ``block_hashes``; with neither, the
        request has no prefix to match (routed by ``key``, ``endpoint`` or load)."""

    def route_pd(
        self,
        tokens: _TokenArray | None = None,
        *,
        block_hashes: _U64Array | None = None,
        key: _Key | None = None,
        endpoint: str | None = None,
        exclude: Iterable[str] | None = None,
        now: float | None = None,
    ) -> PdDecision:
        """Route one request as a prefill/decode pair (arguments as for ``route``; ``exclude``
        applies to both halves): the decode worker by its KV load less the prefix it holds, the
        prefill on it when it lacks at most ``pd_threshold`` tokens of the prompt (or the
        prefill side is ``pd_saturation`` times costlier), else on the policy's prefill
        worker."""

    def begin(self, decision: Decision) -> int:
        """The request starts: counted in its worker's load. Returns the blocks this router's
        requests had left to prefill on the worker just before it (``load(worker)
        ["prefill_blocks"]`` before the call)."""

    def prefilled(self, decision: Decision) -> None:
        """The request's prefill is done: its blocks leave the worker's prefill queue."""

    def finish(self, decision: Decision, *, now: float | None = None) -> None:
        """The request ended: taken off its worker's load."""

    def withdraw(self, decision: Decision) -> bool:
        """Take back a decision whose request never ran on its worker (shed, or served
        elsewhere): its load and the blocks only its route recorded; ``False`` if already
        withdrawn."""

    def observe(self, decision: Decision, cached_tokens: int, *, now: float | None = None) -> None:
        """Feed back the engine's reported cached tokens (corrects the approx model)."""

    def add_worker(self, name: str, weight: float = 1.0, *, role: _Role | None = None) -> None: ...
    def set_role(self, name: str, role: _Role) -> None:
        """Endpoint pools follow the new role; the worker's load and cached blocks stay."""

    def role(self, name: str) -> _Role: ...
    @property
    def roles(self) -> dict[str, _Role]: ...
    def remove_worker(self, name: str) -> None: ...
    def set_healthy(self, name: str, ok: bool) -> None: ...
    def is_healthy(self, name: str) -> bool: ...
    def load(self, name: str) -> dict[str, Any]:
        """``{"active", "queued", "prefill_blocks", "decode_blocks", "written_blocks", "weight"}``
        of worker ``name``, this router's requests (``queued``: begun, prefill not done;
        ``prefill_blocks``: left to prefill after cache and in-flight hits; ``written_blocks``:
        what the active requests add to the worker's cache), and ``"others"``: the same five
        counters for requests it did not begin (other replicas' as they announce them, the
        engine's figures at the last ``set_load``)."""

    def set_load(
        self,
        worker: str,
        *,
        active: int | None = None,
        queued: int | None = None,
        prefill_blocks: int | None = None,
        decode_blocks: int | None = None,
    ) -> None:
        """The engine's own load figures (this router's requests included): the rest is kept as
        the others' load, added to this router's own until the next report."""

    def set_engine_block_size(self, worker: str, tokens: int) -> None:
        """The worker's engine caches blocks of ``tokens`` tokens (e.g. its
        ``cache_config_info``): its matches count whole engine blocks only. In events mode the
        router's ``event_applier`` sets it from each engine's stores. ``remove_worker`` forgets
        it: a worker added again under the name is a new engine, until told its own size."""

    def engine_block_size(self, worker: str) -> int | None:
        """The worker's engine block size in tokens, None while unknown."""

    def take_updates(self, max_bytes: int | None = None) -> bytes:
        """``updates=True``: the load and (approx) model updates since the last call, as one
        batch for other replicas (``b""`` when there is none), at most ``max_bytes`` long but
        for a single longer update; the rest stays for the next call."""

    def apply_updates(
        self, data: bytes, *, now: float | None = None, loads: bool = True
    ) -> dict[str, int]:
        """Apply another replica's batch; counts ``records``, ``forgets``, ``loads``,
        ``unanchored``, ``unknown_workers``, ``inconsistent``. A malformed batch changes nothing.
        ``loads=False`` skips load updates (own updates re-applied after ``load_model``)."""

    def dump_model(self) -> bytes:
        """Approx mode: the model as a snapshot (``load_model``)."""

    def load_model(self, data: bytes, *, now: float | None = None) -> None:
        """Approx mode: replace the model with a snapshot (workers matched by name)."""

    def add_endpoint(
        self,
        endpoint_id: str,
        *,
        pool_size: int,
        reserved_blocks: int | None = None,
        salt: str | None = None,
        isolate: bool | None = None,
        priority: int | None = None,
    ) -> None:
        """A dedicated endpoint: a sticky pool, its own block-hash salt (``isolate``, default
        True; ``salt`` defaults to the id, is never empty, and is refused with
        ``isolate=False``), reserved blocks, and the scheduling ``priority`` of its requests
        (default 0; higher is served first; ``Decision.priority``)."""

    def endpoint_priority(self, endpoint_id: str) -> int:
        """The scheduling priority of the endpoint's requests (higher first)."""

    def remove_endpoint(self, endpoint_id: str) -> None: ...
    def endpoint_pool(
        self, endpoint_id: str, *, phase: Literal["prefill", "decode"] | None = None
    ) -> list[str]:
        """The pool's workers: those serving ``phase``, or (None) every member."""

    def endpoint_salt(self, endpoint_id: str) -> str | None:
        """The ``cache_salt`` to send upstream for this endpoint (None if not isolated)."""

    def salt_block_hashes(
        self, endpoint_id: str, block_hashes: _BlockHashes
    ) -> npt.NDArray[np.uint64]:
        """The hashes ``route(block_hashes=..., endpoint=endpoint_id)`` matches (a new array)."""

    @property
    def endpoints(self) -> list[str]: ...
    def mark_stale(self, worker: str, now: float | None = None) -> None:
        """The worker's index stream is stale: its overlap credit halves every half-life."""

    def mark_fresh(self, worker: str) -> None: ...
    def set_freshness(self, worker: str, value: float) -> None: ...
    def freshness(self, worker: str, now: float | None = None) -> float: ...
    @property
    def index(self) -> PrefixIndex: ...
    @property
    def event_applier(self) -> KvEventApplier | None: ...
    @property
    def workers(self) -> list[str]: ...
    @property
    def policy(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def hash_profile(self) -> str: ...
    @property
    def mode(self) -> Literal["approx", "events"]: ...
    @property
    def config(self) -> dict[str, Any]:
        """The configuration in effect, keyed like the constructor's keywords."""

    def _check_model(self) -> None: ...
    def __len__(self) -> int: ...
