//! Bindings for `crate::index` (`kvroute.PrefixIndex`).
//!
//! The index sits behind a `parking_lot::RwLock` (shared with the router and the event applier
//! when they own it). Mutations, `match`, `dump` and `load` run with the GIL released, taking the
//! lock inside `py.detach`; short reads take the read lock with the GIL held only when it is free.

use std::sync::Arc;

use parking_lot::RwLock;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::convert::{
    block_hash_from_py, block_hash_to_find, optional, u64_slice, usize_from_int, with_bytes, Name,
    Negative, ReadOnlyError,
};
use super::names::NameCache;
use super::{with_read, with_write};
use crate::index::{PrefixIndex, SharedPrefixIndex, WorkerId};

/// Queries of fewer blocks are matched with the GIL held when the index's lock is free (the
/// match takes well under a microsecond per 100 blocks; releasing the GIL costs more).
const INLINE_BLOCKS: usize = 512;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixIndex>()?;
    m.add("ReadOnlyError", m.py().get_type::<ReadOnlyError>())
}

/// Which worker holds which chained KV blocks; `match` gives, per worker, how many leading blocks
/// of a request it already holds.
///
/// Block hashes are chained (a block's hash identifies its whole prefix). A worker's blocks are
/// prefix-closed: `store(worker, hashes, parent)` needs the worker to hold `parent` (else
/// `KeyError`); a hash already stored after a different parent, or repeated, raises
/// `ValueError`; both leave the index unchanged. `remove` drops each listed block and every block
/// after it that the worker holds; unknown blocks are ignored. `len()` counts distinct blocks;
/// `num_blocks(worker)` counts one worker's blocks. `match` omits workers with 0 blocks.
/// Block hashes: NumPy uint64 arrays (borrowed, no copy), int64 arrays or ints (negative values
/// taken as their two's-complement bits), or sequences of ints.
/// `max_bytes` is a hard budget on `memory_bytes()`: least recently stored/matched leaves are
/// dropped first, and answers stay sound (never claim a block a worker does not hold).
/// `dump()` / `PrefixIndex.load(data)` copy the state as a versioned, checksummed image.
/// An index another object owns (the router's approx model) is read-only from Python: `store`,
/// `remove`, `clear` and `remove_worker` raise `kvroute.ReadOnlyError` naming the owner.
/// Safe to share between threads; the GIL is released while it works.
#[pyclass(frozen, module = "kvroute._core", name = "PrefixIndex")]
pub struct PyPrefixIndex {
    core: SharedPrefixIndex,
    /// Python `str` of each worker name by worker id, reused by `match`.
    names: NameCache,
    /// Why Python may not write this index (who owns it), or None.
    read_only: Option<&'static str>,
}

impl PyPrefixIndex {
    /// A Python face for an index shared with Rust code (e.g. the router's own index).
    pub(crate) fn from_shared(core: SharedPrefixIndex) -> Self {
        PyPrefixIndex {
            core,
            names: NameCache::default(),
            read_only: None,
        }
    }

    /// A read-only Python face for an index that Rust code owns and writes; `why` (the error
    /// message of a write) names the owner.
    pub(crate) fn owned_by(core: SharedPrefixIndex, why: &'static str) -> Self {
        PyPrefixIndex {
            read_only: Some(why),
            ..Self::from_shared(core)
        }
    }

    /// Write access from Python, or the `ReadOnlyError` saying why not.
    pub(crate) fn writable(&self) -> PyResult<()> {
        match self.read_only {
            Some(why) => Err(ReadOnlyError::new_err(why)),
            None => Ok(()),
        }
    }

    /// The shared core, for Rust code that feeds or reads the same index (e.g. the event applier).
    pub(crate) fn shared(&self) -> &SharedPrefixIndex {
        &self.core
    }

    /// Runs short read-only work on the index (see the module docs).
    fn read<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&PrefixIndex) -> R + Send) -> R {
        with_read(py, &self.core, true, f)
    }
}

fn budget(max_bytes: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    optional(max_bytes, |obj| usize_from_int(obj, "max_bytes"))
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    #[pyo3(signature = (*, max_bytes = None))]
    fn new(max_bytes: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let core = PrefixIndex::new(budget(max_bytes)?)?;
        Ok(PyPrefixIndex::from_shared(Arc::new(RwLock::new(core))))
    }

    /// Worker `worker` now holds the chain `block_hashes`, continuing from block `parent`.
    #[pyo3(signature = (worker, block_hashes, parent = None))]
    fn store(
        &self,
        py: Python<'_>,
        worker: Name<'_>,
        block_hashes: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.writable()?;
        let hashes = u64_slice(block_hashes, "block_hashes", Negative::Reinterpret)?;
        let parent = optional(parent, |p| block_hash_from_py(p, "parent"))?;
        let (name, slice) = (&*worker, hashes.as_slice());
        with_write(py, &self.core, |c| c.store(name, slice, parent))?;
        Ok(())
    }

    /// Worker `worker` dropped `block_hashes` (and the blocks after each); returns the number of
    /// blocks it dropped.
    fn remove(
        &self,
        py: Python<'_>,
        worker: Name<'_>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        self.writable()?;
        let hashes = u64_slice(block_hashes, "block_hashes", Negative::Reinterpret)?;
        let (name, slice) = (&*worker, hashes.as_slice());
        Ok(with_write(py, &self.core, |c| c.remove(name, slice))?)
    }

    /// Worker `worker` dropped all its blocks (it stays known); returns how many.
    fn clear(&self, py: Python<'_>, worker: Name<'_>) -> PyResult<u64> {
        self.writable()?;
        let name = &*worker;
        Ok(with_write(py, &self.core, |c| c.clear(name))?)
    }

    /// Forgets worker `worker` and its blocks; returns how many blocks it held.
    fn remove_worker(&self, py: Python<'_>, worker: Name<'_>) -> PyResult<u64> {
        self.writable()?;
        let name = &*worker;
        Ok(with_write(py, &self.core, |c| c.remove_worker(name))?)
    }

    /// Per worker, how many leading blocks of `block_hashes` it holds (workers with 0 omitted).
    #[pyo3(name = "match")]
    fn match_<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hashes = u64_slice(block_hashes, "block_hashes", Negative::Reinterpret)?;
        let slice = hashes.as_slice();
        let out = PyDict::new(py);
        let mut found: Vec<(WorkerId, u32, Option<Arc<str>>)> = Vec::new();
        // A short query whose lock is free: matched with the GIL held, which it keeps to the end,
        // so the name cache (changed only under the GIL) is labelled under the index lock and
        // stays so; only a worker whose cached `str` is stale takes a copy of its name.
        let free = (slice.len() < INLINE_BLOCKS)
            .then(|| self.core.try_read())
            .flatten();
        let inline = match free {
            Some(core) => {
                let mut ids = Vec::new();
                core.match_into(slice, &mut ids);
                let cache = self.names.view(py);
                for (w, n) in ids {
                    if let Some(name) = core.worker_name_ref(w) {
                        found.push((w, n, (!cache.holds(w, name)).then(|| Arc::clone(name))));
                    }
                }
                drop(core);
                let mut cache = cache;
                for (w, n, stale) in found.drain(..) {
                    let name = match stale {
                        Some(name) => cache.get(py, w, &name),
                        None => match cache.cached(py, w) {
                            Some(s) => s,
                            None => continue, // unreachable: `holds` said it was cached
                        },
                    };
                    out.set_item(name, n)?;
                }
                true
            }
            None => false,
        };
        if !inline {
            let found = with_read(py, &self.core, false, |core| {
                let mut ids = Vec::new();
                core.match_into(slice, &mut ids);
                ids.into_iter()
                    .filter_map(|(w, n)| core.worker_name_arc(w).map(|name| (w, n, name)))
                    .collect::<Vec<_>>()
            });
            let mut cache = self.names.view(py);
            for (w, n, name) in found {
                out.set_item(cache.get(py, w, &name), n)?;
            }
        }
        Ok(out)
    }

    /// Names of the known workers, sorted.
    #[getter]
    fn workers(&self, py: Python<'_>) -> Vec<String> {
        self.read(py, |c| c.workers().iter().map(|n| n.to_string()).collect())
    }

    /// Number of blocks `worker` holds (`KeyError` if unknown).
    fn num_blocks(&self, py: Python<'_>, worker: Name<'_>) -> PyResult<u64> {
        let name = &*worker;
        Ok(self.read(py, |c| c.num_blocks(name))?)
    }

    /// Number of distinct blocks held by at least one worker.
    fn __len__(&self, py: Python<'_>) -> usize {
        self.read(py, |c| c.len())
    }

    /// True when some worker holds block `block_hash`.
    fn __contains__(&self, py: Python<'_>, block_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(match block_hash_to_find(block_hash)? {
            Some(h) => self.read(py, |c| c.contains(h)),
            None => false,
        })
    }

    /// Heap bytes of the whole structure (what `max_bytes` bounds).
    fn memory_bytes(&self, py: Python<'_>) -> usize {
        self.read(py, |c| c.memory_bytes())
    }

    /// The memory budget given at construction, or None.
    #[getter]
    fn max_bytes(&self, py: Python<'_>) -> Option<usize> {
        self.read(py, |c| c.max_bytes())
    }

    /// Number of radix-tree nodes (runs of blocks with the same workers); a function of the
    /// stored state alone, since nodes merge back when a split stops being needed.
    fn num_nodes(&self, py: Python<'_>) -> usize {
        self.read(py, |c| c.num_nodes())
    }

    /// The index as a versioned, checksummed binary image.
    fn dump<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let image = with_read(py, &self.core, false, |c| c.dump());
        PyBytes::new(py, &image)
    }

    /// An index rebuilt from `dump()` output; `ValueError` for a bad image.
    #[staticmethod]
    #[pyo3(signature = (data, *, max_bytes = None))]
    fn load(
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        max_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let max_bytes = budget(max_bytes)?;
        let core = with_bytes(data, "data", |bytes| {
            py.detach(|| PrefixIndex::load(bytes, max_bytes))
        })??;
        Ok(PyPrefixIndex::from_shared(Arc::new(RwLock::new(core))))
    }

    /// Whether this index is read-only from Python (owned and written by a router in approx mode).
    #[getter]
    fn read_only(&self) -> bool {
        self.read_only.is_some()
    }

    /// Raises ValueError if an internal invariant is broken (for tests).
    fn _check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        with_read(py, &self.core, false, |c| c.check_invariants()).map_err(PyValueError::new_err)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        self.read(py, |c| {
            format!(
                "PrefixIndex(workers={}, blocks={}, nodes={}, memory_bytes={})",
                c.num_workers(),
                c.len(),
                c.num_nodes(),
                c.memory_bytes()
            )
        })
    }
}
