//! Bindings for `crate::cache`: `kvroute.BlockCache`.
//!
//! Calls on up to [`INLINE_BLOCKS`] blocks run with the GIL held when the cache's lock is free
//! (`try_lock`, never a blocking wait while holding the GIL): releasing and re-taking the GIL
//! would cost more than the work. Larger calls, and calls that find the lock taken, release the
//! GIL and take the lock inside `py.detach`.

use parking_lot::Mutex;
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::{
    block_hash_from_py, block_hash_to_find, name_item, optional, type_error, u64_array, u64_slice,
    usize_from_int, MonotonicClock, Name, Negative, U64Slice,
};
use super::{with_mutex, with_mutex_unless};
use crate::cache::{BlockCache, PartitionId};

/// Largest call that may run without releasing the GIL.
const INLINE_BLOCKS: usize = 64;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockCache>()
}

fn hash_array<'py>(obj: &Bound<'py, PyAny>) -> PyResult<U64Slice<'py>> {
    u64_slice(obj, "block_hashes", Negative::Reinterpret)
}

/// An LRU cache of KV blocks with leaf-first eviction, pins, leases and reserved partitions.
///
/// `BlockCache(capacity, *, reserved=None)`: `capacity` in blocks; `reserved` maps partition
/// names to blocks reserved for them (their sum must not exceed `capacity`).
///
/// - Blocks form chains as inserted; eviction takes the least recently used unpinned *leaf* (a
///   block with no cached child), so a prefix never goes before its descendants. Recency is each
///   block's own last touch (insert, match, or the release of its last pin).
/// - A partition's blocks, up to its reservation, are evicted only by inserts into that
///   partition. Unused reservations are lent to everyone and taken back by evicting borrowers.
///   A new block belongs to the partition that inserted it; a cached block inserted again into a
///   declared partition moves to it (never to the shared pool). `usage(p)` counts the blocks that
///   belong to `p`; `usage()` those of the shared pool.
/// - `pin` references are counted and undone by `unpin`; `pin(..., ttl=s)` is a lease until
///   `now + s` instead, released (lazily) by the first `insert`/`pin`/`unpin`/`expire` whose
///   `now` is at or past its end. `now` defaults to `time.monotonic()`: pass it on every call
///   (virtual time) or on none.
/// - `track_idle=True` stamps each touch with the cache's clock (the largest `now` passed so
///   far) so that `expire_idle(max_idle)` can drop the evictable blocks idle longer than that.
/// - `add_partition` / `set_reserved` declare and resize partitions later; `remove` takes
///   blocks out explicitly (descendants first).
/// - Invalid input raises (KeyError, ValueError, TypeError) and changes nothing.
///
/// The Rust module `kvroute::cache` states the semantics in full. Safe to share between threads.
#[pyclass(frozen, module = "kvroute._core", name = "BlockCache")]
pub struct PyBlockCache {
    core: Mutex<BlockCache>,
    clock: MonotonicClock,
}

impl PyBlockCache {
    /// Runs `f` on the core (a call on `blocks` blocks; see the module docs).
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        blocks: usize,
        f: impl FnOnce(&mut BlockCache) -> R + Send,
    ) -> R {
        with_mutex(py, &self.core, blocks <= INLINE_BLOCKS, f)
    }

    /// [`Self::run`] for a call that first releases the leases ended at `now`: inline only when
    /// none is due (releasing them is unbounded work), else with the GIL released.
    fn run_at<R: Send>(
        &self,
        py: Python<'_>,
        blocks: usize,
        now: f64,
        f: impl FnOnce(&mut BlockCache) -> R + Send,
    ) -> R {
        let inline = blocks <= INLINE_BLOCKS;
        with_mutex_unless(py, &self.core, inline, |c| c.leases_due(now), f)
    }
}

/// The id of partition `name` in `core` (`None`: the shared pool); `KeyError` if undeclared.
fn partition_id(core: &BlockCache, name: Option<&str>) -> crate::Result<PartitionId> {
    name.map_or(Ok(PartitionId::SHARED), |n| core.partition(n))
}

#[pymethods]
impl PyBlockCache {
    #[new]
    #[pyo3(signature = (capacity, *, reserved=None, track_idle=false))]
    fn new(
        py: Python<'_>,
        capacity: &Bound<'_, PyAny>,
        reserved: Option<&Bound<'_, PyAny>>,
        track_idle: bool,
    ) -> PyResult<Self> {
        let capacity = usize_from_int(capacity, "capacity")?;
        let mut shares: Vec<(String, usize)> = Vec::new();
        if let Some(obj) = reserved {
            let dict = obj.cast::<PyDict>().map_err(|_| {
                type_error(obj, "reserved must be a dict of partition name to blocks")
            })?;
            for (name, blocks) in dict.iter() {
                let name = name_item(&name, "partition name")?;
                let blocks = usize_from_int(&blocks, &format!("reserved[{name:?}]"))?;
                shares.push((name, blocks));
            }
        }
        let mut core = BlockCache::with_reserved(capacity, &shares)?;
        if track_idle {
            core.track_idle();
        }
        Ok(PyBlockCache {
            core: Mutex::new(core),
            clock: MonotonicClock::new(py)?,
        })
    }

    /// Inserts the chain `block_hashes` (each block the child of the one before; the first the
    /// child of `parent`, which must be cached, or a root) into `partition` (None: the shared
    /// pool). Returns `(stored, evicted)`: how many leading blocks of the chain are now cached
    /// (all unless pins and reservations left no room) and the evicted hashes, in eviction order.
    /// Leases that ended at or before `now` (default: `time.monotonic()`) are released first.
    #[pyo3(signature = (block_hashes, *, partition=None, parent=None, now=None))]
    fn insert<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        partition: Option<Name<'_>>,
        parent: Option<&Bound<'py, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<(usize, Bound<'py, numpy::PyArray1<u64>>)> {
        let hashes = hash_array(block_hashes)?;
        let parent = optional(parent, |p| block_hash_from_py(p, "parent"))?;
        let now = self.clock.now(now);
        let (slice, partition) = (hashes.as_slice(), partition.as_deref());
        let mut evicted = Vec::new();
        let stored = self.run_at(py, slice.len(), now, |c| {
            let part = partition_id(c, partition)?;
            c.insert_into(slice, part, parent, now, &mut evicted)
        })?;
        Ok((stored, u64_array(py, evicted)))
    }

    /// Number of leading blocks of `block_hashes` that are cached; refreshes them, in order.
    #[pyo3(name = "match", signature = (block_hashes, /))]
    fn match_prefix(&self, py: Python<'_>, block_hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let hashes = hash_array(block_hashes)?;
        let slice = hashes.as_slice();
        Ok(self.run(py, slice.len(), |c| c.match_prefix(slice)))
    }

    /// Number of leading blocks of `block_hashes` that are cached, without refreshing them.
    #[pyo3(signature = (block_hashes, /))]
    fn peek(&self, py: Python<'_>, block_hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let hashes = hash_array(block_hashes)?;
        let slice = hashes.as_slice();
        Ok(self.run(py, slice.len(), |c| c.peek_prefix(slice)))
    }

    /// Pins every block (all must be cached): with `ttl=None`, adds one reference per listed
    /// block (undone by `unpin`); with `ttl` seconds, gives each block a lease until `now + ttl`
    /// that ends by itself (extending, never shortening, an existing lease).
    #[pyo3(signature = (block_hashes, *, ttl=None, now=None))]
    fn pin(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        ttl: Option<f64>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let hashes = hash_array(block_hashes)?;
        let now = self.clock.now(now);
        let slice = hashes.as_slice();
        self.run_at(py, slice.len(), now, |c| match ttl {
            Some(ttl) => c.lease(slice, ttl, now),
            None => c.pin(slice, now),
        })?;
        Ok(())
    }

    /// Removes one reference per listed block; a block released of its last pin becomes the
    /// most recently used. Raises (and changes nothing) if a block is not cached or not pinned.
    #[pyo3(signature = (block_hashes, *, now=None))]
    fn unpin(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let hashes = hash_array(block_hashes)?;
        let now = self.clock.now(now);
        let slice = hashes.as_slice();
        self.run_at(py, slice.len(), now, |c| c.unpin(slice, now))?;
        Ok(())
    }

    /// Releases the leases that ended at or before `now`; returns how many.
    #[pyo3(signature = (*, now=None))]
    fn expire(&self, py: Python<'_>, now: Option<f64>) -> PyResult<usize> {
        let now = self.clock.now(now);
        // Releasing many leases is long work: always release the GIL.
        Ok(self.run(py, usize::MAX, |c| c.expire(now))?)
    }

    /// Drops every block idle for more than `max_idle` seconds at `now` (needs
    /// `track_idle=True`): last touched before `now - max_idle`, unpinned, without a lease
    /// (leases ended at `now` are released first) and without a cached child once its idle
    /// descendants are gone — leaves first, least recently used first within each partition.
    /// Returns `(dropped hashes in that order, last touch of the least recently used evictable
    /// block left, or None)`: nothing expires before that time plus `max_idle`, unless an
    /// eviction or a pin release intervenes.
    #[pyo3(signature = (max_idle, *, now=None))]
    fn expire_idle<'py>(
        &self,
        py: Python<'py>,
        max_idle: f64,
        now: Option<f64>,
    ) -> PyResult<(Bound<'py, numpy::PyArray1<u64>>, Option<f64>)> {
        let now = self.clock.now(now);
        let mut dropped = Vec::new();
        let oldest = self.run(py, usize::MAX, |c| {
            c.expire_idle_into(now, max_idle, &mut dropped)
        })?;
        Ok((u64_array(py, dropped), oldest))
    }

    /// When `block_hash` was last touched (the cache's clock then: the largest `now` passed so
    /// far), or None without `track_idle`; KeyError if not cached.
    fn last_touch(&self, py: Python<'_>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
        let h = block_hash_from_py(block_hash, "block_hash")?;
        let (cached, t) = self.run(py, 0, |c| (c.contains(h), c.last_touch(h)));
        if cached {
            Ok(t)
        } else {
            Err(PyKeyError::new_err(format!("block {h:#x} is not cached")))
        }
    }

    /// Declares partition `name` with `reserved` blocks (0: a name to insert under, with no
    /// reservation); the reservations must still fit in the capacity. ValueError if `name` is
    /// declared already.
    fn add_partition(
        &self,
        py: Python<'_>,
        name: Name<'_>,
        reserved: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let blocks = usize_from_int(reserved, "reserved")?;
        let name = &*name;
        self.run(py, 0, |c| c.add_partition(name, blocks))?;
        Ok(())
    }

    /// Sets declared partition `name`'s reservation to `blocks`. Lowering it evicts nothing:
    /// the blocks above it become borrowers. KeyError if undeclared; ValueError if the
    /// reservations would exceed the capacity.
    fn set_reserved(
        &self,
        py: Python<'_>,
        name: Name<'_>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let blocks = usize_from_int(blocks, "blocks")?;
        let name = &*name;
        Ok(self.run(py, 0, |c| {
            c.partition(name).and_then(|p| c.set_reserved(p, blocks))
        })?)
    }

    /// Takes the listed cached blocks out (what the engine reported gone), in list order;
    /// hashes not cached are ignored. Each must be unpinned, without a lease, and have no cached
    /// child when its turn comes (list descendants first); otherwise ValueError naming the
    /// block, and nothing changes. Not a touch. Returns the removed hashes, in order.
    #[pyo3(signature = (block_hashes, /))]
    fn remove<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, numpy::PyArray1<u64>>> {
        let hashes = hash_array(block_hashes)?;
        let slice = hashes.as_slice();
        let mut removed = Vec::new();
        self.run(py, slice.len(), |c| c.remove_into(slice, &mut removed))?;
        Ok(u64_array(py, removed))
    }

    /// Whether last-touch times are recorded (`track_idle=True`).
    #[getter]
    fn track_idle(&self, py: Python<'_>) -> bool {
        self.run(py, 0, |c| c.tracks_idle())
    }

    /// Blocks that belong to `partition` (None: the shared pool).
    #[pyo3(signature = (partition=None))]
    fn usage(&self, py: Python<'_>, partition: Option<Name<'_>>) -> PyResult<usize> {
        let partition = partition.as_deref();
        Ok(self.run(py, 0, |c| partition_id(c, partition).map(|p| c.usage(p)))?)
    }

    /// References held on `block_hash` by `pin` (leases not counted); KeyError if not cached.
    fn pins(&self, py: Python<'_>, block_hash: &Bound<'_, PyAny>) -> PyResult<u32> {
        let h = block_hash_from_py(block_hash, "block_hash")?;
        self.run(py, 0, |c| c.pins(h))
            .ok_or_else(|| PyKeyError::new_err(format!("block {h:#x} is not cached")))
    }

    /// End time of `block_hash`'s lease, or None; KeyError if not cached.
    fn lease_end(&self, py: Python<'_>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
        let h = block_hash_from_py(block_hash, "block_hash")?;
        let (cached, end) = self.run(py, 0, |c| (c.contains(h), c.lease_end(h)));
        if cached {
            Ok(end)
        } else {
            Err(PyKeyError::new_err(format!("block {h:#x} is not cached")))
        }
    }

    /// Capacity in blocks.
    #[getter]
    fn capacity(&self, py: Python<'_>) -> usize {
        self.run(py, 0, |c| c.capacity())
    }

    /// The declared partitions: `{name: reserved blocks}`, in declaration order.
    #[getter]
    fn reserved<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let shares: Vec<(String, usize)> = self.run(py, 0, |c| {
            c.reservations().map(|(n, r)| (n.to_owned(), r)).collect()
        });
        let dict = PyDict::new(py);
        for (name, blocks) in shares {
            dict.set_item(name, blocks)?;
        }
        Ok(dict)
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.run(py, 0, |c| c.len())
    }

    fn __contains__(&self, py: Python<'_>, block_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(match block_hash_to_find(block_hash)? {
            Some(h) => self.run(py, 0, |c| c.contains(h)),
            None => false,
        })
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (len, capacity) = self.run(py, 0, |c| (c.len(), c.capacity()));
        format!("BlockCache(len={len}, capacity={capacity})")
    }
}
